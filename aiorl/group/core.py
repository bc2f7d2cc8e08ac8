"""The shared state of one launched group: its ranks, their readiness, deaths and calls.

Every [`WorkerGroup`][aiorl.WorkerGroup] view of a group shares one `GroupCore`. The core
lives on the runtime loop: it is mutated only there (``dispatch``, registry events,
``close``), so views can be used from any thread without locks.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import functools
import logging
import os
import struct
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from aiorl.errors import ClusterClosedError, PeerLostError, WorkerInitError
from aiorl.group import call_relay as _relay
from aiorl.group.shipping import ship_working_dir
from aiorl.group.supervision import HISTORY, EventKind, GroupEvent, GroupEvents, Supervision
from aiorl.group.timeouts import describe_timeout
from aiorl.names import WorkerAddress
from aiorl.protocol.ops import AgentOp, WorkerOp
from aiorl.protocol.registry import DETAIL_FENCED_IN, DETAIL_GROUP_CLOSED
from aiorl.protocol.spawn import SpawnRequest, WorkerLaunch
from aiorl.registry.client import INCARNATION_VARIABLE
from aiorl.runtime import AsyncWork, Runtime, Session, describe_death
from aiorl.runtime.descriptors import check_descriptors_for
from aiorl.runtime.promise import explain_timeouts, is_settled, link_threads, reject, resolve
from aiorl.runtime.working_dir import PackedDir
from aiorl.trace import recorder as _trace
from aiorl.transport import serialization
from aiorl.transport.code import dumps_with_sources

if TYPE_CHECKING:
    from aiorl.placement import Placement

__all__ = ["REPLAY_ATTRIBUTE", "GroupCore", "ship_class"]

log = logging.getLogger("aiorl.group")

#: A worker class attribute naming methods whose last call a restarted rank receives again,
#: before any other call (``PollingWorker`` names ``configure``).
REPLAY_ATTRIBUTE = "_aiorl_replay_on_restart"
#: How long a node agent may take to answer a spawn request (a fork once its zygote is warm;
#: a cold zygote imports torch first, which takes seconds on a loaded machine).
SPAWN_TIMEOUT_S = 60.0
#: How long a launch waits for a node of its placement to (re)appear in the driver's node list.
NODE_WAIT_S = 10.0
#: How often a pending spawn checks that its node is still in the cluster: an agent killed
#: after it got the request never answers, and its node leaving the list is how we learn it.
NODE_CHECK_S = 0.25
#: How long a node must stay out of the list to count as gone: after a registry restart the
#: live agents take a heartbeat or two to join again.
NODE_GONE_S = 2.0


#: The call op as a plain str: an enum member costs ~0.2 µs to look up on the hot path.
_CALL: str = WorkerOp.CALL.value
_now = _trace.now  # the recorder's clock (a constant: bound once)


class _Rank:
    """The driver's view of one rank: its endpoint once ready, or why it cannot be called,
    and which process of the rank (incarnation) that is."""

    __slots__ = ("address", "error", "queued", "incarnation", "restarts", "streak", "restarting",
                 "member", "stalled")

    def __init__(self) -> None:
        self.address: str | None = None
        self.error: BaseException | None = None
        self.queued: list[Callable[[], object]] = []
        self.incarnation = 0
        self.restarts = 0
        self.streak = 0  # restarts since it was last ready: the backoff's exponent
        self.restarting = False  # a replacement is on its way (calls wait for it)
        self.member = True  # False once remove_ranks took it out of the group
        #: The earliest call of a plain method on this rank alone that a wait gave up on and
        #: that has not answered: what its method thread is busy with (`describe_timeout`).
        self.stalled: _GroupCall | None = None


class _GroupCall:
    """One call on some ranks: the per-rank answers, gathered into the work's result list.

    Until rank ``i`` answers, ``results[i]`` holds the id of its request (set as it is
    sent): a traced call names its flow by it, with no list of its own to allocate.
    ``remaining`` counts the ranks that have not answered and ``answered`` has bit ``i`` set
    once rank ``i`` has, late answers (after the work was cancelled or failed) included: what
    a timed-out wait's message reports (`describe_timeout`), with the group, method and ranks
    that `GroupCore.dispatch` sets.
    """

    __slots__ = ("work", "results", "remaining", "answered", "core", "method", "ranks")

    work: AsyncWork[list[Any]] | None
    core: GroupCore
    method: str
    ranks: tuple[int, ...]

    def __init__(self, work: AsyncWork[list[Any]], n: int) -> None:
        self.work = work
        self.results: list[Any] = [None] * n
        self.remaining = n
        self.answered = 0

    def timeout_message(self, timeout: float | None) -> str:
        """What a ``wait(timeout)`` on the call that expired says (`describe_timeout`)."""
        return describe_timeout(self, timeout)

    def settle(self, i: int, error: BaseException | None, reply: Any) -> None:
        """Rank ``i`` answered (an endpoint settle): the first error fails the call.

        The call lets go of its work once the work settles here (or, cancelled, once every
        rank has answered): the work refers to the call (`explain_timeouts`), and a cycle
        would leave both to the garbage collector instead of reference counting.
        """
        work = self.work
        self.answered |= 1 << i
        if work is None or is_settled(work):
            self.remaining -= 1  # a late answer: the rank is no longer busy with the call
            if self.remaining <= 0:
                self.work = None
            return
        if error is None:
            payload = reply[1]
            try:
                self.results[i] = serialization.loads(payload) if payload else None
            except Exception as exc:  # noqa: BLE001 - an unreadable result fails the call
                error = exc
        if error is not None:
            self.remaining -= 1
            self.work = None
            reject(work, error)
            return
        self.remaining -= 1
        if self.remaining == 0:
            self.work = None
            resolve(work, self.results)


class _TracedGroupCall(_GroupCall):
    """A group call that records a span per rank as each answers (only while tracing is on).

    Kept to a few stores and one buffer record per rank (tracing a no-op call must cost a
    few percent of it): what a rank's record needs besides the times is made
    once per rank list and method (`_CallTrace`), and the record is a compact one
    packed inline (`CompactShape`). The flow from the call to
    its execution is named by the request's id, which the worker reads from the message
    header: neither end counts messages for it.
    """

    __slots__ = ("shape", "t0", "nbytes")

    # No __init__ of its own (a Python call less per call): GroupCore.dispatch makes it
    # with the base's and sets the three fields.
    shape: _CallTrace
    t0: int
    nbytes: int

    def settle(self, i: int, error: BaseException | None, reply: Any) -> None:
        # results[i] is still rank i's request id (None if it failed before it was sent).
        if error is None:
            frames = reply[1]
            _trace.append(_pack_call(self.shape.key, self.t0, _now(), i, self.results[i],
                                     (self.nbytes + _trace.payload_bytes(frames)) if frames
                                     else self.nbytes))
        else:
            _trace.append(self.shape.record(self.t0, _now(), i, self.results[i], self.nbytes,
                                            _trace.error_text(error)))
        _GroupCall.settle(self, i, error, reply)


class _CallTrace(_trace.CompactShape):
    """What a traced call's records share, made once per rank list and method: the method,
    the workers' names, the flow pair of our calls to each, and the loop thread (where
    calls are sent and settled)."""

    __slots__ = ("method", "n", "peers", "pairs", "tid")

    #: ``(key, t0, t1, rank index, request id, bytes)``
    layout = struct.Struct("<qqqqqq")

    def __init__(self, me: str, group: str, ranks: Sequence[int], method: str) -> None:
        super().__init__()
        self.method = method
        self.n = len(ranks)
        self.peers = [f"{group}:{r}" for r in ranks]
        self.pairs = [f"{me}>{group}:{r}/call" for r in ranks]
        self.tid = threading.get_ident()

    def expand(self, fields: tuple[int, ...]) -> tuple[Any, ...]:
        _, t0, t1, i, rid, nbytes = fields
        return self.record(t0, t1, i, rid, nbytes, None)

    def record(self, t0: int, t1: int, i: int, rid: int | None, nbytes: int,
               error: str | None) -> tuple[Any, ...]:
        """The full record of rank ``i``'s answer (an error's is appended as is: rare)."""
        tid = self.tid
        return ("call", self.method, t0, t1, tid, tid, self.peers[i], nbytes, error is None,
                error, (self.pairs[i], rid) if rid else None, None, None, True)


_pack_call = _CallTrace.layout.pack


class GroupCore:
    """Rank slots, readiness queues, deaths, restarts and membership of one group (loop only).

    Supervision (docs/failures.md): a rank's death fails what is pending on it
    (``PeerLostError``), then the group's `Supervision` decides: nothing more
    (``restart="never"``), a new process for the rank after a backoff (``"on_failure"``:
    same name and rank, the next incarnation; calls made meanwhile wait for it), or,
    with ``fate="group"``, the end (or a restart) of every rank. Events whose
    incarnation is older than the rank's current one are news of a process already
    replaced and are ignored.

    Membership: ``members`` are the ranks of the current ``epoch``; ``add_ranks`` and
    ``remove_ranks`` change them and start a new epoch. Rank numbers are never reused,
    so ``ranks`` (indexed by rank) only grows; a removed rank keeps its slot with the
    error that says it was removed, so a call of an older epoch that names it fails.
    """

    def __init__(self, session: Session, cls: type, name: str, world_size: int,
                 supervision: Supervision | None = None) -> None:
        self.session = session
        self.runtime: Runtime = session.runtime
        self.cls = cls
        self.name = name
        self.world_size = world_size  # the rank bound: ranks 0..world_size-1 have existed
        self.ranks = [_Rank() for _ in range(world_size)]
        self.members: tuple[int, ...] = tuple(range(world_size))
        self.epoch = 0
        self.closed = False
        self.supervision = supervision if supervision is not None else Supervision()
        self._watching = False
        #: Views handed out by ``WorkerGroup.on_ranks``, by (epoch, rank tuple) (cached, bounded).
        self.views: dict[tuple[int, tuple[int, ...]], Any] = {}
        #: Builds a WorkerGroup view of some ranks (set by aiorl.group.group, above us).
        self.view_of: Callable[[tuple[int, ...]], Any] | None = None
        #: Methods whose last call each rank replays after a restart (``configure``).
        self.replayed: frozenset[str] = frozenset(getattr(cls, REPLAY_ATTRIBUTE, ()))
        self._last_calls: dict[int, dict[str, list[Any]]] = {}
        # What a restart or ``add_ranks`` needs to start a process: rank -> (node, launch).
        self._launches: dict[int, tuple[int, WorkerLaunch]] = {}
        #: This process starts the group (set before `start` runs, so calls made at once see
        #: it): it knows, or will know, where each rank runs. A view attached by name does not.
        self.launched_here = False
        self._payload = b""
        self._extra_env: dict[str, str] = {}
        #: The driver's packed working directory, shipped to each node before a spawn there.
        self.working_dir: PackedDir | None = None
        self._master: tuple[str, int] | None = None  # MASTER_ADDR, MASTER_PORT
        self._group_restarts = 0
        self._history: collections.deque[GroupEvent] = collections.deque(maxlen=HISTORY)
        self._subscribers: list[GroupEvents] = []
        self._tasks: set[asyncio.Task[None]] = set()  # pending restarts (strong references)
        #: Tracing: what a traced call's records share, by method and rank list (on the loop).
        self._call_traces: dict[str, dict[tuple[int, ...], _CallTrace]] = {}
        #: Large calls go through the node agents, one message per node (group/call_relay.py).
        self._relay = _relay.RelayPath(self, self._send_call)
        # The runtime stopping (its Cluster closed, or its embedded registry died) fails what
        # is pending here, queued calls on ranks not ready yet included.
        self.runtime.on_close(self._runtime_closed)

    def dispatch(self, work: AsyncWork[list[Any]], method: str, ranks: tuple[int, ...],
                  frames: list[Any], off_loop: bool) -> None:
        if off_loop:
            link_threads(work)  # link now, on the loop, so wait() needs no extra wake-up
        if self.closed:
            stopped = self.runtime.closed_reason
            reject(work, ClusterClosedError(stopped) if stopped is not None
                   else PeerLostError(f"worker group {self.name} is closed"))
            return
        if not ranks:
            resolve(work, [])
            return
        if _trace.ON:
            shapes = self._call_traces.get(method)
            if shapes is None:
                shapes = self._call_traces[method] = {}
            shape = shapes.get(ranks)
            if shape is None:
                shape = shapes[ranks] = _CallTrace(self.runtime.name, self.name, ranks, method)
            traced = _TracedGroupCall(work, shape.n)
            traced.shape = shape
            traced.nbytes = _trace.payload_bytes(frames) if frames else 0
            traced.t0 = _now()
            call: _GroupCall = traced
        else:
            call = _GroupCall(work, len(ranks))
        call.core, call.method, call.ranks = self, method, ranks
        explain_timeouts(work, call)
        # A traced call keeps the direct path: its spans are per rank, sent and answered here.
        if len(ranks) >= _relay.RELAY_MIN_RANKS and not _trace.ON and self._relay.dispatch(
                call, method, ranks, frames):
            return
        send = self._send_call
        for i, r in enumerate(ranks):
            state = self.ranks[r]
            if state.error is not None or state.address is not None:
                send(call, i, state, method, frames)
            else:
                state.queued.append(functools.partial(send, call, i, state, method, frames))

    def dispatch_remembered(self, work: AsyncWork[list[Any]], method: str, ranks: tuple[int, ...],
                            frames: list[Any], off_loop: bool) -> None:
        """`dispatch` of a method in `replayed`: each rank keeps the call's
        arguments, sent again to its next incarnation before anything else."""
        for r in ranks:
            self._last_calls.setdefault(r, {})[method] = frames
        self.dispatch(work, method, ranks, frames, off_loop)

    def _send_call(self, call: _GroupCall, i: int, state: _Rank, method: str,
                   frames: list[Any]) -> int:
        """Send rank ``i``'s request; its request id (0 when it failed at once), kept in
        ``call.results[i]`` until the rank answers (a traced call names its flow by it)."""
        if state.error is not None:
            call.settle(i, _fresh(state.error), None)
            return 0
        assert state.address is not None
        rid = call.results[i] = self.runtime.endpoint.request_then(
            state.address, _CALL, method, frames, functools.partial(call.settle, i))
        return rid

    def ready(self, ranks: Sequence[int]) -> AsyncWork[None]:
        work: AsyncWork[None] = AsyncWork(self.runtime.loop)

        def check() -> None:
            states = [self.ranks[r] for r in ranks]
            waiting = [0]

            def one_ready() -> None:
                for st in states:
                    if st.error is not None:
                        reject(work, _fresh(st.error))
                        return
                waiting[0] -= 1
                if waiting[0] == 0:
                    resolve(work, None)

            for st in states:
                if st.error is not None:
                    reject(work, _fresh(st.error))
                    return
                if st.address is None:
                    waiting[0] += 1
                    st.queued.append(one_ready)
            if waiting[0] == 0:
                resolve(work, None)

        self.runtime.submit(check)
        return work

    # ------------------------------------------------------------------ starting processes
    async def start(self, placements: list[Placement], payload: bytes, extra_env: dict[str, str]) -> None:
        self._payload, self._extra_env = payload, extra_env
        try:
            # This process talks to each rank directly unless its calls go through the
            # agents: too low a file limit is one clear error now, not a ZMQ one mid-launch.
            nodes = {p.node_rank for p in placements}
            relayed = len(placements) >= _relay.RELAY_MIN_RANKS and len(nodes) >= 2
            check_descriptors_for(len(nodes) if relayed else len(placements),
                                  f"ranks of group {self.name}")
            await self.watch()
            await self._wait_for_nodes({p.node_rank for p in placements})
            await self._plan(placements, len(placements))
            await self._spawn([p.rank for p in placements])
        except ClusterClosedError as exc:  # closed while launching: not a failed launch
            self._mark_closed(f"worker group {self.name} can no longer be reached: {exc}")
        except Exception as exc:  # noqa: BLE001 - every rank learns why
            self._launch_failed([p.rank for p in placements], exc)

    def _launch_failed(self, ranks: Sequence[int], exc: BaseException) -> None:
        log.error("launching ranks %s of group %s failed: %s", list(ranks), self.name, exc)
        err = WorkerInitError(f"{self.name}:*", -1, type(exc).__name__, str(exc), "", exc)
        for r in ranks:
            st = self.ranks[r]
            # A rank restarted meanwhile (its first process died while this launch waited
            # for an agent that never answered) is not this launch's to fail.
            if st.address is None and st.error is None and st.incarnation == 0:
                self._fail_rank(st, err)

    async def watch(self) -> None:
        if not self._watching:
            self._watching = True
            await self.runtime.registry.watch(self.name, self._on_worker_event)

    def _nodes(self) -> dict[int, dict[str, Any]]:
        return {n["node_rank"]: n for n in self.session._node_list()}

    nodes_by_rank = _nodes

    @property
    def launches(self) -> dict[int, tuple[int, WorkerLaunch]]:
        """rank -> (node rank, launch) of each rank this process started (empty in a view
        attached by name)."""
        return self._launches

    async def _wait_for_nodes(self, node_ranks: set[int]) -> None:
        """Wait (bounded) until the driver's node list holds every node a launch was planned on.

        Right after a registry restart the list is rebuilt as agents register again, so a
        node the plan saw may be missing for a moment; one gone for longer fails the launch
        with a clear error instead of a lookup failure deep in the spawn.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + NODE_WAIT_S
        while missing := node_ranks - self._nodes().keys():
            if loop.time() >= deadline:
                raise RuntimeError(
                    f"node(s) {sorted(missing)} of this launch's placement are not in the cluster "
                    f"(waited {NODE_WAIT_S:g} s for their agents)")
            await asyncio.sleep(0.05)

    async def _plan(self, placements: list[Placement], world_size: int) -> None:
        """Build and keep each placement's launch (environment, devices): what
        `_spawn` sends now and again for each restart."""
        nodes = self._nodes()
        if self._master is None:
            master_node = nodes[placements[0].node_rank]
            port_reply, _ = await self.runtime.endpoint.request(master_node["endpoint"],
                                                                AgentOp.FREE_PORT, timeout=10)
            self._master = (master_node["ip"], int(port_reply["port"]))
        master_ip, master_port = self._master
        for p in placements:
            profiler = p.profiler_launch(self.name)  # None unless profiling selects us
            env = {
                "RANK": str(p.rank), "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(p.launch_local_rank),
                "LOCAL_WORLD_SIZE": str(p.local_world_size),
                "NODE_LOCAL_RANK": str(p.local_rank), "NODE_LOCAL_WORLD_SIZE": str(p.local_world_size),
                "NODE_RANK": str(p.node_rank), "NODE_GROUP_LABEL": p.node_group_label,
                "MASTER_ADDR": master_ip, "MASTER_PORT": str(master_port),
                "AIORL_WORKER_NAME": f"{self.name}:{p.rank}",
                "AIORL_REGISTRY": self.session.registry_address,
                "AIORL_DRIVER_ID": self.session.driver_id,
                **({_trace.ENV: "1"} if _trace.ON else {}),  # a traced driver traces workers
                **(profiler.env if profiler else {}), **p.env, **self._extra_env,
            }
            if p.visible_accelerators:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(p.visible_accelerators)
            self._launches[p.rank] = (p.node_rank, WorkerLaunch(
                rank=p.rank, env=env, hardware_ranks=tuple(p.hardware_ranks),
                visible_accelerators=tuple(p.visible_accelerators),
                sys_path=self._sys_path(), log_level=logging.getLevelName(
                    logging.getLogger("aiorl").getEffectiveLevel()),
                launcher=profiler.argv if profiler else (),
                python_interpreter=p.python_interpreter,
            ))
        self._relay.forget_placement()

    def _sys_path(self) -> tuple[str, ...]:
        """The driver's ``sys.path`` for the workers, less the entries inside a shipped
        working directory: the node's copy stands for them (first on the workers' path), and
        the driver's own path to it means nothing on another machine."""
        shipped = self.working_dir
        return tuple(x for x in sys.path if x and not (shipped and shipped.contains(x)))

    async def _spawn(self, ranks: Sequence[int]) -> None:
        """Ask the node agents to start ``ranks``, each as its current incarnation."""
        nodes = self._nodes()
        by_node: dict[int, list[WorkerLaunch]] = {}
        for r in ranks:
            node_rank, launch = self._launches[r]
            incarnation = self.ranks[r].incarnation
            if incarnation:
                launch = dataclasses.replace(
                    launch, env={**launch.env, INCARNATION_VARIABLE: str(incarnation)})
            by_node.setdefault(node_rank, []).append(launch)
        output_to = self.runtime.endpoint.address if getattr(self.session, "log_to_driver",
                                                             False) else None
        if not by_node.keys() <= nodes.keys():
            await self._wait_for_nodes(set(by_node))
            nodes = self._nodes()
        shipped = self.working_dir
        for node_rank, launches in by_node.items():
            node = nodes[node_rank]
            if shipped is not None:
                await ship_working_dir(self.runtime.endpoint, node, shipped)
            request = SpawnRequest(self.name, self.session.driver_id, self.world_size,
                                   tuple(launches), f"{self.cls.__module__}.{self.cls.__qualname__}",
                                   output_to, shipped.digest if shipped else None,
                                   shipped.chdir if shipped else False)
            await self._request_spawn(node, request)

    async def _request_spawn(self, node: dict[str, Any], request: SpawnRequest) -> None:
        """Send ``request`` to ``node``'s agent; fail once the node has been out of the
        cluster for ``NODE_GONE_S`` (its agent died) before it answered, instead of waiting
        for the timeout."""
        reply = self.runtime.endpoint.request(node["endpoint"], AgentOp.SPAWN, request.to_wire(),
                                              [self._payload], timeout=SPAWN_TIMEOUT_S)
        missing_since: float | None = None
        while not reply.done():
            await asyncio.wait((reply,), timeout=NODE_CHECK_S)
            if reply.done():
                break
            if any(n.get("node_id") == node.get("node_id") for n in self.session._node_list()):
                missing_since = None
            elif missing_since is None:
                missing_since = time.monotonic()
            elif time.monotonic() - missing_since > NODE_GONE_S:
                reply.cancel()
                raise PeerLostError(f"node {node['node_rank']} left the cluster before its "
                                    f"agent answered the spawn of {self.name}")
        reply.result()

    # ------------------------------------------------------------------ registry news
    def _on_worker_event(self, name: str, state: str, info: dict[str, Any], detail: dict[str, Any]) -> None:
        try:
            rank = WorkerAddress.from_name(name).rank
        except ValueError:
            return
        if not 0 <= rank < len(self.ranks) or self.closed:
            return
        st = self.ranks[rank]
        record = self.runtime.registry.known.get(name)
        incarnation = record.incarnation if record is not None else 0
        if incarnation < st.incarnation or not st.member:
            return  # an earlier process of this rank (already replaced), or a removed rank
        st.incarnation = incarnation  # an attached view learns of restarts by the owner
        if state == "ready":
            if st.address is not None and st.address != info["endpoint"]:
                # A newer process of this rank, and we never heard the old one die (it died
                # while the registry was down): its pending calls fail instead of waiting.
                self.runtime.endpoint.mark_peer_lost(
                    st.address, f"worker {name} was replaced by incarnation {incarnation}")
            st.address = info["endpoint"]
            st.error = None
            if st.restarting:
                st.restarting = False
                st.streak = 0
                self._restarted(rank, st)
            queued, st.queued = st.queued, []
            for fn in queued:
                fn()
        elif state == "failed":
            error = WorkerInitError(
                name, rank, str(detail.get("type", "Exception")), str(detail.get("message", "")),
                str(detail.get("traceback", "")), None)
            st.restarting = False
            self._fail_rank(st, error)
            self._emit(EventKind.GAVE_UP, rank, f"its __init__ raised: {error}")
            if self.supervision.fate == "group":
                self._tear_down(rank, str(error))
        elif state == "dead" and detail.get(DETAIL_GROUP_CLOSED):
            # Closed by someone else (a channel's destroy, another driver, the owner's
            # end): the group is over, not a rank to restart or to report as dead.
            self.session.groups.pop(self.name, None)  # nothing to restore later
            self._mark_closed(f"worker group {self.name} is over: {detail.get('reason')}")
        elif state == "dead" and st.error is None:
            reason = describe_death(name, detail)
            if st.address is None:
                self._fail_rank(st, WorkerInitError(name, rank, "WorkerDied", reason, "", None))
            else:
                self.runtime.endpoint.mark_peer_lost(st.address, reason)
                self._fail_rank(st, PeerLostError(reason))
            st.address = None
            st.restarting = False
            if DETAIL_FENCED_IN in detail:  # its node left the cluster, with its agent
                self._relay.node_lost(rank, reason)
            else:
                self._relay.rank_died(rank, PeerLostError(reason))
            # A lost node's workers stop themselves only after this (its agent's fence).
            self._on_death(rank, st, reason, _seconds(detail.get(DETAIL_FENCED_IN)))

    def _on_death(self, rank: int, st: _Rank, reason: str, not_before: float = 0.0) -> None:
        """Apply the supervision policy to a rank whose process ended (errors already set);
        a restart waits at least ``not_before`` seconds."""
        self._emit(EventKind.DIED, rank, reason)
        sup = self.supervision
        if sup.fate == "group":
            if sup.restarts and self._group_restarts < sup.max_restarts:
                self._group_restarts += 1
                self._restart_group(rank, reason, not_before)
            else:
                self._tear_down(rank, reason)
        elif not sup.restarts:
            return
        elif st.restarts >= sup.max_restarts:
            self._emit(EventKind.GAVE_UP, rank,
                       f"restarted {st.restarts} time(s) already (max_restarts="
                       f"{sup.max_restarts}); its calls fail with the last death's error")
        else:
            self._schedule_restart([rank], max(sup.delay(st.streak), not_before), reason)

    def _schedule_restart(self, ranks: Sequence[int], delay: float, reason: str) -> None:
        """Each rank becomes its next incarnation: later calls wait for it (queued), and in
        ``delay`` seconds its process is started again."""
        for r in ranks:
            st = self.ranks[r]
            st.incarnation += 1
            st.restarts += 1
            st.streak += 1
            st.restarting = True
            st.error = None
            st.address = None
            self._emit(EventKind.RESTARTING, r, f"in {delay:.2f} s, after: {reason}")
        task = self.runtime.loop.create_task(
            self._respawn({r: self.ranks[r].incarnation for r in ranks}, delay, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _respawn(self, incarnations: dict[int, int], delay: float, reason: str) -> None:
        await asyncio.sleep(delay)
        ranks = [r for r, inc in incarnations.items()
                 if not self.closed and self.ranks[r].member
                 and self.ranks[r].incarnation == inc and self.ranks[r].restarting]
        if not ranks:
            return
        try:
            self._relocate(ranks)
            await self._spawn(ranks)
        except Exception as exc:  # noqa: BLE001 - the restart itself failed: a death of its own
            self._kill_ranks(ranks)  # whatever the agent may still start for this attempt
            why = f"restarting it failed: {type(exc).__name__}: {exc} (after: {reason})"
            for r in ranks:
                st = self.ranks[r]
                if st.incarnation != incarnations[r] or not st.restarting:
                    continue  # it came up after all, or was replaced again meanwhile
                st.restarting = False
                self._fail_rank(st, PeerLostError(f"worker {self.name}:{r} {why}"))
                if self.supervision.fate == "rank":
                    self._on_death(r, st, why)
            if self.supervision.fate == "group":
                self._on_death(ranks[0], self.ranks[ranks[0]], why)

    def _relocate(self, ranks: Sequence[int]) -> None:
        """A rank whose node is gone restarts on the live node holding the fewest of this
        group's ranks, if it needs no accelerator (one that does waits for its node)."""
        nodes = self._nodes()
        if not nodes:
            raise RuntimeError("no node agent is alive")
        load = {n: 0 for n in nodes}
        for r in self.members:
            node_rank = self._launches.get(r, (-1, None))[0]
            if node_rank in load:
                load[node_rank] += 1
        for r in ranks:
            node_rank, launch = self._launches[r]
            if node_rank in nodes or launch.visible_accelerators:
                continue
            target = min(load, key=lambda n: (load[n], n))
            load[target] += 1
            log.warning("node %d of %s:%d is gone: restarting it on node %d", node_rank,
                        self.name, r, target)
            self._launches[r] = (target, dataclasses.replace(
                launch, env={**launch.env, "NODE_RANK": str(target)}))
            self._relay.forget_placement()

    def _restarted(self, rank: int, st: _Rank) -> None:
        """A restarted rank is ready: tell the driver, let its hook speak first, then send
        the replayed calls (``configure`` with its last arguments), then what waited."""
        assert st.address is not None
        event = self._emit(EventKind.RESTARTED, rank, f"ready at {st.address}")
        for method, frames in self._last_calls.get(rank, {}).items():
            self.runtime.endpoint.request_then(
                st.address, _CALL, method, frames,
                functools.partial(self._replay_answered, rank, method))
        hook = self.supervision.on_restart
        if hook is not None:
            try:
                hook(self.view_of((rank,)) if self.view_of else None, event)
            except Exception:
                log.exception("on_restart hook of group %s failed for rank %d", self.name, rank)

    def _replay_answered(self, rank: int, method: str, error: BaseException | None,
                         _reply: Any) -> None:
        if error is not None:
            log.error("replaying %s on restarted %s:%d failed: %s", method, self.name, rank,
                      error)

    def _restart_group(self, rank: int, reason: str, not_before: float) -> None:
        """``fate="group"`` with restarts: stop every rank, then start all of them again."""
        why = f"group {self.name} restarts (fate='group') because rank {rank} died: {reason}"
        self._fail_all(why)
        self._kill_ranks([r for r in self.members if r != rank])
        delay = max(self.supervision.delay(self._group_restarts - 1), not_before)
        self._schedule_restart(self.members, delay, why)

    def _tear_down(self, rank: int, reason: str) -> None:
        """``fate="group"``: one rank died, so no rank may go on; stop them all now."""
        why = f"group {self.name} was torn down (fate='group') because rank {rank} died: {reason}"
        self._fail_all(why)
        self._emit(EventKind.TORN_DOWN, None, why)
        self.closed = True
        self.runtime.loop.create_task(self.close())

    def _fail_all(self, why: str) -> None:
        for r in self.members:
            st = self.ranks[r]
            if st.address is not None:
                self.runtime.endpoint.mark_peer_lost(st.address, why)
                st.address = None
            if st.error is None:
                self._fail_rank(st, PeerLostError(why))

    def _kill_ranks(self, ranks: Sequence[int]) -> None:
        """Ask the agents hosting ``ranks`` to stop them (SIGTERM, SIGKILL after 1 s)."""
        nodes = self._nodes()
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(self._launches[r][0], []).append(r)
        for node_rank, node_ranks in by_node.items():
            node = nodes.get(node_rank)
            if node is None:
                continue  # its node is gone, and its workers with it
            try:
                self.runtime.endpoint.send_oneway(node["endpoint"], AgentOp.KILL_WORKERS,
                                                  {"group": self.name, "ranks": node_ranks})
            except Exception as exc:  # noqa: BLE001 - the agent may be gone as well
                log.warning("could not ask node %d to stop %s ranks %s: %s", node_rank,
                            self.name, node_ranks, exc)

    def _fail_rank(self, st: _Rank, error: BaseException) -> None:
        st.error = error
        queued, st.queued = st.queued, []
        for fn in queued:
            fn()

    # ------------------------------------------------------------------ membership
    def _require_launches(self, what: str) -> None:
        if not self._launches:
            raise RuntimeError(f"{what} of group {self.name}: only the process that launched "
                               "the group can change its membership")

    async def add_ranks(self, placements: list[Placement]) -> tuple[int, ...]:
        """Start new ranks (``placements`` numbered 0..n-1) after the highest rank so far;
        returns the new ranks. A new epoch begins once the registry knows the new size."""
        self._require_launches("add_ranks")
        if self.closed:
            raise PeerLostError(f"worker group {self.name} is closed")
        base = len(self.ranks)
        placements = [dataclasses.replace(p, rank=base + p.rank) for p in placements]
        new = tuple(p.rank for p in placements)
        bound = base + len(new)
        spec = self.session.groups.get(self.name)
        if spec is None:
            raise RuntimeError(f"group {self.name} is not one this session launched")
        await self.runtime.registry.create_group(
            dataclasses.replace(spec, world_size=bound, restore=True))
        self.session.groups[self.name] = dataclasses.replace(spec, world_size=bound)
        self.world_size = bound
        self.ranks.extend(_Rank() for _ in new)
        self.members += new
        self._new_epoch()
        for r in new:
            self._emit(EventKind.ADDED, r, f"placed on node {placements[r - base].node_rank}")
        try:
            await self._plan(placements, len(self.members))
            await self._spawn(new)
        except Exception as exc:  # noqa: BLE001 - the new ranks' calls learn why
            self._launch_failed(new, exc)
        return new

    def remove_ranks(self, ranks: Sequence[int]) -> None:
        """Stop ``ranks`` and start a new epoch without them; what is pending on them fails
        with PeerLostError (calls of earlier epochs that name them, too)."""
        self._require_launches("remove_ranks")
        unknown = [r for r in ranks if r not in self.members]
        if unknown:
            raise IndexError(f"ranks {unknown} are not members of group {self.name} "
                             f"(members: {list(self.members)})")
        gone = set(ranks)
        self.members = tuple(r for r in self.members if r not in gone)
        self._new_epoch()
        for r in ranks:
            st = self.ranks[r]
            reason = f"worker {self.name}:{r} was removed from its group (epoch {self.epoch})"
            st.member = False
            st.restarting = False
            if st.address is not None:
                self.runtime.endpoint.mark_peer_lost(st.address, reason)
            self._fail_rank(st, PeerLostError(reason))
            self._last_calls.pop(r, None)
            self._emit(EventKind.REMOVED, r, reason)
        self._kill_ranks(list(ranks))

    def _new_epoch(self) -> None:
        self.epoch += 1
        self.views.clear()  # views name the ranks of their epoch; new ones are made on demand

    # ------------------------------------------------------------------ events
    def _emit(self, kind: EventKind, rank: int | None, reason: str) -> GroupEvent:
        incarnation = self.ranks[rank].incarnation if rank is not None else 0
        event = GroupEvent(kind, self.name, rank, incarnation, self.epoch, reason, time.time())
        level = logging.WARNING if kind in _BAD_NEWS else logging.INFO
        log.log(level, "%s", event)
        self._history.append(event)
        for sub in self._subscribers:
            sub._push(event)
        if kind == EventKind.CLOSED:
            self._subscribers.clear()
        return event

    def subscribe(self) -> GroupEvents:
        """A new subscription: the events so far, then each new one (loop thread only)."""
        sub = GroupEvents(self._history)
        if not self._history or self._history[-1].kind != EventKind.CLOSED:
            self._subscribers.append(sub)
        return sub

    async def close(self) -> None:
        self.session.groups.pop(self.name, None)
        try:
            await self.runtime.registry.close_group(self.name, timeout=5)
        finally:
            self._mark_closed(f"worker group {self.name} was closed")

    def _runtime_closed(self) -> None:
        """The runtime is stopping (a runtime closer, on the loop): nothing will be sent or
        answered any more, so what is pending or queued fails now with the reason."""
        self._mark_closed(f"worker group {self.name} can no longer be reached: "
                          f"{self.runtime.closed_reason}")

    def _mark_closed(self, reason: str) -> None:
        """The group is over: what is pending or queued on any rank fails, and subscribers
        hear CLOSED (once)."""
        self.closed = True
        self.runtime.discard_closer(self._runtime_closed)
        for st in self.ranks:
            if st.address is not None:
                self.runtime.endpoint.mark_peer_lost(st.address, reason)
            st.restarting = False
            self._fail_rank(st, PeerLostError(reason))
        if not self._history or self._history[-1].kind != EventKind.CLOSED:
            self._emit(EventKind.CLOSED, None, reason)


_BAD_NEWS = frozenset({EventKind.DIED, EventKind.GAVE_UP, EventKind.TORN_DOWN})


def _seconds(value: Any) -> float:
    """A duration from a registry detail map (0 when absent or not a number)."""
    return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0


def _fresh(error: BaseException) -> BaseException:
    """A copy of a stored error, so each raise gets its own traceback."""
    try:
        return copy.copy(error).with_traceback(None)
    except Exception:  # an exception type that cannot be copied: raise the stored one
        return error


def _installed(module_file: str | None) -> bool:
    if not module_file:
        return True  # builtins and extension modules are importable everywhere
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
    path = os.path.realpath(module_file)
    return any(path.startswith(os.path.realpath(r) + os.sep) for r in roots)


def ship_class(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any],
               shipped: PackedDir | None = None) -> bytes:
    """Pickle (cls, args, kwargs) for the node agents.

    A class from an installed package, or from a module inside the ``shipped`` working
    directory (importable on every node from its copy), travels by reference. A class from a user's
    script or test module travels by value (cloudpickle), so a node that lacks
    the file (or imports it under another name) can still build it. Its code keeps its
    file name and lines, and the files' source travels with it, so a remote traceback shows
    the user's file and failing line (`aiorl.transport.code`).
    """
    import cloudpickle

    module = sys.modules.get(cls.__module__)
    module_file = getattr(module, "__file__", None)
    by_value = module is not None and cls.__module__ != "__main__" and not _installed(
        module_file) and not cls.__module__.startswith("aiorl.") and not (
        shipped is not None and shipped.contains(module_file))
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return dumps_with_sources((cls, args, kwargs))
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
