"""What a driver hears of its groups: one piece of news, the stream of them, and the log a
group keeps of them.

[`GroupEvent`][aiorl.GroupEvent] is one piece of news (a death, a restart, a give-up, a
membership change) and `GroupEvents` the stream a driver subscribes to with
``group.events()``. `EventLog` is a group's side: the events so far (the last `HISTORY`)
and its subscribers, kept on the runtime loop.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import threading
import time
from dataclasses import dataclass

from aiorl.errors import WaitTimeout

__all__ = ["EventKind", "EventLog", "GroupEvent", "GroupEvents"]

#: Events a group keeps for subscribers that arrive later (bounded: a long job's history).
HISTORY = 1000


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


class EventLog:
    """A group's events so far (the last `HISTORY`) and its subscribers (loop thread only).

    The stream ends with the ``closed`` event: subscribers are let go then, and a later
    subscription gets the history alone.
    """

    def __init__(self) -> None:
        self._history: collections.deque[GroupEvent] = collections.deque(maxlen=HISTORY)
        self._subscribers: list[GroupEvents] = []

    @property
    def ended(self) -> bool:
        """The last event is ``closed``."""
        return bool(self._history) and self._history[-1].kind == EventKind.CLOSED

    def add(self, event: GroupEvent) -> None:
        """Keep ``event`` and hand it to every subscriber."""
        self._history.append(event)
        for sub in self._subscribers:
            sub._push(event)
        if event.kind == EventKind.CLOSED:
            self._subscribers.clear()

    def subscribe(self) -> GroupEvents:
        """A new subscription: the events so far, then each new one."""
        sub = GroupEvents(self._history)
        if not self.ended:
            self._subscribers.append(sub)
        return sub
