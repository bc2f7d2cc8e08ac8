"""Receive-side backpressure for CUDA payloads: how many bytes from one sender land at once."""

from __future__ import annotations

import os
from collections import deque
from typing import Any

from aiorl.errors import ProtocolError

__all__ = ["CUDA_INFLIGHT_BYTES", "ByteWindow"]

#: Bytes of CUDA payload a receiver lets land at once from one sender (allocations
#: included); further messages wait, unallocated, until earlier ones complete.
#: ``AIORL_P2P_CUDA_INFLIGHT_MB`` overrides it.
CUDA_INFLIGHT_BYTES = int(os.environ.get("AIORL_P2P_CUDA_INFLIGHT_MB", "1024")) << 20


class ByteWindow:
    """Receive-side backpressure for one sender: at most ``limit`` bytes land at once.

    ``offer(item, nbytes)`` returns True when ``item`` may start now (allocate and land);
    otherwise it waits, in arrival order, and a later `release` hands it back. A
    message larger than the whole window starts alone, once nothing else is in flight,
    so it cannot wait for ever. Pure bookkeeping (no CUDA): unit-tested on its own.
    """

    __slots__ = ("limit", "in_flight", "waiting")

    def __init__(self, limit: int = CUDA_INFLIGHT_BYTES) -> None:
        if limit <= 0:
            raise ValueError("the in-flight byte limit must be positive")
        self.limit = limit
        self.in_flight = 0
        self.waiting: deque[tuple[Any, int]] = deque()

    def _fits(self, nbytes: int) -> bool:
        return self.in_flight == 0 or self.in_flight + nbytes <= self.limit

    def offer(self, item: Any, nbytes: int) -> bool:
        """Start ``item`` now (True, its bytes are counted) or queue it (False)."""
        if not self.waiting and self._fits(nbytes):
            self.in_flight += nbytes
            return True
        self.waiting.append((item, nbytes))
        return False

    def release(self, nbytes: int) -> list[Any]:
        """``nbytes`` landed (or failed): the waiting items that may start now, in order."""
        self.in_flight -= nbytes
        if self.in_flight < 0:
            raise ProtocolError("released more CUDA bytes than were in flight")
        started = []
        while self.waiting and self._fits(self.waiting[0][1]):
            item, n = self.waiting.popleft()
            self.in_flight += n
            started.append(item)
        return started

    def clear(self) -> list[Any]:
        """Forget everything (the pair is gone): the items that never started."""
        waiting = [item for item, _ in self.waiting]
        self.waiting.clear()
        self.in_flight = 0
        return waiting
