"""Flow control of one pair: how much a Sender may have out before it waits.

A `Window` counts bytes charged against a limit. A message may go while the count is
under the limit, whatever its size, so a pair has at most the limit plus one message
out; a send that finds the window spent waits in the Sender's backlog, in order, until
the receiver releases some. Two windows use it:

* a relayed pair's credit (`aiorl.p2p.p2p_relay.RelayRoute`): bytes the receiver has not
  read yet, released as its loop reads them (what the node agents hold for the pair);
* every pair's `ReceiveWindow`, direct or relayed: messages the receiver holds that no
  receive has taken yet, released as receives take them (``p2p.taken``, a count), so that
  a sender faster than its receiver's receives cannot fill the receiver's memory (or its
  GPU's, or the sender's shared-memory pool) without bound. ``AIORL_P2P_WINDOW`` sets its
  limit.

A relayed pair's Sender waits while either of its two is spent.
"""

from __future__ import annotations

import asyncio
import bisect
import os
from collections.abc import Mapping
from typing import Final

from aiorl.p2p.settings import BATCH_MAX_BYTES, BATCH_MAX_MSGS
from aiorl.util.settings import count_setting

__all__ = ["DEFAULT_RECEIVE_WINDOW", "MESSAGE_COST", "ReceiveWindow", "Window", "receive_window"]

#: Bytes of one sender's messages a receiver may hold that no receive has taken. 1 GiB: the
#: shared-memory pool's bound toward one receiver, and far more than a receiver that keeps up
#: ever holds (a sender waits only for one that fell a gigabyte behind).
DEFAULT_RECEIVE_WINDOW: Final = 1 << 30
#: What each message counts besides its payload's bytes: what holding a small message costs
#: the receiver (its objects, its frame), so a million tiny messages are bounded too.
MESSAGE_COST: Final = 1024


def receive_window(environ: Mapping[str, str] = os.environ) -> int:
    """``AIORL_P2P_WINDOW`` (bytes a receiver may hold untaken from one sender), else the
    default.

    Raises ValueError for a value that is not a positive integer: 0 would stop every pair,
    and a typo must not silently lift the bound.
    """
    value = count_setting(environ, "AIORL_P2P_WINDOW", DEFAULT_RECEIVE_WINDOW, "a byte count")
    if value == 0:
        raise ValueError("AIORL_P2P_WINDOW must be > 0 bytes (0 would stop every pair)")
    return value


class Window:
    """Bytes charged against ``limit``; `wait_room` resolves at the next `release`."""

    __slots__ = ("limit", "outstanding", "open_below", "_waiter")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: Bytes charged that have not been released.
        self.outstanding = 0
        #: Below this, any message may go, whatever a batch queued to leave holds: the
        #: Sender's test per send is then one comparison (`has_room` counts the batch).
        self.open_below = limit - BATCH_MAX_BYTES - MESSAGE_COST * BATCH_MAX_MSGS
        self._waiter: asyncio.Future[None] | None = None

    def has_room(self, queued: int = 0) -> bool:
        """Whether a message may go now (``queued``: bytes already batched to go)."""
        return self.outstanding + queued < self.limit

    def wait_room(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """Resolves at the next `release` (or `wake`: the pair is lost)."""
        if self._waiter is None or self._waiter.done():
            self._waiter = loop.create_future()
        return self._waiter

    def release(self, nbytes: int) -> None:
        """``nbytes`` are free again: messages may use them."""
        self.outstanding = max(0, self.outstanding - nbytes)
        self.wake()

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class ReceiveWindow(Window):
    """A pair's messages that the receiver holds untaken, each charged its cost
    (payload bytes plus `MESSAGE_COST`) when it leaves; the receiver says how many of them
    receives took, in order (its receives take messages in the order they were sent), and
    the costs of that many are released.

    Kept as running totals per charge (a message, or a batch of small ones whose messages
    count an equal share of its total), so that neither a batch nor a grant of thousands of
    messages costs a step per message."""

    __slots__ = ("_counts", "_ends", "_first", "_before", "_sent", "_charged", "_taken",
                 "_released")

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self._counts: list[int] = []  # messages charged, in all, after each charge
        self._ends: list[int] = []  # bytes charged, in all, after each charge
        self._first = 0  # the first charge not wholly taken
        self._before = (0, 0)  # (messages, bytes) of the charges dropped from the lists
        self._sent = self._charged = 0
        self._taken = self._released = 0

    def charge(self, cost: int) -> None:
        """A message of ``cost`` left toward the receiver."""
        self.charge_batch(1, cost)

    def charge_batch(self, count: int, total: int) -> None:
        """``count`` messages costing ``total`` in all left toward the receiver."""
        self._sent += count
        self._charged += total
        self._counts.append(self._sent)
        self._ends.append(self._charged)
        self.outstanding += total

    def taken(self, count: int) -> None:
        """Receives took the ``count`` oldest messages (more than were charged: all)."""
        target = min(self._taken + count, self._sent)
        if target <= self._taken:
            return
        counts, ends = self._counts, self._ends
        i = bisect.bisect_left(counts, target, self._first)  # the charge holding ``target``
        n0, b0 = (counts[i - 1], ends[i - 1]) if i else self._before
        upto = b0 + (ends[i] - b0) * (target - n0) // (counts[i] - n0)
        freed, self._released, self._taken = upto - self._released, upto, target
        self._first = i if counts[i] > target else i + 1
        if self._first > 1024 and 2 * self._first > len(counts):  # drop the taken charges
            self._before = (counts[self._first - 1], ends[self._first - 1])
            del counts[: self._first], ends[: self._first]
            self._first = 0
        self.release(freed)
