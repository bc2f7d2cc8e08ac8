"""A double-buffered, seqlocked shared-memory segment: where one shard's versions live.

Layout of one segment (an anonymous memfd, `aiorl.transport.shared_memory`)::

    +-- header page ------------------+-- slot 0 ----------------+-- slot 1 ----------------+
    | seq0 ver0 seq1 ver1 host0 host1 | tensors of one version   | tensors of another       |
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
only loses its copy.

A publisher whose state dict is on a GPU keeps its versions in GPU slots
(`aiorl.weights.cuda`) and writes a slot's *host bytes* only while some reader needs
them (docs/weights.md, "CUDA"). The header therefore also says, per slot, which version
its host bytes hold (``host``): a host reader requires ``host == version`` besides the
seqlock, a GPU reader only the seqlock. Such a segment is created *sparse*: only the
header page is backed and mapped until the first host write (`VersionedSegment.ensure_host`),
and a reader maps only the header until it copies host bytes, so a model read from the GPU
costs no host memory at all. (x86 keeps loads in order and stores in order, and every access here
goes through a C call the compiler cannot reorder around, so the two plain 8-byte loads are
a correct seqlock on this platform.)
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from aiorl.protocol.weights import SegmentRef
from aiorl.transport.shared_memory import ShmUnavailable, open_segment

__all__ = ["SLOTS", "SegmentReader", "VersionedSegment", "read_slot"]

#: Slots per segment: the newest complete version and the one being written (or read).
SLOTS = 2
_HEADER = mmap.PAGESIZE
_NO_VERSION = -1
#: Header words: ``seq, version`` per slot, then per slot the version its host bytes hold.
_WORDS = 3 * SLOTS
_HOST = 2 * SLOTS
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _slot_offset(slot: int, slot_bytes: int) -> int:
    return _HEADER + slot * _page_align(slot_bytes)


def _page_align(n: int) -> int:
    return (n + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


def read_slot(header: Any, slot: int, version: int, copy: Callable[[], None],
              host: bool = True) -> bool:
    """Run ``copy`` (which reads slot ``slot``) and say whether it saw exactly ``version``.

    False when the slot does not hold ``version`` complete before the copy (with
    ``host``: complete in its host bytes, which a GPU publisher may not have written), or
    when the writer touched it while ``copy`` ran (the seqlock's sequence moved): the bytes
    copied must then be discarded. ``copy`` is not run when the slot does not hold it.
    """
    seq = int(header[2 * slot])
    if seq & 1 or int(header[2 * slot + 1]) != version:
        return False
    if host and int(header[_HOST + slot]) != version:
        return False
    copy()
    return int(header[2 * slot]) == seq


def _sparse_segment(size: int) -> tuple[int, mmap.mmap]:
    """A memfd of ``size`` bytes of which only the header page is backed and mapped.

    Not `aiorl.transport.shared_memory.create_segment`: that one reserves (``fallocate``) and
    populates every page at once (about a second for a 1 GB model's two slots;
    docs/weights.md), memory a model read only from its GPU never uses. The rest is
    reserved by `VersionedSegment.ensure_host` before it is first written, so that running
    out of memory is still an error there, never a ``SIGBUS`` in a copy.
    """
    try:
        fd = os.memfd_create("aiorl-weights", os.MFD_CLOEXEC)
    except (AttributeError, OSError) as exc:
        raise ShmUnavailable(f"memfd_create failed: {exc}") from exc
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, _HEADER)
        mm = mmap.mmap(fd, _HEADER, mmap.MAP_SHARED | _POPULATE,
                       mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.close(fd)
        raise ShmUnavailable(f"cannot allocate a {size}-byte shared segment: {exc}") from exc
    return fd, mm


def _close_mapping(mm: mmap.mmap | None) -> None:
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass  # a view is still exported; the mapping goes when the last view does


class VersionedSegment:
    """The writer's side: a memfd with `SLOTS` slots of ``slot_bytes`` and their header.

    With ``host=False`` the slots' host bytes are neither reserved nor mapped until
    `ensure_host` (a GPU publisher that may never need them); otherwise at once.
    """

    def __init__(self, slot_bytes: int, host: bool = True) -> None:
        self.slot_bytes = slot_bytes
        self.size = _HEADER + SLOTS * _page_align(slot_bytes)
        self._fd, self._header_mm = _sparse_segment(self.size)
        self._mm: mmap.mmap | None = None  # the whole segment, once the host bytes exist
        self._bytes: Any = None
        #: What users of the slots made from their bytes and keep, by their own key (the
        #: typed views of `aiorl.weights.layout.TensorPlan.host_places`): it goes with the
        #: mapping, which cannot close while a view of it exists.
        self.kept: dict[Any, Any] = {}
        self.header = np.frombuffer(self._header_mm, dtype=np.int64, count=_WORDS)
        self.header[1 : 2 * SLOTS : 2] = _NO_VERSION
        self.header[_HOST:] = _NO_VERSION
        if host:
            try:
                self.ensure_host()
            except BaseException:
                self.close()
                raise

    @property
    def ref(self) -> SegmentRef:
        return SegmentRef(os.getpid(), self._fd, self.size, self.slot_bytes)

    @property
    def host_backed(self) -> bool:
        """Whether the slots' host bytes exist (reserved and mapped)."""
        return self._bytes is not None

    def ensure_host(self) -> bool:
        """Reserve and map the slots' host bytes (once; True the time it did). Costly for a
        large model (every page is allocated and mapped): done the first time a version
        must reach host memory, on the copier thread."""
        if self._bytes is not None:
            return False
        try:
            os.posix_fallocate(self._fd, 0, self.size)
            mm = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED | _POPULATE,
                           mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise ShmUnavailable(f"cannot allocate the {self.size}-byte host slots of a "
                                 f"weights segment: {exc}") from exc
        self._mm = mm
        self._bytes = np.frombuffer(mm, dtype=np.uint8)
        return True

    def host_bytes(self) -> Any:
        """Every slot's host bytes, one uint8 array from the first slot's (page-aligned)
        start to the segment's end (what `aiorl.weights.cuda.pin_host` page-locks)."""
        if self._bytes is None:
            raise RuntimeError("the host bytes of this segment are not allocated")
        return self._bytes[_HEADER:]

    def slot(self, slot: int) -> Any:
        """The writable uint8 array of slot ``slot`` (its host bytes: `ensure_host` first)."""
        if self._bytes is None:
            raise RuntimeError("the host bytes of this segment are not allocated")
        start = _slot_offset(slot, self.slot_bytes)
        return self._bytes[start : start + self.slot_bytes]

    def version(self, slot: int) -> int:
        """The version slot ``slot`` holds complete, or -1 (none, or being written)."""
        return _NO_VERSION if self.header[2 * slot] & 1 else int(self.header[2 * slot + 1])

    def host_version(self, slot: int) -> int:
        """The version slot ``slot`` holds complete *in its host bytes*, or -1."""
        version = self.version(slot)
        return version if version >= 0 and int(self.header[_HOST + slot]) == version else -1

    def slot_of(self, version: int) -> int | None:
        for slot in range(SLOTS):
            if self.version(slot) == version:
                return slot
        return None

    def host_slot_of(self, version: int) -> int | None:
        """The slot whose host bytes hold ``version`` complete (what a relay can fetch)."""
        for slot in range(SLOTS):
            if self.host_version(slot) == version:
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
        self.header[_HOST + slot] = _NO_VERSION

    def end_write(self, slot: int, complete: bool = True, host: bool = True) -> None:
        """Make ``slot`` readable again; an incomplete write leaves it holding no version.
        ``host``: its host bytes were written too (else only its GPU copy holds it)."""
        if not complete:
            self.header[2 * slot + 1] = _NO_VERSION
        elif host:
            self.header[_HOST + slot] = self.header[2 * slot + 1]
        self.header[2 * slot] += 1

    def mark_host(self, slot: int, version: int) -> bool:
        """The host bytes of ``slot`` now hold ``version``, copied there after its write
        (from its GPU copy, which did not change: the sequence number stays, so GPU readers
        are not disturbed). The bytes must be complete before this store: host readers take
        ``host == version`` as their go-ahead. False if the slot no longer holds it."""
        if self.version(slot) != version:
            return False
        self.header[_HOST + slot] = version
        return True

    def close(self) -> None:
        self.kept.clear()
        del self.header  # numpy views must go before the mappings can close
        self._bytes = None
        _close_mapping(self._mm)
        _close_mapping(self._header_mm)
        try:
            os.close(self._fd)
        except OSError:
            pass


class SegmentReader:
    """A read-only mapping of another process's `VersionedSegment`.

    Kept for as long as the subscriber may pull from it: a mapping outlives the writer,
    so the last complete version stays readable after the publisher dies. Only the header
    is mapped until a host read needs the slots (a reader that copies from a GPU never
    maps them).
    """

    def __init__(self, ref: SegmentRef) -> None:
        self.ref = ref
        self._header_mm = open_segment(ref.pid, ref.fd, _HEADER, writable=False)
        self.header = np.frombuffer(self._header_mm, dtype=np.int64, count=_WORDS)
        self._bytes: Any = None
        #: What users of the slots made from their bytes and keep, by their own key (the
        #: typed views of `aiorl.weights.layout.TensorPlan.host_places`): it goes with the
        #: mapping, which cannot close while a view of it exists.
        self.kept: dict[Any, Any] = {}

    def slot(self, slot: int) -> Any:
        if self._bytes is None:
            self._bytes = np.frombuffer(
                open_segment(self.ref.pid, self.ref.fd, self.ref.size, writable=False),
                dtype=np.uint8)
        start = _slot_offset(slot, self.ref.slot_bytes)
        return self._bytes[start : start + self.ref.slot_bytes]

    def read(self, slot: int, version: int, copy: Callable[[Any], None],
             host: bool = True) -> bool:
        """``copy(slot bytes)`` under the seqlock; see `read_slot`. ``host=False``: the
        copy reads a GPU copy of the slot (it gets None), only the seqlock is checked."""
        if host:
            return read_slot(self.header, slot, version, lambda: copy(self.slot(slot)))
        return read_slot(self.header, slot, version, lambda: copy(None), host=False)
