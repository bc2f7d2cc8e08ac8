"""CUDA publishers to CUDA subscribers on other GPUs: one NCCL broadcast round per version.

A publisher whose state dict is on a GPU keeps its two version slots on that GPU too
(`aiorl.weights.cuda`). Subscribers on that GPU copy out of them by CUDA IPC; a
subscriber whose ``into`` is on *another* GPU (of its node or another node) would cross the
host. Instead, the directory elects one subscriber per (node, GPU, shard) as that GPU's
*representative*; it keeps two GPU slots of its own (`GpuReceiver`) and joins the
publisher's NCCL rounds. Every other subscriber on that GPU copies out of the
representative's slots by CUDA IPC, exactly as it would out of a publisher on its GPU.

**Rounds.** The publisher (`GpuFanout`) runs at most one round at a time, each the
broadcast of one complete version from its GPU slot to every representative that joined
(the publisher is NCCL rank 0), bucket by bucket (``Layout.buckets``, one NCCL broadcast
each, issued back to back on the communicator's work-thread stream, straight into the
representatives' spare slots: bucket k+1 is on the wire while bucket k lands, and nothing
is staged). Rounds run beside ``publish``, never inside it: a version published while a
round runs becomes the *pending* round, replacing any version pending before it
(`RoundSchedule`), so a slow representative makes its GPU skip versions, it never
queues work on the publisher nor delays a publish.

**Consistency** is the seqlock of the host header, as for every other copy: a round notes
the sequence number of the slot it broadcasts from before it starts and compares it once
its GPU work completed; a publish that reused the slot meanwhile makes the round *torn*.
The publisher then tells every member (``weights.gpu.end``) whether its round was intact,
and a representative announces the version to the directory only if it was, and its own
NCCL work completed. A torn or failed round leaves the representative's slot holding no
version; the subscribers of that GPU meanwhile copy from the host slots (one host to device
copy each), so a pull never waits for a round.

**Communicators** are created lazily per member set (the publisher, then the
representatives in address order) with the broadcast machinery
(`aiorl.collective.nccl_broadcast.NcclCommunicator`: a work thread, non-blocking NCCL set-up
with aiorl's NCCL settings, a ``TCPStore`` hosted by the publisher whose address travels in
each round message). A join or a loss changes the set, so the next round creates a new one;
the previous one is retired when a round on its successor completed.

**Failures.** Both sides watch each other through the registry (``resolve_worker``) and the
endpoint's peer-lost reports. A lost member fails the running round with ``PeerLostError``
on the publisher at once, its communicator is aborted off the loop
(``abort_in_background``), and every other member is told the round ended torn, which fails
and aborts theirs: bounded by the registry's death report plus one message, never by NCCL's
timeout. A lost publisher fails a representative's round the same way (and the directory
marks the shard lost, so ``wait_for`` raises ``PeerLostError``).

Importable without CUDA: torch is imported inside functions, and nothing here runs unless a
CUDA state dict is published and a subscriber pulls into another GPU.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiorl.collective.nccl_broadcast import NcclCommunicator
from aiorl.cuda.completion import GpuHost, after_work_thread, gpu_done
from aiorl.errors import PeerLostError, ProtocolError
from aiorl.names import WorkerAddress
from aiorl.protocol.ops import WeightsOp
from aiorl.protocol.weights import AnnounceGpu, Layout, ShardSource
from aiorl.runtime.waiter import BlockingWaiter
from aiorl.transport.endpoint import Incoming
from aiorl.weights.cuda import CudaSlots
from aiorl.weights.segment import SLOTS, VersionedSegment
from aiorl.weights.service import WeightsService

__all__ = ["OP_END", "OP_JOIN", "OP_ROUND", "GpuFanout", "GpuReceiver", "Round",
           "RoundSchedule", "communicator_key", "nccl_weights"]

log = logging.getLogger("aiorl.weights")

#: The round messages (their meaning: `aiorl.protocol.ops.WeightsOp`).
OP_JOIN = WeightsOp.GPU_JOIN
OP_ROUND = WeightsOp.GPU_ROUND
OP_END = WeightsOp.GPU_END


# ----------------------------------------------------------------------------- schedule
@dataclass(frozen=True)
class Round:
    """One broadcast of ``version`` (in the publisher's slot ``slot``) to ``members`` (NCCL
    ranks 1..n in this order; the publisher is rank 0)."""

    number: int
    version: int
    slot: int
    members: tuple[str, ...]


class RoundSchedule:
    """Which round a publisher runs next: at most one runs, the newest version waits.

    Pure bookkeeping (no CUDA, no loop): `offer` a version when it is complete,
    `next` when something may have changed (a publish, a join, a round's end),
    `finished` when the running round ended. Versions offered while a round runs
    replace each other: only the newest is broadcast next, which is what keeps a slow
    member from making work pile up on the publisher.
    """

    def __init__(self) -> None:
        self.running: Round | None = None
        self._pending: tuple[int, int] | None = None
        self._numbers = itertools.count(1)

    def offer(self, version: int, slot: int) -> None:
        """Version ``version`` is complete in slot ``slot``: broadcast it next."""
        if self._pending is None or version > self._pending[0]:
            self._pending = (version, slot)

    def next(self, members: Sequence[str]) -> Round | None:
        """The round to start now (None while one runs, nothing is pending, or no member)."""
        if self.running is not None or self._pending is None or not members:
            return None
        version, slot = self._pending
        self._pending = None
        self.running = Round(next(self._numbers), version, slot,
                             tuple(sorted(set(members), key=WorkerAddress.from_name)))
        return self.running

    def finished(self) -> None:
        self.running = None


def communicator_key(name: str, shard: int, publisher: str, members: Sequence[str]) -> str:
    """The communicator of one member set of one publisher (also its TCPStore prefix)."""
    text = "\0".join(["weights", name, str(shard), publisher, *members])
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


def _bucket_views(slot: Any, layout: Layout) -> list[Any]:
    """One flat uint8 view of ``slot`` (a GPU slot) per bucket of ``layout``."""
    return [slot[start:end] for start, end in layout.buckets]


# ----------------------------------------------------------------------------- per process
@dataclass
class _Host:
    """What the GPU helpers (``gpu_done``, ``after_work_thread``) need: the loop and the waiter."""

    loop: asyncio.AbstractEventLoop
    waiter: BlockingWaiter

    def call_soon_threadsafe(self, fn: Callable[..., object], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)


class NcclWeights:
    """The NCCL side of one process's weights: routes round messages to its fanouts
    (publisher side) and receivers (representative side), and reports lost peers to them."""

    def __init__(self, service: WeightsService) -> None:
        self.service = service
        runtime = service.runtime
        self.host: GpuHost = _Host(runtime.loop, runtime.waiter)
        self.fanouts: dict[tuple[str, int], GpuFanout] = {}
        self.receivers: dict[tuple[str, int], GpuReceiver] = {}
        endpoint = runtime.endpoint
        endpoint.handle(OP_JOIN, self._on_join)
        endpoint.handle(OP_ROUND, self._on_round)
        endpoint.handle(OP_END, self._on_end)
        endpoint.on_peer_lost(self._on_peer_lost)
        service.on_close(self.close)

    def _on_join(self, msg: Incoming) -> None:
        name, shard, worker, address = msg.meta
        fanout = self.fanouts.get((name, shard))
        if fanout is None:
            msg.reply_error(LookupError(f"this worker does not publish shard {shard} of "
                                        f"weights {name!r} from a GPU"))
            return
        fanout.join(str(worker), str(address))
        msg.reply(True)

    def _on_round(self, msg: Incoming) -> None:
        receiver = self.receivers.get((msg.meta[0], msg.meta[1]))
        if receiver is not None:
            receiver.on_round(msg.meta)

    def _on_end(self, msg: Incoming) -> None:
        receiver = self.receivers.get((msg.meta[0], msg.meta[1]))
        if receiver is not None:
            receiver.on_end(int(msg.meta[2]), bool(msg.meta[3]))

    def _on_peer_lost(self, address: str, exc: BaseException) -> None:
        for fanout in list(self.fanouts.values()):
            fanout.peer_lost(address, exc)
        for receiver in list(self.receivers.values()):
            receiver.peer_lost(address, exc)

    def close(self) -> None:
        for fanout in list(self.fanouts.values()):
            fanout.close()
        for receiver in list(self.receivers.values()):
            receiver.close()
        self.fanouts.clear()
        self.receivers.clear()


def nccl_weights(service: WeightsService) -> NcclWeights:
    """The process's `NcclWeights` (loop thread), created on first use."""
    nccl = service.handles.get(NcclWeights)
    if nccl is None:
        nccl = service.handles[NcclWeights] = NcclWeights(service)
    assert isinstance(nccl, NcclWeights)
    return nccl


def _watch(service: WeightsService, worker: str, lost: Callable[[str, BaseException], None]
           ) -> None:
    """Have the registry watch ``worker`` (its death then reaches ``on_peer_lost``); a worker
    already gone is reported to ``lost`` at once."""

    async def resolve() -> None:
        try:
            info = await service.runtime.resolve_worker(worker, timeout=60.0)
        except (PeerLostError, LookupError) as exc:
            lost(worker, exc)
            return
        address = str(info["endpoint"])
        if service.runtime.endpoint.is_lost(address):
            lost(worker, PeerLostError(f"worker {worker} is gone"))

    service.loop.create_task(resolve())


# ----------------------------------------------------------------------------- publisher
class GpuFanout:
    """A GPU publisher's rounds to the representatives of other GPUs (loop thread)."""

    def __init__(self, service: WeightsService, name: str, shard: int, layout: Layout,
                 gpu: CudaSlots, segment: VersionedSegment) -> None:
        self.service = service
        self.name = name
        self.shard = shard
        self.layout = layout
        self.gpu = gpu
        self.segment = segment
        self.schedule = RoundSchedule()
        self.members: dict[str, str] = {}  # representative -> its endpoint address
        self.rounds_intact = 0
        self.rounds_failed = 0
        self._nccl = nccl_weights(service)
        self._comm: NcclCommunicator | None = None
        self._retired: NcclCommunicator | None = None  # kept until its successor worked once
        self._outcome: asyncio.Future[None] | None = None  # the running round's GPU work
        self._told = 0  # the last round whose members were sent its round message
        self._nccl.fanouts[(name, shard)] = self

    def offer(self, version: int, slot: int) -> None:
        """``version`` is complete in ``slot`` (after the publish's seqlock bracket)."""
        self.schedule.offer(version, slot)
        self._pump()

    def join(self, worker: str, address: str) -> None:
        """Representative ``worker`` takes part from the next round on; it gets the newest
        version at once (a join is rare: a GPU's first pull, or a replaced representative)."""
        if self.members.get(worker) != address:
            self.members[worker] = address
            _watch(self.service, worker, self._member_gone)
        newest = max(range(SLOTS), key=self.segment.version)
        if self.segment.version(newest) >= 0:
            self.schedule.offer(self.segment.version(newest), newest)
        self._pump()

    def _pump(self) -> None:
        rnd = self.schedule.next(list(self.members))
        if rnd is not None:
            self.service.loop.create_task(self._run(rnd))

    async def _run(self, rnd: Round) -> None:
        seq = int(self.segment.header[2 * rnd.slot])
        if seq & 1 or self.segment.version(rnd.slot) != rnd.version:
            self.schedule.finished()  # already being overwritten: the newer one is pending
            self._pump()
            return
        intact = False
        try:
            intact = await self._broadcast(rnd, seq)
        except Exception as exc:  # a lost member or an NCCL failure: this round only
            log.info("weights %r shard %d: NCCL round %d (version %d) failed: %s",
                     self.name, self.shard, rnd.number, rnd.version, exc)
        finally:
            self._outcome = None
            if intact:
                self.rounds_intact += 1
            else:
                self.rounds_failed += 1
            if self._told == rnd.number:  # members that took part hear how it ended
                self._tell(rnd, OP_END, [self.name, self.shard, rnd.number, intact])
            self.schedule.finished()
            self._pump()

    async def _broadcast(self, rnd: Round, seq: int) -> bool:
        """Run round ``rnd`` from its slot, whose sequence number was ``seq`` before it; True
        when the slot was not rewritten meanwhile (every byte sent was of ``rnd.version``)."""
        comm = self._communicator(rnd.members)
        assert comm.store_address is not None
        me = self.service.worker
        self._tell(rnd, OP_ROUND, [self.name, self.shard, rnd.number, comm.key,
                                   list(comm.store_address), [me, *rnd.members], rnd.version])
        self._told = rnd.number
        host = self._nccl.host
        issued = comm.work_thread.run(comm.broadcast,
                                      _bucket_views(self.gpu.slots[rnd.slot], self.layout), 0, None)
        self._outcome = outcome = after_work_thread(
            host, issued, lambda r: gpu_done(host, r[0], r[1], comm.pg, r[2]))
        await outcome
        if self._retired is not None:  # the new communicator works: the old one can go
            self._retired.abort()
            self._retired = None
        return int(self.segment.header[2 * rnd.slot]) == seq

    def _communicator(self, members: tuple[str, ...]) -> NcclCommunicator:
        key = communicator_key(self.name, self.shard, self.service.worker, members)
        comm = self._comm
        if comm is not None and comm.key == key:
            return comm
        if comm is not None:
            if self._retired is not None:
                self._retired.abort()
            self._retired = comm
        comm = self._comm = NcclCommunicator(key, 0, len(members) + 1, self.gpu.device)
        comm.open_store(self.service.runtime.endpoint.ip)
        return comm

    def _tell(self, rnd: Round, op: str, meta: list[Any]) -> None:
        endpoint = self.service.runtime.endpoint
        for worker in rnd.members:
            address = self.members.get(worker)
            if address is None or endpoint.is_lost(address):
                continue
            try:
                endpoint.send_oneway(address, op, meta)
            except PeerLostError:
                pass  # its loss is being reported

    def peer_lost(self, address: str, exc: BaseException) -> None:
        for worker, member in list(self.members.items()):
            if member == address:
                self._member_gone(worker, exc)

    def _member_gone(self, worker: str, exc: BaseException) -> None:
        """A representative is gone: fail the running round now, abort the communicators it
        is in (off the loop), and run later rounds without it."""
        if self.members.pop(worker, None) is None:
            return
        running = self.schedule.running
        if running is not None and worker in running.members:
            outcome = self._outcome
            if outcome is not None and not outcome.done():
                outcome.set_exception(PeerLostError(
                    f"round {running.number} of weights {self.name!r}: member {worker} is "
                    f"gone: {exc}"))
            # Its version goes to the others again, in a round on the new member set.
            self.schedule.offer(running.version, running.slot)
        for comm in (self._comm, self._retired):
            if comm is not None:
                comm.abort()
        self._comm = self._retired = None

    def close(self) -> None:
        for comm in (self._comm, self._retired):
            if comm is not None:
                comm.abort()
        self._comm = self._retired = None
        self.members.clear()
        if self._nccl.fanouts.get((self.name, self.shard)) is self:
            del self._nccl.fanouts[(self.name, self.shard)]


# ----------------------------------------------------------------------------- representative
@dataclass(frozen=True)
class _RoundCall:
    number: int
    key: str
    store: tuple[str, int]
    ranks: tuple[str, ...]
    version: int


class GpuReceiver:
    """A subscriber elected its GPU's representative for one shard: receives the publisher's
    rounds into two GPU slots of its own and announces each complete version to the
    directory (loop thread). ``device`` (local index) is the GPU named ``uuid``; ``stats``
    (its subscriber's) counts ``gpu_versions`` and ``gpu_bytes`` received.
    """

    def __init__(self, service: WeightsService, name: str, publisher: ShardSource,
                 layout: Layout, device: int, uuid: str, stats: dict[str, int]) -> None:
        self.service = service
        self.name = name
        self.shard = publisher.shard
        self.publisher = publisher
        self.layout = layout
        self.device = device
        self.uuid = uuid
        self.stats = stats
        self.segment: VersionedSegment | None = None  # the seqlock header (no host bytes)
        self.gpu: CudaSlots | None = None
        self.closed = False
        self._nccl = nccl_weights(service)
        self._comm: NcclCommunicator | None = None
        self._calls: asyncio.Queue[_RoundCall] = asyncio.Queue()
        self._ends: dict[int, asyncio.Future[bool]] = {}  # round -> intact, from the publisher
        self._done_through = 0  # rounds up to this one are over here
        self._outcome: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        old = self._nccl.receivers.get((name, self.shard))
        if old is not None:
            old.close()
        self._nccl.receivers[(name, self.shard)] = self

    async def start(self) -> None:
        """Allocate the slots (off the loop), then join the publisher's rounds."""
        service = self.service
        self.gpu = await service.copy(lambda: CudaSlots(self.layout, self.device, SLOTS))
        self.segment = VersionedSegment(0)  # header only: the versions live on the GPU
        self._task = service.loop.create_task(self._serve())
        _watch(service, self.publisher.worker, lambda _w, exc: self._publisher_gone(exc))
        await service.runtime.endpoint.request(
            self.publisher.endpoint, OP_JOIN,
            [self.name, self.shard, service.worker, service.info.endpoint])

    def on_round(self, meta: Sequence[Any]) -> None:
        _name, _shard, number, key, store, ranks, version = meta
        self._calls.put_nowait(_RoundCall(int(number), str(key), (str(store[0]), int(store[1])),
                                          tuple(ranks), int(version)))

    def on_end(self, number: int, intact: bool) -> None:
        if number <= self._done_through:
            return  # a round we already gave up on
        fut = self._ends.get(number)
        if fut is None:
            fut = self._ends[number] = self.service.loop.create_future()
        if not fut.done():
            fut.set_result(intact)
        if not intact and self._outcome is not None and not self._outcome.done():
            # The publisher gave up on this round (a member is gone): so do we, now.
            self._outcome.set_exception(PeerLostError(
                f"round {number} of weights {self.name!r} failed at the publisher"))

    async def _serve(self) -> None:
        """Rounds one at a time: each writes the spare slot, which the previous round may
        still be writing until it ended."""
        while True:
            call = await self._calls.get()
            await self._receive(call)

    async def _receive(self, call: _RoundCall) -> None:
        segment, gpu = self.segment, self.gpu
        assert segment is not None and gpu is not None
        end = self._ends.get(call.number)
        if end is None:
            end = self._ends[call.number] = self.service.loop.create_future()
        elif end.done() and not end.result():
            del self._ends[call.number]  # failed at the publisher before we issued anything
            self._done_through = call.number
            return
        slot = segment.spare_slot()
        segment.begin_write(slot, call.version)
        complete = False
        try:
            comm = self._communicator(call)
            host = self._nccl.host
            issued = comm.work_thread.run(comm.broadcast,
                                          _bucket_views(gpu.slots[slot], self.layout), 0, None)
            self._outcome = outcome = after_work_thread(
                host, issued, lambda r: gpu_done(host, r[0], r[1], comm.pg, r[2]))
            await outcome
            complete = await end
        except Exception as exc:  # the publisher or a member is gone, or NCCL failed
            log.info("weights %r shard %d: NCCL round %d (version %d) not received: %s",
                     self.name, self.shard, call.number, call.version, exc)
            self._abort()
        finally:
            self._outcome = None
            self._ends.pop(call.number, None)
            self._done_through = call.number
            if not self.closed:
                segment.end_write(slot, complete)
        if complete and not self.closed:
            self.stats["gpu_versions"] += 1
            self.stats["gpu_bytes"] += sum(hi - lo for lo, hi in self.layout.buckets)
            try:
                await self.service.call_directory(
                    self.name, AnnounceGpu(self.service.worker, self.service.node_id, self.uuid,
                                           self.shard, call.version, slot, segment.ref,
                                           gpu.export),
                    patience=0.0)  # a restarted directory elects representatives afresh
            except Exception as exc:  # the directory is gone: its subscribers hear it
                log.info("weights %r shard %d: version %d not announced: %s", self.name,
                         self.shard, call.version, exc)

    def _communicator(self, call: _RoundCall) -> NcclCommunicator:
        comm = self._comm
        if comm is not None and comm.key == call.key:
            return comm
        if self.service.worker not in call.ranks:
            raise ProtocolError(f"round {call.number} does not list {self.service.worker}")
        if comm is not None:  # the member set changed; our last round on it has ended
            comm.abort()
        comm = self._comm = NcclCommunicator(call.key, call.ranks.index(self.service.worker),
                                             len(call.ranks), self.device)
        comm.store_address = call.store
        return comm

    def peer_lost(self, address: str, exc: BaseException) -> None:
        if address == self.publisher.endpoint:
            self._publisher_gone(exc)

    def _publisher_gone(self, exc: BaseException) -> None:
        outcome = self._outcome
        if outcome is not None and not outcome.done():
            outcome.set_exception(PeerLostError(
                f"publisher {self.publisher.worker} of weights {self.name!r} is gone: {exc}"))
        for end in self._ends.values():  # no end message will come
            if not end.done():
                end.set_result(False)
        self._abort()

    def _abort(self) -> None:
        if self._comm is not None:
            self._comm.abort()
            self._comm = None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._task is not None:
            self._task.cancel()
        self._abort()
        if self._nccl.receivers.get((self.name, self.shard)) is self:
            del self._nccl.receivers[(self.name, self.shard)]
        for fut in self._ends.values():
            fut.cancel()
        self._ends.clear()
        if self.segment is not None:
            self.segment.close()  # mappings of it (its subscribers') stay valid
