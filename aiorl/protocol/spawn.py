"""What starts a worker: the driver's request to a node agent, and the agent's spec per process.

A `SpawnRequest` (driver -> agent, msgpack, checked by ``from_wire``)
names the group, its owner and size, and one `WorkerLaunch` per rank
placed on that agent's node; the class and its arguments travel as one
cloudpickled frame beside it. For each launch the agent builds a
`WorkerSpawn` (agent -> zygote -> forked worker, in-process objects of
one trusted node, never on the network), whose `WorkerSpawn.worker_info`
is the one place a worker's [`WorkerInfo`][aiorl.WorkerInfo] is built.

The request carries the group's owner and world size so the agent can tell a
restarted registry who owns the workers it hosts (see
`NodeRegistration`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only (postponed)

from aiorl.names import WorkerAddress, WorkerInfo
from aiorl.protocol.fields import Fields
from aiorl.protocol.registry import GroupSpec
from aiorl.protocol.working_dir import check_digest

__all__ = ["HostNode", "SpawnReply", "SpawnRequest", "WorkerLaunch", "WorkerSpawn"]

_MAX_WORLD = 1 << 20


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """One rank to start: its environment and the devices it may use.

    ``env`` is merged into the node's environment when the worker starts (path lists
    such as ``PATH`` are prepended, see `aiorl.node.launch_env`). A worker with a
    ``launcher`` (a profiler command such as ``nsys profile ...``) or an interpreter
    other than the zygote's cannot be forked from the warm zygote: it is started by
    exec, as ``launcher... python_interpreter -m aiorl.node.exec_worker``.
    """

    rank: int
    env: Mapping[str, str] = field(default_factory=dict)
    hardware_ranks: tuple[int, ...] = ()
    visible_accelerators: tuple[str, ...] = ()
    sys_path: tuple[str, ...] = ()
    log_level: str = "INFO"
    launcher: tuple[str, ...] = ()
    python_interpreter: str | None = None
    #: The worker's current directory (set by the agent for a shipped working directory).
    cwd: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire = {"rank": self.rank, "env": dict(self.env),
                "hardware_ranks": list(self.hardware_ranks),
                "visible_accelerators": list(self.visible_accelerators),
                "sys_path": list(self.sys_path), "log_level": self.log_level,
                "launcher": list(self.launcher)}
        if self.python_interpreter is not None:
            wire["python_interpreter"] = self.python_interpreter
        if self.cwd is not None:
            wire["cwd"] = self.cwd
        return wire

    @classmethod
    def read(cls, f: Fields) -> Self:
        env = f.text_map("env", {})
        if any("\0" in k or "\0" in v or "=" in k or not k for k, v in env.items()):
            raise f.error("env", "names must be non-empty without '=' or NUL, values without NUL")
        return cls(
            rank=f.integer("rank", lo=0, hi=_MAX_WORLD),
            env=env,
            hardware_ranks=f.int_list("hardware_ranks", (), hi=_MAX_WORLD),
            visible_accelerators=f.text_list("visible_accelerators", (), max_len=64),
            sys_path=f.text_list("sys_path", ()),
            log_level=f.text("log_level", "INFO", max_len=16),
            launcher=f.text_list("launcher", ()),
            python_interpreter=f.optional_text("python_interpreter"),
            cwd=f.optional_text("cwd"),
        )


@dataclass(frozen=True, slots=True)
class SpawnRequest:
    """``spawn``: start these ranks of ``group`` on the receiving agent's node."""

    group: str
    owner: str
    world_size: int
    workers: tuple[WorkerLaunch, ...]
    worker_class: str = ""
    output_to: str | None = None  # the driver endpoint that wants the workers' output
    #: The digest of the driver's working directory, sent to the agent before
    #: (protocol/working_dir.py): first on the workers' ``sys.path``.
    working_dir: str | None = None
    #: Whether that directory is also the workers' current directory.
    working_dir_chdir: bool = False

    def to_wire(self) -> dict[str, Any]:
        wire = {"group": self.group, "owner": self.owner, "world_size": self.world_size,
                "worker_class": self.worker_class,
                "workers": [w.to_wire() for w in self.workers], "output_to": self.output_to}
        if self.working_dir is not None:
            wire["working_dir"] = self.working_dir
            wire["working_dir_chdir"] = self.working_dir_chdir
        return wire

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "spawn")
        request = cls(
            group=f.group_name("group"),
            owner=f.ident("owner"),
            world_size=f.integer("world_size", lo=1, hi=_MAX_WORLD),
            workers=tuple(f.each("workers", WorkerLaunch.read)),
            worker_class=f.text("worker_class", ""),
            output_to=f.optional_text("output_to"),
            working_dir=(f.checked("working_dir", check_digest) if f.has("working_dir")
                         else None),
            working_dir_chdir=f.flag("working_dir_chdir", False),
        )
        if any(w.rank >= request.world_size for w in request.workers):
            raise f.error("workers", f"a rank is outside the group of {request.world_size}")
        return request

    def group_spec(self) -> GroupSpec:
        """The group these workers belong to, as the agent reports it to a restarted registry."""
        return GroupSpec(self.group, self.world_size, self.owner, self.worker_class, restore=True)


@dataclass(frozen=True, slots=True)
class SpawnReply:
    """The reply to ``spawn``: the new processes' pids, in the order of the request."""

    pids: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"pids": list(self.pids)}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls(Fields(meta, "spawn reply").int_list("pids", hi=2**31 - 1))


@dataclass(frozen=True, slots=True)
class HostNode:
    """The node a worker runs on, as its agent describes it to the worker."""

    node_id: str
    node_rank: int
    ip: str
    hostname: str
    accelerator_type: str
    endpoint: str  # the agent's


@dataclass(frozen=True, slots=True)
class WorkerSpawn:
    """Everything a forked worker process needs to become ``group:rank``."""

    launch: WorkerLaunch
    group: str
    world_size: int
    payload: bytes  # cloudpickled (class, args, kwargs)
    registry: str
    node: HostNode
    log_path: str

    @property
    def name(self) -> str:
        return f"{self.group}:{self.launch.rank}"

    def worker_info(self, endpoint: str, pid: int | None = None) -> WorkerInfo:
        """The worker's registry record, once its endpoint is bound."""
        return WorkerInfo(
            address=WorkerAddress(self.group, [self.launch.rank]),
            rank=self.launch.rank,
            group_world_size=self.world_size,
            node_rank=self.node.node_rank,
            node_ip=self.node.ip,
            endpoint=endpoint,
            pid=os.getpid() if pid is None else pid,
            accelerator_type=self.node.accelerator_type,
            available_accelerators=[int(a) for a in self.launch.visible_accelerators
                                    if a.isdigit()],
            hardware_ranks=list(self.launch.hardware_ranks),
            node_id=self.node.node_id,
            hostname=self.node.hostname,
        )
