"""``MappingThread``: a thread that maps items from one queue into another.

Typical use inside a worker: decode, collate or move to the GPU what another
thread produces, off the poll thread and the event loop::

    t = MappingThread(to_device, raw_q, ready_q, cuda_device=0)
    t.start()
    ...
    t.stop()
    t.join()          # re-raises an exception of to_device, if there was one

The thread takes an item from ``upstream_queue``, calls ``map_fn(item)`` and
puts the result into ``downstream_queue`` (when one is given; otherwise
``map_fn`` is called for its effect), until `stop`. Both queues are
``queue.Queue``-like: ``get(timeout=...)`` raising `queue.Empty`, and
``put(item, timeout=...)`` raising `queue.Full` (``torch.multiprocessing``
queues qualify).

Stopping is prompt: the thread waits on the queues with a short timeout
(``poll_interval``) and checks the stop flag in between, so it ends within
about ``poll_interval`` seconds of `stop`, or when the ``map_fn`` call in
progress returns. ``stop`` does not drain: items still upstream stay there, and
a result that could not be put downstream before the stop is dropped.

Errors are never swallowed: an exception raised by ``map_fn`` (or by a queue,
or by ``torch.cuda.set_device``) is logged with its traceback, stored in
`MappingThread.error`, and ends the thread; `join` re-raises it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["MappingThread"]

log = logging.getLogger("aiorl.mapping")


class MappingThread:
    """A thread that takes items from ``upstream_queue``, maps them with ``map_fn`` and puts
    the results into ``downstream_queue``, until [`stop`][aiorl.MappingThread.stop] (details: the
    module docstring).

    Args:
        map_fn: called with each upstream item; its result goes downstream.
        upstream_queue: where items come from (``get(timeout=...)``).
        downstream_queue: where results go (``put(item, timeout=...)``), or None.
        cuda_device: device index (or ``torch.device``) made current on the thread
            at start, when CUDA is available; ignored (with a debug message) otherwise.
        name: the thread's name (default ``aiorl-map-<map_fn name>``).
        poll_interval: seconds to wait on a queue before re-checking the stop flag.
        daemon: whether the thread is a daemon (default True, so a thread left
            running does not keep its process alive).

    Example:
        ```python
        raw, ready = queue.Queue(maxsize=8), queue.Queue(maxsize=8)
        t = MappingThread(lambda batch: batch.to("cuda", non_blocking=True), raw, ready,
                          cuda_device=0)
        t.start()
        raw.put(cpu_batch)
        gpu_batch = ready.get()
        t.stop()
        t.join()          # re-raises what map_fn raised, if anything
        ```
    """

    def __init__(
        self,
        map_fn: Callable[[Any], Any],
        upstream_queue: Any,
        downstream_queue: Any = None,
        cuda_device: Any = None,
        *,
        name: str | None = None,
        poll_interval: float = 0.05,
        daemon: bool = True,
    ) -> None:
        if not callable(map_fn):
            raise TypeError(f"map_fn must be callable, got {type(map_fn).__name__}")
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval}")
        self.map_fn = map_fn
        self.upstream_queue = upstream_queue
        self.downstream_queue = downstream_queue
        self.cuda_device = cuda_device
        self.poll_interval = poll_interval
        #: The exception that ended the thread, or None.
        self.error: BaseException | None = None
        #: Items mapped (and delivered downstream, when there is a downstream queue).
        self.processed = 0
        self._stop = threading.Event()
        fn_name = getattr(map_fn, "__name__", type(map_fn).__name__)
        self._thread = threading.Thread(
            target=self._main, name=name or f"aiorl-map-{fn_name}", daemon=daemon)

    @property
    def name(self) -> str:
        """The thread's name."""
        return self._thread.name

    def start(self) -> None:
        """Start the thread (once; a second call raises `RuntimeError`)."""
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop; it ends within about ``poll_interval`` (see the module doc)."""
        self._stop.set()

    def stopped(self) -> bool:
        """Whether [`stop`][aiorl.MappingThread.stop] was called or the thread ended on an error."""
        return self._stop.is_set()

    def is_alive(self) -> bool:
        """Whether the thread is running (started, and not ended)."""
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end, then re-raise the exception that ended it, if any.

        Like `threading.Thread.join`: returns with [`is_alive`][aiorl.MappingThread.is_alive] still
        true if ``timeout`` expires first, and raises `RuntimeError`
        before [`start`][aiorl.MappingThread.start]. Does not stop the thread; call
        [`stop`][aiorl.MappingThread.stop] first.
        """
        self._thread.join(timeout)
        if not self._thread.is_alive() and self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        state = "failed" if self.error is not None else (
            "alive" if self.is_alive() else "stopped" if self._stop.is_set() else "idle")
        return f"<MappingThread {self.name} {state} processed={self.processed}>"

    # ------------------------------------------------------------------ thread body
    def _main(self) -> None:
        try:
            self._set_cuda_device()
            while not self._stop.is_set():
                try:
                    item = self.upstream_queue.get(timeout=self.poll_interval)
                except queue.Empty:
                    continue
                result = self.map_fn(item)
                if self.downstream_queue is not None and not self._put(result):
                    return
                self.processed += 1
        except BaseException as exc:  # noqa: BLE001 - stored for join(), logged now
            self.error = exc
            self._stop.set()
            log.error("mapping thread %s stopped on %s", self.name, type(exc).__name__,
                      exc_info=exc)

    def _put(self, result: Any) -> bool:
        """Put ``result`` downstream, waiting for room; False if stopped meanwhile."""
        while not self._stop.is_set():
            try:
                self.downstream_queue.put(result, timeout=self.poll_interval)
                return True
            except queue.Full:
                continue
        return False

    def _set_cuda_device(self) -> None:
        if self.cuda_device is None:
            return
        import torch  # lazily: this module is imported by aiorl/__init__

        if not torch.cuda.is_available():
            log.debug("%s: CUDA is not available; cuda_device=%r is ignored", self.name,
                      self.cuda_device)
            return
        # The current CUDA device is per thread: set it here, not in the creating thread.
        torch.cuda.set_device(self.cuda_device)
