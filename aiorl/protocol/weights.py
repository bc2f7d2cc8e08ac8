"""The weights messages: a weight name's directory, its requests and replies, and what they carry.

A weight name's directory (``aiorl.weights.directory``) is a worker: every request is a
call of the directory method named by its op (`aiorl.protocol.ops.DirectoryOp`), with the
request's ``to_wire()`` as its one argument, answered with the reply's ``to_wire()``
(`SCHEMA` pairs them). Each ``from_wire`` checks every field on the way in
(`aiorl.protocol.fields`) and raises [`ProtocolError`][aiorl.ProtocolError] naming the
field, so that neither the directory's tables nor a subscriber's view ever hold a
malformed value, and no side decodes a reply by its length or a request by the position
of its arguments.

The things these messages carry are plain data defined here too (where a segment is,
`SegmentRef`; which tensors a slot holds, `Layout`; where a GPU's slots are,
`CudaExport`; one copy of a shard, `ShardSource`), so that this package, which imports no
layer above it, can check them. `aiorl.protocol.ops.WeightsOp` names the messages weights
processes send each other directly (a relay's bucket fetch, the directory's word to a GPU
publisher, the NCCL rounds of ``aiorl.weights.nccl``).

Directory calls travel pickled, as every worker call does, and a `CudaExport` needs it (it
holds torch's IPC rebuild functions): the wire form is plain data plus those functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only (postponed)

from aiorl.errors import ProtocolError
from aiorl.protocol.fields import MAX_TEXT, Fields
from aiorl.protocol.ops import DirectoryOp, WeightsOp

__all__ = [
    "SCHEMA",
    "Ack",
    "Announce",
    "AnnounceGpu",
    "AnnounceReply",
    "CudaExport",
    "DirectoryRequest",
    "FetchBucket",
    "GpuSubscribe",
    "HostNotice",
    "HostPull",
    "HostWanted",
    "Layout",
    "NodeView",
    "Poll",
    "PublisherRegistered",
    "RegisterPublisher",
    "RelayJob",
    "RestoreRelay",
    "SegmentRef",
    "ShardSource",
    "TensorSpec",
]

_MAX_SHARDS = 1 << 16
_MAX_VERSION = 2**63 - 1
_MAX_SLOT = 1
_MAX_BYTES = 1 << 50
_MAX_WAIT_S = 3600.0


def _count(f: Fields, key: str, hi: int = _MAX_BYTES) -> int:
    return f.integer(key, lo=0, hi=hi)


def _version(f: Fields, key: str = "version") -> int:
    return f.integer(key, lo=0, hi=_MAX_VERSION)


def _slot(f: Fields, key: str = "slot") -> int:
    return f.integer(key, lo=0, hi=_MAX_SLOT)


def _pairs(f: Fields, key: str) -> list[tuple[int, int]]:
    """A list of ``[a, b]`` pairs of non-negative integers."""
    pairs = f.items(key)
    if not all(isinstance(p, (list, tuple)) and len(p) == 2
               and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in p)
               for p in pairs):
        raise f.error(key, "expected pairs of non-negative integers")
    return [(int(p[0]), int(p[1])) for p in pairs]  # type: ignore[index]  # checked above


# ---------------------------------------------------------------------- what messages carry
@dataclass(frozen=True)
class SegmentRef:
    """How another process of the node finds a segment: the owner's pid and fd, and sizes."""

    pid: int
    fd: int
    size: int
    slot_bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {"pid": self.pid, "fd": self.fd, "size": self.size,
                "slot_bytes": self.slot_bytes}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls.read(Fields(meta, "segment"))

    @classmethod
    def read(cls, f: Fields) -> Self:
        return cls(_count(f, "pid", 2**31 - 1), _count(f, "fd", 2**31 - 1), _count(f, "size"),
                   _count(f, "slot_bytes"))


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the shard: its name, dtype (torch name, e.g. ``"bfloat16"``), shape and
    byte range in the slot."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """The tensors of one shard in slot order, the slot size and the bucket ranges
    (``aiorl.weights.layout`` computes it from a state dict)."""

    tensors: tuple[TensorSpec, ...]
    nbytes: int
    buckets: tuple[tuple[int, int], ...]

    def to_wire(self) -> dict[str, Any]:
        return {"tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes]
                            for t in self.tensors],
                "nbytes": self.nbytes, "buckets": [list(b) for b in self.buckets]}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls.read(Fields(meta, "layout"))

    @classmethod
    def read(cls, f: Fields) -> Self:
        """The layout ``f`` holds; the same object for the same content while it is among the
        last `_KEPT_LAYOUTS` read. A directory's reply repeats each shard's layout, and
        checking 1,000 tensor specs field by field costs milliseconds where packing them to
        find the layout read before costs a tenth of that; so plans made for a layout
        (``aiorl.weights.layout.TensorPlan``) can be kept by its identity."""
        key = f.packed()
        if key is not None:
            kept = _kept_layouts.get(key)
            if kept is not None:
                return kept  # type: ignore[return-value]
        layout = cls._read(f)
        if key is not None:
            if len(_kept_layouts) >= _KEPT_LAYOUTS:
                del _kept_layouts[next(iter(_kept_layouts))]
            _kept_layouts[key] = layout
        return layout

    @classmethod
    def _read(cls, f: Fields) -> Self:
        tensors = []
        for i, entry in enumerate(f.items("tensors")):
            t = Fields(dict(zip(("name", "dtype", "shape", "offset", "nbytes"), entry, strict=True))
                       if isinstance(entry, (list, tuple)) and len(entry) == 5 else entry,
                       f"layout.tensors[{i}]")
            tensors.append(TensorSpec(t.text("name"), t.text("dtype", max_len=64),
                                      t.int_list("shape", lo=0), _count(t, "offset"),
                                      _count(t, "nbytes")))
        nbytes = _count(f, "nbytes")
        buckets = tuple(_pairs(f, "buckets"))
        if any(not start < end <= nbytes for start, end in buckets):
            raise f.error("buckets", f"a bucket is empty or beyond the slot's {nbytes} bytes")
        return cls(tuple(tensors), nbytes, buckets)


#: Layouts read lately, by their wire form packed (`Layout.read`): at most this many, the
#: oldest dropped first.
_KEPT_LAYOUTS = 16
_kept_layouts: dict[bytes, Layout] = {}


@dataclass(frozen=True)
class CudaExport:
    """What a subscriber needs to open a publisher's GPU slots: the device's UUID and, per
    slot, torch's IPC rebuild function and arguments."""

    device_uuid: str
    slots: tuple[tuple[Any, tuple[Any, ...]], ...]

    def to_wire(self) -> dict[str, Any]:
        return {"device_uuid": self.device_uuid, "slots": [list(s) for s in self.slots]}

    @classmethod
    def read(cls, f: Fields) -> Self:
        slots = f.items("slots")
        if not all(isinstance(s, (list, tuple)) and len(s) == 2 and callable(s[0])
                   and isinstance(s[1], tuple) for s in slots):
            raise f.error("slots", "expected [rebuild function, arguments] per slot")
        return cls(f.text("device_uuid"), tuple((s[0], s[1]) for s in slots))  # type: ignore[index]


@dataclass(frozen=True)
class ShardSource:
    """One copy of a shard on one node: the worker writing it, its segment, version -> slot,
    and for a publisher on a GPU its GPU slots (`CudaExport`) and which versions of
    ``slots`` are in the GPU slots only (``device_only``: their host bytes were not
    written, no host reader may be given them)."""

    shard: int
    worker: str
    endpoint: str
    ref: SegmentRef
    slots: dict[int, int] = field(default_factory=dict)
    cuda: CudaExport | None = None
    device_only: set[int] = field(default_factory=set)

    def to_wire(self) -> dict[str, Any]:
        return {"shard": self.shard, "worker": self.worker, "endpoint": self.endpoint,
                "ref": self.ref.to_wire(), "slots": [list(s) for s in self.slots.items()],
                "cuda": None if self.cuda is None else self.cuda.to_wire(),
                "device_only": sorted(self.device_only)}

    @classmethod
    def read(cls, f: Fields) -> Self:
        cuda = f.nested("cuda") if f.has("cuda") else None
        return cls(_count(f, "shard", _MAX_SHARDS), f.worker_name("worker"), f.text("endpoint"),
                   SegmentRef.read(f.nested("ref")), dict(_pairs(f, "slots")),
                   None if cuda is None else CudaExport.read(cuda),
                   set(f.int_list("device_only", lo=0)))


def _optional_source(f: Fields, key: str) -> ShardSource | None:
    return ShardSource.read(f.nested(key)) if f.has(key) else None


@dataclass(frozen=True)
class RelayJob:
    """Fetch ``version`` of ``shard`` from its publisher into this node's relay segment."""

    shard: int
    version: int
    publisher: ShardSource


# ---------------------------------------------------------------------- requests and replies
class DirectoryRequest:
    """What every directory request offers: its op (the directory method it calls) and its
    wire form; `SCHEMA` names its reply."""

    op: DirectoryOp

    def to_wire(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class Ack:
    """The reply of a request that only states a fact (sent as nil)."""

    def to_wire(self) -> None:
        return None

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        if meta is not None:
            raise ProtocolError(f"this reply has no fields, got {type(meta).__name__}")
        return cls()


@dataclass(frozen=True)
class RegisterPublisher(DirectoryRequest):
    """Shard ``source.shard`` of ``num_shards`` is published by ``source.worker`` on
    ``node_id``, with ``layout``."""

    op = DirectoryOp.REGISTER_PUBLISHER
    source: ShardSource
    num_shards: int
    node_id: str
    layout: Layout

    def to_wire(self) -> dict[str, Any]:
        return {"source": self.source.to_wire(), "num_shards": self.num_shards,
                "node_id": self.node_id, "layout": self.layout.to_wire()}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, cls.op)
        return cls(ShardSource.read(f.nested("source")),
                   f.integer("num_shards", lo=1, hi=_MAX_SHARDS), f.text("node_id"),
                   Layout.read(f.nested("layout")))


@dataclass(frozen=True)
class PublisherRegistered:
    """The reply of `RegisterPublisher`: the newest version a publisher of the shard
    completed (None: none yet); the new publisher's versions must be above it."""

    floor: int | None

    def to_wire(self) -> dict[str, Any]:
        return {"floor": self.floor}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "register_publisher reply")
        return cls(_version(f, "floor") if f.has("floor") else None)


@dataclass(frozen=True)
class Announce(DirectoryRequest):
    """``worker`` (the shard's publisher, or a relay with its ``ref`` and ``node_id``)
    completed ``version`` in ``slot``; ``host=False``: a GPU publisher wrote it to its GPU
    slot only."""

    op = DirectoryOp.ANNOUNCE
    worker: str
    shard: int
    version: int
    slot: int
    ref: SegmentRef | None = None
    node_id: str = ""
    host: bool = True

    def to_wire(self) -> dict[str, Any]:
        return {"worker": self.worker, "shard": self.shard, "version": self.version,
                "slot": self.slot, "ref": None if self.ref is None else self.ref.to_wire(),
                "node_id": self.node_id, "host": self.host}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, cls.op)
        return cls(f.worker_name("worker"), _count(f, "shard", _MAX_SHARDS), _version(f),
                   _slot(f), SegmentRef.read(f.nested("ref")) if f.has("ref") else None,
                   f.text("node_id", ""), f.flag("host", True))


@dataclass(frozen=True)
class HostWanted:
    """Whether some subscriber reads a GPU publisher's shard from host memory, as
    directory incarnation ``incarnation`` said it the ``counter``-th time (a publisher
    applies only a word newer than the last it applied)."""

    wanted: bool
    incarnation: str
    counter: int

    def to_wire(self) -> dict[str, Any]:
        return {"wanted": self.wanted, "incarnation": self.incarnation, "counter": self.counter}

    @classmethod
    def read(cls, f: Fields) -> Self:
        return cls(f.flag("wanted"), f.text("incarnation"), _count(f, "counter", 2**63 - 1))


@dataclass(frozen=True)
class AnnounceReply:
    """The reply of `Announce`: to the shard's GPU publisher, the directory's latest
    `HostWanted`; None to anyone else (a CPU publisher, a relay, a replaced relay)."""

    host: HostWanted | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"host": None if self.host is None else self.host.to_wire()}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "announce reply")
        return cls(HostWanted.read(f.nested("host")) if f.has("host") else None)


@dataclass(frozen=True)
class HostNotice:
    """`WeightsOp.HOST`: the directory's `HostWanted` for shard ``shard`` of weights
    ``name``, sent one-way to its GPU publisher."""

    name: str
    shard: int
    host: HostWanted

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "shard": self.shard, "host": self.host.to_wire()}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, WeightsOp.HOST)
        return cls(f.text("name"), _count(f, "shard", _MAX_SHARDS),
                   HostWanted.read(f.nested("host")))


@dataclass(frozen=True)
class HostPull(DirectoryRequest):
    """Subscriber ``worker`` of ``node_id`` pulled into host memory (or another device than
    a GPU publisher's)."""

    op = DirectoryOp.HOST_PULL
    worker: str
    node_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"worker": self.worker, "node_id": self.node_id}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, cls.op)
        return cls(f.worker_name("worker"), f.text("node_id"))


@dataclass(frozen=True)
class RestoreRelay(DirectoryRequest):
    """``worker`` was ``node_id``'s relay of ``shard`` before the directory restarted: its
    segment ``ref`` holds ``slots`` (version -> slot) copied from publisher segment
    ``origin``."""

    op = DirectoryOp.RESTORE_RELAY
    worker: str
    node_id: str
    shard: int
    ref: SegmentRef
    slots: dict[int, int]
    origin: SegmentRef

    def to_wire(self) -> dict[str, Any]:
        return {"worker": self.worker, "node_id": self.node_id, "shard": self.shard,
                "ref": self.ref.to_wire(), "slots": [list(s) for s in self.slots.items()],
                "origin": self.origin.to_wire()}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, cls.op)
        return cls(f.worker_name("worker"), f.text("node_id"), _count(f, "shard", _MAX_SHARDS),
                   SegmentRef.read(f.nested("ref")), dict(_pairs(f, "slots")),
                   SegmentRef.read(f.nested("origin")))


@dataclass(frozen=True)
class GpuSubscribe(DirectoryRequest):
    """Subscriber ``worker`` of ``node_id`` pulls into the GPU named ``uuid``."""

    op = DirectoryOp.GPU_SUBSCRIBE
    worker: str
    node_id: str
    uuid: str

    def to_wire(self) -> dict[str, Any]:
        return {"worker": self.worker, "node_id": self.node_id, "uuid": self.uuid}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, cls.op)
        return cls(f.worker_name("worker"), f.text("node_id"), f.text("uuid"))


@dataclass(frozen=True)
class AnnounceGpu(DirectoryRequest):
    """Representative ``worker`` of GPU ``uuid`` of ``node_id`` holds ``version`` of
    ``shard`` complete in its GPU slot ``slot`` (``ref``: its seqlock header; ``export``:
    the slots)."""

    op = DirectoryOp.ANNOUNCE_GPU
    worker: str
    node_id: str
    uuid: str
    shard: int
    version: int
    slot: int
    ref: SegmentRef
    export: CudaExport

    def to_wire(self) -> dict[str, Any]:
        return {"worker": self.worker, "node_id": self.node_id, "uuid": self.uuid,
                "shard": self.shard, "version": self.version, "slot": self.slot,
                "ref": self.ref.to_wire(), "export": self.export.to_wire()}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, cls.op)
        return cls(f.worker_name("worker"), f.text("node_id"), f.text("uuid"),
                   _count(f, "shard", _MAX_SHARDS), _version(f), _slot(f),
                   SegmentRef.read(f.nested("ref")), CudaExport.read(f.nested("export")))


@dataclass(frozen=True)
class Poll(DirectoryRequest):
    """Subscriber ``worker`` of ``node_id`` asks for the directory's state once it is newer
    than ``generation`` of incarnation ``directory`` (or after ``wait_s`` seconds)."""

    op = DirectoryOp.POLL
    worker: str
    node_id: str
    generation: int
    wait_s: float
    directory: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"worker": self.worker, "node_id": self.node_id, "generation": self.generation,
                "wait_s": self.wait_s, "directory": self.directory}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, cls.op)
        return cls(f.worker_name("worker"), f.text("node_id"),
                   f.integer("generation", lo=-1), f.number("wait_s", hi=_MAX_WAIT_S),
                   f.text("directory", ""))


@dataclass(frozen=True)
class NodeView:
    """The reply of `Poll`: the directory's answer for one subscriber.

    ``version`` is the newest version every shard holds complete on the subscriber's node
    (None if there is none), ``sources`` the node's source of each shard, ``layouts`` each
    shard's layout, ``relay_jobs`` what this subscriber should fetch as its node's relay,
    ``lost`` why a publisher is gone (None while all are alive), ``generation`` the
    directory state this answers and ``directory`` the directory incarnation that answers
    (pass both back to wait for a change).

    For a subscriber that pulls into a GPU other than a GPU publisher's (`GpuSubscribe`):
    ``gpu_sources`` holds, per shard, the copy of that shard on the subscriber's GPU (its
    representative's, ``aiorl.weights.nccl``; None where there is none, or none needed),
    and ``gpu_jobs`` the publishers (their sources) of the shards for which the subscriber
    itself is its GPU's representative.
    """

    version: int | None
    sources: tuple[ShardSource, ...]
    layouts: tuple[Layout, ...]
    relay_jobs: tuple[RelayJob, ...]
    lost: str | None
    generation: int
    directory: str = ""
    gpu_sources: tuple[ShardSource | None, ...] = ()
    gpu_jobs: tuple[ShardSource, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version, "sources": [s.to_wire() for s in self.sources],
            "layouts": [lay.to_wire() for lay in self.layouts],
            "relay_jobs": [{"shard": j.shard, "version": j.version,
                            "publisher": j.publisher.to_wire()} for j in self.relay_jobs],
            "lost": self.lost, "generation": self.generation, "directory": self.directory,
            "gpu_sources": [{"source": None if s is None else s.to_wire()}
                            for s in self.gpu_sources],
            "gpu_jobs": [s.to_wire() for s in self.gpu_jobs],
        }

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "poll reply")
        jobs = f.each("relay_jobs", lambda j: RelayJob(
            _count(j, "shard", _MAX_SHARDS), _version(j), ShardSource.read(j.nested("publisher"))))
        return cls(
            _version(f) if f.has("version") else None, tuple(f.each("sources", ShardSource.read)),
            tuple(f.each("layouts", Layout.read)), tuple(jobs),
            f.optional_text("lost", max_len=MAX_TEXT), f.integer("generation", lo=-1),
            f.text("directory", ""),
            tuple(f.each("gpu_sources", lambda s: _optional_source(s, "source"))),
            tuple(f.each("gpu_jobs", ShardSource.read)))


@dataclass(frozen=True)
class FetchBucket:
    """`WeightsOp.FETCH`: a relay asks a publisher for bytes ``start:end`` of ``version`` of
    shard ``shard`` of weights ``name`` (answered with whether the copy is intact, and the
    bytes as frames)."""

    name: str
    shard: int
    version: int
    start: int
    end: int

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "shard": self.shard, "version": self.version,
                "start": self.start, "end": self.end}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, WeightsOp.FETCH)
        fetch = cls(f.text("name"), _count(f, "shard", _MAX_SHARDS), _version(f),
                    _count(f, "start"), _count(f, "end"))
        if fetch.end <= fetch.start:
            raise f.error("end", f"{fetch.end} is not above start {fetch.start}")
        return fetch


#: Each directory op's request and reply types: the directory decodes requests with the
#: first, its clients decode answers with the second.
SCHEMA: dict[DirectoryOp, tuple[type[Any], type[Any]]] = {
    DirectoryOp.REGISTER_PUBLISHER: (RegisterPublisher, PublisherRegistered),
    DirectoryOp.ANNOUNCE: (Announce, AnnounceReply),
    DirectoryOp.HOST_PULL: (HostPull, Ack),
    DirectoryOp.RESTORE_RELAY: (RestoreRelay, Ack),
    DirectoryOp.GPU_SUBSCRIBE: (GpuSubscribe, Ack),
    DirectoryOp.ANNOUNCE_GPU: (AnnounceGpu, Ack),
    DirectoryOp.POLL: (Poll, NodeView),
}
