"""``Worker.broadcast``: one object from one member to every member of a set of workers.

One `Broadcaster` per process runtime (`get_broadcaster`), created when a worker
process starts so that a broadcast message never finds nobody to take it.

**Identity and order.** The members (``groups`` expanded) form a *member set*; its id does
not depend on the order of ``groups``. Every member numbers its broadcasts over a set in call
order, so the k-th call on every member is the same broadcast, whoever its source. Messages
carry ``(set id, number)``: they are matched by number, never by arrival order, and they
travel on their own ops (``aiorl.protocol.broadcast``), so broadcasts and point-to-point
messages between the same two workers never take each other's place. Each member handles the broadcasts of a set
strictly in number order (an *in-order pump* per set): the source's sends and a receiver's
landing of number k start after number k-1's, which keeps CUDA collectives issued in the same
order on every member.

**Where bytes go** (`aiorl.collective.broadcast_plan.relay_tree`). The object is encoded once, on
the source's calling thread, with the point-to-point codec (``aiorl.p2p.message``). Large CPU
buffers for members on the source's node are written once into one shared segment; each such
member maps it copy-on-write (``MAP_PRIVATE``): it reads the source's pages without copying,
and a write by one member stays private to it (`aiorl.collective.payload`). Each other node
receives the bytes once, as ZMQ frames, at its relay (its lowest-ranked member), which writes
them once into a segment of its own and passes the descriptor to the rest of its node
(`aiorl.collective.broadcast_tree`). Small payloads travel inline. CUDA tensors take
`aiorl.collective.nccl_broadcast`.

**Completion** (two phases). A member acknowledges to the source once it called the broadcast
and holds the object; when every member has, the source says ``done`` and the broadcast
completes everywhere: on the source with the object it passed, elsewhere with the received
copy. A member that could not land or decode the object makes the broadcast fail everywhere
with its reason. A segment goes back to its owner's pool when every reader's views are gone.

**Loss.** Every member watches every other member through the registry
(`aiorl.collective.members`). When one is lost, every broadcast over a set containing it that
has not completed fails with [`PeerLostError`][aiorl.PeerLostError] on every surviving member,
and later broadcasts over such a set fail at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, cast

from aiorl.collective.broadcast_plan import BroadcastPlan, plan_broadcast
from aiorl.collective.broadcast_tree import TreeSender
from aiorl.collective.members import MemberWatch
from aiorl.collective.nccl_broadcast import CudaBroadcast
from aiorl.collective.oneway import read_oneway
from aiorl.collective.payload import SharedSegments, take_frames
from aiorl.collective.rounds import MemberSet, Round, member_gone
from aiorl.errors import PeerLostError, ProtocolError
from aiorl.names import WorkerAddress
from aiorl.p2p.message import InMessage, OutMessage, encode_object
from aiorl.protocol.broadcast import BroadcastAck, BroadcastData, BroadcastDone, SharedBuffers
from aiorl.protocol.ops import BroadcastOp
from aiorl.protocol.p2p import K_OBJ
from aiorl.runtime import AsyncWork, Runtime
from aiorl.runtime.promise import reject, resolve, trace_until_settled
from aiorl.trace import recorder as _trace
from aiorl.transport.endpoint import Incoming

__all__ = ["BroadcastStatistics", "Broadcaster", "get_broadcaster"]

log = logging.getLogger("aiorl.collective")

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


class Broadcaster:
    """The broadcasts of one process: the calls, each member set's in-order pump, landing
    and two-phase completion. Obtain it with `get_broadcaster`."""

    def __init__(self, runtime: Runtime, node_id: str | None) -> None:
        self.runtime = runtime
        self.loop = runtime.loop
        self.endpoint = runtime.endpoint
        self.name = runtime.name
        self.node_id = node_id or None
        self.waiter = runtime.waiter
        self._closed = False
        self._sets: dict[str, MemberSet] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._sourced = 0
        self.cuda = CudaBroadcast(self)
        self.members = MemberWatch(runtime, self.spawn, self._member_lost)
        self.segments = SharedSegments(runtime)
        self.tree = TreeSender(self.endpoint, self.name, self.node_id, self.members,
                               self.segments, self.cuda)
        ep = self.endpoint
        ep.handle(BroadcastOp.BCAST, self._on_bcast)
        ep.handle(BroadcastOp.ACK, self._on_ack)
        ep.handle(BroadcastOp.DONE, self._on_done)
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
                                                                   MemberSet(plan.set_id))
        if not ms.members:
            ms.members = plan.members
            self.spawn(self.members.watch(ms.members))
        seq = ms.calls
        ms.calls += 1
        rnd = ms.round(seq)
        rnd.plan, rnd.work, rnd.since = plan, work, time.time()
        lost = ms.lost or self.members.lost_among(plan.members)
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

    # ------------------------------------------------------------------ in-order pump
    def _queue(self, ms: MemberSet, seq: int, step: Coroutine[Any, Any, None],
               data: BroadcastData | None = None) -> None:
        replaced = ms.steps.get(seq)
        if replaced is not None:
            replaced[0].close()  # the placeholder of a broadcast that failed at its source
        ms.steps[seq] = (step, data)
        if not ms.pumping and ms.next_step in ms.steps:
            ms.pumping = True
            self.spawn(self._pump(ms))

    async def _pump(self, ms: MemberSet) -> None:
        try:
            while ms.next_step in ms.steps:
                step, _data = ms.steps.pop(ms.next_step)
                seq = ms.next_step
                ms.next_step += 1
                try:
                    await step
                except Exception as exc:  # noqa: BLE001 - a bug fails this broadcast, not the set
                    if member_gone(exc):
                        self._fail_set(ms, cast(PeerLostError | LookupError, exc))
                        continue
                    log.exception("%s: broadcast %s/%d failed", self.name, ms.set_id, seq)
                    self._fail_round(ms, ms.round(seq), repr(exc))
        finally:
            ms.pumping = False

    # ------------------------------------------------------------------ loss
    def _member_lost(self, name: str, exc: PeerLostError | LookupError) -> None:
        """Member ``name`` is gone (`MemberWatch` says so once): every set containing it
        fails, its views of our segments are gone, its communicators are aborted."""
        for ms in self._sets.values():
            if name in ms.members:
                why = f"broadcast failed: worker {name} is gone: {exc}"
                if not isinstance(exc, PeerLostError):
                    why = f"broadcast failed: {exc}"
                self._fail_set(ms, PeerLostError(why) if isinstance(exc, PeerLostError)
                               else LookupError(why))
        self.segments.drop_reader(name)
        self.cuda.lost(name)

    def _fail_set(self, ms: MemberSet, exc: PeerLostError | LookupError) -> None:
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
        for step, data in ms.steps.values():
            step.close()
            if data is not None:
                self._refuse(data)
        ms.steps.clear()

    # ------------------------------------------------------------------ source
    async def _emit(self, ms: MemberSet, rnd: Round) -> None:
        """Send round ``rnd`` (this member is its source) down the relay tree."""
        plan, out = rnd.plan, rnd.out
        assert plan is not None and out is not None
        others = [n for n in plan.members if n != self.name]
        infos = await self.members.resolve_all(others)
        if ms.lost is not None:
            return
        rnd.waiting = set(others)
        if not others:
            self._finish(ms, rnd)
            return
        await self.tree.send(ms.set_id, rnd.seq, plan, out, infos)

    def _on_ack(self, msg: Incoming) -> None:
        ack = read_oneway(BroadcastAck, msg, self.name)
        if ack is None:
            return
        ms = self._sets.get(ack.set_id)
        rnd = ms.rounds.get(ack.seq) if ms is not None else None
        if ms is None or rnd is None or ack.member not in rnd.waiting:
            return  # the broadcast already failed here
        rnd.waiting.discard(ack.member)
        if ack.error is not None and rnd.error is None:
            rnd.error = f"worker {ack.member} could not take the broadcast: {ack.error}"
        if not rnd.waiting:
            self._finish(ms, rnd)

    def _finish(self, ms: MemberSet, rnd: Round) -> None:
        """Source: every member answered; tell them all, complete here."""
        plan = rnd.plan
        assert plan is not None and rnd.work is not None
        done = BroadcastDone(ms.set_id, rnd.seq, rnd.error).to_wire()
        for name in plan.members:
            if name != self.name:
                try:
                    self.endpoint.send_oneway(self.members.endpoint(name), BroadcastOp.DONE,
                                              done)
                except PeerLostError:
                    pass  # its death fails the set through the registry as well
        ms.rounds.pop(rnd.seq, None)
        if rnd.error is None:
            resolve(rnd.work, rnd.obj)
        else:
            reject(rnd.work, ProtocolError(rnd.error))

    # ------------------------------------------------------------------ receivers
    def _on_bcast(self, msg: Incoming) -> None:
        data = read_oneway(BroadcastData, msg, self.name)
        if data is None:
            return
        ms = self._sets.get(data.set_id) or self._sets.setdefault(data.set_id,
                                                                   MemberSet(data.set_id))
        if ms.lost is not None or data.seq < ms.next_step:
            self._refuse(data)
            return
        self._queue(ms, data.seq, self._land(ms, data, msg.frames), data)

    def _refuse(self, data: BroadcastData) -> None:
        """A message of a failed set: give its segment back at once."""
        if isinstance(data.buffers, SharedBuffers):
            self.segments.give_back(data.buffers.owner, data.buffers.seg_id)

    async def _land(self, ms: MemberSet, data: BroadcastData, frames: list[Any]) -> None:
        """Take a broadcast's payload (in number order): map or keep its bytes, pass it on to
        this node's members if this member relays, start its CUDA transfers."""
        seq, buffers = data.seq, data.buffers
        rnd = ms.round(seq)
        if rnd.final is not None:
            self._refuse(data)  # failed at its source: a call for it fails at once
            return
        rnd.sender, rnd.src_address = data.src, data.src_address
        inc = InMessage(data.kind, data.head)
        start = 0
        if data.kind == K_OBJ:
            inc.pickle = frames[0]
            start = 1
        try:
            if isinstance(buffers, SharedBuffers):
                self.segments.map(inc, buffers)
            elif buffers is not None:
                take_frames(inc, buffers, frames, start)
            if data.children:
                await self.tree.pass_on(data, inc, frames, frames[:start])
            if data.cuda is not None:
                inc.cuda_fut = self.cuda.receive(ms.set_id, seq, inc, data.cuda)
        except Exception as exc:  # noqa: BLE001 - this member fails the broadcast, with why
            inc.release()
            if member_gone(exc):
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

    def _maybe_ack(self, ms: MemberSet, rnd: Round) -> None:
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
            self.endpoint.send_oneway(rnd.src_address, BroadcastOp.ACK,
                                      BroadcastAck(ms.set_id, rnd.seq, self.name,
                                                   error).to_wire())
        except PeerLostError:
            pass  # the source's death fails the set

    def _on_done(self, msg: Incoming) -> None:
        done = read_oneway(BroadcastDone, msg, self.name)
        if done is None:
            return
        seq, error = done.seq, done.error
        ms = self._sets.get(done.set_id)
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

    def _fail_round(self, ms: MemberSet, rnd: Round, error: str) -> None:
        """This member could not do its part of ``rnd``: the source learns why (or, at the
        source, every member does)."""
        rnd.error = error
        if rnd.plan is not None and rnd.plan.src == self.name:
            rnd.waiting.clear()
            self._finish(ms, rnd)
        else:
            self._maybe_ack(ms, rnd)

    # ------------------------------------------------------------------ state
    def waits(self) -> list[dict[str, Any]]:
        """The broadcasts this member called that have not completed, as ``aiorl doctor``
        joins them to the other mechanisms' waits (a typed record each, as
        ``P2PEngine.waits``): ``{"kind": "broadcast", "set", "seq", "source", "members",
        "waiting_for", "since"}``. The source waits for the members that have not
        acknowledged (those that did not call yet among them); any other member waits for
        the source (its payload, then its verdict). Runtime loop only."""
        out: list[dict[str, Any]] = []
        for ms in self._sets.values():
            for rnd in ms.rounds.values():
                plan, work = rnd.plan, rnd.work
                if plan is None or work is None or work.done():
                    continue
                waiting = sorted(rnd.waiting) if plan.src == plan.me else [plan.src]
                out.append({"kind": "broadcast", "set": ms.set_id, "seq": rnd.seq,
                            "source": plan.src, "members": list(plan.members),
                            "waiting_for": waiting, "since": rnd.since})
        return out

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task of the broadcaster (cancelled when it closes)."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        self.runtime.submit(fn, *args)

    def address_of(self, member: str) -> str | None:
        """The endpoint of a member this process resolved (None if it did not)."""
        return self.members.address_of(member)

    def statistics(self) -> BroadcastStatistics:
        """A snapshot (loop thread: an ``async def`` worker method may call it)."""
        segments, tree = self.segments, self.tree
        return BroadcastStatistics(
            sourced=self._sourced,
            relayed=tree.relayed,
            shm_bytes_written=segments.bytes_written,
            shm_readers=segments.readers_served,
            frame_bytes_sent=tree.frame_bytes,
            segments=segments.held,
            segments_in_use=segments.in_use,
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
        self.segments.close()


async def _nothing() -> None:
    """The step of a broadcast that failed at its source before its message came."""


def get_broadcaster(runtime: Runtime, node_id: str | None = None) -> Broadcaster:
    """The broadcaster of ``runtime``, created (and its handlers registered) once.

    Worker processes create it when they start (with their node id), so a broadcast message
    that arrives before this worker calls ``broadcast`` is kept, not refused.
    """
    return runtime.service(Broadcaster, runtime, node_id)
