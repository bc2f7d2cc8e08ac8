"""``WorkerGroup``: launch a worker class on many processes and call it on all of them.

``launch()`` registers the group, asks the node agents to spawn the processes
and returns at once. A call such as ``group.step(x)`` sends ``step`` to every
rank (or to the ranks of a view: ``group.execute_on(0, 3).step(x)``) and returns
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
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from aiorl.group.core import GroupCore, ship_class
from aiorl.names import WorkerAddress, WorkerInfo
from aiorl.placement import (
    ClusterSpec,
    ComponentPlacement,
    NodePlacementStrategy,
    PackedPlacementStrategy,
    PlacementError,
    PlacementStrategy,
    RankStringPlacementStrategy,
    default_placement_strategy,
)
from aiorl.protocol.registry import GroupSpec
from aiorl.runtime import AsyncWork, Session
from aiorl.runtime.promise import prepare_threads
from aiorl.transport import serialization

__all__ = ["WorkerGroup", "WorkerGroupBuilder"]

log = logging.getLogger("aiorl.group")
W = TypeVar("W")


class WorkerGroupBuilder(Generic[W]):
    """What ``Worker.create_group(*args, **kwargs)`` returns; ``launch`` starts it.

    Example::

        builder = Trainer.create_group(cfg)        # nothing runs yet
        trainer = builder.launch(cluster, "0-7", name="trainer")
    """

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
        placement_strategy: PlacementStrategy | str | int | None = None,
        name: str | None = None,
        *,
        num_workers: int | None = None,
        env: dict[str, str] | None = None,
        isolate_gpu: bool = True,
    ) -> WorkerGroup[W]:
        """Start the group's processes and return at once (calls wait for readiness).

        Where the ranks go, from the first of these that is given:

        * ``placement_strategy``: a strategy from :mod:`aiorl.placement`, or a placement
          string (``"0-3"``: one rank per accelerator 0-3, docs/placement.md);
        * ``num_workers=N``: one rank per accelerator on the first ``N`` accelerators
          (node 0's first, as torchrun fills a node) when the cluster declares
          accelerators; otherwise ``N`` CPU processes spread over the nodes in
          contiguous blocks (ranks ``0..k-1`` on node 0, the next block on node 1, ...);
        * neither: one rank per declared accelerator, or one rank on node 0.

        ``isolate_gpu=False`` (RLinf's name) shows every rank all accelerators of its node
        instead of only its own, with ``LOCAL_RANK`` set to its device id.

        Example::

            group = Rollout.create_group(cfg).launch(cluster, num_workers=4, name="rollout")
            group = Trainer.create_group(cfg).launch(cluster, "0-3", name="trainer")

        Raises:
            GroupExistsError: a live group already has ``name`` (a ``ValueError``).
            PlacementError: a placement the cluster cannot hold (a ``ValueError``).
            TypeError: ``placement_strategy`` is not a strategy, string or int, or both it
                and ``num_workers`` are given.
            RuntimeError: ``cluster`` is closed.
        """
        request, start = self._plan(cluster, placement_strategy, name, num_workers, env,
                                    isolate_gpu)
        runtime = cluster.runtime
        runtime.run_sync(runtime.registry.create_group(request), timeout=30)
        return start()

    async def launch_async(
        self,
        cluster: Session,
        placement_strategy: PlacementStrategy | str | int | None = None,
        name: str | None = None,
        *,
        num_workers: int | None = None,
        env: dict[str, str] | None = None,
        isolate_gpu: bool = True,
    ) -> WorkerGroup[W]:
        """:meth:`launch` for code on the runtime loop's thread (channels launch their
        host from there): it awaits the registry instead of blocking the loop."""
        request, start = self._plan(cluster, placement_strategy, name, num_workers, env,
                                    isolate_gpu)
        await cluster.runtime.registry.create_group(request)
        return start()

    def _plan(self, cluster: Session, placement_strategy: PlacementStrategy | str | int | None,
              name: str | None, num_workers: int | None, env: dict[str, str] | None,
              isolate_gpu: bool = True) -> tuple[GroupSpec, Callable[[], WorkerGroup[W]]]:
        """The registry's create_group request, and what starts the group once it succeeded."""
        group_name = name if name is not None else self.cls.__name__
        WorkerAddress(group_name)  # validates the name
        spec = cluster.spec
        strategy = _strategy(spec, placement_strategy, num_workers, group_name)
        # Custom strategies written for get_placement(spec) keep working when isolating.
        placements = (strategy.get_placement(spec) if isolate_gpu
                      else strategy.get_placement(spec, isolate_accelerator=False))
        runtime = cluster.runtime
        payload = ship_class(self.cls, self.args, self.kwargs)
        request = GroupSpec(group_name, len(placements), cluster.driver_id,
                            f"{self.cls.__module__}.{self.cls.__qualname__}")

        def start() -> WorkerGroup[W]:
            cluster.groups[group_name] = request  # restored if the registry restarts
            core = GroupCore(cluster, self.cls, group_name, len(placements))
            runtime.submit(
                lambda: runtime.loop.create_task(core.start(placements, payload, env or {})))
            return WorkerGroup(core)

        return request, start


def _strategy(spec: ClusterSpec, placement: PlacementStrategy | str | int | None,
              num_workers: int | None, group_name: str) -> PlacementStrategy:
    """The strategy ``launch`` uses (its docstring gives the rules), with errors that say
    what to pass instead."""
    if placement is not None and num_workers is not None:
        raise TypeError(f"launch() of group {group_name!r}: give placement_strategy or "
                        "num_workers, not both (a strategy fixes the number of workers)")
    if isinstance(placement, PlacementStrategy):
        return placement
    if isinstance(placement, (str, int)) and not isinstance(placement, bool):
        return RankStringPlacementStrategy(placement, context=f"group {group_name!r}")
    if placement is not None:
        hint = (" (a ComponentPlacement holds one strategy per component: pass "
                "placement.get_strategy('component'))"
                if isinstance(placement, ComponentPlacement) else "")
        raise TypeError(
            f"launch() of group {group_name!r}: placement_strategy must be a placement strategy "
            "(e.g. PackedPlacementStrategy(0, 3) or NodePlacementStrategy([0, 0])), a placement "
            f"string such as '0-3', or None; got {type(placement).__name__}{hint}")
    if num_workers is None:
        return default_placement_strategy(spec)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise PlacementError(f"launch() of group {group_name!r}: num_workers must be a "
                             f"positive int, got {num_workers!r}")
    if spec.num_accelerators:
        if num_workers > spec.num_accelerators:
            raise PlacementError(
                f"launch() of group {group_name!r}: num_workers={num_workers} asks for one "
                f"accelerator per worker, and the cluster declares {spec.num_accelerators}; "
                "for CPU workers pass NodePlacementStrategy([node rank per worker])")
        return PackedPlacementStrategy(0, num_workers - 1)
    num_nodes = max(spec.num_nodes, 1)
    per_node, extra = divmod(num_workers, num_nodes)
    return NodePlacementStrategy(
        [n for n in range(num_nodes) for _ in range(per_node + (n < extra))])


class WorkerGroup(Generic[W]):
    """A launched group, or a view of some of its ranks. Immutable: safe from any thread.

    Attribute access gives fan-out callables for the worker's public methods:
    ``group.step(x)`` calls every rank of the view and returns an
    :class:`~aiorl.AsyncWork` of the per-rank results, in the view's rank order.
    :meth:`on_ranks` (alias :meth:`execute_on`) returns a view of some ranks; it does
    not change this object, so ``group.execute_on(0).step()`` followed by
    ``group.step()`` calls rank 0, then every rank.

    Example::

        group = Rollout.create_group(cfg).launch(cluster, num_workers=4, name="rollout")
        results = group.generate(8).wait()            # [r0, r1, r2, r3]
        first = await group.execute_on(0, 3).generate(1)   # [r0, r3], in a coroutine
        group.close()
    """

    _VIEW_CACHE_SIZE = 64

    def __init__(self, core: GroupCore, ranks: tuple[int, ...] | None = None) -> None:
        self._core = core
        self._view_ranks = ranks if ranks is not None else tuple(range(core.world_size))

    # ------------------------------------------------------------------ public surface
    @property
    def worker_group_name(self) -> str:
        """The group's name (``launch(name=...)``, the class name by default)."""
        return self._core.name

    @property
    def world_size(self) -> int:
        """The number of ranks in the whole group (not in this view)."""
        return self._core.world_size

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks this view calls, in result order."""
        return self._view_ranks

    @property
    def worker_cls(self) -> type[W]:
        """The worker class whose methods this group calls."""
        return self._core.cls

    @property
    def worker_info_list(self) -> list[WorkerInfo]:
        """The :class:`~aiorl.WorkerInfo` of every rank of the group, in rank order, as the
        workers registered it (node, pid, accelerators, endpoint). Waits until every
        rank is ready; call it from synchronous code, not from the runtime loop."""
        self.wait_ready()
        core = self._core
        record = core.runtime.run_sync(core.runtime.registry.lookup_group(core.name), timeout=30)
        return [record.workers[f"{core.name}:{rank}"].info for rank in range(core.world_size)]

    def on_ranks(self, *ranks: int | list[int] | tuple[int, ...]) -> WorkerGroup[W]:
        """A view that calls only ``ranks`` (results in the order given); views are cached."""
        flat = tuple(r for item in ranks for r in (item if isinstance(item, (list, tuple)) else [item]))
        views = self._core.views
        view = views.get(flat)
        if view is None:
            for r in flat:
                if not 0 <= r < self._core.world_size:
                    raise IndexError(f"rank {r} is out of range for group {self._core.name} "
                                     f"of {self._core.world_size}")
            view = WorkerGroup(self._core, flat)
            if len(views) >= self._VIEW_CACHE_SIZE:  # bounded: drop the oldest view
                views.pop(next(iter(views)))
            views[flat] = view
        return view

    execute_on = on_ranks

    def __getattr__(self, method: str) -> Callable[..., AsyncWork[list[Any]]]:
        if method.startswith("_"):
            raise AttributeError(f"{method!r} is private: only public worker methods can be called")
        cls = self._core.cls
        fn = getattr(cls, method, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"{cls.__name__} has no method {method!r}")
        call = functools.partial(self._call, method)
        functools.update_wrapper(call, fn)
        # Cached on the view: later look-ups skip __getattr__ (a hot path).
        self.__dict__[method] = call
        return call

    def wait_ready(self, timeout: float | None = 60) -> None:
        """Block until every rank is ready (raises WorkerInitError / PeerLostError)."""
        self._ready().wait(timeout)

    async def async_wait_ready(self) -> None:
        """:meth:`wait_ready` for coroutines: ``await group.async_wait_ready()``."""
        await self._ready()

    def close(self) -> None:
        """Stop the group's processes (all ranks, whatever the view).

        Pending and later calls fail with PeerLostError.
        """
        core = self._core
        if core.closed:
            return
        core.closed = True
        try:
            core.runtime.run_sync(core.close(), timeout=10)
        except Exception as exc:  # the cluster may be closing too; the agents still kill everything
            log.debug("closing group %s: %s", core.name, exc)

    async def aclose(self) -> None:
        """:meth:`close` for coroutines: ``await group.aclose()``."""
        core = self._core
        if core.closed:
            return
        core.closed = True
        if core.runtime.on_loop_thread():
            await core.close()
        else:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(core.close(), core.runtime.loop))

    @classmethod
    def from_group_name(cls, cluster: Session, worker_cls: type[W], name: str) -> WorkerGroup[W]:
        """Attach to the running group ``name`` (launched by this or another driver).

        Calls through the handle reach the group's workers like the launcher's own;
        ``close()`` on it closes the group for everyone. Inside a worker, use
        ``self.group(name)`` (:meth:`aiorl.Worker.group`) instead.

        Example::

            trainer = WorkerGroup.from_group_name(cluster, Trainer, "trainer")
            trainer.execute_on(0).step().wait()

        Raises:
            GroupNotFoundError: no live group has this name (a ``LookupError``).
        """
        runtime = cluster.runtime
        return runtime.run_sync(cls.from_group_name_async(cluster, worker_cls, name), timeout=30)

    @classmethod
    async def from_group_name_async(cls, cluster: Session, worker_cls: type[W], name: str) -> WorkerGroup[W]:
        """:meth:`from_group_name` for code on the runtime loop's thread (``async def``
        worker methods): it awaits the registry instead of blocking the loop."""
        record = await cluster.runtime.registry.lookup_group(name)
        core = GroupCore(cluster, worker_cls, name, record.world_size)
        await core.watch()
        return WorkerGroup(core)

    def __repr__(self) -> str:
        core = self._core
        ranks = "" if len(self._view_ranks) == core.world_size and self._view_ranks == tuple(
            range(core.world_size)) else f" ranks={list(self._view_ranks)}"
        return f"<WorkerGroup {core.name} x{core.world_size}{ranks} of {core.cls.__name__}>"

    # ------------------------------------------------------------------ calls
    def _call(self, method: str, *args: Any, **kwargs: Any) -> AsyncWork[list[Any]]:
        # Serialize in the caller's thread: errors surface here, and the loop stays free.
        frames = serialization.dumps((args, kwargs)) if args or kwargs else []
        core = self._core
        runtime = core.runtime
        work: AsyncWork[list[Any]] = AsyncWork(runtime.loop)
        if runtime.on_loop_thread():
            core.dispatch(work, method, self._view_ranks, frames, False)
        else:
            prepare_threads(work)  # this thread will likely wait(): mirror ready, no lock
            runtime.submit(core.dispatch, work, method, self._view_ranks, frames, True)
        return work

    def _ready(self) -> AsyncWork[None]:
        return self._core.ready()


_GROUP_ATTRIBUTES = frozenset(
    n for n in dir(WorkerGroup) if not n.startswith("__")
) | {"execute_on", "on_ranks", "close", "aclose", "wait_ready", "from_group_name", "ranks"}
