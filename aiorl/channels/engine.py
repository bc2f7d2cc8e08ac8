"""The per-process engine behind every [`Channel`][aiorl.Channel] handle (`ClientEngine`).

The engine sends operations and reads their answers; two helpers it owns do the rest:
`aiorl.channels.resolution` finds (or creates) the channel workers by name, and
`aiorl.channels.routing` sends each operation of a distributed channel to the replica
that holds its key. The gets' own rules are in `aiorl.channels.gets`.

Threads
    A handle can be used from any thread of a process that has an aiorl runtime
    (the driver's threads, a worker's method thread, a worker's event loop). The
    payload is pickled in the calling thread; everything else happens on the
    runtime loop. From the loop thread an operation is handled directly (the fast
    path); from other threads it goes through ``Runtime.submit`` (one loop
    wake-up per burst of calls).

Batching
    Operations issued to one channel during one turn of the loop leave as one
    ZMQ message, and the channel worker answers everything that arrived together
    in one message too (see `aiorl.protocol.channels`). Many puts or gets
    in flight therefore cost a few messages, not a round trip each.

Pipelining
    A put of an item without out-of-band buffers leaves at once, without waiting
    for the puts before it, while the process holds a *credit* for its queue (room
    the channel worker promised); its work completes when the channel worker
    reports it in the queue, so many puts in flight cost a few messages, and a put
    that returned is in the channel. Credits come back as the worker accepts items,
    and a full queue grants none, so backpressure holds. Gets that follow each
    other closely prefetch items already queued (`GetStream`), so a loop of
    ``await ch.get()`` streams without a round trip per item.

Ordering
    One process sends everything for one channel through one outbox, in call
    order, over one connection; so puts from one process enter their queue in
    the order they were made, and requests that observe the queue (``qsize``)
    see the puts issued before them and the items this process prefetched. The
    gets of one process on a queue receive items in queue order, in call order,
    prefetch or not (`GetStream` says how). docs/ordering.md has the
    whole contract.

Failure
    The process watches the channel worker through the registry
    (`resolve_worker`, in `aiorl.channels.resolution`); when it dies the
    endpoint marks it lost and every pending operation fails with
    [`PeerLostError`][aiorl.PeerLostError], puts sent on credits and not yet
    reported in their queue included.

Keys and distributed channels
    Each queue is named by a key: a ``str`` travels as it is, any other hashable
    as its canonical bytes (`wire_key`). Every channel worker has its own
    `ChannelState`; a plain channel has one, a distributed channel one per
    replica, and everything below (outboxes, credits, prefetch, failure) works
    per replica unchanged. Replica 0's state also knows the channel's replicas
    and caches which replica holds each key; an operation on a key it does not
    know yet waits (in call order with the others on that key) for replica 0's
    answer to a ``ROUTE`` (`aiorl.channels.routing`).

Cancellation
    Cancelling a pending put or get (``work.cancel()``, ``wait(timeout)``
    expiring, a cancelled task) withdraws it at the channel worker. If the item
    was already on its way, the handle sends it back, and it returns to its
    place in its queue, so a cancelled get never loses an item, and the gets of
    this process made after the cancellation take it first.
"""

# HOT PATH: ClientEngine.submit/accept/enqueue/_on_done run per item.

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from aiorl.channels import settings
from aiorl.channels.client_state import (
    CREDITED,
    SEES_PREFETCH,
    TAKES,
    USER_GET,
    ChannelState,
    Op,
    Outbox,
)
from aiorl.channels.gets import Gets
from aiorl.channels.items import decode_item, key_from_wire
from aiorl.channels.resolution import Resolver
from aiorl.channels.routing import KeyRouter
from aiorl.channels.weighted_queue import QueuedItem, QueueStats
from aiorl.errors import PeerLostError, ProtocolError, QueueEmpty, QueueFull, RemoteError
from aiorl.protocol import channels as chan
from aiorl.protocol.channels import QueueKey, Received
from aiorl.protocol.ops import ChannelOp
from aiorl.runtime import AsyncChannelWork, Runtime
from aiorl.runtime.promise import link_threads, prepare_threads
from aiorl.util.tokens import TokenTable

__all__ = ["ClientEngine", "channel_waits", "engine_for"]

log = logging.getLogger("aiorl.channels")


class ClientEngine:
    """The per-process engine behind every [`Channel`][aiorl.Channel] handle (one per runtime)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.loop = runtime.loop
        self.endpoint = runtime.endpoint
        self._states: dict[tuple[str, int], ChannelState] = {}
        self._states_lock = threading.Lock()
        #: the state of each resolved channel worker, by its address (answers and losses
        #: name the peer)
        self.by_address: dict[str, ChannelState] = {}
        self._pending: TokenTable[Op] = TokenTable()
        self._outboxes: dict[str, Outbox] = {}
        self._flush_scheduled = False
        self.gets = Gets(self)  # user gets, per queue, and their slots
        self.resolver = Resolver(self)  # channel workers by name
        self.router = KeyRouter(self, self.resolver)  # keys to the replicas that hold them
        # Before any operation can be posted (call_soon keeps FIFO order).
        runtime.submit(self._install)

    def _install(self) -> None:
        self.endpoint.on_event(ChannelOp.DONE, self._on_done)
        self.endpoint.on_peer_lost(self._on_lost)

    def waits(self) -> list[dict[str, Any]]:
        """Every channel operation of this process still waiting, as ``aiorl doctor`` lists
        it: ``kind`` (``put``, ``get`` or ``get_batch``), ``channel``, ``queue``, ``peer`` (the
        channel's worker) and ``unresolved`` (not sent yet: the channel is not reachable)."""
        out: list[dict[str, Any]] = []
        pending = self._pending.values()
        for (channel, _rank), state in list(self._states.items()):
            for queue, stream in state.streams.items():
                for _ in stream.waiting:
                    out.append({"kind": "get", "channel": channel, "queue": queue,
                                "peer": state.worker, "unresolved": False})
            for op in pending:
                if op.state is state and op.kind in _WAITING_KINDS and not op.done():
                    out.append({"kind": _WAITING_KINDS[op.kind], "channel": channel,
                                "queue": op.queue, "peer": state.worker, "unresolved": False})
            for op in state.backlog:
                out.append({"kind": _KIND_NAMES.get(op.kind, "op"), "channel": channel,
                            "queue": op.queue, "peer": state.worker, "unresolved": True})
        return out

    def held(self) -> list[str]:
        """The channels this process holds a handle to (connected or created here): who may
        still put into a channel it has not put into yet, as ``aiorl doctor`` reads it."""
        with self._states_lock:
            return sorted({channel for channel, _rank in self._states})

    def state(self, name: str, rank: int = 0) -> ChannelState:
        """This process's state of replica ``rank`` of channel ``name`` (0: the channel)."""
        with self._states_lock:
            st = self._states.get((name, rank))
            if st is None:
                st = self._states[name, rank] = ChannelState(name, rank)
            return st

    # ------------------------------------------------------------------ any thread
    def submit(self, state: ChannelState, kind: int, queue: QueueKey, number: Any, payload: Any = 0,
               frames: Sequence[Any] = ()) -> AsyncChannelWork[Any]:
        on_loop = self.runtime.on_loop_thread()
        if on_loop:  # the fast path of a get served from prefetched items: no Op
            if kind == USER_GET:
                stream = state.streams.get(queue)
                if stream is not None and stream.can_serve():
                    fut: asyncio.Future[Any] = self.loop.create_future()
                    self.gets.serve_ready(stream, fut)
                    return AsyncChannelWork(self.loop, fut)
        op = Op(self, state, kind, queue, number, payload, frames)
        work: AsyncChannelWork[Any] = AsyncChannelWork(self.loop, op)
        if on_loop:
            self.accept(op)
        else:
            prepare_threads(work)  # this thread will likely wait(): mirror ready, no lock
            self.runtime.submit(self._accept_from_thread, op, work)
        return work

    def _accept_from_thread(self, op: Op, work: AsyncChannelWork[Any]) -> None:
        link_threads(work)  # link the thread-side mirror now: wait() then needs no extra hop
        self.accept(op)

    def accept(self, op: Op) -> None:
        if op.done():  # cancelled before it could leave
            return
        st = op.state
        kind = op.kind
        if kind == USER_GET:
            self.gets.accept_get(op)
            return
        if kind in SEES_PREFETCH:
            stream = st.streams.get(op.queue)
            if stream is not None:
                if not self.gets.prefetch_returned(stream, op):
                    return
                if kind in TAKES:
                    self.issue(op)
                    if stream.waiting:  # no prefetch is out: they have a GET slot each
                        stream.fences.append([op.token, len(stream.waiting)])
                    return
        elif kind == chan.STATS:
            for stream in st.streams.values():
                if not self.gets.prefetch_returned(stream, op):
                    return  # held: accepted again (and the other queues checked) once settled
        elif kind in CREDITED and self._put_credited(op):
            return
        self.issue(op)

    def _put_credited(self, op: Op) -> bool:
        """Send put ``op`` with a credit, without waiting for anything; False without one.

        Its work completes once the channel worker reports it in its queue (a ``CREDIT``
        answer counts the credited puts admitted, in order), so a put that returned is in
        the channel, and a producer that dies after it loses nothing. Only items with at
        most their own pickle in ``frames`` qualify: no user buffer (tensor data sent
        zero-copy) that must stay untouched until it has been sent.
        """
        st = op.state
        address = st.address
        if address is None or len(op.frames) > 1:
            return False
        credits = st.credits.get(op.queue, 0)
        if not credits:
            return False
        st.credits[op.queue] = credits - 1
        op.kind = chan.PUT_CREDITED  # not parkable: once sent, cancelling only stops the wait
        op.token = self._pending.issue(op)
        admitting = st.admitting.get(op.queue)
        if admitting is None:
            admitting = st.admitting[op.queue] = collections.deque()
        admitting.append(op)
        self.enqueue(address, op)
        return True

    def issue(self, op: Op) -> None:
        """Send ``op`` (or keep it until its channel is resolved); its answer is awaited."""
        op.token = self._pending.issue(op)
        st = op.state
        if st.address is not None:
            self.enqueue(st.address, op)
        else:
            st.backlog.append(op)
            self.resolver.ensure_resolving(st)

    def enqueue(self, address: str, op: Op) -> None:
        """Add ``op`` to the outbox of ``address``; send the outbox now once it is full."""
        op.address = address
        box = self._box(address)
        box.ops.append(op)
        payload, frames = op.payload, op.frames
        box.meta.append(chan.request_entry(op.kind, op.token, op.queue, op.number, payload))
        if frames:
            box.frames.extend(frames)
            box.nbytes += sum(len(f) for f in frames)
        elif payload.__class__ is not int:  # an inline pickle
            box.inline += len(payload)
        if (len(box.meta) >= settings.MAX_BATCH_OPS or box.inline >= settings.MAX_INLINE_BYTES
                or box.nbytes >= settings.MAX_BATCH_BYTES):
            self._send(address, self._outboxes.pop(address))

    def _box(self, address: str) -> Outbox:
        box = self._outboxes.get(address)
        if box is None:
            box = self._outboxes[address] = Outbox()
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self.loop.call_soon(self._flush)
        return box

    def _flush(self) -> None:
        self._flush_scheduled = False
        boxes, self._outboxes = self._outboxes, {}
        for address, box in boxes.items():
            self._send(address, box)

    def _send(self, address: str, box: Outbox) -> None:
        try:
            self.endpoint.send_oneway(address, ChannelOp.OPS, box.meta, box.frames)
        except Exception as exc:  # PeerLostError for a dead channel; anything else is ours
            lost = exc if isinstance(exc, PeerLostError) else PeerLostError(
                f"could not send to channel worker {address}: {exc}")
            for op in box.ops:
                self._fail(op, lost)

    def release(self, st: ChannelState) -> None:
        """Channel worker ``st`` was resolved: send what waited for it, in call order."""
        if st.unrouted:  # before the backlog: they were issued first, or concern other keys
            self.router.route_waiting(st)
        assert st.address is not None
        backlog, st.backlog = st.backlog, []
        for op in backlog:
            self.enqueue(st.address, op)

    def abandon(self, st: ChannelState, exc: BaseException) -> None:
        """Channel worker ``st`` could not be resolved: what waited for it fails with ``exc``."""
        self.router.fail_waiting(st, exc)
        backlog, st.backlog = st.backlog, []
        for op in backlog:
            self._fail(op, exc)

    def _fail(self, op: Op, exc: BaseException) -> None:
        if self._pending.pop(op.token) is None:
            return
        if op.kind == chan.PUT_CREDITED:
            self._not_admitted(op)
        if op.stream is not None:
            self.gets.stream_failed(op.stream, exc)
        elif not op.done():
            op.set_exception(exc)

    def _not_admitted(self, op: Op) -> None:
        """Credited put ``op`` failed: it will never be counted admitted (see _on_credit)."""
        admitting = op.state.admitting.get(op.queue)
        if admitting is not None and op in admitting:
            admitting.remove(op)

    def withdraw_get(self, op: Op) -> None:
        """A user get was cancelled (`Op.cancel`)."""
        self.gets.withdraw_get(op)

    def on_cancel(self, op: Op) -> None:
        """A parkable operation was cancelled locally: withdraw it at the channel worker."""
        if op.token not in self._pending:
            return  # not accepted yet (``accept`` drops it) or already answered
        if op.address is None:  # still in the backlog: it never left
            self._pending.pop(op.token)
            if op in op.state.backlog:
                op.state.backlog.remove(op)
            return
        # The answer (CANCELLED, or the result if it was already sent) clears _pending.
        cancel = Op(self, op.state, chan.CANCEL, op.queue, 0, 0, ())
        cancel.token = op.token
        self.enqueue(op.address, cancel)
        if op.kind == chan.GET_BATCH:
            # Items it may have taken come back with its answer; until then this
            # process's gets on the queue must not take the items behind them.
            op.stream = self.gets.stream(op.state, op.queue)
            op.stream.settling += 1

    def _on_done(self, peer: str, meta: Any, frames: list[Any]) -> None:
        pos = 0
        pending = self._pending
        try:
            answers = chan.read_answers(meta)
        except ProtocolError as exc:  # not a batch at all: nothing in it names an operation
            log.error("channel worker %s sent a malformed message: %s", peer, exc)
            return
        info: Any
        for answer in answers:
            if isinstance(answer, chan.Refused):  # its operation fails as if answered ERROR
                log.error("channel worker %s sent a malformed answer: %s", peer, answer.error)
                if answer.token is None:
                    continue
                token, status, info = answer.token, chan.ERROR, f"ProtocolError: {answer.error}"
            else:
                token, status, info = answer
            op = pending.pop(token)
            if status == chan.ITEMS or status == chan.PEEKED:
                try:
                    items, pos = chan.read_items(info, frames, pos)
                except ProtocolError as exc:  # as a refused answer
                    log.error("channel worker %s sent a malformed item: %s", peer, exc)
                    status, info = chan.ERROR, f"ProtocolError: {exc}"
            if status == chan.ITEMS:
                if op is None or op.done():
                    self._refused(peer, op, token, items)  # before held operations go out
                    if op is not None and op.stream is not None:
                        self.gets.slot_withdrawn(op.stream)
                    continue
                if op.stream is not None:
                    self.gets.slot_items(op, items)
                    continue
                try:
                    if op.kind == chan.GET_BATCH:
                        value: Any = [decode_item(p, f) for p, _, f in items]
                    else:
                        p, _, f = items[0]
                        value = decode_item(p, f)
                except BaseException as exc:  # noqa: BLE001 - the consumer learns why
                    op.set_exception(exc)
                    continue
                op.set_result(value)
                continue
            if status == chan.CREDIT:  # token 0: no operation of its own
                self._on_credit(peer, info)
                continue
            if status == chan.PEEKED:
                if op is not None and not op.done():
                    try:
                        op.set_result([QueuedItem(decode_item(p, f), weight)
                                       for p, (weight, _), f in items])
                    except BaseException as exc:  # noqa: BLE001 - the caller learns why
                        op.set_exception(exc)
                continue
            if op is None:
                continue  # a late answer to an operation that failed here already
            if op.kind == chan.PUT_CREDITED:  # refused (ERROR): it will never be admitted
                self._not_admitted(op)
            if op.done():
                if op.stream is not None:  # CANCELLED: a withdrawn slot
                    self.gets.slot_withdrawn(op.stream)
                continue  # CANCELLED after a local cancel, or a late answer nobody awaits
            if op.stream is not None:
                if status == chan.NO_PREFETCH:
                    self.gets.prefetch_refused(op)
                else:
                    self.gets.slot_answered(op, status, info)
            elif status == chan.OK:
                if op.kind in chan.REPLIES:
                    self._replied(op, info)
                else:
                    op.set_result(None)
            elif status == chan.FULL:
                op.set_exception(QueueFull(
                    f"queue {op.queue!r} of channel {op.state.name!r} is full"))
            elif status == chan.EMPTY:
                op.set_exception(QueueEmpty(
                    f"queue {op.queue!r} of channel {op.state.name!r} is empty"))
            else:
                op.set_exception(RemoteError(
                    op.state.worker, op.state.rank, "ChannelError", str(info), ""))

    def _replied(self, op: Op, info: Any) -> None:
        """``op`` (``STATS``, ``INFO`` or ``ROUTE``) was answered ``OK`` with ``info``."""
        try:
            reply = chan.REPLIES[op.kind].from_wire(info)
        except ProtocolError as exc:
            op.set_exception(exc)
            return
        if isinstance(reply, chan.Statistics):
            op.set_result({key_from_wire(q): QueueStats(*c) for q, c in reply.queues.items()})
        elif isinstance(reply, chan.Route):
            self.router.routed(op, reply.rank)
        else:
            op.set_result((reply.qsize, reply.maxsize))

    def _on_credit(self, peer: str, credit: chan.CreditFields) -> None:
        st = self.by_address.get(peer)
        if st is None:
            return  # from a channel worker this process no longer uses
        queue, granted, admitted = credit
        if granted:
            st.credits[queue] = st.credits.get(queue, 0) + granted
        # Credited puts of one process enter their queue in the order they were sent
        # (parked ones too, in arrival order), so the oldest ``admitted`` are in.
        admitting = st.admitting.get(queue)
        if admitted and admitting:
            pending = self._pending
            for _ in range(min(admitted, len(admitting))):
                op = admitting.popleft()
                pending.pop(op.token)
                if not op.done():  # a cancelled one only stopped waiting
                    op.set_result(None)

    def _refused(self, peer: str, op: Op | None, token: int, items: list[Received]) -> None:
        """Items arrived for a get nobody waits for (it was cancelled): send them back."""
        if op is None:
            log.error("channel answer for unknown operation %s: %d item(s) dropped",
                      token, len(items))
            return
        if items and not self.endpoint.is_lost(peer):
            self.unget(peer, op.state, op.queue, items)

    def unget(self, address: str, st: ChannelState, queue: QueueKey, items: Sequence[Received]) -> None:
        frames = [f for _, _, fs in items for f in fs]
        self.enqueue(address, Op(self, st, chan.UNGET, queue, [place for _, place, _ in items],
                                   [p for p, _, _ in items], frames))

    def _on_lost(self, address: str, exc: BaseException) -> None:
        self._outboxes.pop(address, None)
        st = self.by_address.pop(address, None)
        if st is not None:
            # Resolve again on the next operation: that fails with PeerLostError while
            # the channel is dead, and finds a channel re-created under the same name.
            st.address = None
            st.credits.clear()
            if st.rank == 0:  # learn the channel's shape and routes again (it may be re-created)
                st.world_size = None
                st.key_ranks.clear()
            for stream in st.streams.values():  # prefetched items were lost with it
                self.gets.stream_failed(stream, PeerLostError(
                    f"channel {st.name!r} is gone (its worker {st.worker} was lost): {exc}"))
        for op in [op for op in self._pending.values() if op.address == address]:  # oldest first
            what = ("before this put was in its queue (it was sent, not yet admitted)"
                    if op.kind == chan.PUT_CREDITED else "")
            self._fail(op, PeerLostError(
                f"channel {op.state.name!r} is gone (its worker {op.state.worker} was lost)"
                f"{' ' + what if what else ''}: {exc}"))
        if st is not None:
            st.admitting.clear()



#: The operations `ClientEngine.waits` lists while pending, and every kind's name.
_WAITING_KINDS = {chan.PUT: "put", chan.PUT_CREDITED: "put", chan.GET_BATCH: "get_batch"}
_KIND_NAMES = {**_WAITING_KINDS, chan.GET: "get", USER_GET: "get"}

_engines: weakref.WeakKeyDictionary[Runtime, ClientEngine] = weakref.WeakKeyDictionary()
_engines_lock = threading.Lock()


def channel_waits(runtime: Runtime) -> list[dict[str, Any]]:
    """The channel operations of ``runtime``'s process still waiting (`ClientEngine.waits`;
    none where it never used a channel)."""
    engine = _engines.get(runtime)
    return [] if engine is None else engine.waits()


def held_channels(runtime: Runtime) -> list[str]:
    """The channels ``runtime``'s process holds a handle to (`ClientEngine.held`)."""
    engine = _engines.get(runtime)
    return [] if engine is None else engine.held()


def engine_for(runtime: Runtime) -> ClientEngine:
    with _engines_lock:
        engine = _engines.get(runtime)
        if engine is None:
            engine = _engines[runtime] = ClientEngine(runtime)
        return engine
