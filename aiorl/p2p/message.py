# HOT PATH: encoding on the caller's thread; see DESIGN.md section 7 for the rules.
"""Outgoing and incoming p2p messages: encoding, and the bytes a received message landed in.

An outgoing message is encoded on the caller's thread (validation and pickling, so
errors are raised synchronously) into an `OutMessage`: the pickle stream, the
raw CPU buffers a payload path must carry, and the CUDA tensors to transfer. The
receiver keeps an `InMessage` until a receive takes it; its CPU bytes are either
chunks (ZMQ frames, or a private array a pull filled) or offsets in a shared segment
held through a lease (`aiorl.transport.shared_memory.Lease`).
"""

from __future__ import annotations

import asyncio
import pickle
import sys
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from aiorl.errors import ProtocolError
from aiorl.p2p.settings import INBAND_MAX, INLINE_MAX
from aiorl.protocol.p2p import K_CPU, K_CUDA, K_OBJ
from aiorl.transport import shared_memory
from aiorl.transport.serialization import (
    ATOMIC_TYPES,
    byte_view,
    decode,
    encode,
    not_contiguous_error,
    tensor_from_buffer,
)

if TYPE_CHECKING:
    from aiorl.runtime import AsyncWork

__all__ = [
    "InMessage",
    "OutMessage",
    "PostedRecv",
    "Staged",
    "check_buffer",
    "cuda_specs",
    "record_event",
    "encode_object",
    "encode_tensor",
]


class Lease(Protocol):
    """Bytes a received message holds in memory it must give back (a shared segment)."""

    def view(self, nbytes: int, offset: int) -> Any:
        """``nbytes`` from ``offset`` as a flat uint8 numpy array (no copy)."""
        ...

    def release(self) -> None:
        """Give the memory back (once; any thread)."""
        ...


class Staged:
    """A small message's CUDA tensors copied into one pinned host buffer (the inline CUDA
    road, `aiorl.p2p.paths.cuda_host`): sent once ``events`` (one per device) are done."""

    __slots__ = ("pinned", "events", "sources")

    def __init__(self, pinned: Any, events: list[Any], sources: list[Any]) -> None:
        self.pinned = pinned  # uint8, pinned: every tensor's bytes, in placeholder order
        self.events = events  # recorded after the copies, on the staging streams
        self.sources = sources  # the tensors copied, alive until the copies are done

    def ready(self) -> bool:
        """Whether every copy is done (never blocks)."""
        return all(ev.query() for ev in self.events)


class OutMessage:
    """An outgoing message, encoded on the caller's thread."""

    __slots__ = (
        "kind",
        "head",
        "pickle",
        "bufs",
        "nbytes",
        "cuda",
        "event",
        "raw",
        "inline",
        "staged",
    )

    def __init__(
        self,
        kind: int,
        head: list[Any] | None,
        pickle_frame: bytes | None,
        bufs: list[memoryview],
        cuda: list[Any],
    ) -> None:
        self.kind = kind
        self.head = head  # K_CPU/K_CUDA: [dtype, shape, requires_grad]
        self.pickle = pickle_frame
        self.bufs = bufs  # raw CPU bytes that travel out of band (a payload path carries them)
        self.nbytes = sum(b.nbytes for b in bufs) if bufs else 0
        self.cuda = cuda  # CUDA tensors, in placeholder order
        self.event: Any = None  # {device: CUDA event recorded on the caller's stream at call}
        self.raw = False  # from send_tensor: the receiver most likely fills its own buffer
        # The one frame of a small message that travels inline (batched, no payload path).
        self.inline: Any = None
        # Small CUDA tensors copied to pinned host memory; sent once the copy is done.
        self.staged: Staged | None = None
        if not cuda:
            if kind == K_OBJ:
                if not bufs and pickle_frame is not None and len(pickle_frame) < INLINE_MAX:
                    self.inline = pickle_frame
            elif kind == K_CPU and self.nbytes < INLINE_MAX:
                self.inline = bufs[0]


class PostedRecv:
    """A posted receive: ``buf`` is None for ``recv``, the destination for ``recv_tensor``."""

    __slots__ = ("work", "buf", "event")

    def __init__(self, work: AsyncWork[Any], buf: Any, event: Any) -> None:
        self.work = work
        self.buf = buf
        self.event = event  # CUDA buffer: {device: event recorded on the caller's stream}


class InMessage:
    """A message that arrived, kept until a receive takes it."""

    __slots__ = (
        "kind",
        "head",
        "pickle",
        "sources",
        "lease",
        "cuda",
        "cuda_fut",
        "error",
        "direct",
    )

    def __init__(self, kind: int, head: Any) -> None:
        self.kind = kind
        self.head = head
        self.pickle: Any = None
        # Per CPU buffer: (nbytes, [chunks]) or, with a lease, (nbytes, offset in its segment).
        self.sources: list[tuple[int, Any]] = []
        self.lease: Lease | None = None  # set by the shared-memory path
        self.cuda: list[Any] = []
        self.cuda_fut: asyncio.Future[None] | None = None  # set while CUDA bytes are landing
        self.error: BaseException | None = None
        self.direct: Any = None  # the recv_tensor buffer the payload was already written into

    # ------------------------------------------------------------------ reading the bytes
    def view(self, k: int) -> Any:
        """Buffer ``k`` as a flat uint8 numpy array to read from (no copy where possible)."""
        import numpy as np

        n, where = self.sources[k]
        if self.lease is not None:
            return self.lease.view(n, where)
        if len(where) == 1:
            return np.frombuffer(where[0], dtype=np.uint8)
        out = np.empty(n, dtype=np.uint8)
        _copy_chunks(where, out)
        return out

    def copy_into(self, k: int, dst: Any) -> None:
        """Copy buffer ``k`` into the flat uint8 numpy array ``dst`` (one copy)."""
        if self.lease is None:
            _copy_chunks(self.sources[k][1], dst)
        else:
            shared_memory.copy_into(dst, self.view(k))

    def user_buffers(self) -> list[Any]:
        """Writable buffers for the user's objects; leased ones view the segment (no copy)."""
        import numpy as np

        out: list[Any] = []
        lease = self.lease
        if lease is None:
            for n, chunks in self.sources:
                if len(chunks) == 1 and isinstance(chunks[0], np.ndarray):
                    out.append(chunks[0])  # already private and writable (pulled by CMA)
                elif len(chunks) == 1:
                    out.append(bytearray(chunks[0]))
                else:
                    arr = np.empty(n, dtype=np.uint8)
                    _copy_chunks(chunks, arr)
                    out.append(arr)
            return out
        self.lease = None  # the arrays own the segment from here on
        if not self.sources:
            lease.release()
            return out
        # One array over every buffer, which each buffer's array slices (numpy's ``base``):
        # the segment is given back when the last of them is gone, with one finalizer per
        # message instead of one per tensor.
        start = min(offset for _, offset in self.sources)
        whole = lease.view(max(offset + n for n, offset in self.sources) - start, start)
        weakref.finalize(whole, lease.release).atexit = False
        for n, offset in self.sources:
            out.append(whole[offset - start : offset - start + n])
        return out

    def release(self) -> None:
        """Give the message's shared segment back (its bytes were copied or are not wanted)."""
        lease = self.lease
        if lease is not None:
            self.lease = None
            lease.release()

    def decode(self) -> Any:
        """The received value (its CUDA tensors may still be filling: see ``cuda_fut``)."""
        if self.kind == K_CPU:
            dtype, shape, requires_grad = self.head
            return _rebuild_cpu(dtype_of(dtype), shape, requires_grad, self.user_buffers()[0])
        if self.kind == K_CUDA:
            value = self.cuda[0]
            if self.head[2]:
                value.requires_grad_(True)
            return value
        return decode(self.pickle, self.user_buffers(), self.cuda)


def _copy_chunks(chunks: Sequence[Any], dst: Any) -> None:
    import numpy as np

    off = 0
    for c in chunks:
        m = len(c)
        np.copyto(dst[off : off + m], np.frombuffer(c, dtype=np.uint8))
        off += m


def _rebuild_cpu(dtype: Any, shape: Sequence[int], requires_grad: bool, data: Any) -> Any:
    t = tensor_from_buffer(dtype, shape, data)
    if requires_grad:
        t.requires_grad_(True)
    return t


# ----------------------------------------------------------------------------- encoding
def encode_object(obj: Any) -> OutMessage:
    """Encode ``obj`` for ``send`` on the caller's thread; raises on bad input."""
    if obj.__class__ in ATOMIC_TYPES:  # the common small message: nothing but a pickle
        return OutMessage(K_OBJ, None, pickle.dumps(obj, 5), [], [])
    torch = sys.modules.get("torch")
    if torch is not None and type(obj) is torch.Tensor and obj.layout == torch.strided:
        return encode_tensor(obj)
    cuda: list[Any] = []
    data, bufs = encode(obj, INBAND_MAX, strict=True, cuda_sink=cuda)
    out = OutMessage(K_OBJ, None, data, bufs, cuda)
    if cuda:
        out.event = record_event(*cuda)
    return out


def encode_tensor(t: Any) -> OutMessage:
    """One tensor, no pickle: dtype and shape in the header, its bytes as the payload."""
    if not t.is_contiguous():
        raise not_contiguous_error(t)
    head = [dtype_name(t.dtype), list(t.shape), bool(t.requires_grad)]
    if t.device.type == "cuda":
        out = OutMessage(K_CUDA, head, None, [], [t])
        out.event = record_event(t)
        return out
    if t.device.type != "cpu":
        raise TypeError(f"cannot send a tensor on device {t.device} (only CPU and CUDA)")
    return OutMessage(K_CPU, head, None, [memoryview(byte_view(t))], [])


def check_buffer(buf: Any) -> None:
    """Reject a ``recv_tensor`` destination that cannot be filled as raw bytes."""
    import torch

    if not isinstance(buf, torch.Tensor):
        raise TypeError(
            f"recv_tensor needs a preallocated torch.Tensor, got {type(buf).__qualname__}"
        )
    if buf.layout != torch.strided or not buf.is_contiguous():
        raise ValueError("recv_tensor needs a contiguous (strided) buffer tensor")
    if buf.is_conj() or buf.is_neg():
        raise ValueError("recv_tensor needs a plain buffer (resolve its conj/neg bit first)")
    if buf.device.type not in ("cpu", "cuda"):
        raise TypeError(f"recv_tensor buffer on unsupported device {buf.device}")


# ----------------------------------------------------------------------------- tensor helpers
def record_event(*tensors: Any) -> dict[int, Any]:
    """Per device of ``tensors``, a CUDA event recorded on the calling thread's current
    stream of that device: what the caller had queued for them by the time of the call
    (transfers wait for it). See `aiorl.cuda.events.record_events`."""
    from aiorl.cuda.events import record_events

    return record_events(tensors)


_DTYPES: dict[str, Any] = {}


def dtype_name(dtype: Any) -> str:
    """The wire name of a torch dtype: ``torch.float32`` -> ``"float32"``."""
    return str(dtype)[6:]


def dtype_of(name: str) -> Any:
    """The torch dtype a wire name stands for (``ProtocolError`` for an unknown one)."""
    dt = _DTYPES.get(name)
    if dt is None:
        import torch

        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            raise ProtocolError(f"unknown tensor dtype {name!r} in a p2p message")
        _DTYPES[name] = dt
    return dt


def cuda_specs(msg: OutMessage) -> tuple[list[Any], list[Any]]:
    """``([dtype, shape] per CUDA tensor, the non-empty ones)`` of an outgoing message.

    Empty tensors are not transferred (both sides skip them, so the transfers still
    pair up one to one); the specs list them all, in placeholder order.
    """
    specs = [[dtype_name(t.dtype), list(t.shape)] for t in msg.cuda]
    return specs, [t for t in msg.cuda if t.numel()]


def nbytes_of(t: Any) -> int:
    """A tensor's size in bytes."""
    return int(t.numel() * t.element_size())


def spec_nbytes(spec: Sequence[Any]) -> int:
    """The byte size of a ``[dtype name, shape]`` tensor spec."""
    dtype, shape = spec
    n = int(dtype_of(dtype).itemsize)
    for d in shape:
        n *= d
    return n
