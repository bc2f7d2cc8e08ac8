"""``WorkerGroup``: launch a worker class on many processes and call it on all of them.

``launch()`` registers the group, asks the node agents to spawn the processes
and returns at once. A call such as ``group.step(x)`` sends ``step`` to every
rank (or to the ranks chosen by ``execute_on`` for that one call) and returns
an :class:`~aiorl.AsyncWork` whose result is the list of per-rank results in
rank order. Calls made before a rank is ready are queued and sent, in order,
when the registry reports it ready.

Failure: a rank whose ``__init__`` raised fails every call with
:class:`~aiorl.errors.WorkerInitError`; a rank that dies fails pending and
later calls with :class:`~aiorl.errors.PeerLostError` naming the rank, its
exit code and its last output lines. The first error of a fan-out call is the
call's error.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import sysconfig
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from aiorl.runtime import AsyncWork, Runtime, Session, describe_death
from aiorl.errors import PeerLostError, WorkerInitError
from aiorl.names import WorkerAddress
from aiorl.transport import serialization

if TYPE_CHECKING:
    from aiorl.placement import Placement

__all__ = ["WorkerGroup", "WorkerGroupBuilder"]

log = logging.getLogger("aiorl.group")
W = TypeVar("W")


class _Rank:
    """The driver's view of one rank: its endpoint once ready, or why it cannot be called."""

    __slots__ = ("address", "error", "queued")

    def __init__(self) -> None:
        self.address: str | None = None
        self.error: BaseException | None = None
        self.queued: list[Callable[[], None]] = []


class WorkerGroupBuilder(Generic[W]):
    """What ``Worker.create_group(*args, **kwargs)`` returns; ``launch`` starts it."""

    def __init__(self, cls: type[W], args: tuple[Any, ...], kwargs: dict[str, Any],
                 base: type = object) -> None:
        # ``base`` is the framework class the worker derives from (aiorl.Worker): its own
        # attributes may share a name with a group attribute (``world_size``) on purpose.
        clashes = sorted(
            n for n in dir(cls)
            if not n.startswith("_") and callable(getattr(cls, n, None)) and n in _GROUP_ATTRIBUTES
            and getattr(cls, n) is not getattr(base, n, None)
        )
        if clashes:
            raise ValueError(
                f"{cls.__name__} defines {', '.join(clashes)}, which clash with WorkerGroup "
                "attributes of the same name; rename them"
            )
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def launch(
        self,
        cluster: Session,
        placement_strategy: Any = None,
        name: str | None = None,
        *,
        env: dict[str, str] | None = None,
    ) -> WorkerGroup[W]:
        """Start the group's processes and return at once (calls wait for readiness).

        Raises :class:`ValueError` if a live group already has ``name``, and
        :class:`~aiorl.PlacementError` for a placement the cluster cannot hold.
        """
        from aiorl.placement import default_placement_strategy

        name = name or self.cls.__name__
        WorkerAddress(name)  # validates the name
        spec = cluster.spec
        strategy = placement_strategy or default_placement_strategy(spec)
        placements = strategy.get_placement(spec)
        runtime = cluster.runtime
        payload = _ship_class(self.cls, self.args, self.kwargs)
        request = {
            "group": name, "world_size": len(placements), "owner": cluster.driver_id,
            "worker_class": f"{self.cls.__module__}.{self.cls.__qualname__}",
        }
        runtime.run_sync(runtime.registry.request("create_group", request), timeout=30)
        cluster.groups[name] = request  # restored if the registry restarts
        group: WorkerGroup[W] = WorkerGroup(cluster, self.cls, name, len(placements))
        runtime.call_soon(
            lambda: runtime.loop.create_task(group._start(placements, payload, env or {}))
        )
        return group


class WorkerGroup(Generic[W]):
    """A launched group. Attribute access gives fan-out callables for the worker's methods."""

    def __init__(self, cluster: Session, cls: type[W], name: str, world_size: int) -> None:
        self._cluster = cluster
        self._runtime: Runtime = cluster.runtime
        self._cls = cls
        self._name = name
        self._world_size = world_size
        self._ranks = [_Rank() for _ in range(world_size)]
        self._next_ranks: list[int] | None = None
        self._closed = False
        self._watching = False

    # ------------------------------------------------------------------ public surface
    @property
    def worker_group_name(self) -> str:
        return self._name

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def worker_cls(self) -> type[W]:
        return self._cls

    def execute_on(self, *ranks: int) -> WorkerGroup[W]:
        """Send only the next call to ``ranks`` (results in the order given)."""
        flat = [r for item in ranks for r in (item if isinstance(item, (list, tuple)) else [item])]
        for r in flat:
            if not 0 <= r < self._world_size:
                raise IndexError(f"rank {r} is out of range for group {self._name} of {self._world_size}")
        self._next_ranks = flat
        return self

    def __getattr__(self, method: str) -> Callable[..., AsyncWork[list[Any]]]:
        if method.startswith("_"):
            raise AttributeError(f"{method!r} is private: only public worker methods can be called")
        fn = getattr(self._cls, method, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"{self._cls.__name__} has no method {method!r}")
        call = functools.partial(self._call, method)
        functools.update_wrapper(call, fn)
        # Cached on the instance: later look-ups skip __getattr__ (a hot path).
        self.__dict__[method] = call
        return call

    def wait_ready(self, timeout: float | None = 60) -> None:
        """Block until every rank is ready (raises WorkerInitError / PeerLostError)."""
        self._call_internal_ready().wait(timeout)

    async def async_wait_ready(self) -> None:
        await self._call_internal_ready()

    def close(self) -> None:
        """Stop the group's processes. Pending and later calls fail with PeerLostError."""
        if self._closed:
            return
        self._closed = True
        try:
            self._runtime.run_sync(self._close(), timeout=10)
        except Exception as exc:  # the cluster may be closing too; the agents still kill everything
            log.debug("closing group %s: %s", self._name, exc)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._runtime.on_loop_thread():
            await self._close()
        else:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._close(), self._runtime.loop))

    @classmethod
    def from_group_name(cls, cluster: Session, worker_cls: type[W], name: str) -> WorkerGroup[W]:
        """Attach to the running group ``name`` (launched by this or another driver)."""
        runtime = cluster.runtime
        reply = runtime.run_sync(runtime.registry.request("lookup_group", {"group": name}), timeout=30)
        group: WorkerGroup[W] = WorkerGroup(cluster, worker_cls, name, int(reply["world_size"]))
        runtime.run_sync(group._watch(), timeout=30)
        return group

    def __repr__(self) -> str:
        return f"<WorkerGroup {self._name} x{self._world_size} of {self._cls.__name__}>"

    # ------------------------------------------------------------------ calls
    def _call(self, method: str, *args: Any, **kwargs: Any) -> AsyncWork[list[Any]]:
        ranks = self._next_ranks if self._next_ranks is not None else range(self._world_size)
        self._next_ranks = None
        # Serialize in the caller's thread: errors surface here, and the loop stays free.
        frames = serialization.dumps((args, kwargs)) if args or kwargs else []
        runtime = self._runtime
        work: AsyncWork[list[Any]] = AsyncWork(runtime.loop)
        if runtime.on_loop_thread():
            self._dispatch(work, method, list(ranks), frames, False)
        else:
            runtime.call_soon(self._dispatch, work, method, list(ranks), frames, True)
        return work

    def _dispatch(self, work: AsyncWork[list[Any]], method: str, ranks: list[int],
                  frames: list[Any], off_loop: bool) -> None:
        if off_loop:
            work._concurrent()  # link now, on the loop, so wait() needs no extra wake-up
        if self._closed:
            work._set_exception(PeerLostError(f"worker group {self._name} is closed"))
            return
        results: list[Any] = [None] * len(ranks)
        remaining = [len(ranks)]
        endpoint = self._runtime.endpoint

        def collect(i: int, fut: Any) -> None:
            if fut.cancelled():
                work.cancel()
                return
            exc = fut.exception()  # retrieved even when unused, so asyncio does not warn
            if work._fut.done():
                return
            if exc is not None:
                work._set_exception(exc)
                return
            _, payload = fut.result()
            results[i] = serialization.loads(payload) if payload else None
            remaining[0] -= 1
            if remaining[0] == 0:
                work._set_result(results)

        for i, r in enumerate(ranks):
            state = self._ranks[r]

            def send(i: int = i, state: _Rank = state) -> None:
                if state.error is not None:
                    if not work._fut.done():
                        work._set_exception(_fresh(state.error))
                    return
                assert state.address is not None
                fut = endpoint.request(state.address, "call", method, frames)
                fut.add_done_callback(functools.partial(collect, i))

            if state.address is not None or state.error is not None:
                send()
            else:
                state.queued.append(send)
        if not ranks:
            work._set_result([])

    def _call_internal_ready(self) -> AsyncWork[None]:
        work: AsyncWork[None] = AsyncWork(self._runtime.loop)

        def check() -> None:
            waiting = [0]

            def one_ready() -> None:
                for st in self._ranks:
                    if st.error is not None:
                        work._set_exception(_fresh(st.error))
                        return
                waiting[0] -= 1
                if waiting[0] == 0:
                    work._set_result(None)

            for st in self._ranks:
                if st.error is not None:
                    work._set_exception(_fresh(st.error))
                    return
                if st.address is None:
                    waiting[0] += 1
                    st.queued.append(one_ready)
            if waiting[0] == 0:
                work._set_result(None)

        self._runtime.call_soon(check)
        return work

    # ------------------------------------------------------------------ lifecycle (loop thread)
    async def _start(self, placements: list[Placement], payload: bytes, extra_env: dict[str, str]) -> None:
        try:
            await self._watch()
            await self._spawn(placements, payload, extra_env)
        except Exception as exc:  # noqa: BLE001 - every rank learns why
            log.error("launching group %s failed: %s", self._name, exc)
            err = WorkerInitError(f"{self._name}:*", -1, type(exc).__name__, str(exc), "", exc)
            for st in self._ranks:
                if st.address is None and st.error is None:
                    self._fail_rank(st, err)

    async def _watch(self) -> None:
        if not self._watching:
            self._watching = True
            await self._runtime.registry.watch(self._name, self._on_worker_event)

    async def _spawn(self, placements: list[Placement], payload: bytes, extra_env: dict[str, str]) -> None:
        nodes = {n["node_rank"]: n for n in self._cluster._node_list()}
        first = placements[0]
        master_node = nodes[first.node_rank]
        port_reply, _ = await self._runtime.endpoint.request(master_node["endpoint"], "free_port", timeout=10)
        by_node: dict[int, list[dict[str, Any]]] = {}
        for p in placements:
            env = {
                "RANK": str(p.rank), "WORLD_SIZE": str(len(placements)),
                "LOCAL_RANK": str(p.local_rank), "LOCAL_WORLD_SIZE": str(p.local_world_size),
                "NODE_LOCAL_RANK": str(p.local_rank), "NODE_LOCAL_WORLD_SIZE": str(p.local_world_size),
                "NODE_RANK": str(p.node_rank), "NODE_GROUP_LABEL": p.node_group_label,
                "MASTER_ADDR": master_node["ip"], "MASTER_PORT": str(port_reply["port"]),
                "AIORL_WORKER_NAME": f"{self._name}:{p.rank}",
                "AIORL_REGISTRY": self._cluster.registry_address,
                "AIORL_DRIVER_ID": self._cluster.driver_id,
                **p.env, **extra_env,
            }
            if p.visible_accelerators:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(p.visible_accelerators)
            by_node.setdefault(p.node_rank, []).append({
                "rank": p.rank, "world_size": len(placements), "env": env,
                "hardware_ranks": list(p.hardware_ranks),
                "visible_accelerators": list(p.visible_accelerators),
                "sys_path": [x for x in sys.path if x], "log_level": logging.getLevelName(
                    logging.getLogger("aiorl").getEffectiveLevel()),
            })
        for node_rank, specs in by_node.items():
            node = nodes.get(node_rank)
            if node is None:
                raise RuntimeError(f"node {node_rank} is not part of the cluster any more")
            request = {"group": self._name, "workers": specs}
            if getattr(self._cluster, "log_to_driver", False):
                request["output_to"] = self._runtime.endpoint.address
            await self._runtime.endpoint.request(node["endpoint"], "spawn", request, [payload],
                                                 timeout=60)

    def _on_worker_event(self, name: str, state: str, info: dict[str, Any], detail: dict[str, Any]) -> None:
        try:
            rank = WorkerAddress.from_name(name).rank
        except ValueError:
            return
        if not 0 <= rank < self._world_size:
            return
        st = self._ranks[rank]
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
                self._runtime.endpoint.mark_peer_lost(st.address, reason)
                self._fail_rank(st, PeerLostError(reason))

    def _fail_rank(self, st: _Rank, error: BaseException) -> None:
        st.error = error
        queued, st.queued = st.queued, []
        for fn in queued:
            fn()

    async def _close(self) -> None:
        self._cluster.groups.pop(self._name, None)
        try:
            await self._runtime.registry.request("close_group", {"group": self._name}, timeout=5)
        finally:
            reason = f"worker group {self._name} was closed"
            for st in self._ranks:
                if st.address is not None:
                    self._runtime.endpoint.mark_peer_lost(st.address, reason)
                self._fail_rank(st, PeerLostError(reason))


def _fresh(error: BaseException) -> BaseException:
    """A new instance of a stored error, so each raise gets its own traceback."""
    try:
        return error.__reduce__()[0](*error.__reduce__()[1])  # type: ignore[index,operator]
    except Exception:
        return error


_GROUP_ATTRIBUTES = frozenset(
    n for n in dir(WorkerGroup) if not n.startswith("__")
) | {"execute_on", "close", "aclose", "wait_ready", "from_group_name"}


def _installed(module_file: str | None) -> bool:
    if not module_file:
        return True  # builtins and extension modules are importable everywhere
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
    path = os.path.realpath(module_file)
    return any(path.startswith(os.path.realpath(r) + os.sep) for r in roots)


def _ship_class(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
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
        return cloudpickle.dumps((cls, args, kwargs), protocol=5)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
