"""The registry service (``aiorl-registry``): who is where, and who is alive.

The registry holds four tables:

* **nodes**: one per node agent (id, rank, ip, hostname, cpus, accelerators,
  custom hardware, labels, agent endpoint), kept alive by heartbeats;
* **drivers**: processes that own groups (a ``Cluster`` in a user's program),
  also kept alive by heartbeats;
* **groups**: name -> size, class and owning driver;
* **workers**: address -> `WorkerRecord` (info,
  state, why it ended), grouped by root group name.

Clients *watch* names (a worker, a group, or ``"*"``) and get each change
pushed as a ``worker`` event, so nobody polls. When a node's or driver's
heartbeats stop for ``expiry`` seconds it is declared dead: a dead node's
workers are reported ``dead`` (the reason names every worker lost with it); a
dead driver's groups are torn down.

Hardening (docs/failures.md, docs/security.md):

* Every request is parsed by its typed message's ``from_wire``
  (`aiorl.protocol.registry.SCHEMA`) before a handler runs; a malformed
  one is answered with [`ProtocolError`][aiorl.ProtocolError] and never stored,
  so no later scan of a table can trip over it.
* The sweep (expiry) logs a failure and runs again; warnings are rate-limited.
* The state is bounded: dead nodes leave the table at once; a worker that ended
  leaves it ``grace`` seconds after its group is gone; a live worker whose group
  has been gone for ``grace`` seconds is killed through its node; watches are
  capped per client and dropped when the client disconnects.
* Groups survive a registry restart even when their driver does not: node
  agents re-register the groups of the workers they host, and a group whose
  owner has not registered within ``2 * expiry`` is torn down (its workers
  killed by their agents), so nothing is leaked and no later driver is answered
  by an old group's processes.

Nothing here unpickles: every request and reply is msgpack.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from aiorl.errors import (
    GroupExistsError,
    GroupNotFoundError,
    NodeRankTakenError,
    ProtocolError,
    RegistryError,
    WorkerNotFoundError,
)
from aiorl.names import WorkerAddress, WorkerInfo
from aiorl.protocol.ops import AgentOp, RegistryEvent, RegistryOp, WorkerState
from aiorl.protocol.registry import (
    DETAIL_FENCED_IN,
    DETAIL_GROUP_CLOSED,
    FENCE_FACTOR,
    NODES_PATTERN,
    SCHEMA,
    WILDCARD,
    DriverInfo,
    DriverRef,
    GroupRecord,
    GroupRef,
    GroupSpec,
    GroupStatus,
    Heartbeat,
    HeartbeatReply,
    Lease,
    NoArgs,
    NodeInfo,
    NodeList,
    NodeRef,
    NodeRegistered,
    NodeRegistration,
    Pong,
    StatusReport,
    WatchRequest,
    WatchSnapshot,
    WireMessage,
    WorkerChanged,
    WorkerExit,
    WorkerRecord,
    WorkerRef,
    WorkerStateReport,
    root_of,
)
from aiorl.registry.framing import MAY_BE_LARGE, frame
from aiorl.registry.table import WorkerTable
from aiorl.transport.endpoint import Endpoint, Incoming
from aiorl.util.limits import raise_open_file_limit
from aiorl.util.pidfile import PidFileError, pid_file
from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["DEFAULT_GRACE", "RegistryService", "main"]

log = logging.getLogger("aiorl.registry")

#: Seconds an ended worker stays listed after its group is gone (so a late watcher
#: still learns why it ended), and a live worker may run without a group.
DEFAULT_GRACE = 60.0
#: Watch patterns one client may hold, and all clients together.
MAX_WATCHES_PER_CLIENT = 10_000
MAX_WATCHES = 200_000
#: Ended workers of closed groups remembered so their late exit reports are ignored.
MAX_RETIRED = 10_000
#: How many lost workers a dead node's reason names before "and N more".
_NAMED_LOSSES = 16

Handler = Callable[[Any, bytes], WireMessage | None]


def _some(items: Iterable[str]) -> str:
    """Up to 16 items, then how many more: one log line, whatever the count."""
    listed = list(items)
    more = f" and {len(listed) - _NAMED_LOSSES} more" if len(listed) > _NAMED_LOSSES else ""
    return ", ".join(listed[:_NAMED_LOSSES]) + more


@dataclass
class _Node:
    info: NodeInfo
    identity: bytes
    last_seen: float


@dataclass
class _Driver:
    info: DriverInfo
    last_seen: float


@dataclass
class _Group:
    spec: GroupSpec
    orphan_since: float | None = None  # when its owner was last found missing


@dataclass(slots=True)
class _Worker:
    record: WorkerRecord
    since: float  # when it entered its current state (monotonic)
    orphan_since: float | None = None  # when its group was first found missing
    #: Restored from its owner's view after a registry restart, and not yet reported again
    #: by its node agent: dead if no report comes within ``orphan_grace``.
    unconfirmed: bool = False


class RegistryService:
    """The registry's state and request handlers, served on one `Endpoint`."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        heartbeat_interval: float = 0.5,
        expiry: float = 3.0,
        grace: float = DEFAULT_GRACE,
    ) -> None:
        self.endpoint = endpoint
        self.heartbeat_interval = heartbeat_interval
        self.expiry = expiry
        self.grace = grace
        #: How long a group may wait for its owner to (re-)register before it is torn down.
        self.orphan_grace = 2 * expiry
        self.nodes: dict[str, _Node] = {}
        self.drivers: dict[str, _Driver] = {}
        self.workers: WorkerTable[_Worker] = WorkerTable()  # indexed by root group
        self.groups: dict[str, _Group] = {}
        self.watchers: dict[str, set[bytes]] = {}  # pattern -> client identities
        self._watch_counts: dict[bytes, int] = {}  # client identity -> patterns it watches
        #: (name, pid) of ended workers dropped when a new group took their group's name.
        self._retired: dict[tuple[str, int], None] = {}
        self.started = time.time()
        self._warn = RateLimitedLog(log)
        self.handlers: dict[RegistryOp, Handler] = {
            RegistryOp.REGISTER_NODE: self._register_node,
            RegistryOp.UNREGISTER_NODE: self._unregister_node,
            RegistryOp.REGISTER_DRIVER: self._register_driver,
            RegistryOp.UNREGISTER_DRIVER: self._unregister_driver,
            RegistryOp.HEARTBEAT: self._heartbeat,
            RegistryOp.CREATE_GROUP: self._create_group,
            RegistryOp.CLOSE_GROUP: self._close_group,
            RegistryOp.WORKER_STATE: self._worker_state,
            RegistryOp.WORKER_EXITED: self._worker_exited,
            RegistryOp.LOOKUP: self._lookup,
            RegistryOp.LOOKUP_GROUP: self._lookup_group,
            RegistryOp.WATCH: self._watch,
            RegistryOp.UNWATCH: self._unwatch,
            RegistryOp.NODES: self._nodes,
            RegistryOp.STATUS: self._status,
            RegistryOp.PING: self._ping,
        }
        for op, handler in self.handlers.items():
            endpoint.handle(op, functools.partial(self._serve, op, handler))
        self._reaper = endpoint.loop.create_task(self._expire_loop())

    def _serve(self, op: RegistryOp, handler: Handler, msg: Incoming) -> None:
        """Parse, handle, answer: the one boundary every request crosses."""
        try:
            reply = handler(SCHEMA[op][0].from_wire(msg.meta), msg.identity)
        except ProtocolError as exc:
            self._warn.warning(f"malformed {op}", f"rejected a malformed {op} request: {exc}")
            msg.reply_error(exc)
        except RegistryError as exc:  # a refusal (exists, not found): the caller's business
            msg.reply_error(exc)
        except Exception as exc:  # a bug here must not stop the registry
            self._warn.warning(f"failed {op}", f"registry handler {op} failed", exc_info=exc)
            msg.reply_error(exc)
        else:
            if reply is None:
                msg.reply(None)
            elif op in MAY_BE_LARGE:  # past a header's cap it travels as a frame
                msg.reply(*frame(reply.to_wire()))
            else:
                msg.reply(reply.to_wire())

    # ------------------------------------------------------------------ nodes and drivers
    def _register_node(self, req: NodeRegistration, identity: bytes) -> NodeRegistered:
        info = req.node
        taken = {n.info.node_rank for nid, n in self.nodes.items() if nid != info.node_id}
        if info.node_rank >= 0:
            if info.node_rank in taken:
                raise NodeRankTakenError.from_message(
                    f"node rank {info.node_rank} is already taken by another live node")
            rank = info.node_rank
        else:
            rank = next(r for r in range(len(taken) + 1) if r not in taken)
        self.nodes[info.node_id] = _Node(replace(info, node_rank=rank), identity, time.monotonic())
        for spec in req.groups:
            self._restore_group(spec, by=f"node {rank}")
        log.info("node %s joined as rank %d (%s, %d accelerators)", info.node_id, rank,
                 info.ip, info.num_accelerators)
        self._broadcast_nodes()
        return NodeRegistered(rank, self._lease())

    def _restore_group(self, spec: GroupSpec, by: str) -> None:
        """A node agent hosts workers of ``spec`` (the registry restarted): know the group again.

        Its owner gets ``orphan_grace`` seconds to register; otherwise the sweep tears
        the group down."""
        existing = self.groups.get(spec.group)
        if existing is None:
            self.groups[spec.group] = _Group(replace(spec, restore=False, workers=()))
        elif existing.spec.owner != spec.owner:
            self._warn.warning("restore conflict", f"{by} hosts workers of group {spec.group!r} "
                               f"owned by {spec.owner}, but the group now belongs to "
                               f"{existing.spec.owner}; leaving it as it is")

    def _unregister_node(self, req: NodeRef, identity: bytes) -> None:
        node = self.nodes.pop(req.node_id, None)
        if node is not None:
            self._nodes_gone({node.info.node_id: (
                node, f"node {node.info.node_rank} shut down (its node agent stopped)")})

    def _register_driver(self, req: DriverInfo, identity: bytes) -> Lease:
        self.drivers[req.driver_id] = _Driver(req, time.monotonic())
        for group in self.groups.values():
            if group.spec.owner == req.driver_id:
                group.orphan_since = None
        return self._lease()

    def _unregister_driver(self, req: DriverRef, identity: bytes) -> None:
        self.drivers.pop(req.driver_id, None)

    def _lease(self) -> Lease:
        return Lease(self.heartbeat_interval, self.expiry)

    def _heartbeat(self, req: Heartbeat, identity: bytes) -> HeartbeatReply:
        now = time.monotonic()
        known = self.nodes.get(req.id) or self.drivers.get(req.id)
        if known is not None:
            known.last_seen = now
        # Unknown (e.g. this registry restarted, or it declared the sender dead): re-register.
        return HeartbeatReply(known is not None)

    def _nodes_gone(self, gone: dict[str, tuple[_Node, str]]) -> None:
        """Nodes that left the table (node id -> (node, why)): report each one's live workers
        dead, with a reason that names them all, then tell the node watchers once.

        One pass over the workers for all of them: a thousand silent nodes expiring in
        one sweep must not cost a thousand passes."""
        lost: dict[str, list[str]] = {}
        for name, w in self.workers.items():
            if w.record.info.node_id in gone and not w.record.state.is_final:
                lost.setdefault(w.record.info.node_id, []).append(name)
        for node_id, names in lost.items():
            names.sort(key=WorkerAddress.from_name)
            listed = ", ".join(names[:_NAMED_LOSSES])
            if len(names) > _NAMED_LOSSES:
                listed += f" and {len(names) - _NAMED_LOSSES} more"
            reason = f"{gone[node_id][1]}; workers lost with it: {listed}"
            # A node cut off from us stops its workers FENCE_FACTOR expiries after its last
            # answered heartbeat (aiorl.node.agent): an owner that restarts them waits for
            # that, so the old and new processes never run side by side.
            fence = (FENCE_FACTOR - 1) * self.expiry
            for name in names:
                self._set_state(name, WorkerState.DEAD, {"reason": reason, DETAIL_FENCED_IN: fence})
        for node, _ in gone.values():
            self._unwatch_all(node.identity)
        self._broadcast_nodes()

    def _broadcast_nodes(self) -> None:
        if self.watchers.get(NODES_PATTERN):
            self._notify(NODES_PATTERN, RegistryEvent.NODES,
                         NodeList(self._node_list()).to_wire())

    def _node_list(self) -> tuple[NodeInfo, ...]:
        return tuple(sorted((n.info for n in self.nodes.values()), key=lambda i: i.node_rank))

    def _nodes(self, req: NoArgs, identity: bytes) -> NodeList:
        return NodeList(self._node_list())

    # ------------------------------------------------------------------ expiry
    async def _expire_loop(self) -> None:
        period = self.heartbeat_interval / 2
        last = time.monotonic()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            # Time this process did not run (stopped, swapped out, a loop turn that took
            # seconds): the heartbeats sent meanwhile are still unread in its sockets, and
            # this sweep runs before they are read. Not crediting it, a registry that was
            # itself held up would declare every node and driver dead as it resumed.
            stalled = now - last - period
            last = now
            if stalled > period:
                self.credit_stall(stalled)
            try:
                self.sweep(now)
            except Exception as exc:  # the sweep must outlive any bug: it is how the dead leave
                self._warn.warning("sweep", "the registry's expiry sweep failed; it runs again",
                                   exc_info=exc)

    def credit_stall(self, seconds: float) -> None:
        """This registry did not run for ``seconds``: nobody was heard meanwhile, so the
        silence is not held against them (their leases and grace periods move on by it)."""
        log.warning("the registry did not run for %.1f s (stopped or starved); the silence "
                    "of nodes and drivers meanwhile is not held against them", seconds)
        for node in self.nodes.values():
            node.last_seen += seconds
        for driver in self.drivers.values():
            driver.last_seen += seconds
        for group in self.groups.values():
            if group.orphan_since is not None:
                group.orphan_since += seconds
        for w in self.workers.values():
            if w.unconfirmed:
                w.since += seconds

    def sweep(self, now: float) -> None:
        """Declare silent nodes and drivers dead, expire orphans, forget what is long over."""
        silent = [n for n in self.nodes.values() if now - n.last_seen > self.expiry]
        if silent:
            for node in silent:
                del self.nodes[node.info.node_id]
            log.warning("declared dead after %.1f s without heartbeats: %s", self.expiry,
                        _some(f"node {n.info.node_rank} ({n.info.node_id})" for n in silent))
            self._nodes_gone({n.info.node_id: (n, f"node {n.info.node_rank} ({n.info.ip}) stopped "
                                                  f"answering (no heartbeat for "
                                                  f"{now - n.last_seen:.1f} s)")
                              for n in silent})
        lost_drivers = {d.info.driver_id for d in self.drivers.values()
                        if now - d.last_seen > self.expiry}
        if lost_drivers:
            for driver_id in lost_drivers:
                del self.drivers[driver_id]
            log.warning("drivers missed heartbeats, tearing down their groups: %s",
                        _some(sorted(lost_drivers)))
            for group in [g for g in self.groups.values() if g.spec.owner in lost_drivers]:
                self._teardown_group(group, f"its driver {group.spec.owner} disappeared")
        orphans = []
        for group in self.groups.values():
            if group.spec.owner in self.drivers:
                group.orphan_since = None
            elif group.orphan_since is None:
                group.orphan_since = now
            elif now - group.orphan_since > self.orphan_grace:
                orphans.append(group)
        if orphans:
            log.warning("groups whose driver did not register within %.1f s, torn down: %s",
                        self.orphan_grace,
                        _some(f"{g.spec.group} (driver {g.spec.owner})" for g in orphans))
            for group in orphans:
                self._teardown_group(group, f"its driver {group.spec.owner} did not come back")
        self._sweep_workers(now)

    def _sweep_workers(self, now: float) -> None:
        for name, w in list(self.workers.items()):
            if w.unconfirmed and now - w.since > self.orphan_grace:
                self._set_state(name, WorkerState.DEAD, {"reason": (
                    f"worker {name} was lost while the registry was down: no node agent "
                    f"reported it within {self.orphan_grace:.1f} s of the restart")})
            elif root_of(name) in self.groups:
                w.orphan_since = None
            elif w.record.state.is_final:
                if now - w.since > self.grace:
                    del self.workers[name]
            elif w.orphan_since is None:
                w.orphan_since = now
            elif now - w.orphan_since > self.grace:
                self._kill_orphan(name, w)

    def _kill_orphan(self, name: str, w: _Worker) -> None:
        """A live worker whose group has been gone for ``grace``: nobody can own it any more."""
        node = self.nodes.get(w.record.info.node_id)
        if node is not None:
            self._send_kill(node, root_of(name))
        self._set_state(name, WorkerState.DEAD, {"reason": f"worker {name} belongs to no group"})

    # ------------------------------------------------------------------ groups and workers
    def _create_group(self, req: GroupSpec, identity: bytes) -> None:
        existing = self.groups.get(req.group)
        if existing is not None and (existing.spec.owner != req.owner or not req.restore):
            raise GroupExistsError.from_message(f"a worker group named {req.group!r} already exists")
        self.groups[req.group] = _Group(replace(req, restore=False, workers=()))
        now = time.monotonic()
        for record in req.workers:  # the owner's view, after a registry restart
            known = self.workers.get(record.name)
            if (root_of(record.name) == req.group and not record.state.is_final
                    and (known is None or known.record.incarnation < record.incarnation)):
                self.workers[record.name] = _Worker(record, now, unconfirmed=True)
        if not req.restore:
            # Leftovers of a closed group of the same name. (A restore after a registry
            # restart keeps them: a tombstone may be the news its owner has not heard yet.)
            # Their pids are remembered: the exit report of such a worker can arrive after
            # the new group exists, and must not become a tombstone of the new worker.
            for name in [n for n, w in self.workers.of_group(req.group).items()
                         if w.record.state.is_final]:
                self._retired[(name, self.workers.pop(name).record.info.pid)] = None
            while len(self._retired) > MAX_RETIRED:
                del self._retired[next(iter(self._retired))]

    def _close_group(self, req: GroupRef, identity: bytes) -> None:
        group = self.groups.get(req.group)
        if group is None:
            raise GroupNotFoundError.from_message(f"no worker group named {req.group!r}")
        self._teardown_group(group, "its group was closed")

    def _teardown_group(self, group: _Group, reason: str) -> None:
        name = group.spec.group
        del self.groups[name]
        for node in self.nodes.values():
            self._send_kill(node, name)
        for wname in [n for n, w in self.workers.of_group(name).items()
                      if not w.record.state.is_final]:
            self._set_state(wname, WorkerState.DEAD, {"reason": reason, DETAIL_GROUP_CLOSED: True})

    def _send_kill(self, node: _Node, group: str) -> None:
        try:
            self.endpoint.send_oneway(node.info.endpoint, AgentOp.KILL_GROUP, {"group": group})
        except Exception as exc:
            self._warn.warning("kill_group", f"could not ask node {node.info.node_id} to stop "
                               f"group {group}: {exc}")

    def _worker_state(self, req: WorkerStateReport, identity: bytes) -> None:
        current = self.workers.get(req.info.name)
        if current is not None:
            if current.record.incarnation > req.incarnation:
                return  # news of an earlier process of this name (a late replay): stale
            if (current.record.state == WorkerState.DEAD
                    and current.record.info.pid == req.info.pid):
                return  # already reported dead (e.g. its node expired); do not resurrect
        self._store(WorkerRecord(req.info, req.state, req.detail, req.incarnation))

    def _worker_exited(self, req: WorkerExit, identity: bytes) -> None:
        if (req.address, req.pid) in self._retired:
            return  # a worker of a closed group whose name a new group now uses
        current = self.workers.get(req.address)
        if current is None or current.record.incarnation < req.incarnation:
            # Died before it could register: keep a tombstone so the owner learns why.
            address = WorkerAddress.from_name(req.address)
            info = WorkerInfo(address, address.rank, 0, -1, "", "", pid=req.pid)
            self._store(WorkerRecord(info, WorkerState.DEAD, req.detail(), req.incarnation))
        elif (current.record.info.pid in (0, req.pid) and not current.record.state.is_final
              and current.record.incarnation == req.incarnation):
            self._set_state(req.address, WorkerState.DEAD, req.detail())

    def _set_state(self, name: str, state: WorkerState, detail: dict[str, Any]) -> None:
        self._store(replace(self.workers[name].record, state=state, detail=detail))

    def _store(self, record: WorkerRecord) -> None:
        """Keep ``record`` and push it to whoever watches the worker, its group or ``*``."""
        name = record.name
        self.workers[name] = _Worker(record, time.monotonic())
        event = WorkerChanged(record).to_wire()
        for pattern in (name, root_of(name), WILDCARD):
            self._notify(pattern, RegistryEvent.WORKER, event)

    def _lookup(self, req: WorkerRef, identity: bytes) -> WorkerRecord:
        w = self.workers.get(req.name)
        if w is None:
            raise WorkerNotFoundError.from_message(f"no worker named {req.name!r} is registered")
        return w.record

    def _lookup_group(self, req: GroupRef, identity: bytes) -> GroupRecord:
        group = self.groups.get(req.group)
        if group is None:
            raise GroupNotFoundError.from_message(f"no worker group named {req.group!r}")
        spec = group.spec
        return GroupRecord(spec.world_size, spec.worker_class, spec.owner,
                           {n: w.record for n, w in self._members(req.group)})

    def _members(self, pattern: str) -> Iterable[tuple[str, _Worker]]:
        return self.workers.members(pattern, WILDCARD)

    # ------------------------------------------------------------------ watches
    def _watch(self, req: WatchRequest, identity: bytes) -> WatchSnapshot:
        """Subscribe to a worker name, a group name, ``*`` or ``@nodes``; reply with a snapshot."""
        subscribers = self.watchers.get(req.name)
        if subscribers is None or identity not in subscribers:
            count = self._watch_counts.get(identity, 0)
            if count >= MAX_WATCHES_PER_CLIENT or sum(self._watch_counts.values()) >= MAX_WATCHES:
                raise ProtocolError(f"too many watches (at most {MAX_WATCHES_PER_CLIENT} per "
                                    f"client and {MAX_WATCHES} in all)")
            self.watchers.setdefault(req.name, set()).add(identity)
            self._watch_counts[identity] = count + 1
        if req.name == NODES_PATTERN:
            return WatchSnapshot(nodes=self._node_list())
        return WatchSnapshot(workers={n: w.record for n, w in self._members(req.name)})

    def _unwatch(self, req: WatchRequest, identity: bytes) -> None:
        self._drop_watch(req.name, identity)

    def _drop_watch(self, pattern: str, identity: bytes) -> None:
        subscribers = self.watchers.get(pattern)
        if subscribers is None or identity not in subscribers:
            return
        subscribers.discard(identity)
        if not subscribers:
            del self.watchers[pattern]
        left = self._watch_counts.pop(identity, 1) - 1
        if left > 0:
            self._watch_counts[identity] = left

    def _unwatch_all(self, identity: bytes) -> None:
        if identity not in self._watch_counts:
            return  # watches nothing: no need to scan the patterns
        for pattern in [p for p, subs in self.watchers.items() if identity in subs]:
            self._drop_watch(pattern, identity)

    def _notify(self, pattern: str, event: RegistryEvent, meta: Any) -> None:
        for identity in list(self.watchers.get(pattern, ())):
            if not self.endpoint.push_event(identity, event, meta):
                self._unwatch_all(identity)  # the subscriber disconnected

    # ------------------------------------------------------------------ status
    def _status(self, req: NoArgs, identity: bytes) -> StatusReport:
        ready: dict[str, int] = {}
        for n, w in self.workers.items():
            if w.record.state == WorkerState.READY:
                ready[root_of(n)] = ready.get(root_of(n), 0) + 1
        return StatusReport(
            uptime=time.time() - self.started,
            nodes=self._node_list(),
            groups=tuple(GroupStatus(g.spec.group, g.spec.world_size, g.spec.worker_class,
                                     g.spec.owner, ready.get(g.spec.group, 0))
                         for g in self.groups.values()),
            workers=tuple(w.record for _, w in sorted(self.workers.items())),
            drivers=tuple(d.info for d in self.drivers.values()),
        )

    def _ping(self, req: NoArgs, identity: bytes) -> Pong:
        return Pong(time.time() - self.started)

    def close(self) -> None:
        self._reaper.cancel()
        self.endpoint.close()


async def serve(host: str, port: int, *, expiry: float, ready_line: bool, keys: Any,
                exit_on_stdin_close: bool = False, grace: float = DEFAULT_GRACE,
                metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            endpoint = Endpoint("registry", host=host, port=port, keys=keys)
            break
        except Exception as exc:  # zmq.ZMQError (only the transport layer names zmq)
            # A restarted registry may find its port still held by the old socket for a moment.
            if getattr(exc, "errno", None) != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            log.warning("port %d is busy; retrying", port)
            await asyncio.sleep(0.2)
    service = RegistryService(endpoint, expiry=expiry, grace=grace)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if exit_on_stdin_close:
        # An embedded registry's stdin is a pipe from the driver process: EOF means the
        # driver is gone (even SIGKILLed), and nobody else will stop us.
        def on_stdin() -> None:
            if not os.read(sys.stdin.fileno(), 4096):
                loop.remove_reader(sys.stdin.fileno())
                stop.set()

        loop.add_reader(sys.stdin.fileno(), on_stdin)
    if ready_line:
        # The embedded Cluster reads this line to learn the address.
        print(f"AIORL_REGISTRY={endpoint.address}", flush=True)
    log.info("registry serving on %s", endpoint.address)
    if metrics_port is not None:  # Prometheus text format (aiorl/registry/metrics.py)
        from aiorl.registry.metrics import serve_metrics

        metrics = await serve_metrics(endpoint, lambda: [
            w.record for w in service.workers.values() if w.record.state == WorkerState.READY],
            metrics_host, metrics_port)
        bound = metrics.sockets[0].getsockname()
        log.info("metrics on http://%s:%d/metrics (no key: anyone who can reach that address "
                 "reads worker, group and channel names)", bound[0], bound[1])
    await stop.wait()
    service.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiorl-registry", description="Run the aiorl registry service.")
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on (default: all)")
    parser.add_argument("--port", type=int, default=6380, help="TCP port (0 = any free port)")
    parser.add_argument("--expiry", type=float, default=3.0,
                        help="seconds without heartbeats before a node or driver is declared dead")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE,
                        help="seconds an ended worker stays listed once its group is gone, and a "
                             "live worker may run without a group before it is stopped")
    parser.add_argument("--print-address", action="store_true",
                        help="print AIORL_REGISTRY=<address> once listening")
    parser.add_argument("--key-file", default=None,
                        help="cluster key file (created if missing; default: $AIORL_KEY_FILE "
                             "or ~/.aiorl/cluster.key)")
    parser.add_argument("--insecure", action="store_true",
                        help="no authentication (only on a private, trusted network)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve per-worker metrics in the Prometheus text format on this "
                             "HTTP port (GET /metrics; 0 = any free port); it asks for no key")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="interface the metrics port listens on (default: 127.0.0.1, this "
                             "machine only; 0.0.0.0 lets anyone who reaches the host read "
                             "the cluster's worker, group and channel names)")
    parser.add_argument("--pid-file", default=None, metavar="PATH",
                        help="write this process's pid to PATH while it runs (stop it with "
                             "kill -TERM \"$(cat PATH)\")")
    parser.add_argument("--exit-on-stdin-close", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s [registry] %(levelname)s %(message)s", stream=sys.stderr)
    soft, hard = raise_open_file_limit()
    log.info("open file limit: %d (hard limit %d)", soft, hard)
    import uvloop

    from aiorl.transport import security

    if args.insecure or os.environ.get(security.ENV_INSECURE) == "1":
        os.environ[security.ENV_INSECURE] = "1"
        keys = None
    elif os.environ.get(security.ENV_PUBLIC) and not args.key_file:
        keys = security.keys_from_environment()
    else:
        keys = security.load_or_create(
            args.key_file or os.environ.get(security.ENV_KEY_FILE) or security.DEFAULT_KEY_FILE)
    try:
        with pid_file(args.pid_file):
            uvloop.run(serve(args.host, args.port, expiry=args.expiry,
                             ready_line=args.print_address, keys=keys,
                             exit_on_stdin_close=args.exit_on_stdin_close, grace=args.grace,
                             metrics_port=args.metrics_port, metrics_host=args.metrics_host))
    except PidFileError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
