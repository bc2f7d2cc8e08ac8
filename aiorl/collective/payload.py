"""How a broadcast's CPU bytes travel: as ZMQ frames, or once into a shared segment.

To another node, the buffers go as data frames of at most `CHUNK` bytes (`chunks`; the
receiver reassembles them with `take_frames`). On one node, `SharedSegments` writes them
once into a pooled shared segment that every reader maps copy-on-write (``MAP_PRIVATE``):
it reads the writer's pages without copying, and a write by one reader stays private to it.
A segment goes back to its owner's pool when every reader's views are gone (each reader
tells the owner, `SegmentRelease`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

from aiorl.collective.oneway import read_oneway
from aiorl.collective.settings import CHUNK
from aiorl.errors import PeerLostError, ProtocolError
from aiorl.p2p.message import InMessage
from aiorl.protocol.broadcast import FramedBuffers, SegmentRelease, SharedBuffers
from aiorl.protocol.ops import BroadcastOp
from aiorl.runtime import Runtime
from aiorl.transport import shared_memory
from aiorl.transport.endpoint import Incoming

__all__ = ["SharedSegments", "chunks", "take_frames"]

log = logging.getLogger("aiorl.collective")


def chunks(bufs: Sequence[memoryview]) -> tuple[FramedBuffers, list[Any]]:
    """``bufs`` as ZMQ frames of at most `CHUNK` bytes, and their descriptor.

    The endpoint hands large frames to ZMQ without copying; the source keeps the buffers alive
    until the broadcast is done, by which time every frame has arrived.
    """
    frames: list[Any] = []
    sizes, counts = [], []
    for b in bufs:
        n = b.nbytes
        pieces = [b[off : off + CHUNK] for off in range(0, max(n, 1), CHUNK)]
        frames.extend(pieces)
        sizes.append(n)
        counts.append(len(pieces))
    return FramedBuffers(tuple(sizes), tuple(counts)), frames


def take_frames(inc: InMessage, desc: FramedBuffers, frames: Sequence[Any], start: int) -> None:
    """The message's buffers are its data frames' chunks, from frame ``start`` on."""
    i = start
    for n, count in zip(desc.sizes, desc.counts, strict=True):
        pieces = frames[i : i + count]
        if len(pieces) != count or sum(len(c) for c in pieces) != n:
            raise ProtocolError("a broadcast message lost payload frames")
        inc.sources.append((n, pieces))
        i += count


class SharedSegments:
    """The shared segments this process writes for broadcasts, and those it maps."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.endpoint = runtime.endpoint
        self.name = runtime.name
        self.address = runtime.endpoint.address
        self.pid = os.getpid()
        self.closed = False
        self.bytes_written = 0  # bytes copied into segments (once per segment written)
        self.readers_served = 0  # member deliveries that read one of those segments
        self._pool: shared_memory.SegmentPool | None = None
        self._readers: dict[int, set[str]] = {}  # segment id -> members still viewing it
        self.endpoint.handle(BroadcastOp.RELEASE, self._on_release)

    @property
    def held(self) -> int:
        """Segments held (free and in use)."""
        return len(self._pool.segments) if self._pool is not None else 0

    @property
    def in_use(self) -> int:
        """Segments some reader still views."""
        return len(self._readers)

    def write(self, parts: Sequence[Sequence[Any]], readers: Sequence[str]
              ) -> SharedBuffers | None:
        """Copy the buffers ``parts`` (each a list of chunks) once into a pooled shared segment
        that ``readers`` will map; its descriptor, or None when shared memory is unavailable or
        the pool is full (frames are used then)."""
        import numpy as np

        if self._pool is None:
            self._pool = shared_memory.SegmentPool()
        sizes = [sum(memoryview(c).nbytes for c in pieces) for pieces in parts]
        offsets: list[int] = []
        total = 0
        for n in sizes:
            offsets.append(total)
            total = shared_memory.align(total + n)
        try:
            seg, _evicted = self._pool.acquire(total)  # readers never keep a segment's fd
        except shared_memory.ShmUnavailable as exc:
            log.debug("%s: no shared segment for a broadcast (%s); using frames", self.name, exc)
            return None
        if seg.arr is None:
            seg.arr = np.frombuffer(seg.mm, dtype=np.uint8)
        for pieces, off in zip(parts, offsets, strict=True):
            for c in pieces:
                n = memoryview(c).nbytes
                shared_memory.copy_into(seg.arr[off : off + n], c)
                off += n
        self._readers[seg.seg_id] = set(readers)
        self.bytes_written += sum(sizes)
        self.readers_served += len(readers)
        return SharedBuffers(self.pid, seg.fd, seg.size, seg.seg_id, tuple(offsets),
                             tuple(sizes), self.address)

    def map(self, inc: InMessage, desc: SharedBuffers) -> None:
        """``inc``'s buffers are views of segment ``desc``, mapped copy-on-write; the lease
        gives the segment back to its owner when the last view is gone."""
        try:
            mm = shared_memory.open_segment(desc.pid, desc.fd, desc.size, private=True)
        except shared_memory.ShmUnavailable as exc:
            self.give_back(desc.owner, desc.seg_id)
            raise ProtocolError(f"cannot read the broadcast's shared memory: {exc}") from exc
        inc.lease = shared_memory.Lease(mm, functools.partial(self.give_back, desc.owner, desc.seg_id))
        inc.sources = list(zip(desc.sizes, desc.offsets, strict=True))

    def give_back(self, owner: str, seg_id: int) -> None:
        """This member no longer views segment ``seg_id`` of ``owner`` (any thread)."""
        if self.runtime.on_loop_thread():
            self.runtime.loop.call_soon(self._send_release, owner, seg_id)
        else:
            try:
                self.runtime.submit(self._send_release, owner, seg_id)
            except RuntimeError:
                pass  # the loop is closed: the process is exiting

    def _send_release(self, owner: str, seg_id: int) -> None:
        if owner == self.address:
            self.release(seg_id, self.name)
            return
        if self.closed or self.endpoint.is_lost(owner):
            return
        try:
            self.endpoint.send_oneway(owner, BroadcastOp.RELEASE,
                                      SegmentRelease(seg_id, self.name).to_wire())
        except PeerLostError:
            pass

    def _on_release(self, msg: Incoming) -> None:
        release = read_oneway(SegmentRelease, msg, self.name)
        if release is not None:
            self.release(release.seg_id, release.reader)

    def release(self, seg_id: int, reader: str) -> None:
        """``reader`` no longer views our segment ``seg_id``: free once nobody does."""
        readers = self._readers.get(seg_id)
        if readers is None:
            return
        readers.discard(reader)
        if not readers:
            del self._readers[seg_id]
            if self._pool is not None:
                self._pool.release(seg_id)

    def drop_reader(self, name: str) -> None:
        """Member ``name`` is gone: it views none of our segments any more."""
        for seg_id in [s for s, readers in self._readers.items() if name in readers]:
            self.release(seg_id, name)

    def close(self) -> None:
        self.closed = True
        if self._pool is not None:
            self._pool.close()
