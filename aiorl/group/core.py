"""The shared state of one launched group: its ranks, their readiness, deaths and calls.

Every :class:`~aiorl.WorkerGroup` view of a group shares one :class:`GroupCore`. The core
lives on the runtime loop: it is mutated only there (``dispatch``, registry events,
``close``), so views can be used from any thread without locks.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import sys
import sysconfig
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from aiorl.errors import PeerLostError, WorkerInitError
from aiorl.names import WorkerAddress
from aiorl.protocol.ops import AgentOp, WorkerOp
from aiorl.protocol.spawn import SpawnRequest, WorkerLaunch
from aiorl.runtime import AsyncWork, Runtime, Session, describe_death
from aiorl.runtime.promise import is_settled, link_threads, reject, resolve
from aiorl.transport import serialization

if TYPE_CHECKING:
    from aiorl.placement import Placement

__all__ = ["GroupCore", "ship_class"]

log = logging.getLogger("aiorl.group")


class _Rank:
    """The driver's view of one rank: its endpoint once ready, or why it cannot be called."""

    __slots__ = ("address", "error", "queued")

    def __init__(self) -> None:
        self.address: str | None = None
        self.error: BaseException | None = None
        self.queued: list[Callable[[], None]] = []


class _GroupCall:
    """One call on some ranks: the per-rank answers, gathered into the work's result list."""

    __slots__ = ("work", "results", "remaining")

    def __init__(self, work: AsyncWork[list[Any]], n: int) -> None:
        self.work = work
        self.results: list[Any] = [None] * n
        self.remaining = n

    def settle(self, i: int, error: BaseException | None, reply: Any) -> None:
        """Rank ``i`` answered (an endpoint settle): the first error fails the call."""
        work = self.work
        if is_settled(work):
            return
        if error is None:
            payload = reply[1]
            try:
                self.results[i] = serialization.loads(payload) if payload else None
            except Exception as exc:  # noqa: BLE001 - an unreadable result fails the call
                error = exc
        if error is not None:
            reject(work, error)
            return
        self.remaining -= 1
        if self.remaining == 0:
            resolve(work, self.results)


class GroupCore:
    """Rank slots, readiness queues, deaths and close of one group (runtime loop only)."""

    def __init__(self, session: Session, cls: type, name: str, world_size: int) -> None:
        self.session = session
        self.runtime: Runtime = session.runtime
        self.cls = cls
        self.name = name
        self.world_size = world_size
        self.ranks = [_Rank() for _ in range(world_size)]
        self.closed = False
        self._watching = False
        #: Views handed out by ``WorkerGroup.on_ranks``, by rank tuple (cached, bounded).
        self.views: dict[tuple[int, ...], Any] = {}

    def dispatch(self, work: AsyncWork[list[Any]], method: str, ranks: Sequence[int],
                  frames: list[Any], off_loop: bool) -> None:
        if off_loop:
            link_threads(work)  # link now, on the loop, so wait() needs no extra wake-up
        if self.closed:
            reject(work, PeerLostError(f"worker group {self.name} is closed"))
            return
        if not ranks:
            resolve(work, [])
            return
        call = _GroupCall(work, len(ranks))
        for i, r in enumerate(ranks):
            state = self.ranks[r]
            if state.error is not None or state.address is not None:
                self._send_call(call, i, state, method, frames)
            else:
                state.queued.append(
                    functools.partial(self._send_call, call, i, state, method, frames))

    def _send_call(self, call: _GroupCall, i: int, state: _Rank, method: str,
                   frames: list[Any]) -> None:
        if state.error is not None:
            call.settle(i, _fresh(state.error), None)
            return
        assert state.address is not None
        self.runtime.endpoint.request_then(
            state.address, WorkerOp.CALL, method, frames, functools.partial(call.settle, i))

    def ready(self) -> AsyncWork[None]:
        work: AsyncWork[None] = AsyncWork(self.runtime.loop)

        def check() -> None:
            waiting = [0]

            def one_ready() -> None:
                for st in self.ranks:
                    if st.error is not None:
                        reject(work, _fresh(st.error))
                        return
                waiting[0] -= 1
                if waiting[0] == 0:
                    resolve(work, None)

            for st in self.ranks:
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

    async def start(self, placements: list[Placement], payload: bytes, extra_env: dict[str, str]) -> None:
        try:
            await self.watch()
            await self._spawn(placements, payload, extra_env)
        except Exception as exc:  # noqa: BLE001 - every rank learns why
            log.error("launching group %s failed: %s", self.name, exc)
            err = WorkerInitError(f"{self.name}:*", -1, type(exc).__name__, str(exc), "", exc)
            for st in self.ranks:
                if st.address is None and st.error is None:
                    self._fail_rank(st, err)

    async def watch(self) -> None:
        if not self._watching:
            self._watching = True
            await self.runtime.registry.watch(self.name, self._on_worker_event)

    async def _spawn(self, placements: list[Placement], payload: bytes, extra_env: dict[str, str]) -> None:
        nodes = {n["node_rank"]: n for n in self.session._node_list()}
        first = placements[0]
        master_node = nodes[first.node_rank]
        port_reply, _ = await self.runtime.endpoint.request(master_node["endpoint"],
                                                            AgentOp.FREE_PORT, timeout=10)
        by_node: dict[int, list[WorkerLaunch]] = {}
        for p in placements:
            profiler = p.profiler_launch(self.name)  # None unless profiling selects us
            env = {
                "RANK": str(p.rank), "WORLD_SIZE": str(len(placements)),
                "LOCAL_RANK": str(p.launch_local_rank),
                "LOCAL_WORLD_SIZE": str(p.local_world_size),
                "NODE_LOCAL_RANK": str(p.local_rank), "NODE_LOCAL_WORLD_SIZE": str(p.local_world_size),
                "NODE_RANK": str(p.node_rank), "NODE_GROUP_LABEL": p.node_group_label,
                "MASTER_ADDR": master_node["ip"], "MASTER_PORT": str(port_reply["port"]),
                "AIORL_WORKER_NAME": f"{self.name}:{p.rank}",
                "AIORL_REGISTRY": self.session.registry_address,
                "AIORL_DRIVER_ID": self.session.driver_id,
                **(profiler.env if profiler else {}), **p.env, **extra_env,
            }
            if p.visible_accelerators:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(p.visible_accelerators)
            by_node.setdefault(p.node_rank, []).append(WorkerLaunch(
                rank=p.rank, env=env, hardware_ranks=tuple(p.hardware_ranks),
                visible_accelerators=tuple(p.visible_accelerators),
                sys_path=tuple(x for x in sys.path if x), log_level=logging.getLevelName(
                    logging.getLogger("aiorl").getEffectiveLevel()),
                launcher=profiler.argv if profiler else (),
                python_interpreter=p.python_interpreter,
            ))
        output_to = self.runtime.endpoint.address if getattr(self.session, "log_to_driver",
                                                             False) else None
        for node_rank, launches in by_node.items():
            node = nodes.get(node_rank)
            if node is None:
                raise RuntimeError(f"node {node_rank} is not part of the cluster any more")
            request = SpawnRequest(self.name, self.session.driver_id, len(placements),
                                   tuple(launches), f"{self.cls.__module__}.{self.cls.__qualname__}",
                                   output_to)
            await self.runtime.endpoint.request(node["endpoint"], AgentOp.SPAWN,
                                                request.to_wire(), [payload], timeout=60)

    def _on_worker_event(self, name: str, state: str, info: dict[str, Any], detail: dict[str, Any]) -> None:
        try:
            rank = WorkerAddress.from_name(name).rank
        except ValueError:
            return
        if not 0 <= rank < self.world_size:
            return
        st = self.ranks[rank]
        if state == "ready":
            st.address = info["endpoint"]
            st.error = None
            queued, st.queued = st.queued, []
            for fn in queued:
                fn()
        elif state == "failed":
            self._fail_rank(st, WorkerInitError(
                name, rank, str(detail.get("type", "Exception")), str(detail.get("message", "")),
                str(detail.get("traceback", "")), None))
        elif state == "dead":
            reason = describe_death(name, detail)
            if st.address is None and st.error is None:
                self._fail_rank(st, WorkerInitError(name, rank, "WorkerDied", reason, "", None))
            elif st.address is not None:
                self.runtime.endpoint.mark_peer_lost(st.address, reason)
                self._fail_rank(st, PeerLostError(reason))

    def _fail_rank(self, st: _Rank, error: BaseException) -> None:
        st.error = error
        queued, st.queued = st.queued, []
        for fn in queued:
            fn()

    async def close(self) -> None:
        self.session.groups.pop(self.name, None)
        try:
            await self.runtime.registry.close_group(self.name, timeout=5)
        finally:
            reason = f"worker group {self.name} was closed"
            for st in self.ranks:
                if st.address is not None:
                    self.runtime.endpoint.mark_peer_lost(st.address, reason)
                self._fail_rank(st, PeerLostError(reason))


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


def ship_class(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """Pickle (cls, args, kwargs) for the node agents.

    A class from an installed package travels by reference. A class from a user's
    script or test module travels by value (cloudpickle), so a node that lacks
    the file (or imports it under another name) can still build it.
    """
    import cloudpickle

    module = sys.modules.get(cls.__module__)
    by_value = module is not None and cls.__module__ != "__main__" and not _installed(
        getattr(module, "__file__", None)) and not cls.__module__.startswith("aiorl.")
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        payload: bytes = cloudpickle.dumps((cls, args, kwargs), protocol=5)
        return payload
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
