"""The publishing side: ``pub = self.weight_publisher(name); await pub.publish(sd, version)``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from aiorl.errors import PeerLostError
from aiorl.runtime import AsyncWork
from aiorl.runtime.promise import trace_until_settled
from aiorl.trace import recorder as _trace
from aiorl.weights._directory import ShardSource
from aiorl.weights._layout import Layout, tensor_bytes
from aiorl.weights._segment import SLOTS, VersionedSegment
from aiorl.weights._service import WeightsService
from aiorl.weights.cuda import CudaSlots, cuda_device_of
from aiorl.weights.nccl import GpuFanout

__all__ = ["WeightPublisher", "write_tensors"]

log = logging.getLogger("aiorl.weights")

#: How long a publish waits for the directory to hear of its version before it returns
#: anyway (a directory that is down or hung hears it when it is back: the restore). A
#: directory known dead fails the announce at once; this bounds one whose death is not
#: known yet. 2 s proved too short on a loaded 2-core machine: a live directory's answer
#: came later, the publish returned first, and a subscriber asking right after missed
#: the version (tests/test_demo.py, once in a full CI run).
ANNOUNCE_WAIT_S = 5.0


class WeightPublisher:
    """Publishes versions of one shard of the weights ``name`` (see docs/weights.md).

    A publish writes the state dict once into the spare slot of this publisher's shared
    segment (the slot not holding the newest version), then tells the directory that the
    version is complete. It never waits for a subscriber: readers of the slot being
    overwritten lose their copy (the seqlock says so) and retry with the newest version.
    Nor for a directory that is down: the directory is restarted, and told this
    publisher's source and complete slots again before anything else (``_restore``).

    Get one with [`Worker.weight_publisher`][aiorl.Worker.weight_publisher] rather than
    building it.

    Args:
        service: This process's weights service.
        name: The weight name.
        shard: The shard this publisher publishes, ``0 .. num_shards - 1``.
        num_shards: How many shards make one version.
        bucket_bytes: The size of the buckets a relay fetches a version in.

    Raises:
        ValueError: ``shard`` is outside ``0 .. num_shards - 1``.

    Example:
        ```python
        pub = self.weight_publisher("policy", shard=self.rank, num_shards=self.world_size)
        await pub.publish(self.model.state_dict(), version=step)
        ```
    """

    def __init__(self, service: WeightsService, name: str, shard: int, num_shards: int,
                 bucket_bytes: int) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is outside 0..{num_shards - 1}")
        self.service = service
        self.name = name
        self.shard = shard
        self.num_shards = num_shards
        self.bucket_bytes = bucket_bytes
        self._layout: Layout | None = None
        self._segment: VersionedSegment | None = None
        self._gpu: CudaSlots | None = None  # GPU copies of the slots, for a CUDA state dict
        self._fanout: GpuFanout | None = None  # NCCL rounds to other GPUs (aiorl.weights.nccl)
        self._source: ShardSource | None = None
        self._version: int | None = None
        #: The newest version an earlier publisher of this name completed (from the
        #: directory at registration): this one's first version must be above it.
        self._floor: int | None = None
        self._lock: asyncio.Lock | None = None
        self._announce_lock: asyncio.Lock | None = None
        self._announcing: asyncio.Task[None] | None = None

    @property
    def version(self) -> int | None:
        """The newest version this publisher completed (None before the first)."""
        return self._version

    @property
    def floor(self) -> int | None:
        """The newest version an earlier publisher of this shard of this name completed, as
        the directory said when this one registered (its first publish); this publisher's
        versions must be above it. None before the first publish, or when there was none."""
        return self._floor

    def publish(self, state_dict: Mapping[str, Any], version: int) -> AsyncWork[int]:
        """Publish ``state_dict`` (name -> tensor, CPU or CUDA) as ``version``.

        Versions must increase (ValueError otherwise); the tensors must keep the names,
        dtypes and shapes of the first publish. The work completes with ``version`` once
        the version is readable by subscribers (or, while the directory is down, once it
        is written: the restarted directory hears of it); the tensors may be changed right
        after. The first publish registers the publisher and waits (bounded) for a
        directory that is restarting.

        Args:
            state_dict: The tensors to publish, name -> tensor (CPU or CUDA), with the
                names, dtypes and shapes of the first publish.
            version: The version number, above every version published before under this
                name.

        Returns:
            An [`AsyncWork`][aiorl.AsyncWork] completing with ``version`` once subscribers
                can read it.

        Raises:
            TypeError: ``version`` is not an int, or ``state_dict`` is not a mapping of
                names to tensors.
            ValueError: (the work fails with it) ``version`` is not newer than the last
                one published under this name (see
                [`floor`][aiorl.weights.WeightPublisher.floor]), or the tensors' names,
                dtypes or shapes changed since the first publish.
        """
        if type(version) is not int:
            raise TypeError(f"a version must be an int, got {type(version).__name__}")
        Layout.of(state_dict, self.bucket_bytes)  # type errors now, on the caller's thread
        work = self.service.run(self._publish(state_dict, version))
        if _trace.ON:  # the version tag follows a trainer step through the pipeline
            trace_until_settled(work, _trace.begin("weights", f"publish {self.name}", None,
                                                   version=version, shard=self.shard))
        return work

    async def _publish(self, state_dict: Mapping[str, Any], version: int) -> int:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._version is not None and version <= self._version:
                raise ValueError(f"version {version} is not newer than the published "
                                 f"{self._version}: versions must increase")
            segment, layout = await self._segment_for(state_dict)
            if self._version is None and self._floor is not None and version <= self._floor:
                raise ValueError(
                    f"version {version} of weights {self.name!r} is not newer than version "
                    f"{self._floor}, which an earlier publisher of its shard {self.shard} "
                    "completed: versions of a weight name never go back, also when its "
                    f"publisher is replaced (docs/weights.md); publish {self._floor + 1} or "
                    "later (pub.floor), or use another name")
            slot = segment.spare_slot()
            segment.begin_write(slot, version)
            complete = False
            try:
                await self.service.copy(lambda: write_tensors(layout, state_dict,
                                                              segment.slot(slot)))
                gpu = self._gpu
                if gpu is not None:
                    await self.service.copy(lambda: gpu.write(slot, state_dict))
                complete = True
            finally:
                segment.end_write(slot, complete)
            self._version = version
            if self._fanout is not None:  # runs beside us: never waited for
                self._fanout.offer(version, slot)
            announcing = self._announcing = self.service.loop.create_task(
                self._announce(version, slot))
            await asyncio.wait({announcing}, timeout=ANNOUNCE_WAIT_S)
            return version

    async def _announce(self, version: int, slot: int) -> None:
        """Tell the directory ``version`` is complete in ``slot``, after the announces of
        earlier versions (they may still be waiting for a hung directory); a directory
        that is down is not waited for: its restore lists the slot."""
        if self._announce_lock is None:
            self._announce_lock = asyncio.Lock()
        service = self.service
        async with self._announce_lock:
            try:
                await service.call_directory(self.name, "announce", service.worker, self.shard,
                                             version, slot, patience=0.0)
            except PeerLostError as exc:
                log.info("%s: weights %r version %d: the directory is down (%s); it hears of "
                         "the version when it is back", service.worker, self.name, version, exc)
            except Exception as exc:  # nobody awaits this task: say it here
                log.warning("%s: weights %r version %d not announced: %r", service.worker,
                            self.name, version, exc)

    async def _restore(self, call: Callable[..., Awaitable[Any]]) -> None:
        """Tell a restarted directory this publisher's source, then each complete slot
        (oldest first, as they were announced)."""
        segment, layout, source = self._segment, self._layout, self._source
        if segment is None or layout is None or source is None:
            return
        await call("register_publisher", source, self.num_shards, self.service.node_id, layout)
        for version, slot in sorted((segment.version(s), s) for s in range(SLOTS)):
            if version >= 0:
                await call("announce", self.service.worker, self.shard, version, slot)

    async def _segment_for(self, state_dict: Mapping[str, Any]) -> tuple[VersionedSegment, Layout]:
        if self._segment is not None and self._layout is not None:
            self._layout.check(state_dict)
            return self._segment, self._layout
        layout = Layout.of(state_dict, self.bucket_bytes)
        device = cuda_device_of(state_dict)
        gpu = None if device is None else CudaSlots(layout, device, SLOTS)
        segment = VersionedSegment(layout.nbytes)
        service = self.service
        source = ShardSource(self.shard, service.worker, service.info.endpoint, segment.ref,
                             cuda=None if gpu is None else gpu.export)
        # Before the directory lists us: a representative may ask to join at once.
        fanout = None if gpu is None else GpuFanout(service, self.name, self.shard, layout, gpu,
                                                    segment)
        try:
            floor = await service.call_directory(self.name, "register_publisher", source,
                                                 self.num_shards, service.node_id, layout)
        except BaseException:
            if fanout is not None:
                fanout.close()
            segment.close()
            raise
        service.segments[(self.name, self.shard)] = segment
        self._floor = floor if isinstance(floor, int) else None
        self._segment, self._layout, self._gpu, self._fanout = segment, layout, gpu, fanout
        self._source = source
        await service.on_directory_restart(self.name, self._restore)
        return segment, layout


def write_tensors(layout: Layout, state_dict: Mapping[str, Any], slot: Any) -> None:
    """Copy every tensor of ``state_dict`` into its place in ``slot`` (a uint8 array)."""
    import torch

    for spec in layout.tensors:
        if spec.nbytes == 0:
            continue
        src = state_dict[spec.name]
        dst = slot[spec.offset : spec.offset + spec.nbytes]
        if src.device.type == "cpu" and src.is_contiguous():
            np.copyto(dst, tensor_bytes(src))
        else:  # a CUDA or strided tensor: torch copies it into a typed view of the slot
            with torch.no_grad():
                torch.from_numpy(dst).view(src.dtype).view(src.shape).copy_(src)
