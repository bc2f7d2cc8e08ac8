"""A subscriber as its GPU's representative: NCCL copies of shards published on other GPUs.

A subscriber that pulls into a GPU tells the directory which (`GpuRepresentative.subscribe`).
For each shard a GPU publisher publishes on another GPU, the directory elects one subscriber
of that GPU its representative: `GpuRepresentative.represent` then runs a
`aiorl.weights.nccl.GpuReceiver`, which receives the publisher's NCCL rounds into GPU
slots of its own; every subscriber of that GPU copies out of them by CUDA IPC (docs/weights.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from aiorl.protocol.weights import GpuSubscribe, Layout, SegmentRef, ShardSource
from aiorl.weights import cuda
from aiorl.weights.nccl import GpuReceiver
from aiorl.weights.service import DirectoryCall, WeightsService

__all__ = ["GpuRepresentative"]

log = logging.getLogger("aiorl.weights")


class GpuRepresentative:
    """One subscriber's GPU (``gpu``: index and UUID, once told to the directory) and the
    shards it represents that GPU for (``receivers``: shard -> its `GpuReceiver`; loop
    thread). ``stats`` (its subscriber's) counts ``gpu_versions`` and ``gpu_bytes``."""

    def __init__(self, service: WeightsService, name: str, stats: dict[str, int]) -> None:
        self.service = service
        self.name = name
        self.stats = stats
        self.receivers: dict[int, GpuReceiver] = {}
        self.gpu: tuple[int, str] | None = None

    async def restore(self, call: DirectoryCall) -> None:
        """Tell a restarted directory the GPU this subscriber pulls into."""
        if self.gpu is not None:
            await call(GpuSubscribe(self.service.worker, self.service.node_id, self.gpu[1]))

    async def subscribe(self, into: Mapping[str, Any]) -> None:
        """Tell the directory, once, which GPU this subscriber pulls into: if a publisher
        is on another GPU, it elects a representative of this GPU to receive by NCCL."""
        if self.gpu is not None:
            return
        gpu = cuda.device_uuid_of(into)
        if gpu is None:
            return
        service = self.service
        try:
            await service.call_directory(
                self.name, GpuSubscribe(service.worker, service.node_id, gpu[1]), patience=0.0)
        except Exception as exc:  # the host path needs no GPU registration: asked again
            log.debug("weights %r: GPU not registered: %r", self.name, exc)
            return
        self.gpu = gpu

    def represent(self, publisher: ShardSource, layout: Layout) -> None:
        """Be this GPU's representative for ``publisher``'s shard: receive its versions by
        NCCL from the publisher's GPU."""
        shard = publisher.shard
        receiver = self.receivers.get(shard)
        if receiver is not None and receiver.publisher.ref == publisher.ref:
            return  # (one that failed to start is not retried: pulls use the host slots)
        if receiver is not None:
            receiver.close()
        assert self.gpu is not None  # only a subscriber that named its GPU is elected
        index, uuid = self.gpu
        service = self.service
        receiver = self.receivers[shard] = GpuReceiver(service, self.name, publisher, layout,
                                                       index, uuid, self.stats)

        async def start() -> None:
            try:
                await receiver.start()
            except Exception as exc:  # pulls keep using the host slots
                log.warning("%s: cannot represent its GPU for weights %r shard %d: %r",
                            service.worker, self.name, shard, exc)
                receiver.close()

        service.loop.create_task(start())

    def own_slots(self, ref: SegmentRef) -> list[Any] | None:
        """The GPU slots behind seqlock header ``ref`` if they are this representative's own
        (a process cannot open its own IPC handles: it reads them directly)."""
        own = [receiver.gpu.slots for receiver in list(self.receivers.values())
               if receiver.gpu is not None and receiver.segment is not None
               and receiver.segment.ref == ref]
        return own[0] if own else None

    def refs(self) -> Iterator[SegmentRef]:
        """The seqlock headers of the GPU slots this representative holds."""
        return (receiver.segment.ref for receiver in self.receivers.values() if receiver.segment)

    def close(self) -> None:
        for receiver in self.receivers.values():
            receiver.close()
        self.receivers.clear()
