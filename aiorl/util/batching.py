"""``TurnBatcher``: what leaves for one peer within an event-loop turn leaves together.

Sending costs a system call and a wake-up of the receiver; with hundreds of calls or
messages in flight, one message per item would pay that hundreds of times per turn. A
batcher holds items per key (a peer) and hands each key's list to ``flush`` once, when
the loop turn ends (a callback scheduled once per turn), or earlier when the key holds
``max_items`` items or ``max_bytes`` bytes. Order per key is kept; a caller that must send
something out of band first takes the key's held items (`take`) and sends them ahead.

Each protocol keeps its own packing: ``flush(key, items)`` builds its batch message.
Loop thread only.

``TurnClock`` does the same for many senders of one loop at once (each lane of a process
holds its own messages and sends them when the turn ends), with one end-of-turn callback per
turn for all of them.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar

__all__ = ["TurnBatcher", "TurnClock", "turn_clock_of"]

K = TypeVar("K", bound=Hashable)
I = TypeVar("I")  # noqa: E741 - the item type


class _Bin(Generic[I]):
    __slots__ = ("items", "nbytes")

    def __init__(self) -> None:
        self.items: list[I] = []
        self.nbytes = 0


class TurnBatcher(Generic[K, I]):
    """See the module docstring."""

    __slots__ = ("_loop", "_flush", "_max_items", "_max_bytes", "_bins", "_scheduled", "_turn")

    def __init__(self, loop: asyncio.AbstractEventLoop, flush: Callable[[K, list[I]], None], *,
                 max_items: int = 256, max_bytes: int = 256 * 1024) -> None:
        self._loop = loop
        self._flush = flush
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._bins: dict[K, _Bin[I]] = {}
        self._scheduled = False
        self._turn = False  # something left or was held during this turn

    def first_in_turn(self) -> bool:
        """True once per loop turn: the caller may send its first message at once (no added
        latency for a lone message); later messages of the turn should be added."""
        if self._turn:
            return False
        self._turn = True
        self._schedule()
        return True

    def add(self, key: K, item: I, nbytes: int = 0) -> None:
        """Hold ``item`` for ``key`` until the turn ends (or the key's limits are reached)."""
        held = self._bins.get(key)
        if held is None:
            held = self._bins[key] = _Bin()
            self._schedule()
        held.items.append(item)
        held.nbytes += nbytes
        if len(held.items) >= self._max_items or held.nbytes >= self._max_bytes:
            del self._bins[key]
            self._flush(key, held.items)

    def take(self, key: K) -> list[I]:
        """Remove and return what is held for ``key`` (to send it ahead of something else)."""
        held = self._bins.pop(key, None)
        return held.items if held is not None else []

    def held(self, key: K) -> int:
        held = self._bins.get(key)
        return len(held.items) if held is not None else 0

    def flush_all(self) -> None:
        """Hand every key's held items to ``flush`` now (the end of a turn, or close)."""
        bins, self._bins = self._bins, {}
        for key, held in bins.items():
            self._flush(key, held.items)

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._end_of_turn)

    def _end_of_turn(self) -> None:
        self._scheduled = False
        self._turn = False
        self.flush_all()


class _Holder(Protocol):
    def send_held(self) -> None:
        """Send what this sender held during the turn that just ended."""


class TurnClock:
    """Where one event loop's turn ends, for all of its senders: a sender's first message of
    a turn leaves at once, the rest of that turn's messages together at its end.

    One end-of-turn callback per turn for every sender of the loop: a driver calling 256
    workers of its machine sends the first message of a turn on 256 lanes, and a batcher per
    lane would schedule (and run) 256 callbacks per group call for that. Loop thread only."""

    __slots__ = ("turn", "scheduled", "holding", "__weakref__")

    def __init__(self) -> None:
        self.turn = 1  # a sender's own turn number starts at 0: its first message leaves at once
        self.scheduled = False
        #: Senders that hold messages until the turn ends.
        self.holding: list[_Holder] = []

    def begin(self, loop: asyncio.AbstractEventLoop) -> int:
        """A sender sends its first message of this turn: the turn's number (the turn ends
        with a callback scheduled now if none is)."""
        if not self.scheduled:
            self.scheduled = True
            loop.call_soon(self._end_of_turn)
        return self.turn

    def _end_of_turn(self) -> None:
        self.scheduled = False
        self.turn += 1
        holding, self.holding = self.holding, []
        for sender in holding:
            sender.send_held()


_CLOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TurnClock] = (
    weakref.WeakKeyDictionary())


def turn_clock_of(loop: asyncio.AbstractEventLoop) -> TurnClock:
    """The loop's one `TurnClock`."""
    clock = _CLOCKS.get(loop)
    if clock is None:
        clock = _CLOCKS[loop] = TurnClock()
    return clock
