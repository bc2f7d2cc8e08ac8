"""The CUDA machinery that point-to-point transfers, broadcasts and weight publication share.

Layer ``cuda``: below ``group | p2p`` (and so below ``collective`` and ``weights``), above
``runtime``; it imports ``runtime`` (the waiter thread that polls NCCL works), ``errors``
and ``util``, nothing above. Importable without CUDA: torch is imported inside the
functions that use it, and nothing here runs unless a CUDA tensor is sent, received or
broadcast. docs/gpu.md states the rules it implements:

* **Device per tensor.** Events are recorded on each tensor's own device and on the
  caller's current stream *of that device* (`events.record_events`); received tensors land
  on the process's selected device (`aiorl.util.cuda_device`), whatever thread runs.
* **Side streams only.** Transfers run on a `work_thread.CudaWorkThread`'s own stream per
  device, after waiting for the caller's events; nothing waits on, or makes wait, a default
  stream. Buffers allocated for a receive are allocated on that stream and marked used by
  the device's default stream (``record_stream``, `tensors.allocate`), so freeing them later
  cannot hand their memory to a transfer while user kernels still read it.
* **No thread per transfer, no spinning, no polling for copies.** A copy's completion is
  one blocking-sync CUDA event (`events.blocking_event`) waited for by a thread that does
  nothing else (`events.EventWaiter`, one per work thread, in record order), which then
  wakes the loop once (`CudaWorkThread.issue`). NCCL transfers, whose events may depend on
  what the peer does next, are polled with their works' status by the runtime's waiter
  thread (`completion.gpu_done`).
* **NCCL that reports instead of killing.** `nccl.new_nccl_group` creates aiorl's
  communicators with `nccl.NCCL_SETTINGS` in force, non-blocking initialisation (so an
  abort interrupts a set-up whose peer died) and aborts them off the event loop
  (`nccl.abort_in_background`).

The modules: `devices` (device UUIDs, this host, what a receiver tells a sender),
`tensors` (bytes reinterpreted, receive buffers), `bulk_copy` (many tensors copied or
allocated as one), `events`, `work_thread`, `completion`, `nccl`, `byte_window` (how many
CUDA bytes from one sender land at once) and `untyped_torch`.
"""
