"""The publishing side: ``pub = self.weight_publisher(name); await pub.publish(sd, version)``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from aiorl.cuda.bulk_copy import copy_grouped
from aiorl.errors import PeerLostError
from aiorl.protocol.weights import Announce, Layout, RegisterPublisher, ShardSource
from aiorl.runtime import AsyncWork
from aiorl.runtime.promise import trace_until_settled
from aiorl.trace import recorder as _trace
from aiorl.weights import cuda
from aiorl.weights.cuda import CudaSlots, cuda_device_of
from aiorl.weights.layout import TensorPlan, check_types, layout_of
from aiorl.weights.nccl import GpuFanout
from aiorl.weights.segment import SLOTS, VersionedSegment
from aiorl.weights.service import DirectoryCall, WeightsService

__all__ = ["WeightPublisher", "write_tensors"]

log = logging.getLogger("aiorl.weights")

#: How long a publish waits for the directory to hear of its version before it returns
#: anyway (a directory that is down or hung hears it when it is back: the restore). A
#: directory known dead fails the announce at once; this bounds one whose death is not
#: known yet. It must exceed a live directory's answer time on a loaded machine (a few
#: seconds on 2 shared cores): a publish that returns before the answer breaks "returned
#: means readable" for a subscriber that asks right after.
ANNOUNCE_WAIT_S = 5.0


class WeightPublisher:
    """Publishes versions of one shard of the weights ``name`` (see docs/weights.md).

    A publish writes the state dict once into the spare slot of this publisher's shared
    segment (the slot not holding the newest version), then tells the directory that the
    version is complete. A CUDA state dict on one GPU is written into that slot's GPU copy,
    and into its host bytes only while the directory says some subscriber reads host
    memory (`host_wanted`; docs/weights.md, "CUDA"). It never waits for a subscriber: readers of the slot being
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
        self._plan: TensorPlan | None = None  # made from the layout of the first publish
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
        #: Whether versions must reach the host slots too (a CUDA publisher only: a CPU one
        #: always writes them). True until the directory says otherwise: a reader it does
        #: not know of yet may read host memory.
        self.host_wanted = True
        self._host_mark: tuple[str, int] = ("", -1)  # (directory incarnation, its counter)
        self._pinned: Any = None  # the host slots, page-locked for CUDA (unpinned at close)
        self._backfill: asyncio.Task[None] | None = None
        #: Versions written to the host slots, and of those copied there after their
        #: publish because a host reader appeared (what tests and `make gpu-check` read).
        self.host_writes = 0
        self.host_backfills = 0

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
        # Type errors now, on the caller's thread (the layout is checked in the work).
        if self._plan is None:
            layout_of(state_dict, self.bucket_bytes)
        else:
            check_types(state_dict)
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
            segment, plan = await self._segment_for(state_dict)
            tensors = plan.sources(state_dict)
            if self._version is None and self._floor is not None and version <= self._floor:
                raise ValueError(
                    f"version {version} of weights {self.name!r} is not newer than version "
                    f"{self._floor}, which an earlier publisher of its shard {self.shard} "
                    "completed: versions of a weight name never go back, also when its "
                    f"publisher is replaced (docs/weights.md); publish {self._floor + 1} or "
                    "later (pub.floor), or use another name")
            gpu = self._gpu
            host = gpu is None or self.host_wanted
            if host and gpu is not None:
                await self.service.copy(self._host_slots)
            slot = segment.spare_slot()
            segment.begin_write(slot, version)
            complete = False
            try:
                if gpu is None:
                    await self.service.copy(lambda: write_tensors(
                        tensors, plan.host_places(segment, slot, segment.slot(slot)),
                        plan.groups))
                else:  # the GPU slot, then (if wanted) its host bytes from it: one copy each
                    dst = segment.slot(slot) if host else None
                    await self.service.copy(lambda: gpu.write(slot, state_dict, dst))
                complete = True
            finally:
                segment.end_write(slot, complete, host)
            self._version = version
            self.host_writes += host
            if self._fanout is not None:  # runs beside us: never waited for
                self._fanout.offer(version, slot)
            announcing = self._announce_task(version, slot, host)
            done, _ = await asyncio.wait({announcing}, timeout=ANNOUNCE_WAIT_S)
            if not done:  # rare, and it breaks "returned means readable": say so
                log.warning("%s: weights %r version %d: the directory has not confirmed it "
                            "within %g s; publish returns, and a subscriber asking now may "
                            "not see it yet", self.service.worker, self.name, version,
                            ANNOUNCE_WAIT_S)
            if not host and self.host_wanted and announcing.done() and gpu is not None:
                # The directory knew a host reader this publish had not heard of yet (its
                # word was on its way): copy the version to host memory before returning,
                # or that reader would be offered the previous version after publish
                # returned (docs/weights.md, "CUDA").
                if await self._copy_to_host(slot, version):
                    await asyncio.wait({self._announce_task(version, slot, True)},
                                       timeout=ANNOUNCE_WAIT_S)
            return version

    def _announce_task(self, version: int, slot: int, host: bool) -> asyncio.Task[None]:
        task = self._announcing = self.service.loop.create_task(
            self._announce(version, slot, host))
        return task

    async def _copy_to_host(self, slot: int, version: int) -> bool:
        """Copy ``version`` from GPU slot ``slot`` to its host bytes and mark it there (the
        caller holds the publish lock); False if it is there already or no longer held."""
        segment, gpu = self._segment, self._gpu
        assert segment is not None and gpu is not None
        if segment.host_version(slot) == version:
            return False
        await self.service.copy(self._host_slots)
        await self.service.copy(lambda: gpu.to_host(slot, segment.slot(slot)))
        if not segment.mark_host(slot, version):
            return False
        self.host_backfills += 1
        return True

    def _host_slots(self) -> None:
        """Copier thread: make the segment's host bytes exist (reserved, mapped and, for a
        CUDA publisher, page-locked), the first time a version must reach them."""
        segment, gpu = self._segment, self._gpu
        assert segment is not None
        if segment.ensure_host() and gpu is not None:
            whole = segment.host_bytes()
            if cuda.pin_host(whole, gpu.device):
                self._pinned = whole

    def on_host_wanted(self, wanted: bool, incarnation: str, counter: int) -> None:
        """The directory says whether some subscriber reads this shard from host memory
        (its ``counter`` orders its answers: an older one arriving late is ignored). When
        one does and the newest version is on the GPU only, it is copied to its host slot
        now (`_fill_host`), beside publish: the host reader waits for that copy, not for
        the next publish."""
        mark = self._host_mark
        if incarnation == mark[0] and counter <= mark[1]:
            return
        self._host_mark = (incarnation, counter)
        self.host_wanted = bool(wanted)
        if self.host_wanted and self._gpu is not None \
                and (self._backfill is None or self._backfill.done()):
            self._backfill = self.service.loop.create_task(self._fill_host())

    async def _fill_host(self) -> None:
        """Copy the newest complete version from its GPU slot to its host bytes, if it is not
        there yet, and tell the directory; under the publish lock (a publish meanwhile
        waits for this one copy), so the slot cannot be rewritten while it is copied."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        try:
            async with self._lock:
                segment, gpu = self._segment, self._gpu
                if segment is None or gpu is None or not self.host_wanted:
                    return
                slot = max(range(SLOTS), key=segment.version)
                version = segment.version(slot)
                if version < 0 or not await self._copy_to_host(slot, version):
                    return
            await self._announce(version, slot, True)
        except Exception as exc:  # host readers keep waiting; the next publish writes host
            log.warning("%s: weights %r: newest version not copied to host memory: %r",
                        self.service.worker, self.name, exc)

    async def _announce(self, version: int, slot: int, host: bool = True) -> None:
        """Tell the directory ``version`` is complete in ``slot`` (``host``: in its host bytes
        too), after the announces of earlier versions (they may still be waiting for a hung
        directory); a directory that is down is not waited for: its restore lists the slot.
        The answer says whether host readers exist (`on_host_wanted`)."""
        if self._announce_lock is None:
            self._announce_lock = asyncio.Lock()
        service = self.service
        async with self._announce_lock:
            try:
                reply = await service.call_directory(
                    self.name, Announce(service.worker, self.shard, version, slot, host=host),
                    patience=0.0)
                if reply.host is not None:
                    self.on_host_wanted(reply.host.wanted, reply.host.incarnation,
                                        reply.host.counter)
            except PeerLostError as exc:
                log.info("%s: weights %r version %d: the directory is down (%s); it hears of "
                         "the version when it is back", service.worker, self.name, version, exc)
            except Exception as exc:  # nobody awaits this task: say it here
                log.warning("%s: weights %r version %d not announced: %r", service.worker,
                            self.name, version, exc)

    async def _restore(self, call: DirectoryCall) -> None:
        """Tell a restarted directory this publisher's source, then each complete slot
        (oldest first, as they were announced)."""
        segment, layout, source = self._segment, self._layout, self._source
        if segment is None or layout is None or source is None:
            return
        await call(RegisterPublisher(source, self.num_shards, self.service.node_id, layout))
        for version, slot in sorted((segment.version(s), s) for s in range(SLOTS)):
            if version >= 0:
                await call(Announce(self.service.worker, self.shard, version, slot,
                                    host=segment.host_version(slot) == version))

    async def _segment_for(self, state_dict: Mapping[str, Any]
                           ) -> tuple[VersionedSegment, TensorPlan]:
        """The segment and the plan of this publisher's layout, made and registered by the
        first publish (from ``state_dict``); later ones check against the plan."""
        if self._segment is not None and self._plan is not None:
            return self._segment, self._plan
        layout = layout_of(state_dict, self.bucket_bytes)
        device = cuda_device_of(state_dict)
        gpu = None if device is None else CudaSlots(layout, device, SLOTS)
        # A GPU publisher's host bytes are made only when a version must reach them.
        segment = VersionedSegment(layout.nbytes, host=gpu is None)
        service = self.service
        source = ShardSource(self.shard, service.worker, service.info.endpoint, segment.ref,
                             cuda=None if gpu is None else gpu.export)
        # Before the directory lists us: a representative may ask to join at once.
        fanout = None if gpu is None else GpuFanout(service, self.name, self.shard, layout, gpu,
                                                    segment)
        # Before the directory lists us too: it says at once whether host readers exist.
        service.host_handlers[(self.name, self.shard)] = self.on_host_wanted
        try:
            registered = await service.call_directory(
                self.name, RegisterPublisher(source, self.num_shards, service.node_id, layout))
        except BaseException:
            service.host_handlers.pop((self.name, self.shard), None)
            if fanout is not None:
                fanout.close()
            segment.close()
            raise
        service.segments[(self.name, self.shard)] = segment
        service.on_close(self._unpin)
        self._floor = registered.floor
        self._segment, self._layout, self._gpu, self._fanout = segment, layout, gpu, fanout
        self._plan = TensorPlan(layout)
        self._source = source
        await service.on_directory_restart(self.name, self._restore)
        return segment, self._plan


    def _unpin(self) -> None:
        """Unlock the host slots' pages (before the service closes the segment)."""
        pinned, self._pinned = self._pinned, None
        if pinned is not None:
            try:
                cuda.unpin_host(pinned)
            except Exception as exc:  # closing: say it, go on
                log.info("weights %r: host slots not unpinned: %r", self.name, exc)


def write_tensors(tensors: list[Any], places: list[Any], groups: list[list[int]]) -> None:
    """Copy the tensors of a state dict (`TensorPlan.sources`) to their places in a host slot
    (`TensorPlan.host_places`), one fused copy per dtype (`TensorPlan.groups`); CUDA and
    strided tensors too, each finished on return."""
    copy_grouped(places, tensors, groups, non_blocking=False)
