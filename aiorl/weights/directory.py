"""The directory of one weight name: who publishes which shard, and which versions exist where.

Weight name ``x`` has one directory, hosted by the one-rank worker group ``weights.x``
(launched on demand by the first publisher or subscriber, on its own node, like a channel).
It never sees a tensor byte: it holds, per shard, the *sources* of that shard (the
publisher's segment on its node, and on every other node the segment of that node's relay)
and which version each source's two slots hold. From that it answers the one question a
subscriber asks: *what is the newest version every shard has on my node, and in which
slots?* It also elects one relay per (node, shard) whose publisher is elsewhere, and tells
that relay which version to fetch.

Publishers and relays report a slot only once it is complete (``announce``), so the
directory's view never includes a version being written; readers still verify each copy
with the segment's seqlock, because a slot may be overwritten after the directory answered.

The directory watches every publisher and relay through the registry. A dead publisher
marks its shard *lost* (``wait_for`` beyond the last complete version then raises
``PeerLostError``) until a new incarnation registers; a dead relay is replaced by the next
subscriber of its node that polls.

For a publisher on a GPU, the directory also decides whether its versions must reach host
memory (`reads_from_gpu`): only while some subscriber reads that shard from the host
slots (one on the CPU, on another GPU or another node, or one that has not yet said where
it pulls to). It tells the publisher (``WeightsOp.HOST``, one-way, numbered so that a late
message is ignored) and lists a version written to the GPU only as such
(`ShardSource.device_only`): a subscriber that reads host memory is never offered it.

The directory itself is *soft state*: its group restarts it when it dies
(``restart="on_failure"``), empty, and every publisher and relay tells the new incarnation
again what it holds (``register_publisher`` and ``announce`` of its complete slots,
``restore_relay``) before anything else it sends; a subscriber's poll names the
incarnation it last heard (``NodeView.directory``), so a new one answers it at once.

Every request and reply is a typed message of `aiorl.protocol.weights` (``SCHEMA`` pairs
them), checked field by field when it arrives.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from aiorl.errors import PeerLostError
from aiorl.names import WorkerAddress
from aiorl.protocol.ops import WeightsOp
from aiorl.protocol.weights import (
    Announce,
    AnnounceGpu,
    AnnounceReply,
    CudaExport,
    GpuSubscribe,
    HostNotice,
    HostPull,
    HostWanted,
    Layout,
    NodeView,
    Poll,
    PublisherRegistered,
    RegisterPublisher,
    RelayJob,
    RestoreRelay,
    SegmentRef,
    ShardSource,
)
from aiorl.runtime import Runtime, current_runtime

__all__ = ["GROUP_PREFIX", "WeightDirectory", "directory_group", "reads_from_gpu"]

log = logging.getLogger("aiorl.weights")

#: The directory of weight name ``x`` is the worker group ``weights.x`` (rank 0).
GROUP_PREFIX = "weights."


def directory_group(name: str) -> str:
    """The worker group hosting the directory of weight name ``name``; validates the name."""
    if not isinstance(name, str) or not name:
        raise ValueError("a weight name must be a non-empty string")
    group = GROUP_PREFIX + name
    WorkerAddress(group)  # ValueError for ':' (it separates ranks in worker names)
    return group


def reads_from_gpu(worker: str, node_id: str, publisher_node: str, publisher_gpu: str | None,
                   gpu_of: Mapping[str, str], host_pulls: Collection[str]) -> bool:
    """Whether subscriber ``worker`` of ``node_id`` reads a shard published from GPU
    ``publisher_gpu`` (None: from host memory) on ``publisher_node`` without host memory:
    it said it pulls into that very GPU (``gpu_of``, its first pull into a GPU) and never
    pulled into host memory since (``host_pulls``). Every other subscriber, one that has not
    pulled yet included, may read the host slots: the publisher must write them."""
    return (publisher_gpu is not None and node_id == publisher_node
            and gpu_of.get(worker) == publisher_gpu and worker not in host_pulls)


@dataclass
class _Publisher:
    source: ShardSource
    node_id: str
    layout: Layout


class WeightDirectory:
    """The instance the ``weights.<name>`` worker hosts; its async methods run on its loop."""

    def __init__(self, name: str) -> None:
        runtime = current_runtime()
        if runtime is None:
            raise RuntimeError("a WeightDirectory runs inside an aiorl worker process")
        self.name = name
        self.runtime: Runtime = runtime
        #: Which incarnation this is: subscribers that knew another one are answered at once.
        self.incarnation = uuid.uuid4().hex
        self.num_shards: int | None = None
        self._publishers: dict[int, _Publisher] = {}
        self._relays: dict[tuple[str, int], ShardSource] = {}  # (node, shard) -> relay copy
        self._relay_workers: dict[tuple[str, int], str] = {}  # (node, shard) -> elected relay
        # (node, shard) -> the publisher segment the relay's copy came from.
        self._relay_origins: dict[tuple[str, int], SegmentRef] = {}
        self._lost: dict[int, str] = {}  # shard -> why its publisher is gone
        #: The newest version a publisher of each shard announced: its replacements start above.
        self._floors: dict[int, int] = {}
        # GPU representatives (aiorl.weights.nccl), by (node, GPU UUID, shard).
        self._gpu_of: dict[str, str] = {}  # subscriber -> the UUID of the GPU it pulls into
        self._gpu_reps: dict[tuple[str, str, int], str] = {}  # -> elected representative
        self._gpu_copies: dict[tuple[str, str, int], ShardSource] = {}  # -> its GPU slots
        self._by_endpoint: dict[str, str] = {}  # endpoint address -> worker name
        # Who reads host memory (for GPU publishers): every subscriber that polled, by node,
        # those that said they pulled into host memory, and what each GPU publisher was told
        # last (shard -> (publisher, wanted, counter); the counter orders the messages).
        self._subscribers: dict[str, str] = {}
        self._host_pulls: set[str] = set()
        self._host_told: dict[int, tuple[str, bool, int]] = {}
        self._host_counter = 0
        self._watches: dict[str, asyncio.Task[None]] = {}  # worker name -> its death watch
        self._generation = 0
        self._changed: asyncio.Event | None = None
        runtime.submit(runtime.endpoint.on_peer_lost, self._on_peer_lost)

    # ------------------------------------------------------------------ the wire
    # Each `DirectoryOp` is the method of its name. It reads its request with the request
    # type's ``from_wire`` (a malformed one fails the call with ProtocolError before anything
    # is stored) and answers with its reply type's wire form (aiorl.protocol.weights.SCHEMA).
    async def register_publisher(self, meta: object) -> object:
        """`RegisterPublisher`; answers `PublisherRegistered`."""
        m = RegisterPublisher.from_wire(meta)
        floor = await self._register_publisher(m.source, m.num_shards, m.node_id, m.layout)
        return PublisherRegistered(floor).to_wire()

    async def announce(self, meta: object) -> object:
        """`Announce`; answers `AnnounceReply`."""
        m = Announce.from_wire(meta)
        host = await self._announce(m.worker, m.shard, m.version, m.slot, m.ref, m.node_id,
                                    m.host)
        return AnnounceReply(host).to_wire()

    async def host_pull(self, meta: object) -> None:
        """`HostPull`; answers `Ack` (nil)."""
        m = HostPull.from_wire(meta)
        await self._host_pull(m.worker, m.node_id)

    async def restore_relay(self, meta: object) -> None:
        """`RestoreRelay`; answers `Ack` (nil)."""
        m = RestoreRelay.from_wire(meta)
        await self._restore_relay(m.worker, m.node_id, m.shard, m.ref, m.slots, m.origin)

    async def gpu_subscribe(self, meta: object) -> None:
        """`GpuSubscribe`; answers `Ack` (nil)."""
        m = GpuSubscribe.from_wire(meta)
        await self._gpu_subscribe(m.worker, m.node_id, m.uuid)

    async def announce_gpu(self, meta: object) -> None:
        """`AnnounceGpu`; answers `Ack` (nil)."""
        m = AnnounceGpu.from_wire(meta)
        await self._announce_gpu(m.worker, m.node_id, m.uuid, m.shard, m.version, m.slot, m.ref,
                                 m.export)

    async def poll(self, meta: object) -> object:
        """`Poll`; answers `NodeView`."""
        m = Poll.from_wire(meta)
        return (await self._poll(m.worker, m.node_id, m.generation, m.wait_s,
                                 m.directory)).to_wire()

    # ------------------------------------------------------------------ publishers
    async def _register_publisher(self, source: ShardSource, num_shards: int, node_id: str,
                                  layout: Layout) -> int | None:
        """Shard ``source.shard`` of ``num_shards`` is published by ``source.worker``.

        Returns the newest version a publisher of this shard completed (None: none yet): a
        publisher that replaces another (a restarted rank, a new group reusing the name)
        must publish above it, so that versions never go back (docs/weights.md, rule 2).
        Per shard: the publishers of the other shards publish the same version numbers."""
        if self.num_shards is None:
            self.num_shards = num_shards
        elif num_shards != self.num_shards:
            raise ValueError(f"weights {self.name!r} have {self.num_shards} shard(s); a publisher "
                             f"says {num_shards}")
        if not 0 <= source.shard < num_shards:
            raise ValueError(f"shard {source.shard} is outside 0..{num_shards - 1}")
        names = {t.name for t in layout.tensors}
        for shard, other in self._publishers.items():
            clash = names & {t.name for t in other.layout.tensors}
            if shard != source.shard and clash:
                raise ValueError(f"shards {shard} and {source.shard} of weights {self.name!r} "
                                 f"both publish {sorted(clash)[:3]}: shards must be disjoint")
        old = self._publishers.get(source.shard)
        if old is not None and old.source.worker != source.worker \
                and source.shard not in self._lost:
            raise ValueError(f"shard {source.shard} of weights {self.name!r} is already "
                             f"published by {old.source.worker}")
        if old is not None and old.source.ref == source.ref:
            return self._floors.get(source.shard)  # registered again (a restore raced it)
        self._publishers[source.shard] = _Publisher(source, node_id, layout)
        self._lost.pop(source.shard, None)
        # Relays of another publisher's segment hold its layout: start them afresh.
        for key in [k for k in self._relays if k[1] == source.shard
                    and self._relay_origins.get(k) != source.ref]:
            del self._relays[key]
            self._relay_origins.pop(key, None)
        for gpu_key in [k for k in self._gpu_reps if k[2] == source.shard]:
            del self._gpu_reps[gpu_key]
            self._gpu_copies.pop(gpu_key, None)
        self._watch(source.worker)
        self._bump()
        return self._floors.get(source.shard)

    async def _announce(self, worker: str, shard: int, version: int, slot: int,
                        ref: SegmentRef | None, node_id: str, host: bool) -> HostWanted | None:
        """``worker`` (the shard's publisher, or a relay with its ``ref`` and node) completed
        ``version`` in ``slot``; the other slot keeps the version it held. ``host=False``: a
        GPU publisher wrote it to its GPU slot only (announced again with ``host=True`` once
        copied to host memory). A GPU publisher is answered whether host readers exist (as
        ``WeightsOp.HOST`` says it)."""
        pub = self._publishers.get(shard)
        if pub is None:
            raise LookupError(f"shard {shard} of weights {self.name!r} has no publisher")
        if worker == pub.source.worker:
            source = pub.source
            self._floors[shard] = max(self._floors.get(shard, version), version)
        else:
            if self._relay_workers.get((node_id, shard)) != worker or ref is None:
                return None  # a relay that was replaced meanwhile
            relay = self._relays.get((node_id, shard))
            if relay is None or relay.ref != ref:
                relay = self._relays[(node_id, shard)] = ShardSource(shard, worker, "", ref)
            self._relay_origins[(node_id, shard)] = pub.source.ref
            source = relay
            host = True  # a relay's copy is host memory
        self._hold(source, version, slot, host)
        told = self._host_told.get(shard)
        if source is not pub.source or told is None or told[0] != worker:
            return None
        return HostWanted(told[1], self.incarnation, told[2])

    async def _host_pull(self, worker: str, node_id: str) -> None:
        """Subscriber ``worker`` pulled into host memory (or another device than a GPU
        publisher's): from now on it is given only versions whose host bytes exist, and GPU
        publishers write their host slots (and copy their newest version there now)."""
        self._subscriber(worker, node_id)
        if worker not in self._host_pulls:
            self._host_pulls.add(worker)
            self._bump()

    async def _restore_relay(self, worker: str, node_id: str, shard: int, ref: SegmentRef,
                             slots: dict[int, int], origin: SegmentRef) -> None:
        """``worker`` was ``node_id``'s relay of ``shard`` before this directory restarted,
        and holds ``slots`` (version -> slot) copied from the publisher segment ``origin``:
        it stays the relay unless another was elected meanwhile. A copy of a publisher
        segment that is no longer the shard's is dropped when that publisher registers."""
        key = (node_id, shard)
        if self._relay_workers.get(key, worker) != worker:
            return
        pub = self._publishers.get(shard)
        if pub is not None and pub.source.ref != origin:
            return  # a copy of an older publisher: the relay fetches the new one's versions
        self._relay_workers[key] = worker
        self._watch(worker)
        self._relays[key] = ShardSource(shard, worker, "", ref, dict(slots))
        self._relay_origins[key] = origin
        self._bump()

    async def _gpu_subscribe(self, worker: str, node_id: str, uuid: str) -> None:
        """Subscriber ``worker`` pulls into GPU ``uuid`` of ``node_id``: for each shard a GPU
        publisher publishes on another GPU, one subscriber of that GPU (the first to ask)
        becomes its representative and receives the versions by NCCL."""
        if self._gpu_of.get(worker) != uuid:
            self._gpu_of[worker] = uuid
            self._bump()

    async def _announce_gpu(self, worker: str, node_id: str, uuid: str, shard: int,
                            version: int, slot: int, ref: SegmentRef, export: CudaExport) -> None:
        """Representative ``worker`` of GPU ``uuid`` holds ``version`` of ``shard`` complete
        in its GPU slot ``slot`` (``ref``: its seqlock header; ``export``: the slots)."""
        key = (node_id, uuid, shard)
        if self._gpu_reps.get(key) != worker:
            return  # a representative that was replaced meanwhile
        copy = self._gpu_copies.get(key)
        if copy is None or copy.ref != ref:
            copy = self._gpu_copies[key] = ShardSource(shard, worker, "", ref, cuda=export)
        self._hold(copy, version, slot)

    def _hold(self, source: ShardSource, version: int, slot: int, host: bool = True) -> None:
        """``source`` holds ``version`` in ``slot`` now (and no longer what it held there);
        ``host``: in its host bytes too."""
        for held, held_slot in list(source.slots.items()):
            if held_slot == slot:
                del source.slots[held]
                source.device_only.discard(held)
        source.slots[version] = slot
        if not host:
            source.device_only.add(version)
        self._bump()

    # ------------------------------------------------------------------ subscribers
    async def _poll(self, worker: str, node_id: str, generation: int, wait_s: float,
                    directory: str) -> NodeView:
        """The state for subscriber ``worker`` on ``node_id`` once it is newer than
        ``generation`` of incarnation ``directory`` (or after ``wait_s`` seconds, whichever
        comes first); at once for a subscriber that knew another incarnation."""
        self._subscriber(worker, node_id)
        if directory == self.incarnation and generation >= self._generation:
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), wait_s)
            except TimeoutError:
                pass
        return self._view(worker, node_id)

    def _view(self, worker: str, node_id: str) -> NodeView:
        n = self.num_shards
        if n is None or len(self._publishers) < n:
            return NodeView(None, (), (), (), self._lost_reason(), self._generation,
                            self.incarnation)
        sources: list[ShardSource] = []
        jobs: list[RelayJob] = []
        # A relay fetches host bytes: the newest version every publisher holds there.
        newest = self._newest({s: p.source for s, p in self._publishers.items()}, range(n))
        from_host: list[int] = []  # the shards this subscriber reads from host memory
        for shard in range(n):
            pub = self._publishers[shard]
            export = pub.source.cuda
            if not reads_from_gpu(worker, node_id, pub.node_id,
                                  None if export is None else export.device_uuid,
                                  self._gpu_of, self._host_pulls):
                from_host.append(shard)
            if pub.node_id == node_id:
                sources.append(pub.source)
                continue
            key = (node_id, shard)
            relay = self._relay_workers.get(key)
            if relay is None:  # the first subscriber of the node to ask relays for it
                relay = self._relay_workers[key] = worker
                self._watch(worker)
            copy = self._relays.get(key)
            if relay == worker and newest is not None and newest not in (copy.slots if copy else {}) \
                    and shard not in self._lost:
                jobs.append(RelayJob(shard, newest, pub.source))
            sources.append(copy or ShardSource(shard, relay, "", pub.source.ref))
        version = self._newest(dict(enumerate(sources)), from_host)
        layouts = tuple(self._publishers[s].layout for s in range(n))
        gpu_sources, gpu_jobs = self._gpu_view(worker, node_id, n)
        return NodeView(version, tuple(sources), layouts, tuple(jobs), self._lost_reason(),
                        self._generation, self.incarnation, gpu_sources, gpu_jobs)

    def _gpu_view(self, worker: str, node_id: str, n: int
                  ) -> tuple[tuple[ShardSource | None, ...], tuple[ShardSource, ...]]:
        """The copies on ``worker``'s GPU of shards published from other GPUs, and the shards
        it represents its GPU for (electing it if the GPU has no representative yet)."""
        uuid = self._gpu_of.get(worker)
        if uuid is None:
            return (), ()
        copies: list[ShardSource | None] = []
        jobs: list[ShardSource] = []
        for shard in range(n):
            export = self._publishers[shard].source.cuda
            if export is None or export.device_uuid == uuid or shard in self._lost:
                copies.append(None)  # no GPU source, the publisher's own GPU, or gone
                continue
            key = (node_id, uuid, shard)
            rep = self._gpu_reps.get(key)
            if rep is None:
                rep = self._gpu_reps[key] = worker
                self._watch(worker)
            if rep == worker:
                jobs.append(self._publishers[shard].source)
            copies.append(self._gpu_copies.get(key))
        return tuple(copies), tuple(jobs)

    @staticmethod
    def _newest(sources: dict[int, ShardSource], from_host: Collection[int] = ()) -> int | None:
        """The newest version every source holds complete (None when they share none); for
        the shards in ``from_host``, complete in host memory."""
        common: set[int] | None = None
        for shard, source in sources.items():
            held = set(source.slots)
            if shard in from_host:
                held -= source.device_only
            common = held if common is None else common & held
        return max(common) if common else None

    # ------------------------------------------------------------------ host readers
    def _subscriber(self, worker: str, node_id: str) -> None:
        """Know subscriber ``worker`` (a possible host reader until it says otherwise) and
        watch it: a dead one no longer makes GPU publishers write host memory."""
        if self._subscribers.get(worker) != node_id:
            self._subscribers[worker] = node_id
            self._watch(worker)
            self._tell_publishers()

    def host_wanted(self, shard: int) -> bool:
        """Whether some known subscriber may read ``shard`` from host memory (always True for
        a publisher without GPU slots; see `reads_from_gpu`)."""
        pub = self._publishers[shard]
        export = pub.source.cuda
        if export is None:
            return True
        return any(not reads_from_gpu(worker, node, pub.node_id, export.device_uuid,
                                      self._gpu_of, self._host_pulls)
                   for worker, node in self._subscribers.items())

    def _tell_publishers(self) -> None:
        """Tell each live GPU publisher whether host readers exist, when that changed (or the
        publisher did). One-way: the publisher applies only answers newer than the last it
        applied, and each announce's answer repeats the latest."""
        for shard, pub in self._publishers.items():
            if pub.source.cuda is None or shard in self._lost:
                continue
            wanted = self.host_wanted(shard)
            told = self._host_told.get(shard)
            if told is not None and told[:2] == (pub.source.worker, wanted):
                continue
            self._host_counter += 1
            self._host_told[shard] = (pub.source.worker, wanted, self._host_counter)
            try:
                self.runtime.endpoint.send_oneway(
                    pub.source.endpoint, WeightsOp.HOST,
                    HostNotice(self.name, shard, HostWanted(wanted, self.incarnation,
                                                            self._host_counter)).to_wire())
            except Exception as exc:  # a lost publisher: its death report follows
                log.info("weights %r: publisher %s of shard %d not told about host readers: "
                         "%r", self.name, pub.source.worker, shard, exc)

    def _lost_reason(self) -> str | None:
        if not self._lost:
            return None
        return "; ".join(f"shard {s}: {why}" for s, why in sorted(self._lost.items()))

    # ------------------------------------------------------------------ deaths
    def _watch(self, worker: str) -> None:
        """Learn of ``worker``'s death (once per worker, however often it is elected)."""
        if worker not in self._watches:
            self._watches[worker] = self.runtime.loop.create_task(self._resolve(worker))

    async def _resolve(self, worker: str) -> None:
        try:
            info = await self.runtime.resolve_worker(worker, timeout=60.0)
        except PeerLostError as exc:
            self._worker_lost(worker, str(exc))
            return
        self._by_endpoint[str(info["endpoint"])] = worker
        if self.runtime.endpoint.is_lost(str(info["endpoint"])):
            self._worker_lost(worker, f"worker {worker} is gone")

    def _on_peer_lost(self, address: str, exc: BaseException) -> None:
        worker = self._by_endpoint.get(address)
        if worker is not None:
            self._worker_lost(worker, str(exc) or f"worker {worker} is gone")

    def _worker_lost(self, worker: str, reason: str) -> None:
        self._watches.pop(worker, None)  # a new incarnation is watched afresh
        for shard, pub in self._publishers.items():
            if pub.source.worker == worker:
                self._lost[shard] = f"publisher {worker} is gone: {reason}"
        for key, relay in list(self._relay_workers.items()):
            if relay == worker:
                del self._relay_workers[key]
                self._relays.pop(key, None)
                self._relay_origins.pop(key, None)
        self._gpu_of.pop(worker, None)
        self._subscribers.pop(worker, None)
        self._host_pulls.discard(worker)
        for gpu_key, rep in list(self._gpu_reps.items()):
            if rep == worker:
                del self._gpu_reps[gpu_key]
                self._gpu_copies.pop(gpu_key, None)
        self._bump()

    def _bump(self) -> None:
        self._generation += 1
        self._tell_publishers()
        if self._changed is not None:
            self._changed.set()
            self._changed = None
