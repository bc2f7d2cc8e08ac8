"""``Worker.broadcast``: one object from one member to every member of a set of workers.

One `Broadcaster` per process runtime (`get_broadcaster`), created when a worker
process starts so that a broadcast message never finds nobody to take it.

**Identity and order.** The members (``groups`` expanded) form a *member set*; its id does
not depend on the order of ``groups``. Every member numbers its broadcasts over a set in call
order, so the k-th call on every member is the same broadcast, whoever its source. Messages
carry ``(set id, number)``: they are matched by number, never by arrival order, and they travel
on their own ops (``aiorl.collective.proto``), so broadcasts and point-to-point messages between
the same two workers never take each other's place. Each member handles the broadcasts of a set
strictly in number order (an *in-order pump* per set): the source's sends and a receiver's
landing of number k start after number k-1's, which keeps CUDA collectives issued in the same
order on every member.

**Where bytes go** (`aiorl.collective.plan.relay_tree`). The object is encoded once, on
the source's calling thread, with the point-to-point codec (``aiorl.p2p.message``). Large CPU
buffers for members on the source's node are written once into one shared segment; each such
member maps it copy-on-write (``MAP_PRIVATE``): it reads the source's pages without copying,
and a write by one member stays private to it. Each other node receives the bytes once, as ZMQ
frames, at its relay (its lowest-ranked member), which writes them once into a segment of its
own and passes the descriptor to the rest of its node. Small payloads travel inline. CUDA
tensors take `aiorl.collective.nccl_broadcast`.

**Completion** (two phases). A member acknowledges to the source once it called the broadcast
and holds the object; when every member has, the source says ``done`` and the broadcast
completes everywhere: on the source with the object it passed, elsewhere with the received
copy. A member that could not land or decode the object makes the broadcast fail everywhere
with its reason. A segment goes back to its owner's pool when every reader's views are gone.

**Loss.** Every member watches every other member through the registry. When one is lost,
every broadcast over a set containing it that has not completed fails with
[`PeerLostError`][aiorl.PeerLostError] on every surviving member, and later broadcasts over such a
set fail at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, cast

from aiorl.collective.nccl_broadcast import CudaBroadcast
from aiorl.collective.plan import BroadcastPlan, plan_broadcast, relay_tree
from aiorl.collective.proto import (
    CHUNK,
    FRAMES,
    OP_ACK,
    OP_BCAST,
    OP_DONE,
    OP_RELEASE,
    SHM,
)
from aiorl.errors import PeerLostError, ProtocolError, RegistryUnavailable
from aiorl.names import WorkerAddress
from aiorl.p2p.message import InMessage, OutMessage, encode_object
from aiorl.p2p.proto import K_OBJ, SHM_MIN
from aiorl.runtime import AsyncWork, Runtime
from aiorl.runtime.promise import reject, resolve, trace_until_settled
from aiorl.trace import recorder as _trace
from aiorl.transport import _shm
from aiorl.transport.endpoint import Incoming

__all__ = ["BroadcastStatistics", "Broadcaster", "get_broadcaster"]

log = logging.getLogger("aiorl.collective")

#: How long one registry lookup of a member waits before it is retried (it waits for ever).
RESOLVE_RETRY_S = 30.0


@dataclass(frozen=True)
class BroadcastStatistics:
    """What this process moved for broadcasts (cumulative; for tests and benchmarks)."""

    sourced: int  # broadcasts this process was the source of
    relayed: int  # broadcasts this process passed on to the other members of its node
    shm_bytes_written: int  # bytes copied into shared segments (once per segment written)
    shm_readers: int  # member deliveries that read one of those segments
    frame_bytes_sent: int  # payload bytes sent as ZMQ frames, summed over destinations
    segments: int  # shared segments held (free and in use)
    segments_in_use: int  # segments some reader still views
    pending: int  # broadcasts of this process not complete yet


class _Round:
    """One broadcast (one number of one member set) as this member sees it."""

    __slots__ = ("seq", "plan", "work", "obj", "out", "inc", "sender", "src_address", "waiting",
                 "error", "value", "acked", "final")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.plan: BroadcastPlan | None = None  # set when this member called
        self.work: AsyncWork[Any] | None = None
        self.obj: Any = None  # the source's object (what the source's broadcast returns)
        self.out: OutMessage | None = None  # the source's encoded object (kept until done)
        self.inc: InMessage | None = None  # a receiver's landed message
        self.sender: str | None = None  # the source a landed message names
        self.src_address: str | None = None
        self.waiting: set[str] = set()  # source: members that have not acknowledged yet
        self.error: str | None = None  # why this member (or, at the source, some member) failed
        self.value: Any = None
        self.acked = False
        self.final: str | None = None  # the source's verdict, when it failed before we called


class _MemberSet:
    """The broadcasts over one member set, as this member sees them."""

    __slots__ = ("set_id", "members", "calls", "rounds", "steps", "next_step", "pumping", "lost")

    def __init__(self, set_id: str) -> None:
        self.set_id = set_id
        self.members: tuple[str, ...] = ()  # known once this member called
        self.calls = 0  # broadcasts this member called over the set
        self.rounds: dict[int, _Round] = {}
        # Work to do in number order: the source's sends, or a receiver's landing (with the
        # message it lands, whose segment goes back if the step never runs).
        self.steps: dict[int, tuple[Coroutine[Any, Any, None], list[Any] | None]] = {}
        self.next_step = 0
        self.pumping = False
        self.lost: PeerLostError | LookupError | None = None

    def round(self, seq: int) -> _Round:
        rnd = self.rounds.get(seq)
        if rnd is None:
            rnd = self.rounds[seq] = _Round(seq)
        return rnd


def _chunks(bufs: Sequence[memoryview]) -> tuple[list[Any], list[Any]]:
    """``bufs`` as ZMQ frames of at most `CHUNK` bytes, and their ``FRAMES`` descriptor.

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
    return [FRAMES, sizes, counts], frames


class Broadcaster:
    """The broadcasts of one process. Obtain it with `get_broadcaster`."""

    def __init__(self, runtime: Runtime, node_id: str | None) -> None:
        self.runtime = runtime
        self.loop = runtime.loop
        self.endpoint = runtime.endpoint
        self.name = runtime.name
        self.address = runtime.endpoint.address
        self.pid = os.getpid()
        self.node_id = node_id or None
        self.waiter = runtime.waiter
        self._closed = False
        self._sets: dict[str, _MemberSet] = {}
        self._infos: dict[str, dict[str, Any]] = {}  # resolved members: registry info by name
        self._resolving: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._name_of: dict[str, str] = {}  # endpoint address -> member name
        self._lost: dict[str, PeerLostError | LookupError] = {}  # LookupError: never existed
        self._pool: _shm.SegmentPool | None = None
        self._readers: dict[int, set[str]] = {}  # segment id -> members still viewing it
        self._tasks: set[asyncio.Task[None]] = set()
        self._sourced = self._relayed = self._shm_bytes = self._shm_readers = 0
        self._frame_bytes = 0
        self.cuda = CudaBroadcast(self)
        ep = self.endpoint
        ep.handle(OP_BCAST, self._on_bcast)
        ep.handle(OP_ACK, self._on_ack)
        ep.handle(OP_DONE, self._on_done)
        ep.handle(OP_RELEASE, self._on_release)
        ep.on_peer_lost(self._on_peer_lost)
        runtime.on_close(self.close)

    # ------------------------------------------------------------------ the call
    def broadcast(self, obj: Any, groups: Any, src: Any, me: WorkerAddress) -> AsyncWork[Any]:
        """Start one broadcast on member ``me`` (see the module docstring).

        Validation and encoding happen here, on the caller's thread, so ``ValueError`` /
        ``TypeError`` (bad arguments, a non-contiguous tensor, an unpicklable object) are
        raised at once and nothing is sent.
        """
        plan = plan_broadcast(groups, src, me)
        out = encode_object(obj) if plan.src == plan.me else None
        work: AsyncWork[Any] = AsyncWork(self.loop)
        if _trace.ON:
            trace_until_settled(work, _trace.begin(
                "broadcast", "broadcast", plan.src, members=len(plan.members),
                source=plan.src == plan.me))
        if self.runtime.on_loop_thread():
            self._start(plan, obj, out, work)
        else:
            self.runtime.submit(self._start, plan, obj, out, work)
        return work

    def _start(self, plan: BroadcastPlan, obj: Any, out: OutMessage | None,
               work: AsyncWork[Any]) -> None:
        if self._closed:
            reject(work, PeerLostError("cannot broadcast: this worker's runtime is closing"))
            return
        ms = self._sets.get(plan.set_id) or self._sets.setdefault(plan.set_id,
                                                                   _MemberSet(plan.set_id))
        if not ms.members:
            ms.members = plan.members
            self.spawn(self._watch_members(ms))
        seq = ms.calls
        ms.calls += 1
        rnd = ms.round(seq)
        rnd.plan, rnd.work = plan, work
        lost = ms.lost or self._lost_among(plan.members)
        if lost is not None:
            self._fail_set(ms, lost)
            return
        if rnd.final is not None:
            ms.rounds.pop(seq, None)
            reject(work, ProtocolError(rnd.final))
        elif plan.src == plan.me:
            assert out is not None
            rnd.obj, rnd.out = obj, out
            self._sourced += 1
            self._queue(ms, seq, self._emit(ms, rnd))
        else:
            self._maybe_ack(ms, rnd)

    def _lost_among(self, members: Sequence[str]) -> PeerLostError | LookupError | None:
        for name in members:
            exc = self._lost.get(name)
            if exc is not None:
                return exc
        return None

    # ------------------------------------------------------------------ in-order pump
    def _queue(self, ms: _MemberSet, seq: int, step: Coroutine[Any, Any, None],
               meta: list[Any] | None = None) -> None:
        replaced = ms.steps.get(seq)
        if replaced is not None:
            replaced[0].close()  # the placeholder of a broadcast that failed at its source
        ms.steps[seq] = (step, meta)
        if not ms.pumping and ms.next_step in ms.steps:
            ms.pumping = True
            self.spawn(self._pump(ms))

    async def _pump(self, ms: _MemberSet) -> None:
        try:
            while ms.next_step in ms.steps:
                step, _meta = ms.steps.pop(ms.next_step)
                seq = ms.next_step
                ms.next_step += 1
                try:
                    await step
                except Exception as exc:  # noqa: BLE001 - a bug fails this broadcast, not the set
                    if _member_gone(exc):
                        self._fail_set(ms, cast(PeerLostError | LookupError, exc))
                        continue
                    log.exception("%s: broadcast %s/%d failed", self.name, ms.set_id, seq)
                    self._fail_round(ms, ms.round(seq), repr(exc))
        finally:
            ms.pumping = False

    # ------------------------------------------------------------------ members
    async def _resolve(self, name: str) -> dict[str, Any]:
        """The registry info of member ``name`` once it is ready (watched for death from then)."""
        info = self._infos.get(name)
        if info is not None:
            return info
        fut = self._resolving.get(name)
        if fut is None:
            fut = self._resolving[name] = self.loop.create_future()
            self.spawn(self._lookup(name, fut))
        return await asyncio.shield(fut)

    async def _lookup(self, name: str, fut: asyncio.Future[dict[str, Any]]) -> None:
        while True:
            try:
                info = await self.runtime.resolve_worker(name, timeout=RESOLVE_RETRY_S)
                break
            except TimeoutError:
                log.info("%s: broadcast still waiting for worker %s to be ready", self.name, name)
            except RegistryUnavailable:
                await asyncio.sleep(1.0)
            except (PeerLostError, LookupError) as exc:
                self._member_lost(name, exc)
                fut.set_exception(exc)
                fut.exception()
                return
        address = info["endpoint"]
        self._infos[name] = info
        self._name_of[address] = name
        fut.set_result(info)
        if self.endpoint.is_lost(address):
            self._member_lost(name, PeerLostError(f"worker {name} is gone"))

    async def _resolve_all(self, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        infos = await asyncio.gather(*(self._resolve(n) for n in names))
        return dict(zip(names, infos, strict=True))

    async def _watch_members(self, ms: _MemberSet) -> None:
        """Resolve (and so watch) every member: any one's death fails the set everywhere."""
        try:
            await self._resolve_all([n for n in ms.members if n != self.name])
        except (PeerLostError, LookupError):
            pass  # _lookup already failed the sets that contain it

    def _on_peer_lost(self, address: str, exc: BaseException) -> None:
        name = self._name_of.get(address)
        if name is not None:
            self._member_lost(name, PeerLostError(str(exc)))

    def _member_lost(self, name: str, exc: PeerLostError | LookupError) -> None:
        if name in self._lost:
            return
        self._lost[name] = exc
        for ms in self._sets.values():
            if name in ms.members:
                why = f"broadcast failed: worker {name} is gone: {exc}"
                if not isinstance(exc, PeerLostError):
                    why = f"broadcast failed: {exc}"
                self._fail_set(ms, PeerLostError(why) if isinstance(exc, PeerLostError)
                               else LookupError(why))
        for seg_id in [s for s, readers in self._readers.items() if name in readers]:
            self._release_segment(seg_id, name)
        self.cuda.lost(name)

    def _fail_set(self, ms: _MemberSet, exc: PeerLostError | LookupError) -> None:
        """Every broadcast of ``ms`` not complete fails; later ones fail at once."""
        if ms.lost is None:
            ms.lost = exc
        for rnd in list(ms.rounds.values()):
            if rnd.inc is not None:
                rnd.inc.release()
                rnd.inc = None
            if rnd.work is not None:  # a fresh error per work: each has its own traceback
                lost = PeerLostError if isinstance(exc, PeerLostError) else LookupError
                reject(rnd.work, lost(str(exc)))
        ms.rounds.clear()
        for step, meta in ms.steps.values():
            step.close()
            if meta is not None:
                self._refuse(meta)
        ms.steps.clear()

    # ------------------------------------------------------------------ source
    async def _emit(self, ms: _MemberSet, rnd: _Round) -> None:
        """Send round ``rnd`` (this member is its source) down the relay tree."""
        plan, out = rnd.plan, rnd.out
        assert plan is not None and out is not None
        others = [n for n in plan.members if n != self.name]
        infos = await self._resolve_all(others)
        if ms.lost is not None:
            return
        rnd.waiting = set(others)
        if not others:
            self._finish(ms, rnd)
            return
        node_of = {n: infos[n].get("node_id") or None for n in others}
        node_of[self.name] = self.node_id
        tree = relay_tree(plan.src, plan.members, node_of)
        cudadesc = await self.cuda.plan(plan, out, infos) if out.cuda else None
        head = [ms.set_id, rnd.seq, self.name, self.address, out.kind, out.head]
        pickle_frames = [out.pickle] if out.kind == K_OBJ else []
        framed: tuple[list[Any], list[Any]] | None = None
        if tree.local:
            shm = None
            if out.bufs and out.nbytes >= SHM_MIN:
                shm = self._write_segment([[b] for b in out.bufs], tree.local)
            if shm is not None:
                self._send_all(tree.local, infos, [*head, shm, cudadesc, []], pickle_frames)
            else:
                framed = _chunks(out.bufs) if out.bufs else None
                self._send_all(tree.local, infos, [*head, framed[0] if framed else None,
                                                   cudadesc, []],
                               pickle_frames + (framed[1] if framed else []))
                self._frame_bytes += out.nbytes * len(tree.local)
        for relay, children in tree.relays.items():
            if framed is None and out.bufs:
                framed = _chunks(out.bufs)
            self._send_all([relay], infos, [*head, framed[0] if framed else None, cudadesc,
                                            list(children)],
                           pickle_frames + (framed[1] if framed else []))
            self._frame_bytes += out.nbytes
        if cudadesc is not None:
            self.cuda.send(ms.set_id, rnd.seq, out, cudadesc)

    def _send_all(self, names: Sequence[str], infos: dict[str, dict[str, Any]], meta: list[Any],
                  frames: list[Any]) -> None:
        for name in names:
            self.endpoint.send_oneway(infos[name]["endpoint"], OP_BCAST, meta, frames)

    def _write_segment(self, parts: Sequence[Sequence[Any]], readers: Sequence[str]
                       ) -> list[Any] | None:
        """Copy the buffers ``parts`` (each a list of chunks) once into a pooled shared segment
        that ``readers`` will map; its descriptor, or None when shared memory is unavailable or
        the pool is full (frames are used then)."""
        import numpy as np

        if self._pool is None:
            self._pool = _shm.SegmentPool()
        sizes = [sum(memoryview(c).nbytes for c in chunks) for chunks in parts]
        offsets: list[int] = []
        total = 0
        for n in sizes:
            offsets.append(total)
            total = _shm.align(total + n)
        try:
            seg, _evicted = self._pool.acquire(total)  # readers never keep a segment's fd
        except _shm.ShmUnavailable as exc:
            log.debug("%s: no shared segment for a broadcast (%s); using frames", self.name, exc)
            return None
        if seg.arr is None:
            seg.arr = np.frombuffer(seg.mm, dtype=np.uint8)
        for chunks, off in zip(parts, offsets, strict=True):
            for c in chunks:
                n = memoryview(c).nbytes
                _shm.copy_into(seg.arr[off : off + n], c)
                off += n
        self._readers[seg.seg_id] = set(readers)
        self._shm_bytes += sum(sizes)
        self._shm_readers += len(readers)
        return [SHM, self.pid, seg.fd, seg.size, seg.seg_id, offsets, sizes, self.address]

    def _on_ack(self, msg: Incoming) -> None:
        set_id, seq, member, error = msg.meta
        ms = self._sets.get(set_id)
        rnd = ms.rounds.get(seq) if ms is not None else None
        if ms is None or rnd is None or member not in rnd.waiting:
            return  # the broadcast already failed here
        rnd.waiting.discard(member)
        if error is not None and rnd.error is None:
            rnd.error = f"worker {member} could not take the broadcast: {error}"
        if not rnd.waiting:
            self._finish(ms, rnd)

    def _finish(self, ms: _MemberSet, rnd: _Round) -> None:
        """Source: every member answered; tell them all, complete here."""
        plan = rnd.plan
        assert plan is not None and rnd.work is not None
        for name in plan.members:
            if name != self.name:
                try:
                    self.endpoint.send_oneway(self._infos[name]["endpoint"], OP_DONE,
                                              [ms.set_id, rnd.seq, rnd.error])
                except PeerLostError:
                    pass  # its death fails the set through the registry as well
        ms.rounds.pop(rnd.seq, None)
        if rnd.error is None:
            resolve(rnd.work, rnd.obj)
        else:
            reject(rnd.work, ProtocolError(rnd.error))

    # ------------------------------------------------------------------ receivers
    def _on_bcast(self, msg: Incoming) -> None:
        set_id, seq = msg.meta[0], msg.meta[1]
        ms = self._sets.get(set_id) or self._sets.setdefault(set_id, _MemberSet(set_id))
        if ms.lost is not None or seq < ms.next_step:
            self._refuse(msg.meta)
            return
        self._queue(ms, seq, self._land(ms, msg.meta, msg.frames), msg.meta)

    def _refuse(self, meta: list[Any]) -> None:
        """A message of a failed set: give its segment back at once."""
        bufdesc = meta[6]
        if bufdesc is not None and bufdesc[0] == SHM:
            self.give_back(bufdesc[7], bufdesc[4])

    async def _land(self, ms: _MemberSet, meta: list[Any], frames: list[Any]) -> None:
        """Take a broadcast's payload (in number order): map or keep its bytes, pass it on to
        this node's members if this member relays, start its CUDA transfers."""
        _, seq, src, src_address, kind, head, bufdesc, cudadesc, children = meta
        rnd = ms.round(seq)
        if rnd.final is not None:
            self._refuse(meta)  # failed at its source: a call for it fails at once
            return
        rnd.sender, rnd.src_address = src, src_address
        inc = InMessage(kind, head)
        start = 0
        if kind == K_OBJ:
            inc.pickle = frames[0]
            start = 1
        try:
            if bufdesc is not None and bufdesc[0] == SHM:
                self._map(inc, bufdesc)
            elif bufdesc is not None:
                _take_frames(inc, bufdesc, frames, start)
            if children:
                await self._relay(meta, inc, frames, frames[:start], children)
            if cudadesc is not None:
                inc.cuda_fut = self.cuda.receive(ms.set_id, seq, inc, cudadesc)
        except Exception as exc:  # noqa: BLE001 - this member fails the broadcast, with why
            inc.release()
            if _member_gone(exc):
                raise
            log.exception("%s: broadcast %s/%d: receiving failed", self.name, ms.set_id, seq)
            rnd.error = f"{type(exc).__name__}: {exc}"
        else:
            rnd.inc = inc
        if ms.lost is not None:
            if rnd.inc is not None:
                rnd.inc.release()
                rnd.inc = None
            return
        self._maybe_ack(ms, rnd)

    def _map(self, inc: InMessage, desc: Sequence[Any]) -> None:
        _, pid, fd, size, seg_id, offsets, sizes, owner = desc
        try:
            mm = _shm.open_segment(int(pid), int(fd), int(size), private=True)
        except _shm.ShmUnavailable as exc:
            self.give_back(owner, seg_id)
            raise ProtocolError(f"cannot read the broadcast's shared memory: {exc}") from exc
        inc.lease = _shm.Lease(mm, functools.partial(self.give_back, owner, seg_id))
        inc.sources = list(zip(sizes, offsets, strict=True))

    async def _relay(self, meta: list[Any], inc: InMessage, frames: list[Any],
                     pickle_frames: list[Any], children: Sequence[str]) -> None:
        """Pass a broadcast on to the other members of this node: its bytes, which arrived as
        frames, are written once into a segment of ours that they (and we) map."""
        infos = await self._resolve_all(children)
        self._relayed += 1
        bufdesc, data = meta[6], frames[len(pickle_frames):]
        total = sum(n for n, _ in inc.sources)
        if total >= SHM_MIN:
            shm = self._write_segment([chunks for _, chunks in inc.sources],
                                      [*children, self.name])
            if shm is not None:
                bufdesc, data = shm, []
                inc.sources = []
                self._map(inc, shm)  # read our own copy, as the others do
        if data:
            self._frame_bytes += total * len(children)
        self._send_all(children, infos, [*meta[:6], bufdesc, meta[7], []], pickle_frames + data)

    def _maybe_ack(self, ms: _MemberSet, rnd: _Round) -> None:
        """Receiver: once this member called and the payload landed, decode and acknowledge."""
        if rnd.acked or rnd.plan is None or (rnd.inc is None and rnd.error is None):
            return
        inc = rnd.inc
        fut = inc.cuda_fut if inc is not None else None
        if fut is not None and not fut.done():
            fut.add_done_callback(lambda _f: self._maybe_ack(ms, rnd))
            return
        rnd.acked = True
        error = rnd.error
        if error is None and inc is not None:
            rnd.inc = None
            try:
                landed = fut.exception() if fut is not None else None
                if landed is not None:
                    raise landed
                if rnd.sender != rnd.plan.src:
                    raise ValueError(
                        f"this member called broadcast with src {rnd.plan.src}, but the "
                        f"broadcast came from {rnd.sender}: members passed different arguments"
                    )
                rnd.value = inc.decode()
            except PeerLostError:
                inc.release()
                return  # the loss fails the set
            except Exception as exc:  # noqa: BLE001 - reported to the source, fails everywhere
                inc.release()
                error = rnd.error = f"{type(exc).__name__}: {exc}"
        assert rnd.src_address is not None
        try:
            self.endpoint.send_oneway(rnd.src_address, OP_ACK,
                                      [ms.set_id, rnd.seq, self.name, error])
        except PeerLostError:
            pass  # the source's death fails the set

    def _on_done(self, msg: Incoming) -> None:
        set_id, seq, error = msg.meta
        ms = self._sets.get(set_id)
        if ms is None or ms.lost is not None:
            return
        rnd = ms.rounds.get(seq)
        if rnd is None or rnd.work is None:
            # Failed at its source before this member called (or got the message): a later
            # call fails at once, and the set's order moves past it even if no message comes.
            if error is not None and seq >= ms.next_step:
                ms.round(seq).final = error
                if seq not in ms.steps:
                    self._queue(ms, seq, _nothing())
            return
        del ms.rounds[seq]
        if rnd.inc is not None:
            rnd.inc.release()
            rnd.inc = None
        if error is None:
            resolve(rnd.work, rnd.value)
        else:
            reject(rnd.work, ProtocolError(error))
        rnd.value = None

    def _fail_round(self, ms: _MemberSet, rnd: _Round, error: str) -> None:
        """This member could not do its part of ``rnd``: the source learns why (or, at the
        source, every member does)."""
        rnd.error = error
        if rnd.plan is not None and rnd.plan.src == self.name:
            rnd.waiting.clear()
            self._finish(ms, rnd)
        else:
            self._maybe_ack(ms, rnd)

    # ------------------------------------------------------------------ segments
    def give_back(self, owner: str, seg_id: int) -> None:
        """This member no longer views segment ``seg_id`` of ``owner`` (any thread)."""
        if self.runtime.on_loop_thread():
            self.loop.call_soon(self._send_release, owner, seg_id)
        else:
            try:
                self.runtime.submit(self._send_release, owner, seg_id)
            except RuntimeError:
                pass  # the loop is closed: the process is exiting

    def _send_release(self, owner: str, seg_id: int) -> None:
        if owner == self.address:
            self._release_segment(seg_id, self.name)
            return
        if self._closed or self.endpoint.is_lost(owner):
            return
        try:
            self.endpoint.send_oneway(owner, OP_RELEASE, [seg_id, self.name])
        except PeerLostError:
            pass

    def _on_release(self, msg: Incoming) -> None:
        seg_id, reader = msg.meta
        self._release_segment(seg_id, reader)

    def _release_segment(self, seg_id: int, reader: str) -> None:
        readers = self._readers.get(seg_id)
        if readers is None:
            return
        readers.discard(reader)
        if not readers:
            del self._readers[seg_id]
            if self._pool is not None:
                self._pool.release(seg_id)

    # ------------------------------------------------------------------ state
    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task of the broadcaster (cancelled when it closes)."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        self.runtime.submit(fn, *args)

    def address_of(self, member: str) -> str | None:
        info = self._infos.get(member)
        return info["endpoint"] if info is not None else None

    def statistics(self) -> BroadcastStatistics:
        """A snapshot (loop thread: an ``async def`` worker method may call it)."""
        pool = self._pool
        return BroadcastStatistics(
            sourced=self._sourced,
            relayed=self._relayed,
            shm_bytes_written=self._shm_bytes,
            shm_readers=self._shm_readers,
            frame_bytes_sent=self._frame_bytes,
            segments=len(pool.segments) if pool is not None else 0,
            segments_in_use=len(self._readers),
            pending=sum(1 for ms in self._sets.values() for r in ms.rounds.values()
                        if r.work is not None),
        )

    def close(self) -> None:
        """Fail what still waits and release the segments (the runtime stops)."""
        if self._closed:
            return
        self._closed = True
        closed = PeerLostError("the broadcast engine is closed")
        for ms in self._sets.values():
            self._fail_set(ms, closed)
        for task in list(self._tasks):
            task.cancel()
        self.cuda.close()
        if self._pool is not None:
            self._pool.close()


async def _nothing() -> None:
    """The step of a broadcast that failed at its source before its message came."""


def _take_frames(inc: InMessage, desc: Sequence[Any], frames: Sequence[Any], start: int) -> None:
    """The message's buffers are its data frames' chunks (``FRAMES`` descriptor)."""
    i = start
    for n, count in zip(desc[1], desc[2], strict=True):
        chunks = frames[i : i + count]
        if len(chunks) != count or sum(len(c) for c in chunks) != n:
            raise ProtocolError("a broadcast message lost payload frames")
        inc.sources.append((n, chunks))
        i += count




def get_broadcaster(runtime: Runtime, node_id: str | None = None) -> Broadcaster:
    """The broadcaster of ``runtime``, created (and its handlers registered) once.

    Worker processes create it when they start (with their node id), so a broadcast message
    that arrives before this worker calls ``broadcast`` is kept, not refused.
    """
    return runtime.service(Broadcaster, runtime, node_id)


def _member_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says a member is dead (`PeerLostError`) or never existed (a lookup
    error from the registry), rather than a bug: an ``IndexError`` or ``KeyError`` is a
    ``LookupError`` too, and taken for a missing member it hid where it was raised (an
    H200 run failed a broadcast with only "LookupError: list index out of range")."""
    if isinstance(exc, PeerLostError):
        return True
    return isinstance(exc, LookupError) and not isinstance(exc, (IndexError, KeyError))
