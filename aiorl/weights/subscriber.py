"""The subscribing side: ``sub = self.weight_subscriber(name); v = await sub.pull(into=sd)``.

A subscriber follows its weight name's directory with one long poll at a time (so
``latest_version`` is a plain attribute read) and pulls by copying each shard straight out
of the node's shared segment into the caller's tensors under the segment's seqlock. When the
directory elects it as its node's relay for a shard published on another node, the same
follow loop fetches each new version's buckets from the publisher into a segment of its
own, which every subscriber of the node then reads (`aiorl.weights.node_relay`). When it
pulls into a GPU that a GPU publisher is not on, the directory may elect it its GPU's
representative, which receives versions by NCCL (`aiorl.weights.gpu_representative`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiorl.cuda.bulk_copy import copy_grouped
from aiorl.errors import PeerLostError
from aiorl.protocol.weights import HostPull, Layout, NodeView, Poll, SegmentRef, ShardSource
from aiorl.runtime import AsyncWork
from aiorl.runtime.promise import trace_until_settled
from aiorl.trace import recorder as _trace
from aiorl.transport.shared_memory import ShmUnavailable
from aiorl.weights import cuda
from aiorl.weights.gpu_representative import GpuRepresentative
from aiorl.weights.layout import TensorPlan, plan_of
from aiorl.weights.node_relay import NodeRelay
from aiorl.weights.segment import SLOTS, SegmentReader
from aiorl.weights.service import POLL_S, DirectoryCall, WeightsService

__all__ = ["SubscriberStatistics", "WeightSubscriber", "read_tensors"]

log = logging.getLogger("aiorl.weights")

@dataclass(frozen=True)
class SubscriberStatistics:
    """What one subscriber did: pulls, bytes copied into the caller's tensors, pulls
    retried after a torn copy, versions skipped between pulls, as its node's relay,
    versions and bytes it received from publishers on other nodes, and as its GPU's
    representative, versions and bytes it received by NCCL from a publisher's GPU
    (`aiorl.weights.nccl`).

    Example:
        ```python
        stats = self.weight_subscriber("policy").statistics()
        print(stats.pulls, stats.bytes_copied, stats.torn_retries)
        ```
    """

    pulls: int
    bytes_copied: int
    torn_retries: int
    versions_skipped: int
    relayed_versions: int
    relayed_bytes: int
    gpu_versions: int = 0
    gpu_bytes: int = 0


class WeightSubscriber:
    """Pulls complete versions of the weights ``name`` (see docs/weights.md).

    Get one with [`Worker.weight_subscriber`][aiorl.Worker.weight_subscriber] rather than
    building it: [`pull`][aiorl.weights.WeightSubscriber.pull] copies the newest complete
    version into your tensors, [`wait_for`][aiorl.weights.WeightSubscriber.wait_for] waits
    for a version, [`latest_version`][aiorl.weights.WeightSubscriber.latest_version] says
    which is newest without waiting.

    Args:
        service: This process's weights service.
        name: The weight name.

    Example:
        ```python
        sub = self.weight_subscriber("policy")
        await sub.wait_for(step)                        # at least version step
        version = await sub.pull(into=self.model.state_dict())
        ```
    """

    def __init__(self, service: WeightsService, name: str) -> None:
        self.service = service
        self.name = name
        self._view: NodeView | None = None
        self._latest: int | None = None
        self._lost: str | None = None
        self._changed: asyncio.Event | None = None
        self._readers: dict[SegmentRef, SegmentReader] = {}
        self._gpu_slots: dict[SegmentRef, list[cuda.GpuSlot]] = {}  # a GPU publisher's slots, opened
        # Told the directory it pulls into host memory although it named a GPU: GPU
        # publishers write their host slots for it (docs/weights.md, "CUDA").
        self._host_pull = False
        self._pulled: int | None = None
        self._stats = {"pulls": 0, "bytes_copied": 0, "torn_retries": 0, "versions_skipped": 0,
                       "relayed_versions": 0, "relayed_bytes": 0, "gpu_versions": 0,
                       "gpu_bytes": 0}
        # Its roles besides pulling, as the directory elects it.
        self._node_relay = NodeRelay(service, name, self._stats)
        self._representative = GpuRepresentative(service, name, self._stats)
        self._task: asyncio.Task[None] | None = None
        #: The waits under way (``wait_for`` and pulls with no version to copy yet), by a
        #: token of each: (operation, wanted version or None for "any", start in
        #: ``time.time()``). Read by `waits` for ``aiorl doctor``; kept on the loop only.
        self._waiting: dict[object, tuple[str, int | None, float]] = {}
        service.runtime.submit(self._start)

    # ------------------------------------------------------------------ public
    @property
    def latest_version(self) -> int | None:
        """The newest complete version on this node known here (None before the first).

        Never blocks: it is what the directory last told this subscriber.
        """
        return self._latest

    def pull(self, into: Mapping[str, Any]) -> AsyncWork[int]:
        """Copy the newest complete version into ``into`` (name -> tensor) and return it.

        "Newest" is [`latest_version`][aiorl.weights.WeightSubscriber.latest_version] (or
        newer), which follows the publisher by one directory message: to pull at least
        version v, ``await wait_for(v)`` first.
        Every published tensor must be in ``into`` with the same dtype and shape; the copy
        is in place. Waits only when no version exists yet; never for a publish in
        progress. A pull returns one complete version: a copy the publisher overwrote
        meanwhile is retried with the newest version.

        Args:
            into: Name -> tensor, one for every published tensor, with its dtype and shape
                (a model's ``state_dict()``); the version is copied into them in place.

        Returns:
            An [`AsyncWork`][aiorl.AsyncWork] completing with the version copied.

        Raises:
            TypeError: ``into`` is not a mapping.
            KeyError: (the work fails with it) ``into`` lacks a published tensor.
            ValueError: (the work fails with it) a tensor's dtype or shape differs from the
                published one.
            PeerLostError: (the work fails with it) no version exists and the publisher or
                the directory is gone.
        """
        if not isinstance(into, Mapping):
            raise TypeError(f"into must be a mapping of names to tensors, "
                            f"got {type(into).__name__}")
        work = self.service.run(self._pull(into))
        if _trace.ON:
            trace_until_settled(work, _trace.begin("weights", f"pull {self.name}", None,
                                                   latest=self._latest))
        return work

    def wait_for(self, min_version: int, timeout: float | None = None) -> AsyncWork[int]:
        """Wait until a version >= ``min_version`` is complete on this node; return it.

        A directory being restarted is waited for.

        Args:
            min_version: The oldest version that will do.
            timeout: Seconds to wait at most; None waits for ever.

        Returns:
            An [`AsyncWork`][aiorl.AsyncWork] completing with the newest complete version,
                ``>= min_version``.

        Raises:
            PeerLostError: (the work fails with it) a publisher is gone before that version
                exists, or the directory is gone and not restarted within its bound.
            WaitTimeout: (the work fails with it) no such version after ``timeout`` s.
        """
        return self.service.run(self._wait_for(min_version, timeout))

    def refresh(self) -> AsyncWork[int | None]:
        """Ask the directory now (not at its next change) and return ``latest_version``.

        For code that must not miss a version published just before it asks, such as a
        final report: ``latest_version`` alone may lag by one directory round trip.

        Returns:
            An [`AsyncWork`][aiorl.AsyncWork] completing with the newest complete version on
                this node, or None when there is none yet.
        """
        return self.service.run(self._refresh())

    async def _refresh(self) -> int | None:
        service = self.service
        view: NodeView = await service.call_directory(
            self.name, Poll(service.worker, service.node_id, -1, 0.0))
        self._take(view)
        if view.version is not None and (self._latest is None or view.version > self._latest):
            self._latest = view.version
        return self._latest

    def statistics(self) -> SubscriberStatistics:
        """What this subscriber did so far: pulls, bytes copied, retries, relaying.

        Returns:
            A [`SubscriberStatistics`][aiorl.weights.SubscriberStatistics] snapshot.
        """
        return SubscriberStatistics(**self._stats)

    def waits(self) -> list[dict[str, Any]]:
        """The waits of this subscriber under way, as ``aiorl doctor`` joins them to the other
        mechanisms' (one typed record each, as ``P2PEngine.waits``): ``{"kind": "weights",
        "op": "wait_for" or "pull", "name", "wanted": the version waited for (None: any),
        "latest": the newest version known here, "since": start, in time.time()}``. Only a
        publish of ``name`` can end one (runtime loop only)."""
        return [{"kind": "weights", "op": op, "name": self.name, "wanted": wanted,
                 "latest": self._latest, "since": since}
                for op, wanted, since in self._waiting.values()]

    # ------------------------------------------------------------------ following the directory
    def _start(self) -> None:
        self._task = self.service.loop.create_task(self._follow())
        self.service.on_close(self._close)

    async def _follow(self) -> None:
        try:
            await self._follow_directory()
        finally:
            self._notify()  # waiters see that the task ended (and why, in _lost)

    async def _follow_directory(self) -> None:
        """Long-poll the directory for ever. A directory that dies is waited for while its
        group restarts it (the poll names the incarnation it last heard, so a new one
        answers at once); one that stays away longer than the service's patience makes
        ``wait_for`` raise, and is still polled for in case it comes back."""
        service = self.service
        generation, incarnation = -1, ""
        following = False
        while True:
            try:
                if not following:
                    await service.on_directory_restart(self.name, self._restore)
                    following = True
                view: NodeView = await service.call_directory(
                    self.name, Poll(service.worker, service.node_id, generation, POLL_S,
                                    incarnation), wait_s=POLL_S)
            except Exception as exc:  # gone for longer than the patience, or not launched
                self._lost = (str(exc) if isinstance(exc, PeerLostError) else
                              f"cannot follow the directory of weights {self.name!r}: {exc!r}")
                log.warning("%s: %s", service.worker, self._lost)
                self._notify()
                await asyncio.sleep(1.0)  # and poll again: it may come back
                continue
            generation, incarnation = view.generation, view.directory
            self._take(view)
            self._lost = view.lost
            if view.version is not None and (self._latest is None or view.version > self._latest):
                self._latest = view.version
            self._notify()
            for publisher in view.gpu_jobs:
                self._representative.represent(publisher, view.layouts[publisher.shard])
            for job in view.relay_jobs:
                await self._node_relay.relay(job, view.layouts[job.shard])

    def _take(self, view: NodeView) -> None:
        """Make ``view`` the one pulls copy from, unless it comes from a restarted directory
        that has not yet heard every source again and offers an older version (or none)
        than the view it replaces: across a directory restart a subscriber's versions
        never go backwards (the older view's slots are still checked by the seqlock)."""
        current = self._view
        if current is not None and current.version is not None \
                and view.directory != current.directory \
                and (view.version is None or view.version < current.version):
            return
        self._view = view

    async def _restore(self, call: DirectoryCall) -> None:
        """Tell a restarted directory what this subscriber holds: each shard it relays for
        its node (its segment, complete slots and the publisher segment they came from)
        and the GPU it pulls into."""
        service = self.service
        await self._node_relay.restore(call)
        await self._representative.restore(call)
        if self._host_pull:
            await call(HostPull(service.worker, service.node_id))

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _next_change(self) -> None:
        if self._task is not None and self._task.done():
            raise PeerLostError(self._lost or f"subscriber of {self.name!r} stopped following")
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()

    # ------------------------------------------------------------------ pull and wait
    async def _pull(self, into: Mapping[str, Any]) -> int:
        token = object()
        try:
            return await self._pull_once(into, token)
        finally:
            self._waiting.pop(token, None)

    async def _pull_once(self, into: Mapping[str, Any], token: object) -> int:
        await self._representative.subscribe(into)
        tried: NodeView | None = None  # a view whose copy came out torn
        caught_up = False
        while True:
            view = self._view
            if not caught_up and view is not None and view.version is not None \
                    and self._behind(view):
                # A publish completed a newer version in a segment of this view: it may
                # have returned already, while the directory's message that says so is
                # still on its way here. Ask the directory now (once per pull).
                caught_up = True
                await self._catch_up()
                continue
            # An older version than one already offered is the view of a subscriber that
            # just said it reads host memory, until the publisher copied its newest version
            # (on its GPU only) there. Versions never go back: it waits for that copy.
            older = view is not None and view.version is not None \
                and self._latest is not None and view.version < self._latest
            if view is None or view.version is None or view is tried or older:
                if view is not None and view.version is None and self._lost is not None:
                    raise PeerLostError(self._lost)
                if older and self._lost is not None:
                    raise PeerLostError(f"{self._lost} (version {self._latest} was on its "
                                        "GPU only and cannot reach host memory any more)")
                if view is None or view.version is None:
                    # No version at all yet: a wait only a publish ends (the doctor's).
                    self._waiting.setdefault(token, ("pull", None, time.time()))
                await self._next_change()
                continue
            if await self._needs_host(view, into):
                tried = view  # its version is on a GPU only: wait for its host copy
                await self._next_change()
                continue
            copied = await self.service.copy(functools.partial(self._copy, view, into))
            if copied:
                self._account(view, into)
                return int(view.version)
            if copied is not None:
                self._stats["torn_retries"] += 1
            tried = view  # torn, or unreadable: the next view (a newer version) is waited for

    def _behind(self, view: NodeView) -> bool:
        """Whether a segment ``view`` reads holds a complete version newer than ``view``'s
        (its seqlock header says so: written before the version is announced)."""
        assert view.version is not None
        for source in view.sources:
            if not source.slots:
                continue  # a relay that holds nothing yet
            try:
                header = self._reader(source.ref).header
            except (OSError, ShmUnavailable):
                continue  # a source that cannot be opened any more: the copy says so
            for slot in range(SLOTS):
                if not int(header[2 * slot]) & 1 and int(header[2 * slot + 1]) > view.version:
                    return True
        return False

    async def _catch_up(self) -> None:
        """Take the directory's view now rather than at the follow loop's next message; a
        directory that does not answer at once is not waited for (the pull goes on)."""
        service = self.service
        try:
            view: NodeView = await service.call_directory(
                self.name, Poll(service.worker, service.node_id, -1, 0.0), patience=0.0)
        except Exception as exc:  # down or restarting: the view we have is still whole
            log.debug("weights %r: directory not asked before a pull: %r", self.name, exc)
            return
        self._take(view)
        if view.version is not None and (self._latest is None or view.version > self._latest):
            self._latest = view.version
        self._notify()

    def _from_gpu_slots(self, view: NodeView, shard: int, into: Mapping[str, Any]) -> bool:
        """Whether a pull of ``view``'s version copies ``shard`` from GPU slots into
        ``into`` (the publisher's, or its GPU representative's), not from host memory."""
        source = view.sources[shard]
        if source.cuda is not None and cuda.same_device(source.cuda, into):
            return True
        on_gpu = view.gpu_sources[shard] if view.gpu_sources else None
        return on_gpu is not None and view.version in on_gpu.slots \
            and cuda.same_device(on_gpu.cuda, into)

    async def _needs_host(self, view: NodeView, into: Mapping[str, Any]) -> bool:
        """Whether ``view``'s version is missing from the host memory this pull reads some
        shard from (a GPU publisher wrote it to its GPU only). A subscriber that named a GPU
        and reads host memory says so to the directory, once: from then on the publisher
        writes host memory (and copies its newest version there now)."""
        host = [shard for shard in range(len(view.sources))
                if not self._from_gpu_slots(view, shard, into)]
        missing = any(view.version in view.sources[shard].device_only for shard in host)
        if host and not self._host_pull and (self._representative.gpu is not None or missing):
            service = self.service
            try:
                await service.call_directory(
                    self.name, HostPull(service.worker, service.node_id), patience=0.0)
                self._host_pull = True
            except Exception as exc:  # a directory down: the next pull says it again
                log.debug("weights %r: host reads not registered: %r", self.name, exc)
        return missing

    def _copy(self, view: NodeView, into: Mapping[str, Any]) -> bool | None:
        """Copy ``view``'s version into ``into``: True, False if a copy came out torn (the
        slot was overwritten meanwhile), None if a source cannot be read any more: its
        segment went with its process (a publisher that died before this process mapped its
        segment; docs/weights.md), so pulls wait for a version someone alive holds."""
        try:
            return self._copy_sources(view, into)
        except ShmUnavailable as exc:
            log.info("weights %r version %s: a source is gone (%s); waiting for a newer "
                     "version", self.name, view.version, exc)
            return None

    def _copy_sources(self, view: NodeView, into: Mapping[str, Any]) -> bool:
        version = view.version
        assert version is not None
        plans = [plan_of(layout) for layout in view.layouts]
        dsts = [plan.destinations(into) for plan in plans]  # raises on a wrong into
        for shard, (source, layout) in enumerate(zip(view.sources, view.layouts, strict=True)):
            on_gpu = view.gpu_sources[shard] if view.gpu_sources else None
            if source.cuda is not None and cuda.same_device(source.cuda, into):
                copied = self._read_gpu(source, version, layout, into)
            elif self._from_gpu_slots(view, shard, into):
                # The version reached our GPU's representative by NCCL: device to device.
                assert on_gpu is not None
                copied = self._read_gpu(on_gpu, version, layout, into)
            else:  # from the host slot (also while a GPU round is still in flight)
                reader, slot = self._reader(source.ref), source.slots[version]
                copied = reader.read(slot, version,
                                     _from_host(plans[shard], dsts[shard], reader, slot))
            if not copied:
                return False
        return True

    def _read_gpu(self, source: ShardSource, version: int, layout: Layout,
                  into: Mapping[str, Any]) -> bool:
        """Copy ``version`` out of ``source``'s GPU slots (same GPU as ``into``), under the
        seqlock of its host header."""
        assert source.cuda is not None
        gpu = self._gpu_slots.get(source.ref)
        if gpu is None:
            # Our own slots as our GPU's representative are read directly; anyone else's
            # are opened once.
            own = self._representative.own_slots(source.ref)
            opened = own if own is not None else cuda.open_slots(source.cuda)
            gpu = self._gpu_slots[source.ref] = [cuda.GpuSlot(s) for s in opened]
        slot = source.slots[version]
        return self._reader(source.ref).read(slot, version, _from_gpu(layout, gpu[slot], into),
                                             host=False)

    def _account(self, view: NodeView, into: Mapping[str, Any]) -> None:
        assert view.version is not None
        stats = self._stats
        stats["pulls"] += 1
        stats["bytes_copied"] += sum(spec.nbytes for lay in view.layouts for spec in lay.tensors)
        if self._pulled is not None and view.version > self._pulled + 1:
            stats["versions_skipped"] += view.version - self._pulled - 1
        self._pulled = view.version
        # Mappings of segments no longer in the view (a restarted publisher) are dropped.
        live = {source.ref for source in (*view.sources, *view.gpu_sources) if source}
        live.update(self._representative.refs())
        for ref in [r for r in self._readers if r not in live]:
            del self._readers[ref]
            self._gpu_slots.pop(ref, None)

    def _reader(self, ref: SegmentRef) -> SegmentReader:
        reader = self._readers.get(ref)
        if reader is None:
            reader = self._readers[ref] = SegmentReader(ref)
        return reader

    async def _wait_for(self, min_version: int, timeout: float | None) -> int:
        async def wait() -> int:
            token = object()
            try:
                while True:
                    if self._latest is not None and self._latest >= min_version:
                        return self._latest
                    if self._lost is not None:
                        raise PeerLostError(self._lost)
                    self._waiting.setdefault(token, ("wait_for", min_version, time.time()))
                    await self._next_change()
            finally:
                self._waiting.pop(token, None)

        if timeout is None:
            return await wait()
        from aiorl.errors import WaitTimeout

        try:
            return await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            raise WaitTimeout(f"no version >= {min_version} of weights {self.name!r} within "
                              f"{timeout:g} s (latest: {self._latest})") from None

    def _close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._representative.close()
        self._node_relay.close()
        self._readers.clear()
        self._gpu_slots.clear()


def _from_host(plan: TensorPlan, dsts: list[Any], reader: SegmentReader,
               slot: int) -> Callable[[Any], None]:
    """The copy of one shard out of its host slot (given to the seqlocked read)."""
    return lambda host_slot: read_tensors(plan.host_places(reader, slot, host_slot), dsts,
                                          plan.groups)


def _from_gpu(layout: Layout, gpu_slot: cuda.GpuSlot,
              into: Mapping[str, Any]) -> Callable[[Any], None]:
    """The copy of one shard out of the publisher's GPU slot (the host slot only carries
    the seqlock)."""
    return lambda _host_slot: gpu_slot.read(layout, into)


def read_tensors(places: list[Any], dsts: list[Any], groups: list[list[int]]) -> None:
    """Copy each tensor's place in a host slot (`TensorPlan.host_places`) into its tensor of
    ``into`` (`TensorPlan.destinations`), one fused copy per dtype (`TensorPlan.groups`);
    CUDA and strided destinations too, each finished on return."""
    copy_grouped(dsts, places, groups, non_blocking=False)
