"""The broadcast messages (``Worker.broadcast``, ``aiorl.collective``): what members send each other.

A broadcast has its own ops (`aiorl.protocol.ops.BroadcastOp`), never ``p2p.data``, so that it
never takes the place of a ``send`` in a pair's point-to-point order: the two streams are
independent (``docs/broadcast.md``). Every message names its broadcast by member set and
number (``set_id``, ``seq``): members match messages by number, never by arrival order.

* `BroadcastData` (``coll.bcast``, parent -> member, one-way): the payload's control part;
  its frames carry the pickle (kind ``K_OBJ`` of the point-to-point codec) and the buffers'
  data frames (`FramedBuffers`), or the buffers are in a shared segment (`SharedBuffers`),
  and CUDA tensors go by the `CudaPlan`;
* `BroadcastAck` (``coll.ack``, member -> source): the member called and holds the object;
* `BroadcastDone` (``coll.done``, source -> members): every member holds it, or one failed;
* `SegmentRelease` (``coll.release``, reader -> owner): the reader's views are gone;
* `GpuInfo`: the answer to ``coll.gpu`` (source -> member: which GPU do you use?);
* `IpcHandles` (``coll.ipc``, representative -> member on its GPU): the handles of its copy.

They travel as lists, not maps, and ``from_wire`` reads them by position with direct type
and bound checks (microseconds; names are checked as printable text, not parsed):
`BroadcastData`, `BroadcastAck` and `BroadcastDone` go to every member once per broadcast.
A malformed field raises [`ProtocolError`][aiorl.ProtocolError] naming the message and the
field; a name that is well formed but wrong matches no member.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only (postponed)

from aiorl.errors import ProtocolError
from aiorl.protocol.fields import MAX_ITEMS, MAX_SHORT, MAX_TEXT, Fields
from aiorl.protocol.fields import field_error as _bad
from aiorl.protocol.fields import int_field as _int
from aiorl.protocol.fields import list_fields as _fields
from aiorl.protocol.ops import BroadcastOp

__all__ = [
    "FRAMES",
    "SHM",
    "BroadcastAck",
    "BroadcastData",
    "BroadcastDone",
    "Buffers",
    "CudaPlan",
    "FramedBuffers",
    "GpuInfo",
    "IpcHandles",
    "SegmentRelease",
    "SharedBuffers",
]

#: The tag that leads a `FramedBuffers` on the wire.
FRAMES: Final = 0
#: The tag that leads a `SharedBuffers` on the wire.
SHM: Final = 1

_MAX_BYTES = 1 << 50
_MAX_PID = 2**31 - 1
#: A point-to-point codec message kind (``aiorl.p2p.message`` decodes by it): a small tag.
_MAX_KIND = 255
# The op names as plain strings, for error messages.
_BCAST, _ACK, _DONE = BroadcastOp.BCAST.value, BroadcastOp.ACK.value, BroadcastOp.DONE.value
_RELEASE, _IPC = BroadcastOp.RELEASE.value, BroadcastOp.IPC.value


def _text(value: object, message: str, field: str) -> str:
    """A name, id or address: non-empty printable text (it may reach a log line)."""
    if type(value) is str and 0 < len(value) <= MAX_SHORT and value.isprintable():
        return value
    raise _bad(message, field, f"expected a non-empty printable string of at most {MAX_SHORT} "
                               f"characters, got {type(value).__name__}")


def _error(value: object, message: str) -> str | None:
    if value is None or (type(value) is str and len(value) <= MAX_TEXT):
        return value
    raise _bad(message, "error", f"expected None or a string of at most {MAX_TEXT} characters, "
                                 f"got {type(value).__name__}")


def _items(value: object, message: str, field: str) -> Sequence[Any]:
    if (type(value) is not list and type(value) is not tuple) or len(value) > MAX_ITEMS:
        raise _bad(message, field, f"expected a list of at most {MAX_ITEMS} entries, "
                                   f"got {type(value).__name__}")
    return value


def _ints(value: object, message: str, field: str, lo: int = 0) -> tuple[int, ...]:
    values = _items(value, message, field)
    if not all(type(v) is int and lo <= v <= _MAX_BYTES for v in values):
        raise _bad(message, field, f"expected integers in [{lo}, {_MAX_BYTES}]")
    return tuple(values)


def _texts(value: object, message: str, field: str) -> tuple[str, ...]:
    values = _items(value, message, field)
    if not all(type(v) is str and 0 < len(v) <= MAX_SHORT for v in values):
        raise _bad(message, field, f"expected non-empty strings of at most {MAX_SHORT} "
                                   "characters")
    return tuple(values)


# ---------------------------------------------------------------------- what bcast carries
@dataclass(frozen=True, slots=True)
class FramedBuffers:
    """The buffers travel as the message's data frames (after the pickle's): buffer ``i`` is
    ``sizes[i]`` bytes in ``counts[i]`` frames."""

    sizes: tuple[int, ...]
    counts: tuple[int, ...]

    def to_wire(self) -> list[Any]:
        return [FRAMES, list(self.sizes), list(self.counts)]

    @classmethod
    def read(cls, meta: object, message: str) -> Self:
        _, sizes, counts = _fields(meta, ("tag", "sizes", "counts"), message)
        sizes, counts = _ints(sizes, message, "sizes"), _ints(counts, message, "counts", lo=1)
        if len(counts) != len(sizes):
            raise _bad(message, "counts", f"{len(counts)} counts for {len(sizes)} buffers")
        return cls(sizes, counts)


@dataclass(frozen=True, slots=True)
class SharedBuffers:
    """The buffers are in shared segment ``seg_id`` of the worker at ``owner``: process
    ``pid``'s descriptor ``fd``, ``size`` bytes; buffer ``i`` is ``sizes[i]`` bytes at
    ``offsets[i]``. A reader tells the owner when its views are gone (`SegmentRelease`)."""

    pid: int
    fd: int
    size: int
    seg_id: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    owner: str

    def to_wire(self) -> list[Any]:
        return [SHM, self.pid, self.fd, self.size, self.seg_id, list(self.offsets),
                list(self.sizes), self.owner]

    @classmethod
    def read(cls, meta: object, message: str) -> Self:
        _, pid, fd, size, seg_id, offsets, sizes, owner = _fields(
            meta, ("tag", "pid", "fd", "size", "seg_id", "offsets", "sizes", "owner"), message)
        size = _int(size, message, "size", hi=_MAX_BYTES)
        offsets, sizes = _ints(offsets, message, "offsets"), _ints(sizes, message, "sizes")
        if len(offsets) != len(sizes):
            raise _bad(message, "offsets", f"{len(offsets)} offsets for {len(sizes)} buffers")
        if any(off + n > size for off, n in zip(offsets, sizes, strict=True)):
            raise _bad(message, "sizes", f"a buffer ends beyond the segment's {size} bytes")
        return cls(_int(pid, message, "pid", lo=1, hi=_MAX_PID),
                   _int(fd, message, "fd", hi=_MAX_PID), size, _int(seg_id, message, "seg_id"),
                   offsets, sizes, _text(owner, message, "owner"))


#: Where a broadcast's CPU buffers are (None on the wire: it has none, or they are in the pickle).
Buffers = FramedBuffers | SharedBuffers


def _buffers(value: object, message: str) -> Buffers | None:
    """None, or the buffers' place, read by its leading tag."""
    if value is None:
        return None
    tag = value[0] if (type(value) is list or type(value) is tuple) and value else None
    if type(tag) is int and tag == FRAMES:
        return FramedBuffers.read(value, message)
    if type(tag) is int and tag == SHM:
        return SharedBuffers.read(value, message)
    raise ProtocolError(f"{message}: expected None or a list tagged {FRAMES} (frames) or "
                        f"{SHM} (shared memory)")


@dataclass(frozen=True, slots=True)
class CudaPlan:
    """How a broadcast's CUDA tensors travel (``aiorl.collective.nccl_broadcast``): one
    representative per GPU (``reps``, NCCL ranks in that order; ``root`` the source's index)
    joins communicator ``key``, whose rendezvous store is at ``store`` when the source
    created it for this broadcast; every other member (a follower) copies its GPU's
    representative's result through CUDA IPC (``followers``: follower -> representative).
    ``specs`` are the tensors' dtype (torch name) and shape, in the payload's order."""

    key: str
    store: tuple[str, int] | None
    reps: tuple[str, ...]
    root: int
    followers: dict[str, str]
    specs: tuple[tuple[str, tuple[int, ...]], ...]

    def to_wire(self) -> list[Any]:
        return [self.key, None if self.store is None else list(self.store), list(self.reps),
                self.root, dict(self.followers), [[dt, list(shape)] for dt, shape in self.specs]]

    @classmethod
    def read(cls, meta: object, message: str) -> Self:
        key, store, reps, root, followers, specs = _fields(
            meta, ("key", "store", "reps", "root", "followers", "specs"), message)
        reps = _texts(reps, message, "reps")
        if not reps:
            raise _bad(message, "reps", "expected at least one representative")
        if store is not None:
            host, port = _fields(store, ("host", "port"), f"{message}.store")
            store = (_text(host, f"{message}.store", "host"),
                     _int(port, f"{message}.store", "port", hi=65535))
        if (type(followers) is not dict or len(followers) > MAX_ITEMS
                or not all(type(k) is str and type(v) is str for k, v in followers.items())):
            raise _bad(message, "followers", "expected a map of worker names to worker names")
        shapes = []
        for i, entry in enumerate(_items(specs, message, "specs")):
            where = f"{message}.specs[{i}]"
            dtype, shape = _fields(entry, ("dtype", "shape"), where)
            shapes.append((_text(dtype, where, "dtype"), _ints(shape, where, "shape")))
        return cls(_text(key, message, "key"), store, reps,
                   _int(root, message, "root", hi=len(reps) - 1), dict(followers), tuple(shapes))


# ---------------------------------------------------------------------- the messages
@dataclass(frozen=True, slots=True)
class BroadcastData:
    """`BroadcastOp.BCAST`: broadcast ``seq`` of member set ``set_id``, whose source is
    ``src`` (reached at ``src_address``, where acknowledgements go): the point-to-point
    codec's ``kind`` and ``head``, where its ``buffers`` are, its ``cuda`` plan (None without
    CUDA tensors), and ``children``, the members a relay passes it on to (empty for every
    other member)."""

    set_id: str
    seq: int
    src: str
    src_address: str
    kind: int
    head: list[Any] | None
    buffers: Buffers | None
    cuda: CudaPlan | None
    children: tuple[str, ...]

    def to_wire(self) -> list[Any]:
        return [self.set_id, self.seq, self.src, self.src_address, self.kind, self.head,
                None if self.buffers is None else self.buffers.to_wire(),
                None if self.cuda is None else self.cuda.to_wire(), list(self.children)]

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        op = _BCAST
        set_id, seq, src, src_address, kind, head, buffers, cuda, children = _fields(
            meta, ("set_id", "seq", "src", "src_address", "kind", "head", "buffers", "cuda",
                   "children"), op)
        if head is not None and type(head) is not list:
            raise _bad(op, "head", f"expected None or a list, got {type(head).__name__}")
        return cls(_text(set_id, op, "set_id"), _int(seq, op, "seq"), _text(src, op, "src"),
                   _text(src_address, op, "src_address"), _int(kind, op, "kind", hi=_MAX_KIND),
                   head, _buffers(buffers, f"{op}.buffers"),
                   None if cuda is None else CudaPlan.read(cuda, f"{op}.cuda"),
                   _texts(children, op, "children"))


@dataclass(frozen=True, slots=True)
class BroadcastAck:
    """`BroadcastOp.ACK`: ``member`` called broadcast ``seq`` of ``set_id`` and holds the
    object, or could not get it (``error`` says why)."""

    set_id: str
    seq: int
    member: str
    error: str | None

    def to_wire(self) -> list[Any]:
        return [self.set_id, self.seq, self.member, self.error]

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        set_id, seq, member, error = _fields(meta, ("set_id", "seq", "member", "error"), _ACK)
        return cls(_text(set_id, _ACK, "set_id"), _int(seq, _ACK, "seq"),
                   _text(member, _ACK, "member"), _error(error, _ACK))


@dataclass(frozen=True, slots=True)
class BroadcastDone:
    """`BroadcastOp.DONE`: every member holds broadcast ``seq`` of ``set_id`` (it completes),
    or one could not get it (``error``: it fails everywhere)."""

    set_id: str
    seq: int
    error: str | None

    def to_wire(self) -> list[Any]:
        return [self.set_id, self.seq, self.error]

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        set_id, seq, error = _fields(meta, ("set_id", "seq", "error"), _DONE)
        return cls(_text(set_id, _DONE, "set_id"), _int(seq, _DONE, "seq"), _error(error, _DONE))


@dataclass(frozen=True, slots=True)
class SegmentRelease:
    """`BroadcastOp.RELEASE`: member ``reader`` no longer views the owner's segment
    ``seg_id``."""

    seg_id: int
    reader: str

    def to_wire(self) -> list[Any]:
        return [self.seg_id, self.reader]

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        seg_id, reader = _fields(meta, ("seg_id", "reader"), _RELEASE)
        return cls(_int(seg_id, _RELEASE, "seg_id"), _text(reader, _RELEASE, "reader"))


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """The answer to `BroadcastOp.GPU` (asked with no fields): the member's CUDA device index
    and node-unique UUID (``-1`` and None without CUDA)."""

    index: int
    uuid: str | None

    def to_wire(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid}

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        f = Fields(meta, f"{BroadcastOp.GPU.value} reply")  # a map: asked once per member
        return cls(f.integer("index", lo=-1, hi=1 << 16), f.optional_text("uuid"))


@dataclass(frozen=True, slots=True)
class IpcHandles:
    """`BroadcastOp.IPC`: the CUDA IPC handles of a representative's copy of broadcast
    ``seq`` of ``set_id`` (pickled, in the message's one frame)."""

    set_id: str
    seq: int

    def to_wire(self) -> list[Any]:
        return [self.set_id, self.seq]

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        set_id, seq = _fields(meta, ("set_id", "seq"), _IPC)
        return cls(_text(set_id, _IPC, "set_id"), _int(seq, _IPC, "seq"))
