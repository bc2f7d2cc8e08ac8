"""A double-buffered, seqlocked shared-memory segment: where one shard's versions live.

Layout of one segment (an anonymous memfd, `aiorl.transport._shm`)::

    +-- header page ------------------+-- slot 0 ----------------+-- slot 1 ----------------+
    | seq0 ver0 | seq1 ver1 | ...     | tensors of one version   | tensors of another       |
    +---------------------------------+--------------------------+--------------------------+

One process writes it (the publisher, or a node's relay); any process of the node maps it
read-only through ``/proc/<pid>/fd/<fd>`` and copies out of it. Two slots bound the memory
to twice the shard: the newest complete version stays readable while the next is written
into the other slot.

The header is a *seqlock* per slot. The writer makes ``seq`` odd, sets ``version``, writes
the bytes, makes ``seq`` even again. A reader notes ``seq`` (it must be even and the slot
must hold the version it wants), copies, and reads ``seq`` again: if it changed, the writer
touched the slot during the copy and the copy is thrown away (`read_slot` returns
False; the subscriber retries with the newest version). So a torn copy can happen but can
never be returned. Readers take no lock and the writer never waits for them: a slow reader
only loses its copy. (x86 keeps loads in order and stores in order, and every access here
goes through a C call the compiler cannot reorder around, so the two plain 8-byte loads are
a correct seqlock on this platform.)
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiorl.transport._shm import Segment, create_segment, open_segment

__all__ = ["SLOTS", "SegmentRef", "SegmentReader", "VersionedSegment", "read_slot"]

#: Slots per segment: the newest complete version and the one being written (or read).
SLOTS = 2
_HEADER = mmap.PAGESIZE
_NO_VERSION = -1


@dataclass(frozen=True)
class SegmentRef:
    """How another process of the node finds a segment: the owner's pid and fd, and sizes."""

    pid: int
    fd: int
    size: int
    slot_bytes: int


def _slot_offset(slot: int, slot_bytes: int) -> int:
    return _HEADER + slot * _page_align(slot_bytes)


def _page_align(n: int) -> int:
    return (n + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


def read_slot(header: Any, slot: int, version: int, copy: Callable[[], None]) -> bool:
    """Run ``copy`` (which reads slot ``slot``) and say whether it saw exactly ``version``.

    False when the slot does not hold ``version`` complete before the copy, or when the
    writer touched it while ``copy`` ran (the seqlock's sequence moved): the bytes copied
    must then be discarded.
    """
    seq = int(header[2 * slot])
    if seq & 1 or int(header[2 * slot + 1]) != version:
        return False
    copy()
    return int(header[2 * slot]) == seq


class VersionedSegment:
    """The writer's side: a memfd with `SLOTS` slots of ``slot_bytes`` and their header."""

    def __init__(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self._segment: Segment = create_segment(_HEADER + SLOTS * _page_align(slot_bytes))
        self.header = np.frombuffer(self._segment.mm, dtype=np.int64, count=2 * SLOTS)
        self.header[1::2] = _NO_VERSION
        self._bytes = np.frombuffer(self._segment.mm, dtype=np.uint8)

    @property
    def ref(self) -> SegmentRef:
        return SegmentRef(os.getpid(), self._segment.fd, self._segment.size, self.slot_bytes)

    def slot(self, slot: int) -> Any:
        """The writable uint8 array of slot ``slot``."""
        start = _slot_offset(slot, self.slot_bytes)
        return self._bytes[start : start + self.slot_bytes]

    def version(self, slot: int) -> int:
        """The version slot ``slot`` holds complete, or -1 (none, or being written)."""
        return _NO_VERSION if self.header[2 * slot] & 1 else int(self.header[2 * slot + 1])

    def slot_of(self, version: int) -> int | None:
        for slot in range(SLOTS):
            if self.version(slot) == version:
                return slot
        return None

    def spare_slot(self) -> int:
        """The slot to write next: the one not holding the newest complete version."""
        newest = max(range(SLOTS), key=self.version)
        return (newest + 1) % SLOTS

    def begin_write(self, slot: int, version: int) -> None:
        """Make ``slot`` odd (readers of it will fail) and label it ``version``."""
        self.header[2 * slot] += 1
        self.header[2 * slot + 1] = version

    def end_write(self, slot: int, complete: bool = True) -> None:
        """Make ``slot`` readable again; an incomplete write leaves it holding no version."""
        if not complete:
            self.header[2 * slot + 1] = _NO_VERSION
        self.header[2 * slot] += 1

    def close(self) -> None:
        del self.header, self._bytes  # numpy views must go before the mapping can close
        self._segment.close()


class SegmentReader:
    """A read-only mapping of another process's `VersionedSegment`.

    Kept for as long as the subscriber may pull from it: a mapping outlives the writer,
    so the last complete version stays readable after the publisher dies.
    """

    def __init__(self, ref: SegmentRef) -> None:
        self.ref = ref
        self._mm = open_segment(ref.pid, ref.fd, ref.size, writable=False)
        self.header = np.frombuffer(self._mm, dtype=np.int64, count=2 * SLOTS)
        self._bytes = np.frombuffer(self._mm, dtype=np.uint8)

    def slot(self, slot: int) -> Any:
        start = _slot_offset(slot, self.ref.slot_bytes)
        return self._bytes[start : start + self.ref.slot_bytes]

    def read(self, slot: int, version: int, copy: Callable[[Any], None]) -> bool:
        """``copy(slot bytes)`` under the seqlock; see `read_slot`."""
        return read_slot(self.header, slot, version, lambda: copy(self.slot(slot)))
