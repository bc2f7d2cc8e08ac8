# HOT PATH: data_from_wire, batch_from_wire and frames_from_wire run per received message.
"""The point-to-point messages (``send``/``recv``, ``aiorl.p2p``): what the two ends of a pair
send each other.

Each message sent is one control message (`aiorl.protocol.ops.P2POp`) whose meta is a list
read by position; its payload travels in the frames that follow, or takes a payload path
whose *descriptor* (a list led by the path's tag) the control message carries.

* ``p2p.data`` (sender -> receiver): ``[src, kind, head, bufdesc, cudadesc]``: the sender's
  worker name; the message kind (`K_OBJ`, a pickle, its first frame; `K_CPU`, `K_CUDA`, one
  tensor, no pickle); the tensor's ``head`` (`Head`, None for a pickle); where its CPU bytes
  are (None, or a descriptor led by `FRAMES`, `SHM` or `CMA`) and where its CUDA tensors are
  (None, or one led by `HOST`, `IPC`, `NCCL` or `NOTHING`). `data_to_wire`, `data_from_wire`.
* ``p2p.batch`` (sender -> receiver): ``[src, [[kind, head, bufdesc], ...]]``, one frame per
  message, in the order they were sent. `batch_to_wire`, `batch_from_wire`.
* The payload paths' messages: `SegmentAck` (``p2p.ack``), `SegmentDrop` (``p2p.drop``),
  `TransferDone` (``p2p.done``), `IpcDrop`, `IpcDropEvent` and `NcclGo` (``p2p.cuda``), and
  the one-time set-up question `Hello` (``p2p.hello``) with its `HelloReply`.
* The descriptors: `frames_to_wire`/`frames_from_wire` (``FRAMES``), `ShmDesc`, `CmaDesc`,
  `HostDesc`, `IpcDesc`, `NcclDesc`, `EmptyCudaDesc` (``NOTHING``).

Reading checks every field by position with direct type and bound tests and raises
[`ProtocolError`][aiorl.ProtocolError] naming the message and the field. ``p2p.data``,
``p2p.batch`` and the frames descriptor come once per message on the small-message path:
their readers allocate nothing but the tuple they return (the callers unpack it), and
`data_from_wire` and `batch_from_wire` check a descriptor only as far as its tag. The path
the tag names reads the rest when it takes the payload, so a malformed descriptor fails that
message's receive and the pair goes on. Every other message is a frozen dataclass, as in
the other protocol modules. The op names live in `P2POp`; code on the per-message path sends
their ``.value`` (an enum member costs msgpack a slow path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, NamedTuple

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only (postponed)

from aiorl.errors import ProtocolError
from aiorl.protocol.fields import MAX_SHORT, MAX_TEXT, Fields
from aiorl.protocol.fields import field_error as _bad
from aiorl.protocol.fields import int_field as _int
from aiorl.protocol.fields import list_fields as _fields
from aiorl.protocol.ops import P2POp

__all__ = [
    "CMA",
    "FRAMES",
    "HOST",
    "IPC",
    "K_CPU",
    "K_CUDA",
    "K_OBJ",
    "NCCL",
    "NOTHING",
    "OBJECT_ENTRY",
    "SHM",
    "CmaDesc",
    "CudaControl",
    "CudaInfo",
    "EmptyCudaDesc",
    "Head",
    "Hello",
    "HelloReply",
    "HostDesc",
    "IpcDesc",
    "IpcDrop",
    "IpcDropEvent",
    "IpcPart",
    "NcclDesc",
    "NcclGo",
    "NcclReply",
    "NewSegment",
    "PathAck",
    "PathControl",
    "SegmentAck",
    "SegmentDrop",
    "ShmDesc",
    "Taken",
    "TensorSpec",
    "TransferDone",
    "batch_from_wire",
    "batch_to_wire",
    "cuda_control_from_wire",
    "data_from_wire",
    "data_to_wire",
    "frames_from_wire",
    "frames_to_wire",
]

# Message kinds: a pickled object, one CPU tensor, one CUDA tensor.
K_OBJ: Final = 0
K_CPU: Final = 1
K_CUDA: Final = 2

# CPU payload path tags (``bufdesc[0]``).
FRAMES: Final = 0
SHM: Final = 1
CMA: Final = 2

# CUDA payload path tags (``cudadesc[0]``). NOTHING: every CUDA tensor of the message is
# empty; HOST: small CUDA tensors staged through pinned host memory, in the last frame.
NCCL: Final = 0
IPC: Final = 1
NOTHING: Final = 2
HOST: Final = 3

#: A tensor message's head: ``[dtype name, shape, requires_grad]``.
Head = list[Any]
#: A CUDA tensor's ``[dtype name, shape]``, as the CUDA descriptors list them.
TensorSpec = list[Any]

_INT64: Final = 2**63 - 1
_UINT64: Final = 2**64 - 1
_MAX_PID: Final = 2**31 - 1
_MAX_DTYPE: Final = 64  # a torch dtype's name ("float8_e4m3fnuz" is among the longest)
#: Entries of a per-buffer or per-tensor list: a state dict may hold more tensors than the
#: registry's lists hold entries (``fields.MAX_ITEMS``), and refusing it would fail a send
#: that is fine.
_MAX_LIST: Final = 1 << 20
# The op names as plain strings, for error messages.
_DATA, _BATCH, _ACK, _DROP = (P2POp.DATA.value, P2POp.BATCH.value, P2POp.ACK.value,
                              P2POp.DROP.value)
_DONE, _CUDA, _HELLO = P2POp.DONE.value, P2POp.CUDA.value, P2POp.HELLO.value
_TAKEN = P2POp.TAKEN.value
_BUFDESC, _CUDADESC = f"{_DATA}.bufdesc", f"{_DATA}.cudadesc"


# ---------------------------------------------------------------------- positional checks
def _text(value: object, message: str, field: str, max_len: int = MAX_SHORT) -> str:
    """A name or an address: non-empty, bounded (it may reach a log line)."""
    if type(value) is str and 0 < len(value) <= max_len:
        return value
    raise _bad(message, field, f"expected a non-empty string of at most {max_len} characters, "
                               f"got {type(value).__name__}")


def _ints(value: object, message: str, field: str, lo: int = 0) -> list[int]:
    if (type(value) is not list and type(value) is not tuple) or len(value) > _MAX_LIST:
        raise _bad(message, field, f"expected a list of at most {_MAX_LIST} integers, "
                                   f"got {type(value).__name__}")
    for v in value:
        if type(v) is not int or not lo <= v <= _INT64:
            raise _bad(message, field, f"expected integers in [{lo}, {_INT64}]")
    return list(value)


def _optional_text(value: object, message: str, field: str) -> str | None:
    return None if value is None else _text(value, message, field)


def _src(value: object, message: str) -> str:
    """The sending worker's name (its Inbox's key at the receiver)."""
    if type(value) is str and 0 < len(value) <= MAX_SHORT:
        return value
    raise _bad(message, "src", f"expected a worker name of at most {MAX_SHORT} characters, "
                               f"got {type(value).__name__}")


def _head(kind: int, head: object, message: str) -> Head | None:
    """None for a pickle; a tensor's ``[dtype, shape, requires_grad]`` otherwise."""
    if kind == K_OBJ:
        if head is None:
            return None
        raise _bad(message, "head", "a pickled object's head is None")
    if (type(head) is not list and type(head) is not tuple) or len(head) != 3:
        raise _bad(message, "head", "expected [dtype, shape, requires_grad]")
    _text(head[0], message, "head.dtype", _MAX_DTYPE)
    _ints(head[1], message, "head.shape")
    if type(head[2]) is not bool:
        raise _bad(message, "head.requires_grad",
                   f"expected true or false, got {type(head[2]).__name__}")
    return head  # type: ignore[return-value]  # a list, checked just above


def _kind(kind: object, message: str) -> int:
    if type(kind) is int and K_OBJ <= kind <= K_CUDA:
        return kind
    raise _bad(message, "kind", f"expected {K_OBJ}, {K_CPU} or {K_CUDA}, got {kind!r:.40}")


def _desc(value: object, message: str, field: str) -> list[Any] | None:
    """None, or a descriptor: a list led by its path's integer tag (the path reads the rest)."""
    if value is None or ((type(value) is list or type(value) is tuple) and value
                         and type(value[0]) is int):
        return value  # type: ignore[return-value]  # None or a list, checked just above
    raise _bad(message, field, f"expected None or a list led by a path tag, got {value!r:.40}")


def _specs(value: object, message: str) -> list[TensorSpec]:
    """A CUDA descriptor's ``[[dtype, shape], ...]``, one per tensor of the message.

    A state dict names 1,000 tensors or more: each is checked by plain comparisons, and
    the error naming the field is worded only for a spec that fails them."""
    if (type(value) is not list and type(value) is not tuple) or len(value) > _MAX_LIST:
        raise _bad(message, "specs", f"expected a list of at most {_MAX_LIST} tensor specs")
    for i, spec in enumerate(value):
        if not ((type(spec) is list or type(spec) is tuple) and len(spec) == 2
                and type(spec[0]) is str and 0 < len(spec[0]) <= _MAX_DTYPE
                and (type(spec[1]) is list or type(spec[1]) is tuple)
                and all(type(n) is int and 0 <= n <= _INT64 for n in spec[1])):
            where = f"specs[{i}]"
            if (type(spec) is not list and type(spec) is not tuple) or len(spec) != 2:
                raise _bad(message, where, "expected [dtype, shape]")
            _text(spec[0], message, f"{where}.dtype", _MAX_DTYPE)
            _ints(spec[1], message, f"{where}.shape")
    return list(value)


def _store(value: object, message: str) -> list[Any] | None:
    """None, or an NCCL rendezvous store's ``[host, port]``."""
    if value is None:
        return None
    host, port = _fields(value, ("host", "port"), f"{message}.store")
    return [_text(host, f"{message}.store", "host"),
            _int(port, f"{message}.store", "port", hi=65535)]


# ---------------------------------------------------------------------- per-message control
def data_to_wire(src: str, kind: int, head: Head | None, bufdesc: list[Any] | None,
                 cudadesc: list[Any] | None) -> list[Any]:
    """`P2POp.DATA`'s meta: one message from ``src`` (the module docstring has the fields)."""
    return [src, kind, head, bufdesc, cudadesc]


def data_from_wire(
    meta: object,
) -> tuple[str, int, Head | None, list[Any] | None, list[Any] | None]:
    """``(src, kind, head, bufdesc, cudadesc)`` of a received ``p2p.data``."""
    if (type(meta) is not list and type(meta) is not tuple) or len(meta) != 5:
        raise ProtocolError(f"{_DATA}: expected a list of 5 fields (src, kind, head, bufdesc, "
                            "cudadesc)")
    src, kind, head, bufdesc, cudadesc = meta
    if type(src) is not str or not 0 < len(src) <= MAX_SHORT:
        _src(src, _DATA)
    if type(kind) is not int or not K_OBJ <= kind <= K_CUDA:
        _kind(kind, _DATA)
    if head is not None or kind != K_OBJ:
        head = _head(kind, head, _DATA)
    if bufdesc is not None:
        bufdesc = _desc(bufdesc, _DATA, "bufdesc")
    if cudadesc is not None:
        cudadesc = _desc(cudadesc, _DATA, "cudadesc")
    return src, kind, head, bufdesc, cudadesc


#: The ``p2p.batch`` entry of every small pickle: no head, no payload path (one list, shared
#: by the sender's batches: never modified).
OBJECT_ENTRY: Final[list[Any]] = [K_OBJ, None, None]


def batch_to_wire(src: str, entries: list[list[Any]]) -> list[Any]:
    """`P2POp.BATCH`'s meta: ``entries`` (each ``[kind, head, bufdesc]``) from ``src``."""
    return [src, entries]


def batch_from_wire(meta: object, frames: int) -> tuple[str, Sequence[Sequence[Any]]]:
    """``(src, entries)`` of a received ``p2p.batch`` that came with ``frames`` frames (one
    per entry); each entry ``[kind, head, bufdesc]`` as in ``p2p.data``."""
    if (type(meta) is not list and type(meta) is not tuple) or len(meta) != 2:
        raise ProtocolError(f"{_BATCH}: expected a list of 2 fields (src, entries)")
    src, entries = meta
    if type(src) is not str or not 0 < len(src) <= MAX_SHORT:
        _src(src, _BATCH)
    if (type(entries) is not list and type(entries) is not tuple) or len(entries) != frames:
        raise _bad(_BATCH, "entries", f"expected a list of {frames} entries (one per frame), "
                                      f"got {type(entries).__name__}")
    # The common entry, a small pickle, is counted in one pass in C (an entry equal to it
    # but for a kind of 0.0 or False is read the same way downstream); the others are
    # checked one by one.
    if entries.count(OBJECT_ENTRY) != len(entries):
        for entry in entries:
            if entry != OBJECT_ENTRY:
                _entry(entry)
    return src, entries


def _entry(entry: object) -> None:
    """Check one ``p2p.batch`` entry ``[kind, head, bufdesc]``."""
    message = f"{_BATCH}.entries"
    kind, head, bufdesc = _fields(entry, ("kind", "head", "bufdesc"), message)
    _head(_kind(kind, message), head, message)
    _desc(bufdesc, message, "bufdesc")


def frames_to_wire(sizes: list[int], counts: list[int]) -> list[Any]:
    """The `FRAMES` descriptor: buffer ``i`` is ``sizes[i]`` bytes in ``counts[i]`` frames
    (the message's data frames, after its pickle)."""
    return [FRAMES, sizes, counts]


def frames_from_wire(
    desc: object, message: str = _BUFDESC
) -> tuple[Sequence[int], Sequence[int]]:
    """``(sizes, counts)`` of a received `FRAMES` descriptor."""
    _, sizes, counts = _fields(desc, ("tag", "sizes", "counts"), message)
    if ((type(sizes) is not list and type(sizes) is not tuple)
            or (type(counts) is not list and type(counts) is not tuple)
            or len(sizes) != len(counts) or len(sizes) > _MAX_LIST):
        raise _bad(message, "counts", "expected as many frame counts as buffer sizes")
    for n, count in zip(sizes, counts, strict=True):
        if type(n) is not int or type(count) is not int or n < 0 or count < 1:
            raise _bad(message, "sizes", "expected sizes >= 0 and frame counts >= 1")
    return sizes, counts


# ---------------------------------------------------------------------- CPU descriptors
@dataclass(frozen=True, slots=True)
class NewSegment:
    """A shared segment the receiver has not mapped yet: process ``pid``'s descriptor ``fd``,
    ``size`` bytes; ``address`` is where the receiver gives segments back (``p2p.ack``)."""

    pid: int
    fd: int
    size: int
    address: str

    def to_wire(self) -> list[Any]:
        return [self.pid, self.fd, self.size, self.address]

    @classmethod
    def from_wire(cls, meta: object, message: str) -> Self:
        pid, fd, size, address = _fields(meta, ("pid", "fd", "size", "address"), message)
        return cls(_int(pid, message, "pid", lo=1, hi=_MAX_PID),
                   _int(fd, message, "fd", hi=_MAX_PID), _int(size, message, "size"),
                   _text(address, message, "address"))


@dataclass(frozen=True, slots=True)
class ShmDesc:
    """`SHM`: the CPU bytes are in the sender's shared segment ``seg_id`` (``new`` the first
    time it is named), buffer ``i`` ``sizes[i]`` bytes at ``offsets[i]``."""

    seg_id: int
    new: NewSegment | None
    offsets: list[int]
    sizes: list[int]

    def to_wire(self) -> list[Any]:
        return [SHM, self.seg_id, None if self.new is None else self.new.to_wire(),
                self.offsets, self.sizes]

    @classmethod
    def from_wire(cls, meta: object, message: str = _BUFDESC) -> Self:
        _, seg_id, new, offsets, sizes = _fields(
            meta, ("tag", "seg_id", "new", "offsets", "sizes"), message)
        offsets, sizes = _ints(offsets, message, "offsets"), _ints(sizes, message, "sizes")
        if len(offsets) != len(sizes):
            raise _bad(message, "offsets", f"{len(offsets)} offsets for {len(sizes)} buffers")
        return cls(_int(seg_id, message, "seg_id"),
                   None if new is None else NewSegment.from_wire(new, f"{message}.new"),
                   offsets, sizes)


@dataclass(frozen=True, slots=True)
class CmaDesc:
    """`CMA`: the receiver reads ``nbytes`` at address ``addr`` of process ``pid``, then
    says so (``p2p.done`` naming ``token``) to the sender at ``address``."""

    token: int
    pid: int
    addr: int
    nbytes: int
    address: str

    def to_wire(self) -> list[Any]:
        return [CMA, self.token, self.pid, self.addr, self.nbytes, self.address]

    @classmethod
    def from_wire(cls, meta: object, message: str = _BUFDESC) -> Self:
        _, token, pid, addr, nbytes, address = _fields(
            meta, ("tag", "token", "pid", "addr", "nbytes", "address"), message)
        return cls(_int(token, message, "token"), _int(pid, message, "pid", lo=1, hi=_MAX_PID),
                   _int(addr, message, "addr", hi=_UINT64), _int(nbytes, message, "nbytes"),
                   _text(address, message, "address"))


# ---------------------------------------------------------------------- CUDA descriptors
@dataclass(frozen=True, slots=True)
class _SpecsDesc:
    """A CUDA descriptor that names only the tensors' ``specs``: ``[_TAG, specs]``."""

    specs: list[TensorSpec]
    _TAG: ClassVar[int] = -1

    def to_wire(self) -> list[Any]:
        return [self._TAG, self.specs]

    @classmethod
    def from_wire(cls, meta: object, message: str = _CUDADESC) -> Self:
        _, specs = _fields(meta, ("tag", "specs"), message)
        return cls(_specs(specs, message))


@dataclass(frozen=True, slots=True)
class HostDesc(_SpecsDesc):
    """`HOST`: the CUDA tensors ``specs`` staged in pinned host memory, in the last frame."""

    _TAG: ClassVar[int] = HOST


@dataclass(frozen=True, slots=True)
class EmptyCudaDesc(_SpecsDesc):
    """`NOTHING`: every CUDA tensor of the message is empty; ``specs`` rebuild them."""

    _TAG: ClassVar[int] = NOTHING


class IpcPart(NamedTuple):
    """One non-empty tensor sent by CUDA IPC: ``nbytes`` at ``offset`` of share
    ``share_id``, whose export ``args`` come the first time the share is named (else None)."""

    share_id: int
    args: Sequence[Any] | None
    offset: int
    nbytes: int


#: Items of torch's CUDA storage export (``_share_cuda_``).
_EXPORT_ITEMS: Final = 8


def _parts(value: object, message: str) -> list[IpcPart]:
    if (type(value) is not list and type(value) is not tuple) or len(value) > _MAX_LIST:
        raise _bad(message, "parts", f"expected a list of at most {_MAX_LIST} parts")
    parts = []
    for i, part in enumerate(value):
        # Plain comparisons first (a state dict has 1,000 parts); the error is worded only
        # for a part that fails them.
        if (type(part) is list or type(part) is tuple) and len(part) == 4:
            share_id, args, offset, nbytes = part
            if (type(share_id) is int and type(offset) is int and type(nbytes) is int
                    and 0 <= share_id <= _INT64 and 0 <= offset <= _INT64
                    and 0 <= nbytes <= _INT64 and args is None):
                parts.append(IpcPart(share_id, None, offset, nbytes))
                continue
        where = f"{message}.parts[{i}]"
        share_id, args, offset, nbytes = _fields(
            part, ("share_id", "args", "offset", "nbytes"), where)
        if args is not None and ((type(args) is not list and type(args) is not tuple)
                                 or len(args) != _EXPORT_ITEMS):
            raise _bad(where, "args", f"expected None or torch's {_EXPORT_ITEMS} export items")
        parts.append(IpcPart(_int(share_id, where, "share_id"), args,
                             _int(offset, where, "offset"), _int(nbytes, where, "nbytes")))
    return parts


@dataclass(frozen=True, slots=True)
class IpcDesc:
    """`IPC`: the CUDA tensors ``specs`` are read from the sender's GPU ``uuid`` (``parts``,
    one per non-empty tensor) after its interprocess event ``event_id`` (``event_handle``
    the first time, else None); the receiver acknowledges ``token`` to ``address``."""

    token: int
    address: str
    specs: list[TensorSpec]
    uuid: str
    parts: list[IpcPart]
    event_id: int
    event_handle: bytes | None

    def to_wire(self) -> list[Any]:
        return [IPC, self.token, self.address, self.specs, self.uuid,
                [list(p) for p in self.parts], [self.event_id, self.event_handle]]

    @classmethod
    def from_wire(cls, meta: object, message: str = _CUDADESC) -> Self:
        _, token, address, specs, uuid, parts, event = _fields(
            meta, ("tag", "token", "address", "specs", "uuid", "parts", "event"), message)
        event_id, handle = _fields(event, ("event_id", "handle"), f"{message}.event")
        if handle is not None and type(handle) is not bytes:
            raise _bad(message, "event.handle", f"expected None or bytes, got "
                                                f"{type(handle).__name__}")
        return cls(_int(token, message, "token"), _text(address, message, "address"),
                   _specs(specs, message), _text(uuid, message, "uuid"),
                   _parts(parts, message), _int(event_id, f"{message}.event", "event_id"),
                   handle)


@dataclass(frozen=True, slots=True)
class NcclDesc:
    """`NCCL`: the CUDA tensors ``specs`` travel by the pair's communicator ``gid`` (None
    until the leader named it), whose rendezvous store is at ``store`` (the leader's
    messages only); the transfer's handshakes name ``token`` and go to ``address``."""

    gid: str | None
    store: list[Any] | None
    specs: list[TensorSpec]
    token: int
    address: str

    def to_wire(self) -> list[Any]:
        return [NCCL, self.gid, self.store, self.specs, self.token, self.address]

    @classmethod
    def from_wire(cls, meta: object, message: str = _CUDADESC) -> Self:
        _, gid, store, specs, token, address = _fields(
            meta, ("tag", "gid", "store", "specs", "token", "address"), message)
        return cls(_optional_text(gid, message, "gid"), _store(store, message),
                   _specs(specs, message), _int(token, message, "token"),
                   _text(address, message, "address"))


# ---------------------------------------------------------------------- the paths' messages
@dataclass(frozen=True, slots=True)
class _SegmentNote:
    """A shared segment's news from ``src``: ``[src, seg_id]`` on the wire, under op ``_OP``."""

    src: str
    seg_id: int
    _OP: ClassVar[str] = ""

    def to_wire(self) -> list[Any]:
        return [self.src, self.seg_id]

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        src, seg_id = _fields(meta, ("src", "seg_id"), cls._OP)
        return cls(_src(src, cls._OP), _int(seg_id, cls._OP, "seg_id"))


@dataclass(frozen=True, slots=True)
class SegmentAck(_SegmentNote):
    """`P2POp.ACK`, receiver -> sender: shared segment ``seg_id`` is free again."""

    _OP: ClassVar[str] = _ACK


@dataclass(frozen=True, slots=True)
class SegmentDrop(_SegmentNote):
    """`P2POp.DROP`, sender -> receiver: forget shared segment ``seg_id`` (the sender closed it)."""

    _OP: ClassVar[str] = _DROP


@dataclass(frozen=True, slots=True)
class Taken:
    """`P2POp.TAKEN`, receiver -> sender: receives at ``src`` took ``count`` more of the
    sender's messages (what its receive window releases: ``aiorl.p2p.window``)."""

    src: str
    count: int

    def to_wire(self) -> list[Any]:
        return [self.src, self.count]

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        src, count = _fields(meta, ("src", "count"), _TAKEN)
        return cls(_src(src, _TAKEN), _int(count, _TAKEN, "count", lo=1))


@dataclass(frozen=True, slots=True)
class NcclReply:
    """An NCCL handshake from the receiver of transfer ``token`` (``aiorl.p2p.paths.nccl_order``):
    ``ready`` (its memory is allocated), ``go`` (issue your send: communicator ``gid``,
    rendezvous ``store``), ``refuse`` (it cannot take the transfer, for ``reason``)."""

    kind: Literal["ready", "go", "refuse"]
    gid: str | None = None
    store: list[Any] | None = None
    reason: str = ""

    def to_wire(self) -> list[Any]:
        if self.kind == "go":
            return ["go", self.gid, self.store]
        if self.kind == "refuse":
            return ["refuse", self.reason]
        return ["ready"]

    @classmethod
    def from_wire(cls, meta: object, message: str) -> Self:
        kind = meta[0] if (type(meta) is list or type(meta) is tuple) and meta else None
        if kind == "ready":
            _fields(meta, ("kind",), message)
            return cls("ready")
        if kind == "go":
            _, gid, store = _fields(meta, ("kind", "gid", "store"), message)
            return cls("go", _optional_text(gid, message, "gid"), _store(store, message))
        if kind == "refuse":
            _, reason = _fields(meta, ("kind", "reason"), message)
            if type(reason) is not str or len(reason) > MAX_TEXT:
                raise _bad(message, "reason", f"expected a string of at most {MAX_TEXT} "
                                              "characters")
            return cls("refuse", reason=reason)
        raise _bad(message, "kind", f"unknown NCCL handshake {kind!r:.40}")


@dataclass(frozen=True, slots=True)
class TransferDone:
    """`P2POp.DONE`, receiver -> sender, about transfer ``token``: a pulled payload (CMA,
    CUDA IPC) was read (``reply`` None) or not (``reply`` the error), or the transfer's
    NCCL handshake (`NcclReply`)."""

    src: str
    token: int
    reply: str | NcclReply | None

    def to_wire(self) -> list[Any]:
        reply = self.reply
        return [self.src, self.token, reply.to_wire() if isinstance(reply, NcclReply) else reply]

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        src, token, reply = _fields(meta, ("src", "token", "reply"), _DONE)
        if type(reply) is list or type(reply) is tuple:
            reply = NcclReply.from_wire(reply, f"{_DONE}.reply")
        elif reply is not None and (type(reply) is not str or len(reply) > MAX_TEXT):
            raise _bad(_DONE, "reply", f"expected None, an error of at most {MAX_TEXT} "
                                       f"characters or an NCCL handshake, got "
                                       f"{type(reply).__name__}")
        return cls(_src(src, _DONE), _int(token, _DONE, "token"), reply)


@dataclass(frozen=True, slots=True)
class IpcDrop:
    """`P2POp.CUDA` ``ipc-drop``, sender -> receiver: the CUDA IPC shares ``share_ids`` are
    no longer exported; the receiver closes their mappings once no receive reads them."""

    src: str
    share_ids: list[int]

    def to_wire(self) -> list[Any]:
        return [self.src, "ipc-drop", self.share_ids]


@dataclass(frozen=True, slots=True)
class IpcDropEvent:
    """`P2POp.CUDA` ``ipc-drop-event``, sender -> receiver: forget interprocess event
    ``event_id`` (the sender's pool of them is full)."""

    src: str
    event_id: int

    def to_wire(self) -> list[Any]:
        return [self.src, "ipc-drop-event", self.event_id]


@dataclass(frozen=True, slots=True)
class NcclGo:
    """`P2POp.CUDA` ``go``, the leader sender -> the follower receiver: the leader issued its
    send of transfer ``token`` on communicator ``gid`` (rendezvous ``store``): issue the
    receive."""

    src: str
    gid: str | None
    store: list[Any] | None
    token: int

    def to_wire(self) -> list[Any]:
        return [self.src, "go", self.gid, self.store, self.token]


#: What ``p2p.cuda`` carries.
CudaControl = IpcDrop | IpcDropEvent | NcclGo
#: What a payload path's receiving half gets from the sender (``p2p.drop``, ``p2p.cuda``).
PathControl = SegmentDrop | CudaControl
#: What a payload path's sending half gets from the receiver (``p2p.ack``, ``p2p.done``).
PathAck = SegmentAck | TransferDone


def cuda_control_from_wire(meta: object) -> CudaControl:
    """The message a received ``p2p.cuda`` carries, read by its second field."""
    what = meta[1] if (type(meta) is list or type(meta) is tuple) and len(meta) > 1 else None
    if what == "ipc-drop":
        src, _, ids = _fields(meta, ("src", "what", "share_ids"), _CUDA)
        # One id alone is read as a list of one.
        share_ids = _ints(ids if type(ids) is list else [ids], _CUDA, "share_ids")
        return IpcDrop(_src(src, _CUDA), share_ids)
    if what == "ipc-drop-event":
        src, _, event_id = _fields(meta, ("src", "what", "event_id"), _CUDA)
        return IpcDropEvent(_src(src, _CUDA), _int(event_id, _CUDA, "event_id"))
    if what == "go":
        src, _, gid, store, token = _fields(meta, ("src", "what", "gid", "store", "token"), _CUDA)
        return NcclGo(_src(src, _CUDA), _optional_text(gid, _CUDA, "gid"),
                      _store(store, _CUDA), _int(token, _CUDA, "token"))
    raise _bad(_CUDA, "what", f"expected 'ipc-drop', 'ipc-drop-event' or 'go', got {what!r:.40}")


# ---------------------------------------------------------------------- set-up
@dataclass(frozen=True, slots=True)
class Hello:
    """`P2POp.HELLO`, sender -> receiver, once per pair and question: the sender ``src``
    (process ``pid``, at ``addr``) asks what its payload paths need to know. ``cma``: can
    you read this address of my memory (a probe buffer)? ``probe``: can you map my shared
    segment ``(fd, size)``? ``cuda``: which machine and GPUs are yours? A map on the wire,
    holding the questions asked."""

    src: str
    addr: str
    pid: int
    cma: int | None = None
    probe: tuple[int, int] | None = None
    cuda: bool = False

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"src": self.src, "addr": self.addr, "pid": self.pid}
        if self.cma is not None:
            out["cma"] = self.cma
        if self.probe is not None:
            out["probe"] = list(self.probe)
        if self.cuda:
            out["cuda"] = True
        return out

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        f = Fields(meta, _HELLO)
        probe = None
        if f.has("probe"):
            fd, size = _fields(f.items("probe"), ("fd", "size"), f"{_HELLO}.probe")
            probe = (_int(fd, f"{_HELLO}.probe", "fd", hi=_MAX_PID),
                     _int(size, f"{_HELLO}.probe", "size"))
        return cls(f.text("src"), f.text("addr"), f.integer("pid", lo=1, hi=_MAX_PID),
                   f.integer("cma", lo=0, hi=_UINT64) if f.has("cma") else None, probe,
                   f.flag("cuda") if f.has("cuda") else False)


@dataclass(frozen=True, slots=True)
class CudaInfo:
    """A receiver's machine (``host``), selected device (``current``, -1 without CUDA) and
    every device's UUID, what the CUDA IPC path needs to know of it."""

    host: str
    current: int
    uuids: tuple[str, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"host": self.host, "current": self.current, "uuids": list(self.uuids)}

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        return cls.read(Fields(meta, f"{_HELLO} reply.cuda"))

    @classmethod
    def read(cls, f: Fields) -> Self:
        return cls(f.text("host"), f.integer("current", lo=-1, hi=_MAX_PID),
                   f.text_list("uuids", max_len=MAX_SHORT))


@dataclass(frozen=True, slots=True)
class HelloReply:
    """The answer to a `Hello`: each question asked, answered (None: not asked, or not
    answered). ``cma``: the probe buffer was read; ``shm``: the probe segment was mapped."""

    cma: bool | None = None
    shm: bool | None = None
    cuda: CudaInfo | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.cma is not None:
            out["cma"] = self.cma
        if self.shm is not None:
            out["shm"] = self.shm
        if self.cuda is not None:
            out["cuda"] = self.cuda.to_wire()
        return out

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        f = Fields(meta, f"{_HELLO} reply")
        return cls(f.flag("cma") if f.has("cma") else None,
                   f.flag("shm") if f.has("shm") else None,
                   CudaInfo.read(f.nested("cuda")) if f.has("cuda") else None)

