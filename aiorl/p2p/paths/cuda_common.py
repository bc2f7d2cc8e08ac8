"""What the Inbox needs of CUDA outside the two CUDA paths: empty payloads and delivery copies.

A ``recv_tensor`` whose buffer cannot receive in place (another device, a CPU message
into a CUDA buffer, a CUDA message into a CPU buffer) gets the bytes by one copy after
the payload landed. That copy runs on a process-wide copy thread, on its side stream, never
on the event loop and never on a default stream: host memory is staged through pinned
memory (a copy from pageable memory would be synchronous), and completion is a
blocking-sync event the copy thread's waiter waits for (`copy_async`).

Importable without CUDA (torch is imported inside functions).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from aiorl.cuda.completion import GpuHost
from aiorl.cuda.events import blocking_event, wait_events
from aiorl.cuda.tensors import flat_u8, reinterpret
from aiorl.cuda.work_thread import CudaWorkThread
from aiorl.errors import PeerLostError
from aiorl.p2p.message import InMessage, dtype_of
from aiorl.util.cuda_device import selected_device

__all__ = ["copy_async", "empty_targets"]

_copy_thread: CudaWorkThread | None = None
_copy_thread_lock = threading.Lock()


def empty_targets(msg: InMessage, specs: Sequence[Any]) -> None:
    """A message whose CUDA tensors are all empty: rebuild them, nothing to transfer.

    Zero-size tensors own no memory; building them on the selected device needs CUDA to
    be initialised, which the first CUDA message pays for (docs/gpu.md).
    """
    import torch

    device = selected_device()
    msg.cuda = [torch.empty(shape, dtype=dtype_of(dtype), device=device) for dtype, shape in specs]


def _shared_copy_thread() -> CudaWorkThread:
    global _copy_thread
    with _copy_thread_lock:
        if _copy_thread is None or _copy_thread.closed:
            _copy_thread = CudaWorkThread("aiorl-cuda-copy")
        return _copy_thread


def copy_async(
    host: GpuHost, dst: Any, src: Any, dst_events: Mapping[int, Any] | None = None
) -> asyncio.Future[None]:
    """Copy ``src``'s bytes into ``dst`` (same byte count, either may be on the CPU or a
    GPU) on the copy thread; done when the bytes are there. ``dst_events``: what the caller's
    streams still did with ``dst`` when it posted the receive (waited for first)."""
    work_thread = _shared_copy_thread()
    staged: list[Any] = []  # the pinned buffer a copy into host memory lands in first
    landed = work_thread.issue(host, _copy_on_work_thread, work_thread, dst, src, dst_events,
                               staged)
    if dst.device.type != "cpu":
        return landed
    # Into host memory: the GPU filled a pinned buffer; one more work-thread step copies it out
    # (no thread waits on the GPU for it).
    out: asyncio.Future[None] = host.loop.create_future()

    def unpin(f: asyncio.Future[None]) -> None:
        if f.cancelled() or f.exception() is not None:
            out.set_exception(f.exception() or PeerLostError("the copy was abandoned"))
            return
        cf = work_thread.run(_unpin, dst, staged[0])
        cf.add_done_callback(lambda cf: host.call_soon_threadsafe(_finish, out, cf))

    landed.add_done_callback(unpin)
    return out


def _unpin(dst: Any, pinned: Any) -> None:
    """Work thread: the landed bytes from pinned memory into the (pageable) destination."""
    flat_u8(dst).copy_(pinned)


def _finish(out: asyncio.Future[None], cf: concurrent.futures.Future[None]) -> None:
    if out.done():
        return
    exc = cf.exception() if not cf.cancelled() else PeerLostError("the copy was abandoned")
    if exc is None:
        out.set_result(None)
    else:
        out.set_exception(exc)


def _copy_on_work_thread(
    work_thread: CudaWorkThread, dst: Any, src: Any, dst_events: Mapping[int, Any] | None,
    staged: list[Any],
) -> tuple[Any, Any]:
    """Work thread: stage host bytes through pinned memory, copy on the side stream of the GPU end
    (into host memory: into a pinned buffer, copied out once the GPU is done)."""
    import torch

    device = dst.device.index if dst.device.type == "cuda" else src.device.index
    stream = work_thread.stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        wait_events(stream, dst_events)
        keep: list[Any] = [src, dst]
        source = flat_u8(src)
        if src.device.type == "cpu":
            pinned = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=True)
            pinned.copy_(source)  # host to host, on this work thread
            source = pinned
            keep.append(pinned)
        if dst.device.type == "cpu":
            pinned = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=True)
            pinned.copy_(source, non_blocking=True)
            keep.append(pinned)
            staged.append(pinned)
        else:
            dst.copy_(reinterpret(source, dst), non_blocking=True)
        done = blocking_event()
        done.record(stream)
    return done, keep
