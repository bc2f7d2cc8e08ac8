"""Payload path: small CUDA tensors through pinned host memory, inline with the message.

A message whose CUDA tensors hold at most `CUDA_INLINE_BYTES` together (64 KiB unless
``AIORL_CUDA_INLINE_BYTES`` says otherwise; 0 turns the path off) does not take CUDA IPC
or NCCL. At ``send`` time, on the caller's thread, its tensors are copied into one pinned
host buffer on a side stream, after the caller's events (`stage`); once that copy is done
the buffer travels as one frame of the control message, like a small CPU tensor. The
receiver copies the frame into pinned memory and from there into the posted
``recv_tensor`` buffer or fresh tensors on its selected device, on a side stream
(`HostRecv`); a CPU ``recv_tensor`` buffer takes the bytes straight from the frame.

Why: for a few KiB the bytes cost nothing and the fixed costs are all there is. IPC
needs an export or a cached share, an interprocess event, a work-thread hop, a copy and an
acknowledgement before the sender may reuse its tensor; NCCL a handshake. Here the send
completes once the control message left (its tensors were copied out already), nothing
is acknowledged, no path needs a set-up, and it works toward any receiver with CUDA, on
any node. ``benchmarks/bench_gpu.py`` measures both roads (``AIORL_CUDA_INLINE_BYTES=0``
forces IPC).

Completion on both sides is a blocking-sync event waited for by one `EventWaiter` per
process (events of the staging streams, in record order; nothing polls). A receiver
that cannot allocate fails that receive only (the sender's ``send`` has completed, as
for any inline message).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from aiorl.cuda.completion import GpuHost, settle_future
from aiorl.cuda.events import LOOP_SPIN_S, EventWaiter, blocking_event, done_within, wait_events
from aiorl.cuda.tensors import flat_u8
from aiorl.cuda.untyped_torch import untyped
from aiorl.errors import ProtocolError
from aiorl.p2p.message import (
    InMessage,
    OutMessage,
    PostedRecv,
    Staged,
    cuda_specs,
    dtype_of,
    nbytes_of,
    spec_nbytes,
)
from aiorl.p2p.paths.base import PathSpec, Placed, RecvPathBase, SendPathBase
from aiorl.p2p.settings import TRACK_MIN
from aiorl.protocol.p2p import HOST, K_CUDA, HostDesc
from aiorl.transport.serialization import CudaUnavailableError, byte_view
from aiorl.util.cuda_device import selected_device
from aiorl.util.settings import count_setting

__all__ = ["CUDA_INLINE_BYTES", "PATH", "inline_limit", "stage", "staged_future"]

#: The default: CUDA payloads up to this many bytes (all tensors of a message together)
#: travel inline through pinned host memory.
DEFAULT_INLINE_BYTES = 64 * 1024


def inline_limit(environ: Mapping[str, str] = os.environ) -> int:
    """``AIORL_CUDA_INLINE_BYTES`` (bytes; 0 turns the inline road off), else the default.

    Raises ValueError for a value that is not a non-negative integer: a typo must not
    silently send every small tensor by IPC.
    """
    return count_setting(environ, "AIORL_CUDA_INLINE_BYTES", DEFAULT_INLINE_BYTES,
                         "a byte count")


#: The largest CUDA payload (bytes, a message's tensors together) that travels inline.
CUDA_INLINE_BYTES = inline_limit()

_lock = threading.Lock()
_streams: dict[int, Any] = {}  # device -> the side stream staging copies run on
_waiter: EventWaiter | None = None


def _stream(device: int) -> Any:
    """The process's staging stream on ``device`` (any thread)."""
    stream = _streams.get(device)
    if stream is None:
        with _lock:
            stream = _streams.get(device)
            if stream is None:
                stream = _streams[device] = untyped("torch.cuda").Stream(device)
    return stream


def _events_waiter() -> EventWaiter:
    global _waiter
    waiter = _waiter
    if waiter is None or waiter.closed:
        with _lock:
            if _waiter is None or _waiter.closed:
                _waiter = EventWaiter("aiorl-cuda-inline")
            waiter = _waiter
    return waiter


def wants_inline(msg: OutMessage, limit: int) -> bool:
    """Whether ``msg``'s CUDA tensors take the inline road: some, all on CUDA, at most
    ``limit`` bytes together (pure: the decision is unit-tested on the CPU)."""
    if not msg.cuda or limit <= 0:
        return False
    total = 0
    for t in msg.cuda:
        total += nbytes_of(t)
        if total > limit:
            return False
    return total > 0  # all empty: nothing to carry (the Sender sends NOTHING)


def stage(msg: OutMessage, limit: int | None = None) -> bool:
    """Caller's thread: copy a small message's CUDA tensors into one pinned host buffer.

    Runs on each tensor's device on the process's staging stream, after the caller's
    events (what its stream had queued at the call); sets ``msg.staged``. Returns whether
    the message takes the inline road. Nothing blocks: the Sender sends the message once
    the copy is done (`staged_future`), keeping the pair's order.
    """
    if not wants_inline(msg, CUDA_INLINE_BYTES if limit is None else limit):
        return False
    import torch

    _specs, live = cuda_specs(msg)
    total = sum(nbytes_of(t) for t in live)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    events: list[Any] = []
    waited: set[int] = set()
    offset = 0
    # One stream context per tensor and nothing more: it selects the stream's device too, and
    # each context or device guard can cost tens of microseconds of driver calls
    # (docs/gpu.md), more than the copy itself.
    last = len(live) - 1
    for i, t in enumerate(live):
        device = t.device.index
        stream = _stream(device)
        n = nbytes_of(t)
        with torch.cuda.stream(stream):
            if device not in waited:
                waited.add(device)
                if msg.event is not None and device in msg.event:
                    stream.wait_event(msg.event[device])
            pinned[offset : offset + n].copy_(flat_u8(t), non_blocking=True)
            if i == last and len(waited) == 1:
                ev = blocking_event()
                ev.record(stream)
                events.append(ev)
        offset += n
    if len(waited) > 1:  # tensors on several devices: an event after each device's copies
        for device in waited:
            stream = _stream(device)
            with torch.cuda.stream(stream):
                ev = blocking_event()
                ev.record(stream)
            events.append(ev)
    msg.staged = Staged(pinned, events, live)
    return True


def staged_ready(staged: Staged) -> bool:
    """Loop: whether the staging copies of ``staged`` are done, polling them briefly (a few
    KiB copy in microseconds; waiting for them on a thread costs a hop and a loop wake-up)."""
    return done_within(staged.events, LOOP_SPIN_S)


def staged_future(host: GpuHost, staged: Staged) -> asyncio.Future[None]:
    """Loop: a future done once the staging copies of ``staged`` are done."""
    fut: asyncio.Future[None] = host.loop.create_future()
    if not staged.events or done_within(staged.events, LOOP_SPIN_S):
        fut.set_result(None)
        return fut
    waiter = _events_waiter()
    *earlier, last = staged.events
    for ev in earlier:  # several devices: the last report comes after every one is done
        waiter.watch(ev, lambda _error: None)
    waiter.watch(last, lambda error: host.call_soon_threadsafe(settle_future, fut, error, None))
    return fut


class HostSend(SendPathBase):
    """Toward any destination: the staged bytes as one frame of the control message."""

    def fits(self, msg: OutMessage) -> bool:
        return msg.staged is not None

    def place(self, msg: OutMessage, frames: list[Any]) -> Placed | None:
        staged = msg.staged
        if staged is None:
            return None
        specs, _live = cuda_specs(msg)
        view = memoryview(staged.pinned.numpy())
        # ZMQ keeps a reference to a frame it sends without copying (TRACK_MIN and up):
        # the view keeps the pinned buffer alive until then. Below, it copies at once.
        frames.append(view if view.nbytes < TRACK_MIN else bytes(view))
        msg.staged = None  # the tensors were copied out: the send completes now
        return Placed(HostDesc(specs).to_wire())


class HostRecv(RecvPathBase):
    """From any source: the frame onto this process's selected device (or into the posted
    buffer), through pinned memory on a side stream."""

    def accept(
        self,
        msg: InMessage,
        desc: Sequence[Any],
        frames: Sequence[Any],
        start: int,
        posted: PostedRecv | None,
    ) -> None:
        specs = list(HostDesc.from_wire(desc).specs)
        sizes = [spec_nbytes(s) for s in specs]
        frame = frames[-1] if len(frames) > start else None
        if frame is None or len(frame) != sum(sizes):
            raise ProtocolError(f"p2p message from {self.source} lost its CUDA payload frame")
        buf = posted.buf if posted is not None and not posted.work.done() else None
        if buf is not None and (msg.kind != K_CUDA or nbytes_of(buf) != sizes[0]):
            buf = None  # not taken in place: the Inbox copies after the tensors landed
        if buf is not None and buf.device.type == "cpu":
            # A CPU buffer takes the bytes from the frame: no GPU involved at all.
            byte_view(buf)[:] = memoryview(frame).cast("B")
            msg.cuda = [buf]
            msg.direct = buf
            return
        torch = _torch_with_cuda(self.source)
        if buf is not None:
            device = buf.device.index
        else:
            device = selected_device()
        stream = _stream(device)
        # One stream context (it selects the device too): see `stage`.
        with torch.cuda.stream(stream):
            targets = _targets(torch, specs, device, buf)
            live = [(t, n) for t, n in zip(targets, sizes, strict=True) if n]
            msg.cuda = targets
            if not live:
                return
            pinned = torch.empty(len(frame), dtype=torch.uint8, pin_memory=True)
            pinned.numpy()[:] = memoryview(frame).cast("B")  # host memcpy of a few KiB
            if buf is not None:
                assert posted is not None
                wait_events(stream, posted.event)  # the caller may still use its buffer
            offset = 0
            for t, n in live:
                flat_u8(t).copy_(pinned[offset : offset + n], non_blocking=True)
                offset += n
            done = blocking_event()
            done.record(stream)
        # Not ``msg.direct`` for a CUDA buffer: the receive completes once ``cuda_fut`` is.
        fut: asyncio.Future[None] = self.host.loop.create_future()
        msg.cuda_fut = fut
        if done_within((done,), LOOP_SPIN_S):  # a few KiB: usually landed by now
            fut.set_result(None)
            return
        host = self.host
        keep = (pinned, targets)
        _events_waiter().watch(
            done, lambda error: host.call_soon_threadsafe(settle_future, fut, error, keep)
        )


def _torch_with_cuda(source: str) -> Any:
    import torch

    if not torch.cuda.is_available():
        raise CudaUnavailableError(
            f"a CUDA tensor from {source} cannot be received in a process without CUDA; "
            "send tensor.cpu() instead"
        )
    return torch


_defaults: dict[int, Any] = {}  # device -> its default stream (a constant)


def _targets(torch: Any, specs: list[Any], device: int, buf: Any) -> list[Any]:
    """The tensors the bytes land in: the posted buffer, else fresh ones on ``device``
    (allocated on the staging stream, current in the caller's context, and marked used by
    the default stream, where user code most likely reads them: freeing one later never
    hands its block to a copy still writing it, nor a block a kernel still reads to the
    next copy)."""
    if buf is not None:
        return [buf]
    out = []
    default = _defaults.get(device)
    if default is None:
        default = _defaults[device] = torch.cuda.default_stream(device)
    for dtype, shape in specs:
        t = torch.empty(shape, dtype=dtype_of(dtype), device=device)
        if t.numel():
            t.record_stream(default)
        out.append(t)
    return out


PATH = PathSpec("cuda_host", HOST, True, HostSend.create, HostRecv.create)
