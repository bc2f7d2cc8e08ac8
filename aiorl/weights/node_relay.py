"""A subscriber as its node's relay: the versions of shards published on other nodes.

The directory elects one subscriber per (node, shard) whose publisher is on another node.
That subscriber's follow loop hands each relay job here: `NodeRelay` fetches the version's
buckets from the publisher (``WeightsOp.FETCH``, `FETCH_DEPTH` requests in flight) into a
double-buffered segment of its own, under the same seqlock as the publisher's, and announces
the complete slot; every subscriber of the node then copies out of that segment.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import numpy as np

from aiorl.errors import PeerLostError
from aiorl.protocol.ops import WeightsOp
from aiorl.protocol.weights import Announce, FetchBucket, Layout, RelayJob, RestoreRelay, SegmentRef
from aiorl.weights.segment import SLOTS, VersionedSegment
from aiorl.weights.service import DirectoryCall, WeightsService

__all__ = ["FETCH_DEPTH", "NodeRelay"]

log = logging.getLogger("aiorl.weights")

#: Bucket fetches a relay keeps in flight (bucket k+1 on the wire while k is copied).
FETCH_DEPTH = 2


class NodeRelay:
    """The shards one subscriber relays for its node (loop thread): per shard, its segment
    and the publisher segment its versions came from. ``stats`` (its subscriber's) counts
    ``relayed_versions`` and ``relayed_bytes``."""

    def __init__(self, service: WeightsService, name: str, stats: dict[str, int]) -> None:
        self.service = service
        self.name = name
        self.stats = stats
        self.segments: dict[int, VersionedSegment] = {}
        self.origins: dict[int, SegmentRef] = {}  # shard -> publisher segment relayed

    async def restore(self, call: DirectoryCall) -> None:
        """Tell a restarted directory each shard relayed here: the segment, its complete
        slots and the publisher segment they came from."""
        service = self.service
        for shard, segment in list(self.segments.items()):
            origin = self.origins.get(shard)
            slots = {segment.version(s): s for s in range(SLOTS) if segment.version(s) >= 0}
            if origin is not None and slots:
                await call(RestoreRelay(service.worker, service.node_id, shard, segment.ref,
                                        slots, origin))

    async def relay(self, job: RelayJob, layout: Layout) -> None:
        """Fetch ``job.version`` of a shard from its publisher into our relay segment, then
        announce it to the directory."""
        segment = self.segments.get(job.shard)
        if segment is None:
            segment = self.segments[job.shard] = VersionedSegment(layout.nbytes)
        self.origins[job.shard] = job.publisher.ref
        slot = segment.spare_slot()
        segment.begin_write(slot, job.version)
        complete = False
        try:
            complete = await self._fetch(job, layout, segment.slot(slot))
        except Exception as exc:  # the publisher died or failed the fetch: skip this version
            log.info("relay of weights %r shard %d stopped: %s", self.name, job.shard, exc)
        finally:
            segment.end_write(slot, complete)
        if not complete:
            return  # the directory already has (or will soon have) a newer job or a loss
        self.stats["relayed_versions"] += 1
        service = self.service
        try:
            await service.call_directory(
                self.name, Announce(service.worker, job.shard, job.version, slot, segment.ref,
                                    service.node_id), patience=0.0)
        except PeerLostError as exc:  # our restore lists the slot once the directory is back
            log.info("relay of weights %r shard %d: version %d not announced: %s", self.name,
                     job.shard, job.version, exc)

    async def _fetch(self, job: RelayJob, layout: Layout, dst: Any) -> bool:
        """Every bucket of the version into ``dst``, ``FETCH_DEPTH`` requests in flight."""
        endpoint = self.service.runtime.endpoint
        buckets = list(layout.buckets)
        pending: list[tuple[int, int, asyncio.Future[Any]]] = []
        complete = True
        while (buckets or pending) and complete:
            while buckets and len(pending) < FETCH_DEPTH:
                start, end = buckets.pop(0)
                meta = FetchBucket(self.name, job.shard, job.version, start, end).to_wire()
                pending.append((start, end, endpoint.request(job.publisher.endpoint,
                                                             WeightsOp.FETCH, meta)))
            start, end, fut = pending.pop(0)
            intact, frames = await fut
            if not intact:
                complete = False  # the publisher overwrote that version: a newer job follows
                break
            await self.service.copy(functools.partial(_place, dst[start:end], frames))
            self.stats["relayed_bytes"] += end - start
        for _, _, fut in pending:
            fut.cancel()
        return complete

    def close(self) -> None:
        for segment in self.segments.values():
            segment.close()
        self.segments.clear()
        self.origins.clear()


def _place(dst: Any, frames: list[Any]) -> None:
    offset = 0
    for frame in frames:
        chunk = np.frombuffer(frame, dtype=np.uint8)
        dst[offset : offset + chunk.size] = chunk
        offset += chunk.size
    if offset != dst.size:
        raise PeerLostError(f"a weight bucket arrived with {offset} of {dst.size} bytes")
