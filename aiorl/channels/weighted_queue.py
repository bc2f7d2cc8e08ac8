"""The pure logic of one weighted FIFO queue with waiting putters and getters.

Nothing here does I/O or knows about asyncio: every operation mutates the
queue and returns the list of waiters it completed (`Done`), and the
caller (the channel worker, `aiorl.channels.host`) delivers them. That
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
    * Every accepted item gets the next *sequence number* of its queue, and the
      queue is always sorted by it. A cancelled getter gives its reserved items
      back; items handed out but refused by their receiver come back with
      `WeightedQueue.unget`. Both are merged back by sequence number, so
      nothing is lost and the FIFO order is restored whatever order the returns
      arrive in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from aiorl.errors import QueueEmpty, QueueFull

__all__ = ["Done", "Entry", "QueueStats", "QueuedItem", "WeightedQueue"]

T = TypeVar("T")


#: ``(item, weight, sequence number)``: one queued item.
Entry = tuple[object, float, int]


class Done(NamedTuple):
    """A waiter that an operation completed.

    ``items`` is ``None`` for a putter (its item was accepted) and the list of
    entries ``(item, weight, seq)`` it takes for a getter (one for a plain get).
    """

    waiter: Hashable
    items: list[Entry] | None


@dataclass(frozen=True)
class QueueStats:
    """A snapshot of one queue, as ``Channel.statistics()`` reports it.

    Attributes:
        qsize: items queued (not counting ``reserved``).
        weight: the summed weight of the queued items.
        maxsize: the queue's bound (0 = unbounded).
        waiting_putters: puts waiting for room (backpressure).
        waiting_getters: gets and batch gets waiting for items.
        reserved: items already taken by the first waiting ``get_batch``.
    """

    qsize: int
    weight: float
    maxsize: int
    waiting_putters: int
    waiting_getters: int
    reserved: int


class QueuedItem(NamedTuple):
    """One item as ``Channel.peek_all`` shows it: still queued, not taken.

    The attribute names are those of RLinf's ``WeightedItem``, so code that reads
    ``entry.item`` / ``entry.weight`` from a peek keeps working.
    """

    item: object
    weight: float


@dataclass
class _Getter:
    waiter: Hashable
    batch_weight: float | None  # None: a plain get of exactly one item
    reserved: list[Entry] = field(default_factory=list)
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
        self._items: deque[Entry] = deque()  # sorted by sequence number
        self._weight = 0.0
        self._seq = 0
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

    def waiting_putters(self) -> int:
        """Puts parked until the queue has room."""
        return len(self._putters)

    def stats(self) -> QueueStats:
        return QueueStats(
            qsize=len(self._items),
            weight=self._weight,
            maxsize=self.maxsize,
            waiting_putters=len(self._putters),
            waiting_getters=len(self._getters),
            reserved=sum(len(g.reserved) for g in self._getters),
        )

    def peek(self, limit: int = -1) -> list[Entry]:
        """The first ``limit`` queued entries (all when ``limit`` is negative), left in place.

        Items reserved by a waiting batch getter are not shown: like `qsize`,
        a peek shows what a new getter could still take.
        """
        if limit < 0 or limit >= len(self._items):
            return list(self._items)
        return [self._items[i] for i in range(limit)]

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
        """Put ``item`` at once or raise [`QueueFull`][aiorl.QueueFull]; returns getters it
        completed."""
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

    def get_nowait(self) -> tuple[Entry, list[Done]]:
        """Take the first item at once or raise [`QueueEmpty`][aiorl.QueueEmpty].

        Returns ``((item, weight, seq), putters_admitted)``.
        """
        if not self._items:
            raise QueueEmpty("the queue is empty")
        entry = self._popleft()
        done: list[Done] = []
        self._pump(done)
        return entry, done

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
                    self._merge(g.reserved)
                self._pump(done)
                return True, done
        return False, []

    def unget(self, entries: Iterable[Entry]) -> list[Done]:
        """Return entries handed out earlier; they go back to their FIFO places (maxsize ignored)."""
        entries = list(entries)
        if not entries:
            return []
        head = self._getters[0] if self._getters else None
        if head is not None and head.reserved:
            # The head getter may have reserved items newer than these: re-queue its
            # reservation too, so it takes them again in sequence order.
            reserved, head.reserved, head.reserved_weight = head.reserved, [], 0.0
            self._merge(reserved)
        self._merge(entries)
        done: list[Done] = []
        self._pump(done)
        return done

    # ------------------------------------------------------------------ internals
    def _append(self, item: object, weight: float) -> None:
        self._seq += 1
        self._items.append((item, weight, self._seq))
        self._weight += weight

    def _popleft(self) -> Entry:
        entry = self._items.popleft()
        self._weight -= entry[1]
        if not self._items:
            self._weight = 0.0  # do not let float error accumulate across refills
        return entry

    def _merge(self, entries: list[Entry]) -> None:
        """Insert returned entries at their places by sequence number.

        Returned entries were handed out from the front, so they belong near it:
        only the queued entries older than the newest returned one are moved.
        """
        items = self._items
        front: list[Entry] = []
        for entry in sorted(entries, key=lambda e: e[2]):
            while items and items[0][2] < entry[2]:
                front.append(items.popleft())
            front.append(entry)
            self._weight += entry[1]
        items.extendleft(reversed(front))

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
                    entry = self._popleft()
                    g.reserved.append(entry)
                    g.reserved_weight += entry[1]
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
