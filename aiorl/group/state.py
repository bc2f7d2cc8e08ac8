"""The state of one group on the driver: its rank slots, their readiness, its membership
epoch, its events and its end.

Every [`WorkerGroup`][aiorl.WorkerGroup] view of a group shares one `GroupState` (with the
parts that act on it: `aiorl.group.shared.SharedGroup`). It lives on the runtime loop: it
is mutated only there (calls, registry events, ``close``), so views can be used from any
thread without locks.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from aiorl.errors import PeerLostError
from aiorl.group.group_events import EventKind, EventLog, GroupEvent, GroupEvents
from aiorl.protocol.spawn import WorkerLaunch
from aiorl.runtime import AsyncWork, Runtime, Session
from aiorl.runtime.promise import reject, resolve

__all__ = ["GroupState", "RankSlot", "fresh"]

log = logging.getLogger("aiorl.group")

#: Events logged as warnings; the others are logged at INFO.
_BAD_NEWS = frozenset({EventKind.DIED, EventKind.GAVE_UP, EventKind.TORN_DOWN})


class RankSlot:
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
        #: The earliest call (an `aiorl.group.calls.GroupCall`) of a plain method on this rank
        #: alone that a wait gave up on and that has not answered: what its method thread is
        #: busy with (`describe_timeout`).
        self.stalled: object | None = None

    def fail(self, error: BaseException) -> None:
        """The rank cannot be called: ``error`` is what its calls fail with, those queued
        for it now included."""
        self.error = error
        queued, self.queued = self.queued, []
        for fn in queued:
            fn()


class GroupState:
    """Rank slots, readiness, membership epoch, events and the end of one group (loop only).

    Membership: ``members`` are the ranks of the current ``epoch``. Rank numbers are never
    reused, so ``ranks`` (indexed by rank) only grows; a removed rank keeps its slot with
    the error that says it was removed, so a call of an older epoch that names it fails.
    """

    def __init__(self, session: Session, cls: type, name: str, world_size: int, *,
                 held_weakly: bool = False) -> None:
        self.session = session
        self.runtime: Runtime = session.runtime
        self.cls = cls
        self.name = name
        self.world_size = world_size  # the rank bound: ranks 0..world_size-1 have existed
        self.ranks = [RankSlot() for _ in range(world_size)]
        self.members: tuple[int, ...] = tuple(range(world_size))
        self.epoch = 0
        self.closed = False
        #: What calls made after the end fail with, when not the usual ``PeerLostError`` (a
        #: handle on a group the registry does not know: ``GroupNotFoundError``).
        self.end_error: BaseException | None = None
        #: Runs once the group is over (`mark_closed`): who keeps the group forgets it.
        self.on_end: Callable[[], None] | None = None
        #: Views handed out by ``WorkerGroup.on_ranks``, by (epoch, rank tuple) (cached, bounded).
        self.views: dict[tuple[int, tuple[int, ...]], Any] = {}
        #: Builds a WorkerGroup view of some ranks (set by aiorl.group.group, above us).
        self.view_of: Callable[[tuple[int, ...]], Any] | None = None
        #: This process starts the group (set before the launch runs, so calls made at once
        #: see it): it knows, or will know, where each rank runs. A view attached by name
        #: does not.
        self.launched_here = False
        #: rank -> (node rank, launch) of each rank this process started (empty in a view
        #: attached by name): what a restart or ``add_ranks`` needs to start a process.
        self.launches: dict[int, tuple[int, WorkerLaunch]] = {}
        #: Tasks the group runs on the loop (pending restarts, a watch): strong references.
        self.tasks: set[asyncio.Task[None]] = set()
        self.events = EventLog()
        # The runtime stopping (its Cluster closed, or its embedded registry died) fails what
        # is pending here, queued calls on ranks not ready yet included. ``held_weakly``: the
        # runtime does not keep the group alive (a handle that arrived: its last view's
        # collection ends it).
        self.closer: Callable[[], None] = (_weakly(self._runtime_closed) if held_weakly
                                           else self._runtime_closed)
        self.runtime.on_close(self.closer)

    def nodes(self) -> dict[int, dict[str, Any]]:
        """The cluster's live nodes, by node rank (the driver's node list)."""
        return {n["node_rank"]: n for n in self.session._node_list()}

    def ready(self, ranks: Sequence[int]) -> AsyncWork[None]:
        """A work that completes once every rank of ``ranks`` is ready (fails with the first
        rank's error)."""
        work: AsyncWork[None] = AsyncWork(self.runtime.loop)

        def check() -> None:
            states = [self.ranks[r] for r in ranks]
            waiting = [0]

            def one_ready() -> None:
                for st in states:
                    if st.error is not None:
                        reject(work, fresh(st.error))
                        return
                waiting[0] -= 1
                if waiting[0] == 0:
                    resolve(work, None)

            for st in states:
                if st.error is not None:
                    reject(work, fresh(st.error))
                    return
                if st.address is None:
                    waiting[0] += 1
                    st.queued.append(one_ready)
            if waiting[0] == 0:
                resolve(work, None)

        self.runtime.submit(check)
        return work

    def new_epoch(self) -> None:
        self.epoch += 1
        self.views.clear()  # views name the ranks of their epoch; new ones are made on demand

    # ------------------------------------------------------------------ events
    def emit(self, kind: EventKind, rank: int | None, reason: str) -> GroupEvent:
        """Log one piece of news about the group and hand it to its subscribers."""
        incarnation = self.ranks[rank].incarnation if rank is not None else 0
        event = GroupEvent(kind, self.name, rank, incarnation, self.epoch, reason, time.time())
        level = logging.WARNING if kind in _BAD_NEWS else logging.INFO
        log.log(level, "%s", event)
        self.events.add(event)
        return event

    def subscribe(self) -> GroupEvents:
        """A new subscription: the events so far, then each new one (loop thread only)."""
        return self.events.subscribe()

    # ------------------------------------------------------------------ the end
    async def close(self) -> None:
        self.session.groups.pop(self.name, None)
        try:
            await self.runtime.registry.close_group(self.name, timeout=5)
        finally:
            self.mark_closed(f"worker group {self.name} was closed")

    def _runtime_closed(self) -> None:
        """The runtime is stopping (a runtime closer, on the loop): nothing will be sent or
        answered any more, so what is pending or queued fails now with the reason."""
        self.mark_closed(f"worker group {self.name} can no longer be reached: "
                         f"{self.runtime.closed_reason}")

    def mark_closed(self, reason: str, error: BaseException | None = None) -> None:
        """The group is over: what is pending or queued on any rank fails (with ``error``,
        ``PeerLostError(reason)`` by default), as later calls do, and subscribers hear CLOSED
        (once)."""
        self.closed = True
        if error is not None:
            self.end_error = error
        self.runtime.discard_closer(self.closer)
        for st in self.ranks:
            if st.address is not None:
                self.runtime.endpoint.mark_peer_lost(st.address, reason)
            st.restarting = False
            st.fail(error if error is not None else PeerLostError(reason))
        if not self.events.ended:
            self.emit(EventKind.CLOSED, None, reason)
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` (a bound method) without a strong reference to its object: a no-op once
    the object is collected."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def fresh(error: BaseException) -> BaseException:
    """A copy of a stored error, so each raise gets its own traceback."""
    try:
        return copy.copy(error).with_traceback(None)
    except Exception:  # an exception type that cannot be copied: raise the stored one
        return error
