"""What the two CUDA payload paths share: events, device identity, the issuing lane.

Importable without CUDA (torch is imported inside functions; nothing here runs unless
a CUDA tensor is sent or received).

Streams: the caller's current stream may still be writing a tensor when it is sent (or
reading a buffer when a receive is posted). The caller records a CUDA event at call
time (the receiver also records one after allocating fresh tensors on its current
stream); a :class:`CudaLane` issues everything on its own side stream after waiting for
that event, so transfers neither queue behind nor block the default stream. Completion
is a CUDA event recorded on the side stream after the transfer, synchronised on a
the runtime's waiter thread (:func:`gpu_done_future`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from aiorl.errors import PeerLostError
from aiorl.p2p.message import (
    InMessage,
    PostedRecv,
    dtype_of,
    nbytes_of,
    record_event,
    spec_nbytes,
)
from aiorl.p2p.paths.base import PathHost, fail, resolve, watch_completion
from aiorl.p2p.proto import K_CUDA

__all__ = [
    "CudaLane",
    "device_uuid",
    "flat_u8",
    "gpu_done_future",
    "local_cuda_info",
    "receive_targets",
    "record_event",
    "reinterpret",
    "untyped",
]

T = TypeVar("T")


def untyped(module: str) -> Any:
    """A torch module as ``Any``: torch's stubs leave ``Event``, ``Stream``, ``TCPStore``
    and the IPC reductions untyped or unexported."""
    return importlib.import_module(module)


def device_uuid(index: int) -> str:
    """A node-unique identifier of local CUDA device ``index`` (its UUID, else its PCI address)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return "pci:{}:{}:{}".format(
        getattr(props, "pci_domain_id", "?"),
        getattr(props, "pci_bus_id", "?"),
        getattr(props, "pci_device_id", "?"),
    )


def local_cuda_info() -> dict[str, Any]:
    """What a receiver tells a sender about its GPUs: current device and every device's UUID."""
    import torch

    if not torch.cuda.is_available():
        return {"current": -1, "uuids": []}
    return {
        "current": torch.cuda.current_device(),
        "uuids": [device_uuid(i) for i in range(torch.cuda.device_count())],
    }


def reinterpret(src: Any, like: Any) -> Any:
    """``src``'s bytes seen with ``like``'s dtype and shape (same byte count, both contiguous)."""
    import torch

    if src.dtype == like.dtype:
        return src.reshape(like.shape)
    return src.reshape(-1).view(torch.uint8).view(like.dtype).reshape(like.shape)


def flat_u8(t: Any) -> Any:
    """A contiguous tensor's bytes as a flat uint8 tensor (transfers then only match bytes)."""
    import torch

    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class CudaLane:
    """One thread and one side stream on which a peer's CUDA work is issued, in order."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.stream: Any = None
        self.closed = False
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aiorl-p2p-cuda")

    def run(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` on the lane's thread, after everything submitted before it."""
        return self._thread.submit(fn, *args)

    def side_stream(self) -> Any:
        """The lane's own stream (lane thread only)."""
        if self.stream is None:
            cuda = untyped("torch.cuda")
            cuda.set_device(self.device)
            self.stream = cuda.Stream(self.device)
        return self.stream

    def close(self) -> None:
        self.closed = True
        self._thread.shutdown(wait=False, cancel_futures=True)


def gpu_done_future(
    host: PathHost, cf: concurrent.futures.Future[tuple[list[Any], Any]]
) -> asyncio.Future[None]:
    """A loop future for CUDA work issued on a lane: done when the GPU is.

    ``cf`` yields ``(works, done_event)``: the transfers (kept referenced until done)
    and an event recorded after them on the lane's side stream, which the runtime's
    waiter thread polls.
    """
    fut: asyncio.Future[None] = host.loop.create_future()

    def on_issued(cf: concurrent.futures.Future[tuple[list[Any], Any]]) -> None:  # loop
        if cf.cancelled():
            fail(fut, PeerLostError("the CUDA transfer was abandoned (peer lost or engine closed)"))
            return
        exc = cf.exception()
        if exc is not None:
            fail(fut, exc)
            return
        works, done = cf.result()
        # The works already made the side stream wait, and ``done`` was recorded after
        # that: polling ``done`` alone never makes another stream wait for NCCL.
        landed = watch_completion(host, done.query)
        landed.add_done_callback(lambda f: _forward(f, fut, works))

    def issued(cf: concurrent.futures.Future[tuple[list[Any], Any]]) -> None:  # lane thread
        host.call_soon_threadsafe(on_issued, cf)

    cf.add_done_callback(issued)
    return fut


def _forward(src: asyncio.Future[None], dst: asyncio.Future[None], keep: object) -> None:
    """Complete ``dst`` as ``src`` completed (``keep`` stayed referenced until now)."""
    exc = src.exception()
    if exc is not None:
        fail(dst, exc)
    else:
        resolve(dst, None)


def receive_targets(
    msg: InMessage, specs: Sequence[Any], posted: PostedRecv | None
) -> tuple[list[Any], list[Any], int, Any]:
    """The tensors a message's CUDA payload lands in: ``(targets, live, device, wait_event)``.

    A ``recv_tensor`` already waiting with a CUDA buffer of the right size receives in
    place; otherwise fresh tensors are allocated on this thread's current device.
    ``live`` are the non-empty ones (the sender skips empty tensors too).
    """
    import torch

    user = posted.buf if posted is not None and msg.kind == K_CUDA else None
    if user is not None and (
        user.device.type != "cuda" or nbytes_of(user) != spec_nbytes(specs[0])
    ):
        user = None  # copied at delivery instead (or rejected there)
    if user is not None:
        assert posted is not None
        dev = int(user.device.index)
        targets = [user]
        wait_event = posted.event
    else:
        dev = int(torch.cuda.current_device())
        targets = [torch.empty(shape, dtype=dtype_of(dtype), device=dev) for dtype, shape in specs]
        # Allocated on this thread's stream; the lane's side stream writes after it.
        wait_event = record_event()
    msg.cuda = targets
    return targets, [t for t in targets if t.numel()], dev, wait_event
