"""What a group does when a rank dies, and how the driver hears of it.

`Supervision` is the policy given to ``launch(restart=..., max_restarts=...,
backoff=..., fate=..., on_restart=...)``; [`GroupEvent`][aiorl.GroupEvent] is one piece of news
(a death, a restart, a give-up, a membership change) and `GroupEvents` the
stream a driver subscribes to with ``group.events()``. The group core
(`aiorl.group.core`) applies the policy on the runtime loop; this module holds
no process logic.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiorl.errors import WaitTimeout

__all__ = ["EventKind", "GroupEvent", "GroupEvents", "Supervision"]

#: Events a group keeps for subscribers that arrive later (bounded: a long job's history).
HISTORY = 1000
#: The longest pause between two restarts of one rank, however many failed before.
MAX_BACKOFF_S = 30.0


class EventKind(str, enum.Enum):
    """What happened to a group (the ``kind`` of a [`GroupEvent`][aiorl.GroupEvent]).

    Example:
        ```python
        if event.kind is aiorl.EventKind.GAVE_UP:
            print(f"rank {event.rank} will not come back: {event.reason}")
        ```
    """

    DIED = "died"  #: a rank's process ended (or its node was declared dead)
    RESTARTING = "restarting"  #: a replacement for the rank is being started
    RESTARTED = "restarted"  #: the replacement is ready; calls reach it again
    GAVE_UP = "gave_up"  #: the rank will not be restarted (policy, or max_restarts reached)
    TORN_DOWN = "torn_down"  #: ``fate="group"``: every rank stopped because one died
    ADDED = "added"  #: ``add_ranks`` started a rank (epoch changed)
    REMOVED = "removed"  #: ``remove_ranks`` stopped a rank (epoch changed)
    CLOSED = "closed"  #: the group was closed; the stream ends after this event

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class GroupEvent:
    """One piece of news about a group: which rank, which process of it, and why.

    ``incarnation`` is the rank's process count: 0 for its first process, one more
    for each restart (the registry's worker record carries the same number).
    ``epoch`` is the group's membership epoch after the event.

    Example:
        ```python
        for event in group.events():   # an aiorl.GroupEvent each; ends when the group closes
            print(event)               # "rollout:2 died (incarnation 0, epoch 0): ..."
        ```
    """

    kind: EventKind
    group: str
    rank: int | None
    incarnation: int
    epoch: int
    reason: str
    time: float

    def __str__(self) -> str:
        who = self.group if self.rank is None else f"{self.group}:{self.rank}"
        first_line = self.reason.splitlines()[0] if self.reason else ""
        return f"{who} {self.kind} (incarnation {self.incarnation}, epoch {self.epoch})" + (
            f": {first_line}" if first_line else "")


@dataclass(frozen=True)
class Supervision:
    """A group's failure policy (docs/failures.md, "Supervision").

    * ``restart``: ``"never"`` (a dead rank stays dead; its calls fail) or
      ``"on_failure"`` (a rank whose process dies is started again under the same
      name and rank, with the next incarnation; a rank whose ``__init__`` raised is
      not: that would fail again).
    * ``max_restarts``: restarts allowed per rank (per group with ``fate="group"``);
      then the rank gives up and its calls fail with the last death's error.
    * ``backoff``: seconds before a rank's restart, doubling with each further restart
      before it is ready again (at most 30 s); a rank that came up starts over.
    * ``fate``: ``"rank"`` (one rank's death fails only what involves it) or
      ``"group"`` (any death stops every rank: SPMD ranks bound by one communicator;
      with ``restart="on_failure"`` the whole group is started again).
    * ``on_restart``: called on the driver's runtime loop as
      ``on_restart(view, event)`` once a restarted rank is ready, before the calls
      that waited for it are sent: what it calls through ``view`` (that rank alone)
      reaches the new process first. It must not block.
    """

    restart: str = "never"
    max_restarts: int = 3
    backoff: float = 0.5
    fate: str = "rank"
    on_restart: Callable[[Any, GroupEvent], None] | None = None

    def __post_init__(self) -> None:
        if self.restart not in ("never", "on_failure"):
            raise ValueError(f"restart must be 'never' or 'on_failure', got {self.restart!r}")
        if self.fate not in ("rank", "group"):
            raise ValueError(f"fate must be 'rank' or 'group', got {self.fate!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or (
                self.max_restarts < 0):
            raise ValueError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if not self.backoff >= 0:
            raise ValueError(f"backoff must be a number of seconds >= 0, got {self.backoff!r}")
        if self.on_restart is not None and not callable(self.on_restart):
            raise TypeError("on_restart must be a callable(view, event)")

    @property
    def restarts(self) -> bool:
        return self.restart == "on_failure"

    def delay(self, failed_in_a_row: int) -> float:
        """Seconds to wait before a restart that follows ``failed_in_a_row`` restarts that
        did not bring the rank up."""
        return float(min(self.backoff * 2.0 ** failed_in_a_row, MAX_BACKOFF_S))


class GroupEvents:
    """A subscription to a group's events: iterate it (blocking) or ``async for`` it.

    It starts with the events the group already had (up to the last 1,000), then
    follows new ones as they happen; it ends after the group's ``closed`` event.
    `get` takes one event with a timeout. Thread-safe: events arrive on the
    runtime loop, readers may be in any thread.

    Example:
        ```python
        for event in group.events():           # in a thread of its own
            print(event)                       # "rollout:2 died (incarnation 0, ...)"
        ```
    """

    def __init__(self, history: collections.deque[GroupEvent]) -> None:
        self._items: collections.deque[GroupEvent] = collections.deque(history)
        self._changed = threading.Condition()
        self._ended = False  # set once the ``closed`` event has been taken
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def _push(self, event: GroupEvent) -> None:
        with self._changed:
            self._items.append(event)
            self._changed.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_wake, fut)

    def get(self, timeout: float | None = None) -> GroupEvent:
        """The next event; raises [`WaitTimeout`][aiorl.WaitTimeout] if none comes within
        ``timeout`` seconds, and `StopIteration` once the stream has ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while not self._items:
                if self._ended:
                    raise StopIteration
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WaitTimeout(f"no group event within {timeout:g} s")
                self._changed.wait(left)
            return self._take()

    def _take(self) -> GroupEvent:
        event = self._items.popleft()
        if event.kind == EventKind.CLOSED:
            self._ended = True
        return event

    def __iter__(self) -> GroupEvents:
        return self

    def __next__(self) -> GroupEvent:
        return self.get()

    def __aiter__(self) -> GroupEvents:
        return self

    async def __anext__(self) -> GroupEvent:
        loop = asyncio.get_running_loop()
        while True:
            with self._changed:
                if self._items:
                    return self._take()
                if self._ended:
                    raise StopAsyncIteration
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, fut))
            await fut


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
