"""The registry's messages: one frozen dataclass per request, reply and event.

Fields are the wire map's keys (the protocol before these types existed used
the same maps), so ``to_wire()`` is a plain dict for msgpack and
``from_wire(meta)`` rebuilds the message, checking every field on the way in
(`aiorl.protocol.fields`): a malformed message raises
[`ProtocolError`][aiorl.ProtocolError] naming the field, at the boundary, before
anything is stored. `SCHEMA` maps each `RegistryOp` to its
request and reply types; the service's dispatch and the client's typed methods
are both driven by it, and a unit test checks that every op has both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only (postponed)

from aiorl.errors import ProtocolError
from aiorl.names import WorkerAddress, WorkerInfo
from aiorl.protocol.fields import MAX_TEXT, Fields, PlainData
from aiorl.protocol.ops import RegistryOp, WorkerState

__all__ = [
    "DETAIL_FENCED_IN",
    "DETAIL_GROUP_CLOSED",
    "FENCE_FACTOR",
    "NODES_PATTERN",
    "SCHEMA",
    "WILDCARD",
    "DriverInfo",
    "DriverRef",
    "GroupRecord",
    "GroupRef",
    "GroupSpec",
    "GroupStatus",
    "Heartbeat",
    "HeartbeatReply",
    "Lease",
    "NoArgs",
    "NodeInfo",
    "NodeList",
    "NodeRef",
    "NodeRegistered",
    "NodeRegistration",
    "Pong",
    "StatusReport",
    "WatchRequest",
    "WatchSnapshot",
    "WireMessage",
    "WorkerChanged",
    "WorkerExit",
    "WorkerRecord",
    "WorkerRef",
    "WorkerStateReport",
    "parse_worker_info",
    "root_of",
]

#: A node agent whose heartbeats go unanswered for this many expiries stops its workers
#: (the registry declares it dead after one; owners wait out the rest before restarting
#: its workers elsewhere). Two: a registry restart shorter than that loses nothing.
FENCE_FACTOR = 2
#: Watch pattern: every worker of every group.
WILDCARD = "*"
#: Watch pattern: the list of live nodes.
NODES_PATTERN = "@nodes"

Detail: TypeAlias = dict[str, PlainData]

#: Keys of a dead worker's :data:`Detail` besides its exit's (``reason`` and the rest):
#: the seconds its owner waits before restarting it elsewhere (its node was lost; the
#: node's agent stops it within them)...
DETAIL_FENCED_IN = "fenced_in"
#: ... and ``True`` when it ended because its group was closed (by its owner, a channel's
#: ``destroy``, another driver): an end, not a death for supervision to answer.
DETAIL_GROUP_CLOSED = "group_closed"

#: The most a heartbeat interval, expiry or uptime may say (seconds; a year).
_MAX_SECONDS = 365 * 86400.0
_MAX_PID = 2**31 - 1
_MAX_RANK = 2**31 - 1
_MAX_INCARNATION = 2**31 - 1


class WireMessage(Protocol):
    """What every message type offers: to and from its msgpack map."""

    def to_wire(self) -> Any: ...

    @classmethod
    def from_wire(cls, meta: Any) -> Self: ...


def root_of(name: str) -> str:
    """The root group of a worker name (``"g:3" -> "g"``)."""
    return name.split(":", 1)[0]


def _endpoint(f: Fields, key: str, default: object = None) -> str:
    """A transport address (``tcp://`` or ``ipc://``); empty for a worker that never started."""
    value = f.text(key) if default is None else f.text(key, default)
    if value and not value.startswith(("tcp://", "ipc://")):
        raise f.error(key, f"expected a tcp:// or ipc:// address, got {value[:60]!r}")
    return value


# ---------------------------------------------------------------------- requests with no fields
@dataclass(frozen=True, slots=True)
class NoArgs:
    """The request of ``nodes``, ``status`` and ``ping`` (sent as nil)."""

    def to_wire(self) -> None:
        return None

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        if meta is not None and meta != {}:
            raise ProtocolError(f"this request takes no fields, got {type(meta).__name__}")
        return cls()


# ---------------------------------------------------------------------- nodes and drivers
@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node agent: where it is, what it has, where to reach it."""

    node_id: str
    endpoint: str
    node_rank: int = -1  # in a registration: -1 = "any free rank"
    ip: str = ""
    hostname: str = ""
    cpus: int = 1
    num_accelerators: int = 0
    accelerator_type: str = "cpu"
    hardware: Mapping[str, int] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    pid: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id, "endpoint": self.endpoint, "node_rank": self.node_rank,
            "ip": self.ip, "hostname": self.hostname, "cpus": self.cpus,
            "num_accelerators": self.num_accelerators, "accelerator_type": self.accelerator_type,
            "hardware": dict(self.hardware), "labels": dict(self.labels), "pid": self.pid,
        }

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls.read(Fields(meta, "node"))

    @classmethod
    def read(cls, f: Fields) -> Self:
        rank = f.integer("node_rank", lo=-1, hi=_MAX_RANK) if f.has("node_rank") else -1
        return cls(
            node_id=f.ident("node_id"),
            endpoint=_endpoint(f, "endpoint"),
            node_rank=rank,
            ip=f.text("ip", ""),
            hostname=f.text("hostname", ""),
            cpus=f.integer("cpus", 1, lo=0, hi=1 << 20),
            num_accelerators=f.integer("num_accelerators", 0, lo=0, hi=1 << 16),
            accelerator_type=f.text("accelerator_type", "cpu"),
            hardware=f.int_map("hardware", {}),
            labels=f.text_map("labels", {}, max_len=1024),
            pid=f.integer("pid", 0, lo=0, hi=_MAX_PID),
        )


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A worker group: its name, size, owning driver and class (``create_group``).

    ``restore`` re-creates a group this owner already had (after a registry restart);
    node agents send the groups of the workers they host in their registration, so a
    group survives a restart even when its driver does not (and then expires).
    ``workers``, in an owner's restore, are the records of the workers it believes alive:
    the registry keeps each until that worker's node agent reports it again, and declares
    it dead if none does (it died, with its agent, while the registry was down).
    """

    group: str
    world_size: int
    owner: str
    worker_class: str = ""
    restore: bool = False
    workers: tuple[WorkerRecord, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"group": self.group, "world_size": self.world_size, "owner": self.owner,
                "worker_class": self.worker_class, "restore": self.restore,
                "workers": [w.to_wire() for w in self.workers]}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls.read(Fields(meta, "create_group"))

    @classmethod
    def read(cls, f: Fields) -> Self:
        return cls(
            group=f.group_name("group"),
            world_size=f.integer("world_size", lo=1, hi=1 << 20),
            owner=f.ident("owner"),
            worker_class=f.text("worker_class", ""),
            restore=f.flag("restore", False),
            workers=tuple(f.each("workers", WorkerRecord.read, ())),
        )


@dataclass(frozen=True, slots=True)
class NodeRegistration:
    """``register_node``: the node, plus the groups of the workers it already hosts."""

    node: NodeInfo
    groups: tuple[GroupSpec, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {**self.node.to_wire(), "groups": [g.to_wire() for g in self.groups]}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "register_node")
        return cls(NodeInfo.read(f), tuple(f.each("groups", GroupSpec.read, ())))


@dataclass(frozen=True, slots=True)
class Lease:
    """How often to send heartbeats, and after how long without one the sender is dead."""

    heartbeat_interval: float
    expiry: float

    def to_wire(self) -> dict[str, Any]:
        return {"heartbeat_interval": self.heartbeat_interval, "expiry": self.expiry}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "lease")
        return cls(f.number("heartbeat_interval", lo=1e-3, hi=_MAX_SECONDS),
                   f.number("expiry", lo=1e-3, hi=_MAX_SECONDS))


@dataclass(frozen=True, slots=True)
class NodeRegistered:
    """The reply to ``register_node``: the rank the node got, and its lease."""

    node_rank: int
    lease: Lease

    def to_wire(self) -> dict[str, Any]:
        return {"node_rank": self.node_rank, **self.lease.to_wire()}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "register_node reply")
        return cls(f.integer("node_rank", lo=0, hi=_MAX_RANK), Lease.from_wire(meta))


@dataclass(frozen=True, slots=True)
class NodeRef:
    node_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"node_id": self.node_id}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls(Fields(meta, "unregister_node").ident("node_id"))


@dataclass(frozen=True, slots=True)
class DriverInfo:
    """A driver process (a ``Cluster``), which owns groups."""

    driver_id: str
    pid: int = 0
    hostname: str = ""
    endpoint: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"driver_id": self.driver_id, "pid": self.pid, "hostname": self.hostname,
                "endpoint": self.endpoint}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls.read(Fields(meta, "driver"))

    @classmethod
    def read(cls, f: Fields) -> Self:
        return cls(f.ident("driver_id"), f.integer("pid", 0, lo=0, hi=_MAX_PID),
                   f.text("hostname", ""), _endpoint(f, "endpoint", ""))


@dataclass(frozen=True, slots=True)
class DriverRef:
    driver_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"driver_id": self.driver_id}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls(Fields(meta, "unregister_driver").ident("driver_id"))


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A node's or driver's heartbeat (``id`` is its node or driver id)."""

    id: str

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls(Fields(meta, "heartbeat").ident("id"))


@dataclass(frozen=True, slots=True)
class HeartbeatReply:
    """``known`` is false when the registry forgot the sender (it restarted): re-register."""

    known: bool

    def to_wire(self) -> dict[str, Any]:
        return {"known": self.known}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls(Fields(meta, "heartbeat reply").flag("known"))


# ---------------------------------------------------------------------- groups and workers
def parse_worker_info(f: Fields) -> WorkerInfo:
    """A [`WorkerInfo`][aiorl.WorkerInfo] from its wire map, every field checked."""
    name = f.worker_name("address")
    return WorkerInfo(
        address=WorkerAddress.from_name(name),
        rank=f.integer("rank", lo=0, hi=_MAX_RANK),
        group_world_size=f.integer("group_world_size", lo=0, hi=1 << 20),
        node_rank=f.integer("node_rank", lo=-1, hi=_MAX_RANK),
        node_ip=f.text("node_ip"),
        endpoint=_endpoint(f, "endpoint"),
        pid=f.integer("pid", 0, lo=0, hi=_MAX_PID),
        accelerator_type=f.text("accelerator_type", "cpu"),
        available_accelerators=list(f.int_list("available_accelerators", (), hi=1 << 16)),
        hardware_ranks=list(f.int_list("hardware_ranks", (), hi=1 << 20)),
        node_id=f.text("node_id", ""),
        hostname=f.text("hostname", ""),
    )


def _state(f: Fields, key: str, allowed: tuple[WorkerState, ...] = tuple(WorkerState)) -> WorkerState:
    value = f.text(key)
    if value not in allowed:
        raise f.error(key, f"expected one of {', '.join(allowed)}, got {value[:40]!r}")
    return WorkerState(value)


@dataclass(frozen=True, slots=True)
class GroupRef:
    """A request naming one group (``close_group``, ``lookup_group``)."""

    group: str

    def to_wire(self) -> dict[str, Any]:
        return {"group": self.group}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls(Fields(meta, "group request").group_name("group"))


@dataclass(frozen=True, slots=True)
class WorkerRef:
    """``lookup``: one worker by name."""

    name: str

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls(Fields(meta, "lookup").worker_name("name"))


def _incarnation(f: Fields) -> int:
    return f.integer("incarnation", 0, lo=0, hi=_MAX_INCARNATION)


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What the registry knows of one worker: its info, state, and why it ended.

    ``incarnation`` counts the processes that have held this name in its group: 0 for
    the first, one more for each restart (``launch(restart="on_failure")``), so a late
    event of an earlier process is told apart from news of the current one.
    """

    info: WorkerInfo
    state: WorkerState
    detail: Detail = field(default_factory=dict)
    incarnation: int = 0

    @property
    def name(self) -> str:
        return self.info.name

    def to_wire(self) -> dict[str, Any]:
        return {"info": self.info.to_wire(), "state": self.state.value, "detail": self.detail,
                "incarnation": self.incarnation}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls.read(Fields(meta, "worker"))

    @classmethod
    def read(cls, f: Fields) -> Self:
        return cls(parse_worker_info(f.nested("info")), _state(f, "state"),
                   f.plain_map("detail", {}) if f.has("detail") else {}, _incarnation(f))


@dataclass(frozen=True, slots=True)
class WorkerStateReport:
    """``worker_state``: a worker (or its agent, replaying) says it is starting, ready or failed.

    ``dead`` is not reported this way: only the agent that saw the process exit says so,
    with a `WorkerExit`.
    """

    info: WorkerInfo
    state: WorkerState
    detail: Detail = field(default_factory=dict)
    incarnation: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"info": self.info.to_wire(), "state": self.state.value, "detail": self.detail,
                "incarnation": self.incarnation}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "worker_state")
        allowed = (WorkerState.STARTING, WorkerState.READY, WorkerState.FAILED)
        return cls(parse_worker_info(f.nested("info")), _state(f, "state", allowed),
                   f.plain_map("detail", {}) if f.has("detail") else {}, _incarnation(f))


@dataclass(frozen=True, slots=True)
class WorkerExit:
    """``worker_exited``: a node agent saw a worker process end."""

    address: str
    pid: int
    exit_code: int = 0
    signal: int = 0
    stderr_tail: str = ""
    reason: str = ""
    incarnation: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"address": self.address, "pid": self.pid, "exit_code": self.exit_code,
                "signal": self.signal, "stderr_tail": self.stderr_tail, "reason": self.reason,
                "incarnation": self.incarnation}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "worker_exited")
        return cls(
            address=f.worker_name("address"),
            pid=f.integer("pid", lo=0, hi=_MAX_PID),
            exit_code=f.integer("exit_code", 0, lo=-255, hi=255),
            signal=f.integer("signal", 0, lo=0, hi=255),
            stderr_tail=f.text("stderr_tail", "", max_len=MAX_TEXT),
            reason=f.text("reason", "", max_len=MAX_TEXT),
            incarnation=_incarnation(f),
        )

    def detail(self) -> Detail:
        """The dead worker's ``detail`` in the registry (what its owner reads as the reason)."""
        return {"exit_code": self.exit_code, "signal": self.signal,
                "stderr_tail": self.stderr_tail, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class GroupRecord:
    """The reply to ``lookup_group``: the group and every worker it has had (name -> record)."""

    world_size: int
    worker_class: str
    owner: str
    workers: Mapping[str, WorkerRecord] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "worker_class": self.worker_class,
                "owner": self.owner, "workers": {n: w.to_wire() for n, w in self.workers.items()}}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "lookup_group reply")
        return cls(f.integer("world_size", lo=1, hi=1 << 20), f.text("worker_class", ""),
                   f.text("owner"), _records(f, "workers"))


def _records(f: Fields, key: str) -> dict[str, WorkerRecord]:
    out = {}
    for name, value in f.mapping(key, {}).items():
        out[name] = WorkerRecord.read(Fields(value, f"{key}[{name[:40]!r}]"))
    return out


def _check_pattern(pattern: str) -> str:
    if pattern in (WILDCARD, NODES_PATTERN):
        return pattern
    address = WorkerAddress.from_name(pattern)  # a group or a worker; ValueError otherwise
    if address.get_name() != pattern:
        raise ValueError(f"{pattern!r} is not a canonical name")
    return pattern


@dataclass(frozen=True, slots=True)
class WatchRequest:
    """``watch``/``unwatch``: a worker name, a group name, ``"*"`` or ``"@nodes"``."""

    name: str

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls(Fields(meta, "watch").checked("name", _check_pattern))


@dataclass(frozen=True, slots=True)
class WatchSnapshot:
    """The reply to ``watch``: the current members of the pattern (or the nodes, for ``@nodes``)."""

    workers: Mapping[str, WorkerRecord] = field(default_factory=dict)
    nodes: tuple[NodeInfo, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"workers": {n: w.to_wire() for n, w in self.workers.items()},
                "nodes": [n.to_wire() for n in self.nodes]}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "watch reply")
        return cls(_records(f, "workers"), tuple(f.each("nodes", NodeInfo.read, ())))


@dataclass(frozen=True, slots=True)
class NodeList:
    """The reply to ``nodes`` and the ``nodes`` event: the live nodes by rank."""

    nodes: tuple[NodeInfo, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"nodes": [n.to_wire() for n in self.nodes]}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls(tuple(Fields(meta, "nodes").each("nodes", NodeInfo.read)))


@dataclass(frozen=True, slots=True)
class WorkerChanged:
    """The ``worker`` event: a watched worker's new record."""

    record: WorkerRecord

    @property
    def name(self) -> str:
        return self.record.name

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.record.name, **self.record.to_wire()}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "worker event")
        record = WorkerRecord.read(f)
        if f.worker_name("name") != record.name:
            raise f.error("name", "differs from info.address")
        return cls(record)


@dataclass(frozen=True, slots=True)
class GroupStatus:
    """One group in a `StatusReport`."""

    name: str
    world_size: int
    worker_class: str
    owner: str
    ready: int

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "world_size": self.world_size,
                "worker_class": self.worker_class, "owner": self.owner, "ready": self.ready}

    @classmethod
    def read(cls, f: Fields) -> Self:
        return cls(f.group_name("name"), f.integer("world_size", lo=1, hi=1 << 20),
                   f.text("worker_class", ""), f.text("owner"), f.integer("ready", lo=0))


@dataclass(frozen=True, slots=True)
class StatusReport:
    """The reply to ``status``: everything the registry knows, for ``aiorl status``."""

    uptime: float
    nodes: tuple[NodeInfo, ...]
    groups: tuple[GroupStatus, ...]
    workers: tuple[WorkerRecord, ...]
    drivers: tuple[DriverInfo, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "uptime": self.uptime,
            "nodes": [n.to_wire() for n in self.nodes],
            "groups": [g.to_wire() for g in self.groups],
            "workers": [{"name": w.name, **w.to_wire()} for w in self.workers],
            "drivers": [d.to_wire() for d in self.drivers],
        }

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "status")
        return cls(
            f.number("uptime", hi=_MAX_SECONDS * 100),
            tuple(f.each("nodes", NodeInfo.read)),
            tuple(f.each("groups", GroupStatus.read)),
            tuple(f.each("workers", WorkerRecord.read)),
            tuple(f.each("drivers", DriverInfo.read)),
        )


@dataclass(frozen=True, slots=True)
class Pong:
    """The reply to ``ping``."""

    uptime: float

    def to_wire(self) -> dict[str, Any]:
        return {"uptime": self.uptime}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls(Fields(meta, "ping").number("uptime", hi=_MAX_SECONDS * 100))


#: op -> (request type, reply type); ``None`` for a reply with no fields (nil on the wire).
SCHEMA: dict[RegistryOp, tuple[type[WireMessage], type[WireMessage] | None]] = {
    RegistryOp.REGISTER_NODE: (NodeRegistration, NodeRegistered),
    RegistryOp.UNREGISTER_NODE: (NodeRef, None),
    RegistryOp.REGISTER_DRIVER: (DriverInfo, Lease),
    RegistryOp.UNREGISTER_DRIVER: (DriverRef, None),
    RegistryOp.HEARTBEAT: (Heartbeat, HeartbeatReply),
    RegistryOp.CREATE_GROUP: (GroupSpec, None),
    RegistryOp.CLOSE_GROUP: (GroupRef, None),
    RegistryOp.WORKER_STATE: (WorkerStateReport, None),
    RegistryOp.WORKER_EXITED: (WorkerExit, None),
    RegistryOp.LOOKUP: (WorkerRef, WorkerRecord),
    RegistryOp.LOOKUP_GROUP: (GroupRef, GroupRecord),
    RegistryOp.WATCH: (WatchRequest, WatchSnapshot),
    RegistryOp.UNWATCH: (WatchRequest, None),
    RegistryOp.NODES: (NoArgs, NodeList),
    RegistryOp.STATUS: (NoArgs, StatusReport),
    RegistryOp.PING: (NoArgs, Pong),
}
