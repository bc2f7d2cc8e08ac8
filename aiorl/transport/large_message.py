"""A large message on a lane, read into memory of its own and handed out without a copy.

A lane (`aiorl.transport.lane.LaneConnection`) reads messages into one buffer and copies each
frame out of it. For a message of `LARGE_MESSAGE` bytes or more (a tensor in a call or its
result) each such copy costs as much as the transfer, and so does growing the buffer for it
and rebuilding a tensor from read-only bytes. Such a message is read instead into memory of
its own (uninitialised, from the allocator, which reuses what the last one gave back):

* **Bounded by what arrived:** the memory holds at most `GROWTH` times the bytes that have
  arrived plus one read's room, never what the message's head announces (a peer's claim),
  and never more than the message: the next message stays in the socket, for the lane's
  buffer. Growing copies what arrived into the larger block: at most a third of the
  message again, in all.
* **Handed out in place:** frames of `aiorl.transport.lane_queue.COPY_BELOW` bytes or more
  are writable views of that memory (a tensor is rebuilt on one without a copy:
  `aiorl.transport.serialization.tensor_from_buffer`); smaller ones are copied to ``bytes``.
  The memory goes back when the last view of it is dropped.

Loop thread only, as the lane's reading. The figures: ``benchmarks/bench_calls.py``'s
tensor-argument rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiorl.transport.lane_queue import COPY_BELOW

__all__ = ["GROWTH", "LARGE_MESSAGE", "LargeMessage"]

#: Messages of at least this many bytes are read into memory of their own (from 256 KiB a
#: call's round trip is faster so, and the same below: measured by bench_calls.py).
LARGE_MESSAGE = 256 << 10
#: The memory grows to at most this many times what has arrived (as the lane's buffer).
GROWTH = 4
#: What one read may add beyond that: the room for the next read.
_READ_ROOM = 256 * 1024


def _empty(nbytes: int) -> Any:
    """Uninitialised bytes (numpy is imported by the first large message, not by every
    process that imports the transport)."""
    import numpy as np

    return np.empty(nbytes, dtype=np.uint8)


class LargeMessage:
    """One message being read: ``lengths`` of its frames, ``total`` bytes in all (its head
    included), ``have`` of them arrived. See the module docstring."""

    __slots__ = ("lengths", "total", "have", "_memory", "_view")

    def __init__(self, lengths: Sequence[int], total: int, arrived: memoryview) -> None:
        self.lengths = lengths
        self.total = total
        self.have = len(arrived)
        self._memory = _empty(self._bound(self.have))
        self._view = memoryview(self._memory)
        self._view[:self.have] = arrived

    def _bound(self, have: int) -> int:
        return min(self.total, GROWTH * have + _READ_ROOM)

    def room(self) -> memoryview:
        """Where the next bytes go: the rest of the memory, grown first when it is full."""
        if self.have == len(self._memory):
            memory = _empty(self._bound(self.have))
            memory[:self.have] = self._memory
            self._memory = memory
            self._view = memoryview(memory)
        return self._view[self.have:]

    @property
    def capacity(self) -> int:
        """The bytes of memory the message holds now."""
        return len(self._memory)

    @property
    def complete(self) -> bool:
        return self.have == self.total

    def frames(self) -> list[Any]:
        """The whole message's frames: views of its memory, or bytes for small ones."""
        view = self._view
        pos = 4 + 8 * len(self.lengths)
        frames: list[Any] = []
        for n in self.lengths:
            piece = view[pos:pos + n]
            frames.append(piece if n >= COPY_BELOW else bytes(piece))
            pos += n
        return frames
