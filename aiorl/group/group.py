"""``WorkerGroup``: launch a worker class on many processes and call it on all of them.

``launch()`` registers the group, asks the node agents to spawn the processes
and returns at once. A call such as ``group.step(x)`` sends ``step`` to every
rank (or to the ranks of a view: ``group.execute_on(0, 3).step(x)``) and returns
an [`AsyncWork`][aiorl.AsyncWork] whose result is the list of per-rank results in
rank order. Calls made before a rank is ready are queued and sent, in order,
when the registry reports it ready.

Failure: a rank whose ``__init__`` raised fails every call with
[`WorkerInitError`][aiorl.WorkerInitError]; a rank that dies fails pending and
later calls with [`PeerLostError`][aiorl.PeerLostError] naming the rank, its
exit code and its last output lines. The first error of a fan-out call is the
call's error. ``launch(restart="on_failure")`` starts a dead rank again (calls
made meanwhile wait for it); ``fate="group"`` stops every rank when one dies;
``group.events()`` tells the driver (`aiorl.group.group_events`).

Membership: ``add_ranks`` and ``remove_ranks`` start a new epoch and return a
view of its members; a view (and every call made through it) keeps the ranks of
the epoch it was made in.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from aiorl.group import arrivals
from aiorl.group.group_events import GroupEvent, GroupEvents
from aiorl.group.launch import ship_class
from aiorl.group.method_names import check_method_names
from aiorl.group.per_rank import check_per_rank
from aiorl.group.shared import SharedGroup
from aiorl.group.supervision import Supervision
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
from aiorl.runtime.working_dir import WorkingDir
from aiorl.runtime.working_dir import pack as pack_working_dir
from aiorl.transport import serialization

__all__ = ["WorkerClassNotHere", "WorkerGroup", "WorkerGroupBuilder"]

log = logging.getLogger("aiorl.group")
W = TypeVar("W")


class WorkerGroupBuilder(Generic[W]):
    """What ``Worker.create_group(*args, **kwargs)`` returns; ``launch`` starts it.

    Nothing runs until [`launch`][aiorl.group.WorkerGroupBuilder.launch] (or
    [`launch_async`][aiorl.group.WorkerGroupBuilder.launch_async]): the builder only holds
    the worker class and the arguments each rank's ``__init__`` will get.

    Args:
        cls: The worker class (a subclass of [`Worker`][aiorl.Worker]).
        args: Positional arguments of ``cls(*args, **kwargs)`` on every rank.
        kwargs: Keyword arguments of ``cls(*args, **kwargs)`` on every rank.
        base: The framework class ``cls`` derives from; its own attributes may share a name
            with a [`WorkerGroup`][aiorl.WorkerGroup] attribute.

    Raises:
        ValueError: A public method of ``cls`` would be hidden by a
            [`WorkerGroup`][aiorl.WorkerGroup] attribute of the same name, or re-defines
            ``base``'s API without ``@typing.override``; one error names them all.

    Example:
        ```python
        builder = Trainer.create_group(cfg)        # nothing runs yet
        trainer = builder.launch(cluster, "0-7", name="trainer")
        ```
    """

    def __init__(self, cls: type[W], args: tuple[Any, ...], kwargs: dict[str, Any],
                 base: type = object) -> None:
        # ``base`` is the framework class the worker derives from (aiorl.Worker): its own
        # attributes may share a name with a group attribute (``world_size``) on purpose.
        check_method_names(cls, base, _GROUP_ATTRIBUTES)
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
        restart: str = "never",
        max_restarts: int = 3,
        backoff: float = 0.5,
        fate: str = "rank",
        on_restart: Callable[[WorkerGroup[W], GroupEvent], None] | None = None,
        working_dir: WorkingDir | str | os.PathLike[str] | None = None,
    ) -> WorkerGroup[W]:
        """Start the group's processes and return at once (calls wait for readiness).

        Where the ranks go, from the first of these that is given:

        * ``placement_strategy``: a strategy from `aiorl.placement`, or a
          placement string (``"0-3"``: one rank per accelerator 0-3, docs/placement.md);
        * ``num_workers=N``: one rank per accelerator on the first ``N`` accelerators
          (node 0's first, as torchrun fills a node) when the cluster declares
          accelerators; otherwise ``N`` CPU processes spread over the nodes in
          contiguous blocks (ranks ``0..k-1`` on node 0, the next block on node 1, ...);
        * neither: one rank per declared accelerator, or one rank on node 0.

        ``isolate_gpu=False`` (RLinf's name) shows every rank all accelerators of its node
        instead of only its own, with ``LOCAL_RANK`` set to its device id.

        Supervision (docs/failures.md): ``restart="on_failure"`` starts a rank whose process
        died again, same name and rank, next incarnation, up to ``max_restarts`` times per
        rank, ``backoff`` seconds after the death (doubling each time); calls pending on the
        dead process fail with ``PeerLostError``, later ones wait for the new one.
        ``fate="group"`` stops every rank when one dies (with ``restart="on_failure"``:
        restarts them all). ``on_restart(view, event)`` runs on the driver's runtime loop
        when a restarted rank is ready, before the calls that waited for it.
        See `aiorl.group.supervision.Supervision`.

        Args:
            cluster: The [`Cluster`][aiorl.Cluster] (or, inside a worker, the worker's
                session) that runs the group.
            placement_strategy: Where the ranks go: a placement strategy such as
                [`PackedPlacementStrategy`][aiorl.placement.PackedPlacementStrategy], a
                placement string or int (``"0-3"``, ``2``), or None for ``num_workers`` or
                the default. Not together with ``num_workers``.
            name: The group's name, unique among live groups; the worker class's name by
                default.
            num_workers: How many ranks, placed as above (one per accelerator, or CPU
                processes spread over the nodes). Not together with ``placement_strategy``.
            env: Environment variables set in every rank's process.
            isolate_gpu: True: each rank sees only its own accelerators; False: all of its
                node's, with ``LOCAL_RANK`` set to its device id.
            restart: ``"never"`` (a dead rank stays dead) or ``"on_failure"`` (start it
                again, up to ``max_restarts`` times).
            max_restarts: With ``restart="on_failure"``, how many times each rank is
                restarted before the group gives up on it (an
                [`EventKind.GAVE_UP`][aiorl.EventKind] event).
            backoff: Seconds between a death and the restart, doubled for each further
                restart of the rank (at most 30 s).
            fate: ``"rank"`` (a death concerns only that rank) or ``"group"`` (every rank is
                stopped when one dies, and with ``restart="on_failure"`` all restarted).
            on_restart: ``on_restart(view, event)``, called on the driver's runtime loop when
                a restarted rank is ready, before the calls that waited for it.
            working_dir: A directory (or an [`aiorl.WorkingDir`][aiorl.WorkingDir]) packed
                now and shipped to the nodes of the ranks, first on their ``sys.path``
                (docs/deploy.md); the cluster's ``working_dir`` by default.

        Returns:
            The [`WorkerGroup`][aiorl.WorkerGroup], at once; its calls wait until the ranks
                they address are ready.

        Raises:
            GroupExistsError: a live group already has ``name`` (a ``ValueError``).
            PlacementError: a placement the cluster cannot hold (a ``ValueError``).
            TypeError: ``placement_strategy`` is not a strategy, string or int, both it
                and ``num_workers`` are given, or ``on_restart`` is not callable.
            ValueError: ``restart``, ``fate``, ``max_restarts`` or ``backoff`` is invalid.
            WorkingDirError: ``working_dir`` is over its size limit or holds a symbolic
                link that leaves it (a ``ValueError``); nothing was started.
            ClusterClosedError: ``cluster`` is closed (a ``RuntimeError``).

        Example:
            ```python
            group = Rollout.create_group(cfg).launch(cluster, num_workers=4, name="rollout")
            group = Trainer.create_group(cfg).launch(cluster, "0-3", name="trainer")
            ```
        """
        supervision = Supervision(restart, max_restarts, backoff, fate, on_restart)
        request, start = self._plan(cluster, placement_strategy, name, num_workers, env,
                                    isolate_gpu, supervision, working_dir=working_dir)
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
        restart: str = "never",
        max_restarts: int = 3,
        backoff: float = 0.5,
        fate: str = "rank",
        on_restart: Callable[[WorkerGroup[W], GroupEvent], None] | None = None,
        working_dir: WorkingDir | str | os.PathLike[str] | None = None,
    ) -> WorkerGroup[W]:
        """[`launch`][aiorl.group.WorkerGroupBuilder.launch] for code on the runtime loop's
        thread (``async def`` worker methods; channels launch their host from there): it
        awaits the registry instead of blocking the loop.

        Args:
            cluster: The [`Cluster`][aiorl.Cluster], or the worker's session.
            placement_strategy: A placement strategy, placement string or int, or None
                (as in `launch`).
            name: The group's name; the worker class's name by default.
            num_workers: How many ranks (as in `launch`).
            env: Environment variables set in every rank's process.
            isolate_gpu: Whether each rank sees only its own accelerators.
            restart: ``"never"`` or ``"on_failure"``.
            max_restarts: Restarts per rank before the group gives up on it.
            backoff: Seconds from a death to the restart, doubled for each further one.
            fate: ``"rank"`` or ``"group"`` (every rank stops when one dies).
            on_restart: ``on_restart(view, event)``, called when a restarted rank is ready.
            working_dir: A directory shipped to the ranks' nodes (as in `launch`).

        Returns:
            The [`WorkerGroup`][aiorl.WorkerGroup], once the registry has accepted it.

        Raises:
            GroupExistsError: a live group already has ``name`` (a ``ValueError``).
            PlacementError: a placement the cluster cannot hold (a ``ValueError``).
            TypeError: the placement arguments are wrong (see `launch`).
            ValueError: ``restart``, ``fate``, ``max_restarts`` or ``backoff`` is invalid.

        Example:
            ```python
            from aiorl.runtime.session import WorkerSession

            class Grower(aiorl.Worker):
                async def grow(self):              # on the worker's event loop
                    session = WorkerSession.current()
                    self.helper = await Helper.create_group().launch_async(
                        session, num_workers=2, name="helper")
            ```
        """
        supervision = Supervision(restart, max_restarts, backoff, fate, on_restart)
        request, start = self._plan(cluster, placement_strategy, name, num_workers, env,
                                    isolate_gpu, supervision, working_dir=working_dir)
        await cluster.runtime.registry.create_group(request)
        return start()

    def _plan(self, cluster: Session, placement_strategy: PlacementStrategy | str | int | None,
              name: str | None, num_workers: int | None, env: dict[str, str] | None,
              isolate_gpu: bool, supervision: Supervision,
              working_dir: WorkingDir | str | os.PathLike[str] | None = None,
              ) -> tuple[GroupSpec, Callable[[], WorkerGroup[W]]]:
        """The registry's create_group request, and what starts the group once it succeeded."""
        group_name = name if name is not None else self.cls.__name__
        WorkerAddress(group_name)  # validates the name
        spec = cluster.spec
        strategy = _strategy(spec, placement_strategy, num_workers, group_name)
        # Custom strategies written for get_placement(spec) keep working when isolating.
        placements = (strategy.get_placement(spec) if isolate_gpu
                      else strategy.get_placement(spec, isolate_accelerator=False))
        check_per_rank(self.cls.__name__, self.args, self.kwargs, len(placements))
        runtime = cluster.runtime
        # Packed before anything is registered or started: a directory over its limit, or
        # with a link out of it, fails the launch here. A class whose module lies inside it
        # is imported by name on the nodes, from their copy.
        shipped = (pack_working_dir(WorkingDir.of(working_dir)) if working_dir is not None
                   else getattr(cluster, "working_dir", None))
        payload = ship_class(self.cls, self.args, self.kwargs, shipped)
        request = GroupSpec(group_name, len(placements), cluster.driver_id,
                            f"{self.cls.__module__}.{self.cls.__qualname__}")

        def start() -> WorkerGroup[W]:
            cluster.groups[group_name] = request  # restored if the registry restarts
            shared = SharedGroup(cluster, self.cls, group_name, len(placements), supervision)
            shared.launched_here = True
            shared.launcher.working_dir = shipped
            group: WorkerGroup[W] = WorkerGroup(shared)
            runtime.submit(
                lambda: runtime.loop.create_task(shared.start(placements, payload, env or {})))
            return group

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
    [`AsyncWork`][aiorl.AsyncWork] of the per-rank results, in the view's rank order.
    [`on_ranks`][aiorl.WorkerGroup.on_ranks] (alias [`execute_on`][aiorl.WorkerGroup.execute_on])
    returns a view of some ranks; it does not change this object, so ``group.execute_on(0).step()``
    followed by ``group.step()`` calls rank 0, then every rank.

    Example:
        ```python
        group = Rollout.create_group(cfg).launch(cluster, num_workers=4, name="rollout")
        results = group.generate(8).wait()            # [r0, r1, r2, r3]
        first = await group.execute_on(0, 3).generate(1)   # [r0, r3], in a coroutine
        group.close()
        ```
    """

    _VIEW_CACHE_SIZE = 64

    def __init__(self, shared: SharedGroup, ranks: tuple[int, ...] | None = None) -> None:
        self._shared = shared
        #: The group's members and epoch when this view was made: its calls use them.
        self._members = shared.members
        self._epoch = shared.epoch
        self._view_ranks = ranks if ranks is not None else self._members
        if shared.view_of is None:  # the first view: teach the group to make more (hooks)
            shared.view_of = functools.partial(WorkerGroup, shared)

    # ------------------------------------------------------------------ public surface
    @property
    def worker_group_name(self) -> str:
        """The group's name (``launch(name=...)``, the class name by default)."""
        return self._shared.name

    @property
    def world_size(self) -> int:
        """The number of ranks in the whole group at this view's epoch (not in this view)."""
        return len(self._members)

    @property
    def epoch(self) -> int:
        """The membership epoch this view belongs to: 0 at launch, one more for each
        [`add_ranks`][aiorl.WorkerGroup.add_ranks] or
        [`remove_ranks`][aiorl.WorkerGroup.remove_ranks]."""
        return self._epoch

    @property
    def members(self) -> tuple[int, ...]:
        """The group's ranks at this view's epoch (rank numbers are never reused, so after
        a ``remove_ranks`` they need not be ``0..world_size-1``)."""
        return self._members

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks this view calls, in result order."""
        return self._view_ranks

    @property
    def worker_cls(self) -> type[W]:
        """The worker class whose methods this group calls."""
        return self._shared.cls

    @property
    def worker_info_list(self) -> list[WorkerInfo]:
        """The [`WorkerInfo`][aiorl.WorkerInfo] of every rank of the group, in rank order, as the
        workers registered it (node, pid, accelerators, endpoint). Waits until every
        rank is ready; call it from synchronous code, not from the runtime loop."""
        self.wait_ready()
        shared = self._shared
        record = shared.runtime.run_sync(shared.runtime.registry.lookup_group(shared.name),
                                         timeout=30)
        return [record.workers[f"{shared.name}:{rank}"].info for rank in self._members]

    def on_ranks(self, *ranks: int | list[int] | tuple[int, ...]) -> WorkerGroup[W]:
        """A view that calls only ``ranks`` (results in the order given); views are cached.

        Also spelt [`execute_on`][aiorl.WorkerGroup.execute_on] (RLinf's name). The view
        keeps this view's epoch: its members are this view's members.

        Args:
            *ranks: Ranks of the group, each an int or a list or tuple of ints
                (``on_ranks(0, 3)``, ``on_ranks([0, 3])``).

        Returns:
            A [`WorkerGroup`][aiorl.WorkerGroup] view whose calls go to ``ranks`` only, in
                that order; this object is not changed.

        Raises:
            IndexError: a rank is not a member of the group at this view's epoch.

        Example:
            ```python
            first, last = group.on_ranks(0, 3).generate(1).wait()   # ranks 0 and 3
            ```
        """
        flat = tuple(r for item in ranks for r in (item if isinstance(item, (list, tuple)) else [item]))
        views = self._shared.views
        key = (self._epoch, flat)
        view = views.get(key)
        if view is None:
            for r in flat:
                if r not in self._members:
                    raise IndexError(f"rank {r} is not a member of group {self._shared.name} "
                                     f"at epoch {self._epoch} (members: {list(self._members)})")
            view = WorkerGroup(self._shared, flat)
            view._members, view._epoch = self._members, self._epoch
            if len(views) >= self._VIEW_CACHE_SIZE:  # bounded: drop the oldest view
                views.pop(next(iter(views)))
            views[key] = view
        return view

    execute_on = on_ranks
    """``execute_on(*ranks: int | list[int] | tuple[int, ...]) -> WorkerGroup[W]``: the same
    method as [`on_ranks`][aiorl.WorkerGroup.on_ranks], under RLinf's name.

    A view that calls only ``ranks`` (results in the order given); it does not change this
    object. Raises ``IndexError`` when a rank is not a member at this view's epoch.

    Example:
        ```python
        result = group.execute_on(0).step().wait()      # [r0]
        ```
    """

    def __getitem__(self, rank: int) -> WorkerGroup[W]:
        """``group[i]`` is ``group.execute_on(i)``: a view of rank ``i`` (Ray users index a
        list of actor handles so). A slice or anything but an int is refused: say the ranks
        to ``execute_on``."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(
                f"group[{rank!r}]: index a WorkerGroup with one rank (group[3] is "
                "group.execute_on(3)); for several, group.execute_on(0, 3) or "
                "group.execute_on(list_of_ranks)")
        return self.on_ranks(rank)

    def __reduce__(self) -> tuple[Any, ...]:
        """Sent as an argument (or result), a handle arrives as the receiving worker's own
        handle on the same group, as an actor handle does in Ray: by name, through the
        registry, with the class when that process has imported it. Its locks and its
        runtime stay here."""
        shared = self._shared
        ranks = None if self._view_ranks == self._members else self._view_ranks
        return (_group_arriving, (shared.name, shared.cls.__module__, shared.cls.__qualname__,
                                  shared.world_size, ranks))

    def __getattr__(self, method: str) -> Callable[..., AsyncWork[list[Any]]]:
        if method.startswith("_"):
            raise AttributeError(f"{method!r} is private: only public worker methods can be called")
        cls = self._shared.cls
        fn = getattr(cls, method, None)
        ray_remote = method == "remote" and getattr(fn, "__self__", None) is cls
        if fn is None or not callable(fn) or ray_remote:
            if method == "remote":  # Worker.remote is a classmethod that refuses Ray's call
                raise AttributeError(
                    f"a WorkerGroup has no .remote (Ray's spelling): call a method directly, "
                    f"group.step(x), which calls every rank and returns an AsyncWork; "
                    f"Actor.remote(...) is {cls.__name__}.create_group(...).launch(cluster)")
            raise AttributeError(f"{cls.__name__} has no method {method!r}")
        calls = self._shared.calls
        dispatch = calls.dispatch_remembered if method in calls.replayed else calls.dispatch
        call = functools.partial(self._call, dispatch, method)
        functools.update_wrapper(call, fn)
        # Ray's group.step.remote(x): the same call, answered with its spelling here.
        call.remote = functools.partial(_ray_remote, cls.__name__, method)  # type: ignore[attr-defined]
        # Cached on the view: later look-ups skip __getattr__ (a hot path).
        self.__dict__[method] = call
        return call

    def wait_ready(self, timeout: float | None = 60) -> None:
        """Block until every rank is ready (raises WorkerInitError / PeerLostError)."""
        self._ready().wait(timeout)

    async def async_wait_ready(self) -> None:
        """[`wait_ready`][aiorl.WorkerGroup.wait_ready] for coroutines: ``await
        group.async_wait_ready()``."""
        await self._ready()

    # ------------------------------------------------------------------ supervision
    def events(self) -> GroupEvents:
        """Subscribe to the group's events: deaths, restarts, give-ups, tear-downs and
        membership changes ([`GroupEvent`][aiorl.GroupEvent]), those so far
        first. Iterate it (blocking, e.g. in a thread that shows them) or ``async for``
        it; it ends when the group closes.

        Example:
            ```python
            events = group.events()
            event = events.get(timeout=10)   # GroupEvent(kind=EventKind.DIED, rank=2, ...)
            ```
        """
        shared = self._shared
        if shared.runtime.on_loop_thread():
            return shared.subscribe()

        async def subscribe() -> GroupEvents:
            return shared.subscribe()

        return shared.runtime.run_sync(subscribe(), timeout=10)

    def incarnation(self, rank: int) -> int:
        """Which process of ``rank`` the group calls now: 0, then one more per restart."""
        return self._shared.ranks[rank].incarnation

    # ------------------------------------------------------------------ membership
    def add_ranks(self, n: int, placement: PlacementStrategy | str | int | None = None,
                  ) -> WorkerGroup[W]:
        """Start ``n`` more ranks and return a view of the new epoch's members.

        The new ranks are numbered after the highest rank the group has had; ``placement``
        places them like ``launch``'s ``placement_strategy`` (its ranks 0..n-1 become the
        new ranks); by default they spread over the nodes like ``num_workers=n``. Calls
        through this view (and older views) keep their epoch's members: a call already
        running is not widened. Calls to the new ranks wait until they are ready.

        Raises:
            PlacementError: the cluster cannot hold the placement.
            RuntimeError: this process did not launch the group.
        """
        shared = self._shared
        strategy = _strategy(shared.session.spec, placement, None if placement is not None
                             else n, shared.name)
        placements = strategy.get_placement(shared.session.spec)
        if len(placements) != n:
            raise PlacementError(f"add_ranks({n}) of group {shared.name}: the placement gives "
                                 f"{len(placements)} ranks")
        if shared.runtime.on_loop_thread():
            raise RuntimeError("add_ranks blocks; from the runtime loop use add_ranks_async")
        shared.runtime.run_sync(shared.add_ranks(placements), timeout=60)
        return WorkerGroup(shared)

    async def add_ranks_async(self, n: int, placement: PlacementStrategy | str | int | None = None,
                              ) -> WorkerGroup[W]:
        """[`add_ranks`][aiorl.WorkerGroup.add_ranks] for coroutines on the runtime loop's
        thread."""
        shared = self._shared
        strategy = _strategy(shared.session.spec, placement, None if placement is not None
                             else n, shared.name)
        await shared.add_ranks(strategy.get_placement(shared.session.spec))
        return WorkerGroup(shared)

    def remove_ranks(self, ranks: int | list[int] | tuple[int, ...]) -> WorkerGroup[W]:
        """Stop ``ranks`` and return a view of the new epoch's members.

        Work pending on a removed rank fails with ``PeerLostError`` at once (a call of an
        earlier epoch that names it, too); its process gets SIGTERM, then SIGKILL after 1 s.

        Raises:
            IndexError: a rank is not a member now.
            RuntimeError: this process did not launch the group.
        """
        shared = self._shared
        flat = (ranks,) if isinstance(ranks, int) else tuple(ranks)

        async def remove() -> None:
            shared.remove_ranks(flat)

        if shared.runtime.on_loop_thread():
            shared.remove_ranks(flat)
        else:
            shared.runtime.run_sync(remove(), timeout=10)
        return WorkerGroup(shared)

    def refreshed(self) -> WorkerGroup[W]:
        """A view of the group's members at its newest epoch (this view if it is current)."""
        shared = self._shared
        return self if shared.epoch == self._epoch and self._view_ranks == self._members else (
            WorkerGroup(shared))

    def close(self) -> None:
        """Stop the group's processes (all ranks, whatever the view).

        Pending and later calls fail with PeerLostError.
        """
        shared = self._shared
        if shared.closed:
            return
        shared.closed = True
        try:
            shared.runtime.run_sync(shared.close(), timeout=10)
        except Exception as exc:  # the cluster may be closing too; the agents still kill everything
            log.debug("closing group %s: %s", shared.name, exc)

    async def aclose(self) -> None:
        """[`close`][aiorl.WorkerGroup.close] for coroutines: ``await group.aclose()``."""
        shared = self._shared
        if shared.closed:
            return
        shared.closed = True
        if shared.runtime.on_loop_thread():
            await shared.close()
        else:
            await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(shared.close(), shared.runtime.loop))

    @classmethod
    def from_group_name(cls, cluster: Session, worker_cls: type[W], name: str) -> WorkerGroup[W]:
        """Attach to the running group ``name`` (launched by this or another driver).

        Calls through the handle reach the group's workers like the launcher's own;
        ``close()`` on it closes the group for everyone. Inside a worker, use
        ``self.group(name)`` ([`aiorl.Worker.group`][aiorl.Worker.group]) instead.

        Example:
            ```python
            trainer = WorkerGroup.from_group_name(cluster, Trainer, "trainer")
            trainer.execute_on(0).step().wait()
            ```

        Raises:
            GroupNotFoundError: no live group has this name (a ``LookupError``).
        """
        runtime = cluster.runtime
        return runtime.run_sync(cls.from_group_name_async(cluster, worker_cls, name), timeout=30)

    @classmethod
    async def from_group_name_async(cls, cluster: Session, worker_cls: type[W], name: str) -> WorkerGroup[W]:
        """[`from_group_name`][aiorl.WorkerGroup.from_group_name] for code on the runtime loop's
        thread (``async def`` worker methods): it awaits the registry instead of blocking the
            loop."""
        record = await cluster.runtime.registry.lookup_group(name)
        shared = SharedGroup(cluster, worker_cls, name, record.world_size)
        await shared.watch()
        return WorkerGroup(shared)

    def __repr__(self) -> str:
        shared = self._shared
        ranks = "" if self._view_ranks == self._members else f" ranks={list(self._view_ranks)}"
        epoch = f" epoch={self._epoch}" if self._epoch else ""
        return (f"<WorkerGroup {shared.name} x{len(self._members)}{ranks}{epoch} of "
                f"{shared.cls.__name__}>")

    # ------------------------------------------------------------------ calls
    def _call(self, dispatch: Callable[..., None], method: str, *args: Any,
              **kwargs: Any) -> AsyncWork[list[Any]]:
        # Serialize in the caller's thread: errors surface here, and the loop stays free.
        frames = serialization.dumps_arguments(method, args, kwargs) if args or kwargs else []
        runtime = self._shared.runtime
        work: AsyncWork[list[Any]] = AsyncWork(runtime.loop)
        if runtime.on_loop_thread():
            dispatch(work, method, self._view_ranks, frames, False)
        else:
            prepare_threads(work)  # this thread will likely wait(): mirror ready, no lock
            runtime.submit(dispatch, work, method, self._view_ranks, frames, True)
        return work

    def _ready(self) -> AsyncWork[None]:
        return self._shared.ready(self._view_ranks)


_GROUP_ATTRIBUTES = frozenset(
    n for n in dir(WorkerGroup) if not n.startswith("__")
) | {"execute_on", "on_ranks", "close", "aclose", "wait_ready", "from_group_name", "ranks",
   "events", "add_ranks", "remove_ranks", "epoch", "members", "incarnation", "refreshed"}


def _ray_remote(cls_name: str, method: str, *args: Any, **kwargs: Any) -> Any:
    raise TypeError(
        f"group.{method}.remote(...) is Ray's spelling: in aiorl call group.{method}(...) "
        f"directly. It calls every rank of the group and returns an AsyncWork of their results "
        f"(.wait(), or await it); group.execute_on(i).{method}(...) calls rank i only")


class _AnyMethod(type):
    """Metaclass of `WorkerClassNotHere`: every public attribute is a method."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def remote_method(*args: Any, **kwargs: Any) -> Any:
            raise TypeError(f"{name} runs in the worker; call it through a WorkerGroup")

        remote_method.__name__ = remote_method.__qualname__ = name
        return remote_method


class WorkerClassNotHere(metaclass=_AnyMethod):
    """Stands for the worker class of a group handle where the process does not have it (a
    handle received as an argument, [`Worker.group`][aiorl.Worker.group] without
    ``worker_cls``): any public method name is sent, and the worker answers a misspelt one."""


def _group_arriving(name: str, module: str, qualname: str, world_size: int,
                    ranks: tuple[int, ...] | None) -> WorkerGroup[Any]:
    """Rebuild a `WorkerGroup` handle sent from another process (its ``__reduce__``).

    Unpickling may run on the event loop, so nothing here waits: the handle looks its group
    up through the registry (`aiorl.group.arrivals`), and calls made through it before the
    registry's answer are queued, as calls to ranks not ready yet are; a group the registry
    does not know fails them with GroupNotFoundError."""
    from aiorl.runtime.session import WorkerSession

    try:
        session = WorkerSession.current()
    except RuntimeError:
        raise RuntimeError(
            f"a handle on worker group {name!r} arrived in a process that is not an aiorl "
            f"worker: in a driver, attach by name with WorkerGroup.from_group_name(cluster, "
            f"Cls, {name!r})") from None
    shared = arrivals.arrived(session.runtime, name)
    if shared is None:
        cls: Any = sys.modules.get(module)
        for part in qualname.split("."):
            cls = getattr(cls, part, None)
        if not isinstance(cls, type):
            cls = WorkerClassNotHere
        shared = arrivals.arrive(session, cls, name, world_size)
    group: WorkerGroup[Any] = WorkerGroup(shared)
    return group if ranks is None else group.on_ranks(ranks)
