"""The pure logic of one weighted FIFO queue with waiting putters and getters.

Nothing here does I/O or knows about asyncio: every operation mutates the
queue and returns the list of waiters it completed (:class:`Done`), and the
caller (the channel worker, :mod:`aiorl.channels._server`) delivers them. That
keeps the rules testable in one process and the server free of races.

The rules
    * Items are kept in arrival order with their weights. ``maxsize`` bounds the
      number of queued items (0 = unbounded); a put on a full queue parks its
      putter, and parked putters are admitted in arrival order as space frees.
      Hence: *putters are parked only while the queue is full*, so a new put
      never overtakes a parked one.
    * Getters are served in arrival order. A plain getter takes one item. A batch
      getter of weight ``w`` takes items in FIFO order until their summed weight
      reaches or exceeds ``w``; the first waiting batch getter *reserves* items as
      they arrive, which frees queue space (so a batch heavier than ``maxsize``
      items still completes) and keeps them in order. Hence: *getters wait only
      while the queue is empty*.
    * A cancelled getter gives its reserved items back to the front of the queue;
      items handed out but refused by their receiver come back with
      :meth:`WeightedQueue.unget`, also at the front, so nothing is lost and the
      FIFO order of what remains is kept.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from aiorl.errors import QueueEmpty, QueueFull

__all__ = ["Done", "QueueStats", "WeightedQueue"]

T = TypeVar("T")
W = TypeVar("W", bound=Hashable)


class Done(NamedTuple):
    """A waiter that an operation completed.

    ``items`` is ``None`` for a putter (its item was accepted) and the list of
    ``(item, weight)`` pairs it takes for a getter (one pair for a plain get).
    """

    waiter: Hashable
    items: list[tuple[object, float]] | None


@dataclass(frozen=True)
class QueueStats:
    """A snapshot of one queue (the counters ``statistics()`` reports)."""

    qsize: int
    weight: float
    maxsize: int
    waiting_putters: int
    waiting_getters: int
    reserved: int


@dataclass
class _Getter:
    waiter: Hashable
    batch_weight: float | None  # None: a plain get of exactly one item
    reserved: list[tuple[object, float]] = field(default_factory=list)
    reserved_weight: float = 0.0


@dataclass
class _Putter:
    waiter: Hashable
    item: object
    weight: float


class WeightedQueue(Generic[T]):
    """One FIFO queue of weighted items. See the module docstring for the rules.

    Args:
        maxsize: the most items the queue holds; 0 or less means unbounded.
    """

    def __init__(self, maxsize: int = 0) -> None:
        self.maxsize = max(0, int(maxsize))
        self._items: deque[tuple[object, float]] = deque()
        self._weight = 0.0
        self._putters: deque[_Putter] = deque()
        self._getters: deque[_Getter] = deque()

    # ------------------------------------------------------------------ inspection
    def qsize(self) -> int:
        """Items queued now (not counting items reserved by a waiting batch getter)."""
        return len(self._items)

    @property
    def weight(self) -> float:
        """The summed weight of the queued items."""
        return self._weight

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return self.maxsize > 0 and len(self._items) >= self.maxsize

    def stats(self) -> QueueStats:
        return QueueStats(
            qsize=len(self._items),
            weight=self._weight,
            maxsize=self.maxsize,
            waiting_putters=len(self._putters),
            waiting_getters=len(self._getters),
            reserved=sum(len(g.reserved) for g in self._getters),
        )

    def is_idle(self) -> bool:
        """True when the queue holds nothing and nobody waits on it (it may be dropped)."""
        return not self._items and not self._putters and not self._getters

    # ------------------------------------------------------------------ putting
    def put(self, item: T, weight: float, waiter: Hashable) -> list[Done]:
        """Put ``item``; ``waiter`` is completed (in the result) once the item is accepted."""
        done: list[Done] = []
        if self.full():
            self._putters.append(_Putter(waiter, item, weight))
        else:
            self._append(item, weight)
            done.append(Done(waiter, None))
        self._pump(done)
        return done

    def put_nowait(self, item: T, weight: float) -> list[Done]:
        """Put ``item`` at once or raise :class:`~aiorl.QueueFull`; returns getters it completed."""
        if self.full():
            raise QueueFull(f"the queue is full ({self.maxsize} items)")
        self._append(item, weight)
        done: list[Done] = []
        self._pump(done)
        return done

    # ------------------------------------------------------------------ getting
    def get(self, waiter: Hashable, batch_weight: float | None = None) -> list[Done]:
        """Register a getter: one item (``batch_weight=None``) or a batch of weight ``batch_weight``."""
        if batch_weight is not None and not batch_weight > 0:
            raise ValueError(f"batch_weight must be positive, got {batch_weight!r}")
        self._getters.append(_Getter(waiter, batch_weight))
        done: list[Done] = []
        self._pump(done)
        return done

    def get_nowait(self) -> tuple[tuple[object, float], list[Done]]:
        """Take the first item at once or raise :class:`~aiorl.QueueEmpty`.

        Returns ``((item, weight), putters_admitted)``.
        """
        if not self._items:
            raise QueueEmpty("the queue is empty")
        pair = self._popleft()
        done: list[Done] = []
        self._pump(done)
        return pair, done

    # ------------------------------------------------------------------ withdrawing
    def cancel(self, waiter: Hashable) -> tuple[bool, list[Done]]:
        """Withdraw a parked putter or getter.

        Returns ``(found, done)``: ``found`` is False when ``waiter`` is not
        waiting (it was completed already). A getter's reserved items go back
        to the front of the queue, which may complete other waiters.
        """
        for i, p in enumerate(self._putters):
            if p.waiter == waiter:
                del self._putters[i]
                return True, []
        for i, g in enumerate(self._getters):
            if g.waiter == waiter:
                del self._getters[i]
                done: list[Done] = []
                if g.reserved:
                    self._prepend(g.reserved)
                self._pump(done)
                return True, done
        return False, []

    def unget(self, items: Iterable[tuple[T, float]]) -> list[Done]:
        """Put items handed out earlier back at the front, in their order (maxsize ignored)."""
        items = list(items)
        if not items:
            return []
        head = self._getters[0] if self._getters else None
        if head is not None and head.reserved:
            # The head getter's reservation came after these items: re-queue it behind them.
            reserved, head.reserved, head.reserved_weight = head.reserved, [], 0.0
            self._prepend(reserved)
        self._prepend(items)
        done: list[Done] = []
        self._pump(done)
        return done

    # ------------------------------------------------------------------ internals
    def _append(self, item: object, weight: float) -> None:
        self._items.append((item, weight))
        self._weight += weight

    def _popleft(self) -> tuple[object, float]:
        pair = self._items.popleft()
        self._weight -= pair[1]
        if not self._items:
            self._weight = 0.0  # do not let float error accumulate across refills
        return pair

    def _prepend(self, pairs: list[tuple[object, float]]) -> None:
        self._items.extendleft(reversed(pairs))
        self._weight += sum(w for _, w in pairs)

    def _pump(self, done: list[Done]) -> None:
        """Serve getters and admit putters until neither can progress."""
        items, getters, putters = self._items, self._getters, self._putters
        while True:
            while getters and items:
                g = getters[0]
                if g.batch_weight is None:
                    getters.popleft()
                    done.append(Done(g.waiter, [self._popleft()]))
                    continue
                while items and g.reserved_weight < g.batch_weight:
                    pair = self._popleft()
                    g.reserved.append(pair)
                    g.reserved_weight += pair[1]
                if g.reserved_weight >= g.batch_weight:
                    getters.popleft()
                    done.append(Done(g.waiter, g.reserved))
            admitted = False
            while putters and not self.full():
                p = putters.popleft()
                self._append(p.item, p.weight)
                done.append(Done(p.waiter, None))
                admitted = True
            if not (admitted and getters):
                return
