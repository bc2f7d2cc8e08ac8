"""The client side of channels: the [`Channel`][aiorl.Channel] handle and its per-process engine.

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
    in one message too (see `aiorl.channels._protocol`). Many puts or gets
    in flight therefore cost a few messages, not a round trip each.

Pipelining
    A put of an item without out-of-band buffers completes at once while the
    process holds a *credit* for its queue (room the channel worker promised);
    credits come back as the worker accepts items, and a full queue grants
    none, so backpressure holds. Gets that follow each other closely prefetch
    items already queued (`_GetStream`). So ``await ch.put(x)`` and
    ``await ch.get()`` in plain loops stream without a round trip per item.

Ordering
    One process sends everything for one channel through one outbox, in call
    order, over one connection; so puts from one process enter their queue in
    the order they were made, and requests that observe the queue (``qsize``)
    see the puts issued before them and the items this process prefetched. The
    gets of one process on a queue receive items in queue order, in call order,
    prefetch or not (`_GetStream` says how). docs/ordering.md has the
    whole contract.

Failure
    The process watches the channel worker through the registry
    (`resolve_worker`); when it dies the
    endpoint marks it lost and every pending operation fails with
    [`PeerLostError`][aiorl.PeerLostError], and so does the next operation if
    pipelined puts had not yet reached their queue.

Keys and distributed channels
    Each queue is named by a key: a ``str`` travels as it is, any other hashable
    as its canonical bytes (`wire_key`). Every channel worker has its own
    `_ChannelState`; a plain channel has one, a distributed channel one per
    replica, and everything below (outboxes, credits, prefetch, failure) works
    per replica unchanged. Replica 0's state also knows the channel's replicas
    and caches which replica holds each key; an operation on a key it does not
    know yet waits (in call order with the others on that key) for replica 0's
    answer to a ``ROUTE`` (`_ClientCore.submit_routed`).

Cancellation
    Cancelling a pending put or get (``work.cancel()``, ``wait(timeout)``
    expiring, a cancelled task) withdraws it at the channel worker. If the item
    was already on its way, the handle sends it back, and it returns to its
    place in its queue, so a cancelled get never loses an item, and the gets of
    this process made after the cancellation take it first.
"""

# HOT PATH: Channel.put/get, _ClientCore.submit/_accept/_enqueue/_on_done and the
# _GetStream methods run per item.

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import pickle
import reprlib
import threading
import weakref
from collections.abc import Callable, Coroutine, Generator, Hashable, Sequence
from typing import Any, Literal, NamedTuple, overload

import msgpack

from aiorl.channels import _protocol as P
from aiorl.channels._queue import QueuedItem, QueueStats
from aiorl.channels._server import ChannelHost, QueueKey, group_name_for
from aiorl.errors import (
    AiorlError,
    GroupExistsError,
    GroupNotFoundError,
    NotFoundError,
    PeerLostError,
    QueueEmpty,
    QueueFull,
    RemoteError,
    WorkerInitError,
)
from aiorl.group import WorkerGroup, WorkerGroupBuilder
from aiorl.names import WorkerInfo
from aiorl.placement import NodePlacementStrategy
from aiorl.protocol.ops import WorkerState
from aiorl.runtime import AsyncChannelWork, Runtime, Session, WorkerSession, current_runtime
from aiorl.runtime.promise import (
    link_threads,
    prepare_threads,
    reject,
    resolve,
    settle_from,
    trace_until_settled,
)
from aiorl.trace import recorder as _trace
from aiorl.transport import serialization
from aiorl.util.tokens import TokenTable

__all__ = [
    "DEFAULT_KEY",
    "Channel",
    "ReplicaStatistics",
    "connect_channel_from_worker",
    "create_channel_from_worker",
]

log = logging.getLogger("aiorl.channels")

#: How long connecting waits for a channel to exist and be ready, by default.
DEFAULT_CONNECT_TIMEOUT = 60.0
#: The queue of operations that name no key (RLinf's is ``"default_queue"``).
DEFAULT_KEY = "default"
#: How many items of each queue ``str(channel)`` shows.
STR_ITEMS_PER_QUEUE = 8
#: How long ``str(channel)`` waits for the channel to answer.
STR_TIMEOUT = 10.0

_PARKABLE = frozenset((P.PUT, P.GET, P.GET_BATCH))  # kinds the channel worker may hold back
#: Client-side only, never on the wire: a user's ``get``, served by its queue's _GetStream.
_USER_GET = -1
#: Operations that must see the items this process prefetched back in their queue first
#: (``STATS`` too, for every queue of the channel).
_SEES_PREFETCH = frozenset((P.GET_NOWAIT, P.GET_BATCH, P.INFO, P.PEEK))
#: Of those, the ones that take items: a queue's gets made after one are served after it.
_TAKES = frozenset((P.GET_NOWAIT, P.GET_BATCH))
#: Puts that complete at once while their queue's credits last (see _protocol, Credits).
_CREDITED = frozenset((P.PUT, P.PUT_NOWAIT))
#: Operations recorded as spans while tracing is on, and their span names.
_TRACED_KINDS = {P.PUT: "put", P.PUT_NOWAIT: "put_nowait", _USER_GET: "get",
                 P.GET_NOWAIT: "get_nowait", P.GET_BATCH: "get_batch"}

Received = tuple[Any, tuple[float, int], Sequence[Any]]  # (payload, (weight, seq), frames)
#: Gives the node ranks of a new channel's workers, one per replica, for a session.
NodeChoice = Callable[[Session], Coroutine[Any, Any, list[int]]]
#: Combines the answers of every replica (in replica order) to a fanned-out operation.
Combine = Callable[[list["_ChannelState"], list[Any]], Any]


class _Op(asyncio.Future):  # type: ignore[type-arg]
    """One operation: the future its [`AsyncChannelWork`][aiorl.AsyncChannelWork] wraps, and its
    wire data.

    Being the future itself (rather than an object holding one) saves an
    allocation per operation, and overriding ``cancel`` catches every way a work
    gets cancelled (``work.cancel()``, ``wait(timeout)`` expiring, a task
    cancelled while awaiting it) without a done callback per operation.
    Operations that nobody awaits (``CANCEL``, ``UNGET``, the ``GET`` and
    ``PREFETCH`` slots of a `_GetStream`) are never completed.
    """

    __slots__ = ("core", "state", "kind", "queue", "number", "payload", "frames", "token",
                 "address", "stream")

    def __init__(self, core: _ClientCore, state: _ChannelState, kind: int, queue: QueueKey,
                 number: Any, payload: Any, frames: Sequence[Any],
                 stream: _GetStream | None = None) -> None:
        super().__init__(loop=core.loop)
        self.core = core
        self.state = state  # replica 0's until a routed operation knows its replica
        self.kind = kind
        self.queue = queue
        self.number = number
        self.payload = payload  # inline pickle bytes, or the number of frames in ``frames``
        self.frames = frames
        self.token = 0
        self.address: str | None = None  # set once it is handed to an outbox
        #: the stream a GET/PREFETCH sent on behalf of users feeds; for a cancelled
        #: get_batch, the stream whose gets wait for its answer (``settling``)
        self.stream = stream

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg=msg):
            return False
        if self.kind == _USER_GET:
            self.core._withdraw_get(self)
        elif self.kind in _PARKABLE:
            self.core._on_cancel(self)
        return True


class _Outbox:
    """What leaves for one channel worker at the end of this loop turn."""

    __slots__ = ("meta", "frames", "ops", "nbytes", "inline", "credited")

    def __init__(self) -> None:
        self.meta: list[Any] = []
        self.frames: list[Any] = []
        self.ops: list[_Op] = []  # the operations that await an answer, or are withdrawn
        self.nbytes = 0
        self.inline = 0
        #: The channel whose credited puts (already complete, no _Op) are in ``meta``.
        self.credited: _ChannelState | None = None


class _GetStream:
    """The gets of this process on one queue of one channel (loop thread only).

    User gets wait in ``waiting``; the channel worker sees *slots* instead:
    ``PREFETCH`` requests for up to ``depth`` items already queued while the
    user's gets follow each other closely (streaming), and a parkable ``GET`` for
    each waiting user get that no prefetch in flight can serve. ``depth`` doubles
    while user gets still have to wait and halves when a prefetch finds the queue
    empty. Prefetched items go back to the queue (``UNGET``, at their places) after
    `PREFETCH_IDLE` seconds without a get, and
    before any other operation on the queue that must see them (``get_batch``,
    ``get_nowait``, ``qsize``, ``statistics``).

    Ordering (docs/ordering.md): the channel worker handles the slots in the order
    they were sent, each taking from the head of the queue (a ``GET`` parks only
    while the queue is empty, and a ``PREFETCH`` behind it then takes nothing), so
    **items arrive in queue order**, and each goes to the oldest waiting user get or,
    if none waits, to ``ready`` for the next one: the user gets receive the items in
    queue order, as if each get had been sent alone. Giving items *back* is what can
    break this: an item given back while a slot sent earlier is still out lets that
    slot's newer items reach a user get first, and a slot sent after an item was
    taken but before it is back in the queue takes the items behind it. So:

    * ``ready`` goes back only when no ``PREFETCH`` is out (`_ClientCore._idle`
      waits for it), or while ``held`` keeps every later operation back and the
      prefetch's items follow them back (`_ClientCore._prefetch_returned`);
    * only ``GET`` slots newer than every ``PREFETCH`` out are withdrawn, so an item
      a withdrawn slot gives back is newer than every item still to arrive;
    * while a withdrawn request (a slot, or a cancelled ``get_batch``) may still give
      items back (``settling``), no new slot is sent (`_ClientCore._top_up`);
    * before held operations are released, the user gets waiting since before them
      get their slots (`_ClientCore._settled`);
    * slots serve whichever user get is oldest, so a slot sent for a get that was then
      cancelled serves a later get; that must not cross a ``get_batch`` or
      ``get_nowait`` sent in between (it is behind the slot at the channel worker, but
      was made before the later get): cancelling a get made before such a *fence*
      withdraws a GET slot ahead of it (`_ClientCore._withdraw_get`).
    """

    __slots__ = ("state", "queue", "waiting", "ready", "demand", "requested", "requested_total",
                 "settling", "depth", "last_get", "held", "timer", "fences")

    def __init__(self, state: _ChannelState, queue: QueueKey) -> None:
        self.state = state
        self.queue = queue
        self.waiting: collections.deque[_Op] = collections.deque()  # user gets, in call order
        self.ready: collections.deque[Received] = collections.deque()  # prefetched items
        self.demand: collections.deque[_Op] = collections.deque()  # GET slots not answered
        self.requested: dict[_Op, int] = {}  # PREFETCH slots not answered -> items asked for
        self.requested_total = 0
        #: withdrawn requests (CANCEL sent: GET slots, cancelled get_batches) whose answer
        #: (CANCELLED, or items that go back) has not arrived
        self.settling = 0
        self.depth = 0
        self.last_get = -1e9  # when a user get was last issued or served
        #: Operations on this queue held back until withdrawn and in-flight slots are
        #: answered, so that they see the prefetched items back in the queue.
        self.held: list[_Op] | None = None
        self.timer: asyncio.TimerHandle | None = None
        #: ``[token, gets]`` of each get_batch or get_nowait sent for this queue while user
        #: gets waited, oldest first: ``gets`` of the oldest waiting user gets were made
        #: before it, and their GET slots, one each, are ahead of it at the channel worker.
        self.fences: collections.deque[list[int]] = collections.deque()

    def can_serve(self) -> bool:
        """Whether a new user get takes a prefetched item now (nothing waits before it)."""
        return bool(self.ready) and not self.waiting and self.held is None

    def in_flight(self) -> int:
        """Items that slots may still bring beyond what waiting user gets need."""
        return len(self.demand) + self.requested_total - len(self.waiting)


class _ChannelState:
    """What one process knows about one channel worker (a plain channel's, or one replica
    of a distributed channel), shared by all its handles to that channel.

    Replica 0's state (every channel has one) also holds what this process knows about
    the channel as a whole: how many replicas it has and which replica holds which key.
    """

    def __init__(self, name: str, rank: int = 0) -> None:
        self.name = name
        self.group = group_name_for(name)
        self.rank = rank
        self.worker = f"{self.group}:{rank}"
        self.address: str | None = None  # the channel worker's endpoint, once resolved
        self.node_rank: int | None = None  # the channel worker's node, once resolved
        self.backlog: list[_Op] = []  # operations issued before the address was known
        self.task: asyncio.Task[dict[str, Any]] | None = None  # the resolution whose outcome counts
        self.ready_waiters: list[AsyncChannelWork[Any]] = []
        self.credits: dict[QueueKey, int] = {}  # queue -> puts that may complete at once
        self.unconfirmed = 0  # credited puts sent and not yet reported admitted
        #: The error of a pipelined (credited) put, raised by the next operation.
        self.failure: BaseException | None = None
        self.streams: dict[QueueKey, _GetStream] = {}
        # ---- replica 0 only: the channel as a whole (see _ClientCore.submit_routed)
        #: replicas of the channel, learnt when replica 0 is resolved (None: not yet)
        self.world_size: int | None = None
        self.replicas: list[_ChannelState] = [self]
        self.key_ranks: dict[QueueKey, int] = {}  # the routing cache: key -> replica rank
        #: operations on keys whose replica is not known yet, in call order per key
        self.unrouted: dict[QueueKey, list[_Op]] = {}
        self.routing: dict[QueueKey, _Op] = {}  # ROUTE requests in flight, per key


def encode_item(item: Any) -> tuple[Any, list[Any]]:
    """``(payload, frames)`` for an item: a small pickle inline, else ``(n, its n frames)``.

    The frames are the pickle and its out-of-band buffers from aiorl's one codec,
    `aiorl.transport.serialization.encode` (buffers of at least
    ``OOB_THRESHOLD`` bytes, e.g. tensor data, become zero-copy frames). Raises
    `SerializationError`.
    """
    data, buffers = serialization.encode(item)
    if not buffers and len(data) <= P.INLINE_MAX:
        return data, []
    return 1 + len(buffers), [data, *buffers]


def decode_item(payload: Any, frames: Sequence[Any]) -> Any:
    if payload.__class__ is int:
        return serialization.decode(frames[0], frames[1:])
    return serialization.decode(payload)


def _received(info: Any, frames: list[Any], pos: int) -> tuple[list[Received], int]:
    """The items of an ``ITEMS``/``PEEKED`` answer, and the position of the next frame."""
    items: list[Received] = []
    for payload, weight, seq in info:
        if payload.__class__ is int:
            items.append((payload, (weight, seq), frames[pos:pos + payload]))
            pos += payload
        else:
            items.append((payload, (weight, seq), ()))
    return items, pos


#: msgpack extension type of a key that msgpack cannot hold itself: its pickle.
_PICKLED_KEY = 1


def _pickled_key(obj: Any) -> msgpack.ExtType:
    return msgpack.ExtType(_PICKLED_KEY, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _unpickled_key(code: int, data: bytes) -> Any:
    if code != _PICKLED_KEY:
        raise ValueError(f"unknown channel key extension type {code}")
    return pickle.loads(data)


def wire_key(key: Hashable) -> QueueKey:
    """A queue key as it travels and is stored at the channel worker.

    A ``str`` stays as it is (the common case, and free). Any other hashable key
    becomes bytes: its msgpack form, with tuples as arrays and objects msgpack
    cannot hold (enums, frozen dataclasses, ...) as their pickle. Equal keys
    built from ``str``, ``int``, ``float``, ``bool``, ``None``, ``bytes`` and
    tuples of them therefore name one queue in every process; unlike a ``dict``,
    ``1``, ``1.0`` and ``True`` are three keys, and other objects are compared by
    their pickle.
    """
    if key.__class__ is str:
        return key
    if isinstance(key, str):
        return str(key)
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"a channel key must be hashable, got {type(key).__name__}") from None
    return msgpack.packb(key, default=_pickled_key)  # type: ignore[no-any-return]


def key_from_wire(key: QueueKey) -> Any:
    """The key `wire_key` made ``key`` from."""
    if key.__class__ is str:
        return key
    return msgpack.unpackb(key, use_list=False, ext_hook=_unpickled_key)


def _process_node_rank() -> int:
    """The node this process runs on, which a distributed channel assigns new keys by:
    a worker's is the ``NODE_RANK`` its group launched it with; the driver counts as
    node 0, as in RLinf."""
    if "AIORL_WORKER_NAME" not in os.environ:
        return 0
    try:
        return int(os.environ.get("NODE_RANK", "0"))
    except ValueError:
        return 0


class _ClientCore:
    """The per-process engine behind every [`Channel`][aiorl.Channel] handle (one per runtime)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.loop = runtime.loop
        self.endpoint = runtime.endpoint
        self._states: dict[tuple[str, int], _ChannelState] = {}
        #: this process's node, which a distributed channel assigns new keys by
        self.node_rank = _process_node_rank()
        self._states_lock = threading.Lock()
        self._by_address: dict[str, _ChannelState] = {}
        self._pending: TokenTable[_Op] = TokenTable()
        self._outboxes: dict[str, _Outbox] = {}
        self._flush_scheduled = False
        # The future of every put completed with a credit: shared, as it never changes.
        self._accepted: asyncio.Future[None] = self.loop.create_future()
        self._accepted.set_result(None)
        # Before any operation can be posted (call_soon keeps FIFO order).
        runtime.submit(self._install)

    def _install(self) -> None:
        self.endpoint.on_event(P.DONE, self._on_done)
        self.endpoint.on_peer_lost(self._on_lost)

    def state(self, name: str, rank: int = 0) -> _ChannelState:
        """This process's state of replica ``rank`` of channel ``name`` (0: the channel)."""
        with self._states_lock:
            st = self._states.get((name, rank))
            if st is None:
                st = self._states[name, rank] = _ChannelState(name, rank)
            return st

    # ------------------------------------------------------------------ any thread
    def submit(self, state: _ChannelState, kind: int, queue: QueueKey, number: Any, payload: Any = 0,
               frames: Sequence[Any] = ()) -> AsyncChannelWork[Any]:
        on_loop = self.runtime.on_loop_thread()
        if on_loop and state.failure is None:  # the fast paths: no _Op, nothing to await
            if kind in _CREDITED and self._put_credited(state, queue, number, payload, frames):
                return AsyncChannelWork(self.loop, self._accepted)
            if kind == _USER_GET:
                stream = state.streams.get(queue)
                if stream is not None and stream.can_serve():
                    fut: asyncio.Future[Any] = self.loop.create_future()
                    self._serve_ready(stream, fut)
                    return AsyncChannelWork(self.loop, fut)
        op = _Op(self, state, kind, queue, number, payload, frames)
        work: AsyncChannelWork[Any] = AsyncChannelWork(self.loop, op)
        if on_loop:
            self._accept(op)
        else:
            prepare_threads(work)  # this thread will likely wait(): mirror ready, no lock
            self.runtime.submit(self._accept_from_thread, op, work)
        return work

    def submit_routed(self, st: _ChannelState, kind: int, key: QueueKey, number: Any,
                      payload: Any = 0, frames: Sequence[Any] = ()) -> AsyncChannelWork[Any]:
        """`submit` an operation on ``key`` of channel ``st`` (replica 0's state)
        whose replica this process does not know yet: the channel is not resolved, or
        it is distributed and ``key`` is new here. The operation waits, in call order
        with the others on ``key``, until the replica is known (`_route`)."""
        op = _Op(self, st, kind, key, number, payload, frames)
        work: AsyncChannelWork[Any] = AsyncChannelWork(self.loop, op)
        if self.runtime.on_loop_thread():
            self._route(op)
        else:
            prepare_threads(work)
            self.runtime.submit(self._route_from_thread, op, work)
        return work

    def fan_out(self, st: _ChannelState, kind: int, combine: Combine) -> AsyncChannelWork[Any]:
        """``kind`` (``STATS`` or ``FLUSH``) sent to every replica of channel ``st``, once the
        channel is resolved and the routes this process asked for are known (so it comes
        after every earlier operation); the work gives ``combine(replicas, answers)``."""
        work: AsyncChannelWork[Any] = AsyncChannelWork(self.loop)

        async def run() -> Any:
            await self.ready(st)
            while st.routing:  # operations waiting for their route go out first
                await asyncio.gather(*st.routing.values(), return_exceptions=True)
            replicas = list(st.replicas)
            works = [self.submit(replica, kind, "", 0) for replica in replicas]
            return combine(replicas, [await w for w in works])

        def start() -> None:
            task = self.loop.create_task(run())
            task.add_done_callback(lambda t: settle_from(work, t))

        self.runtime.submit(start)
        return work

    # ------------------------------------------------------------------ loop thread
    def _route_from_thread(self, op: _Op, work: AsyncChannelWork[Any]) -> None:
        link_threads(work)
        self._route(op)

    def _route(self, op: _Op) -> None:
        """Accept ``op`` at the replica that holds its key, or keep it until that is known."""
        if op.done():  # cancelled before it could leave
            return
        st = op.state
        rank = 0 if st.world_size == 1 else st.key_ranks.get(op.queue)
        if rank is not None:
            op.state = st.replicas[rank]
            self._accept(op)
            return
        waiting = st.unrouted.get(op.queue)
        if waiting is None:
            waiting = st.unrouted[op.queue] = []
        waiting.append(op)
        if st.world_size is None:
            self._ensure_resolving(st)  # _resolved routes what waits here
        elif op.queue not in st.routing:
            self._ask_route(st, op.queue)

    def _ask_route(self, st: _ChannelState, key: QueueKey) -> None:
        """Ask replica 0, the one authority, which replica holds ``key`` (assigning it)."""
        ask = _Op(self, st, P.ROUTE, key, self.node_rank, 0, ())
        st.routing[key] = ask
        ask.add_done_callback(functools.partial(self._route_failed, st, key))
        self._issue(ask)

    def _routed(self, ask: _Op, rank: int) -> None:
        """The answer to a ``ROUTE``: cache it and send what waited for it, in order."""
        st, key = ask.state, ask.queue
        if st.routing.get(key) is ask:
            del st.routing[key]
        if not 0 <= rank < len(st.replicas):
            ask.set_exception(RemoteError(st.worker, 0, "ChannelError",
                                          f"key routed to replica {rank} of {len(st.replicas)}",
                                          ""))
            return
        st.key_ranks[key] = rank
        replica = st.replicas[rank]
        for op in st.unrouted.pop(key, ()):
            if not op.done():
                op.state = replica
                self._accept(op)
        ask.set_result(rank)

    def _route_failed(self, st: _ChannelState, key: QueueKey, ask: _Op) -> None:
        if ask.cancelled() or ask.exception() is None:
            return
        if st.routing.get(key) is ask:
            del st.routing[key]
        exc = ask.exception()
        assert exc is not None
        for op in st.unrouted.pop(key, ()):
            if not op.done():
                op.set_exception(exc)

    def _route_waiting(self, st: _ChannelState) -> None:
        """Replica 0 was just resolved: route the operations that waited for it."""
        if st.world_size != 1:
            for key in st.unrouted:
                if key not in st.routing:
                    self._ask_route(st, key)
            return
        waiting, st.unrouted = st.unrouted, {}
        for ops in waiting.values():
            for op in ops:
                if not op.done():
                    self._accept(op)

    def _accept_from_thread(self, op: _Op, work: AsyncChannelWork[Any]) -> None:
        link_threads(work)  # link the thread-side mirror now: wait() then needs no extra hop
        self._accept(op)

    def _accept(self, op: _Op) -> None:
        if op.done():  # cancelled before it could leave
            return
        st = op.state
        if st.failure is not None:  # an earlier pipelined put failed: this operation says so
            exc, st.failure = st.failure, None
            op.set_exception(exc)
            return
        kind = op.kind
        if kind == _USER_GET:
            self._accept_get(op)
            return
        if kind in _SEES_PREFETCH:
            stream = st.streams.get(op.queue)
            if stream is not None:
                if not self._prefetch_returned(stream, op):
                    return
                if kind in _TAKES:
                    self._issue(op)
                    if stream.waiting:  # no prefetch is out: they have a GET slot each
                        stream.fences.append([op.token, len(stream.waiting)])
                    return
        elif kind == P.STATS:
            for stream in st.streams.values():
                if not self._prefetch_returned(stream, op):
                    return  # held: accepted again (and the other queues checked) once settled
        elif kind in _CREDITED and self._put_credited(st, op.queue, op.number, op.payload,
                                                      op.frames):
            op.set_result(None)
            return
        self._issue(op)

    def _put_credited(self, st: _ChannelState, queue: QueueKey, weight: float, payload: Any,
                      frames: Sequence[Any]) -> bool:
        """Send a put with a credit, complete already; False without a credit.

        Only items with at most their own pickle in ``frames`` qualify: no user buffer
        (tensor data sent zero-copy) that must stay untouched until it has been sent.
        """
        address = st.address
        if address is None or len(frames) > 1:
            return False
        credits = st.credits.get(queue, 0)
        if not credits:
            return False
        st.credits[queue] = credits - 1
        st.unconfirmed += 1
        box = self._box(address)
        box.credited = st
        self._add(address, box, (P.PUT_CREDITED, self._pending.next_token(), queue, weight, payload),
                  frames)
        return True

    def _issue(self, op: _Op) -> None:
        """Send ``op`` (or keep it until its channel is resolved); its answer is awaited."""
        op.token = self._pending.issue(op)
        st = op.state
        if st.address is not None:
            self._enqueue(st.address, op)
        else:
            st.backlog.append(op)
            self._ensure_resolving(st)

    def _enqueue(self, address: str, op: _Op) -> None:
        op.address = address
        box = self._box(address)
        box.ops.append(op)
        self._add(address, box, (op.kind, op.token, op.queue, op.number, op.payload), op.frames)

    def _box(self, address: str) -> _Outbox:
        box = self._outboxes.get(address)
        if box is None:
            box = self._outboxes[address] = _Outbox()
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self.loop.call_soon(self._flush)
        return box

    def _add(self, address: str, box: _Outbox, entry: tuple[Any, ...],
             frames: Sequence[Any]) -> None:
        """Add one wire entry to ``box``; send the box now once it is full."""
        box.meta.append(entry)
        if frames:
            box.frames.extend(frames)
            box.nbytes += sum(len(f) for f in frames)
        elif entry[4].__class__ is not int:  # the payload: an inline pickle
            box.inline += len(entry[4])
        if (len(box.meta) >= P.MAX_BATCH_OPS or box.inline >= P.MAX_INLINE_BYTES
                or box.nbytes >= P.MAX_BATCH_BYTES):
            self._send(address, self._outboxes.pop(address))

    def _flush(self) -> None:
        self._flush_scheduled = False
        boxes, self._outboxes = self._outboxes, {}
        for address, box in boxes.items():
            self._send(address, box)

    def _send(self, address: str, box: _Outbox) -> None:
        try:
            self.endpoint.send_oneway(address, P.OPS, box.meta, box.frames)
        except Exception as exc:  # PeerLostError for a dead channel; anything else is ours
            lost = exc if isinstance(exc, PeerLostError) else PeerLostError(
                f"could not send to channel worker {address}: {exc}")
            if box.credited is not None:
                self._pipelined_failed(box.credited, lost)
            for op in box.ops:
                self._fail(op, lost)

    def _fail(self, op: _Op, exc: BaseException) -> None:
        if self._pending.pop(op.token) is None:
            return
        if op.stream is not None:
            self._stream_failed(op.stream, exc)
        elif not op.done():
            op.set_exception(exc)

    def _pipelined_failed(self, st: _ChannelState, exc: BaseException) -> None:
        """A put that already completed (with a credit) failed: the next operation raises it."""
        if st.failure is None:
            log.warning("channel %r: a pipelined put failed; the next operation on the channel "
                        "(or flush()) raises it: %s", st.name, exc)
            st.failure = exc

    def _on_cancel(self, op: _Op) -> None:
        """A parkable operation was cancelled locally: withdraw it at the channel worker."""
        if op.token not in self._pending:
            return  # not accepted yet (``_accept`` drops it) or already answered
        if op.address is None:  # still in the backlog: it never left
            self._pending.pop(op.token)
            if op in op.state.backlog:
                op.state.backlog.remove(op)
            return
        # The answer (CANCELLED, or the result if it was already sent) clears _pending.
        cancel = _Op(self, op.state, P.CANCEL, op.queue, 0, 0, ())
        cancel.token = op.token
        self._enqueue(op.address, cancel)
        if op.kind == P.GET_BATCH:
            # Items it may have taken come back with its answer; until then this
            # process's gets on the queue must not take the items behind them.
            op.stream = self._stream(op.state, op.queue)
            op.stream.settling += 1

    def _on_done(self, peer: str, meta: Any, frames: list[Any]) -> None:
        pos = 0
        pending = self._pending
        for token, status, info in meta:
            op = pending.pop(token)
            if status == P.ITEMS:
                items, pos = _received(info, frames, pos)
                if op is None or op.done():
                    self._refused(peer, op, token, items)  # before held operations go out
                    if op is not None and op.stream is not None:
                        self._slot_withdrawn(op.stream)
                    continue
                if op.stream is not None:
                    self._slot_items(op, items)
                    continue
                try:
                    if op.kind == P.GET_BATCH:
                        value: Any = [decode_item(p, f) for p, _, f in items]
                    else:
                        p, _, f = items[0]
                        value = decode_item(p, f)
                except BaseException as exc:  # noqa: BLE001 - the consumer learns why
                    op.set_exception(exc)
                    continue
                op.set_result(value)
                continue
            if status == P.CREDIT:
                self._on_credit(peer, info)
                continue
            if status == P.PEEKED:
                items, pos = _received(info, frames, pos)
                if op is not None and not op.done():
                    try:
                        op.set_result([QueuedItem(decode_item(p, f), weight)
                                       for p, (weight, _), f in items])
                    except BaseException as exc:  # noqa: BLE001 - the caller learns why
                        op.set_exception(exc)
                continue
            if op is None:
                if status == P.ERROR:  # a pipelined put the channel worker refused
                    st = self._by_address.get(peer)
                    if st is not None:
                        self._pipelined_failed(st, RemoteError(
                            st.worker, st.rank, "ChannelError", str(info), ""))
                continue
            if op.done():
                if op.stream is not None:  # CANCELLED: a withdrawn slot
                    self._slot_withdrawn(op.stream)
                continue  # CANCELLED after a local cancel, or a late answer nobody awaits
            if op.stream is not None:
                self._slot_answered(op, status, info)
            elif status == P.OK:
                if op.kind == P.STATS:
                    op.set_result({
                        key_from_wire(q): QueueStats(int(v[0]), float(v[1]), int(v[2]),
                                                     int(v[3]), int(v[4]), int(v[5]))
                        for q, v in info.items()
                    })
                elif op.kind == P.ROUTE:
                    self._routed(op, int(info))
                elif op.kind == P.INFO:
                    op.set_result((int(info[0]), int(info[1])))
                else:
                    op.set_result(None)
            elif status == P.FULL:
                op.set_exception(QueueFull(
                    f"queue {op.queue!r} of channel {op.state.name!r} is full"))
            elif status == P.EMPTY:
                op.set_exception(QueueEmpty(
                    f"queue {op.queue!r} of channel {op.state.name!r} is empty"))
            else:
                op.set_exception(RemoteError(
                    op.state.worker, op.state.rank, "ChannelError", str(info), ""))

    def _on_credit(self, peer: str, info: Any) -> None:
        st = self._by_address.get(peer)
        if st is None:
            return  # from a channel worker this process no longer uses
        queue, granted, admitted = info
        if granted:
            st.credits[queue] = st.credits.get(queue, 0) + int(granted)
        st.unconfirmed -= int(admitted)

    def _refused(self, peer: str, op: _Op | None, token: int, items: list[Received]) -> None:
        """Items arrived for a get nobody waits for (it was cancelled): send them back."""
        if op is None:
            log.error("channel answer for unknown operation %s: %d item(s) dropped",
                      token, len(items))
            return
        if items and not self.endpoint.is_lost(peer):
            self._unget(peer, op.state, op.queue, items)

    def _unget(self, address: str, st: _ChannelState, queue: QueueKey, items: Sequence[Received]) -> None:
        frames = [f for _, _, fs in items for f in fs]
        self._enqueue(address, _Op(self, st, P.UNGET, queue, [place for _, place, _ in items],
                                   [p for p, _, _ in items], frames))

    def _on_lost(self, address: str, exc: BaseException) -> None:
        self._outboxes.pop(address, None)
        st = self._by_address.pop(address, None)
        if st is not None:
            # Resolve again on the next operation: that fails with PeerLostError while
            # the channel is dead, and finds a channel re-created under the same name.
            st.address = None
            st.credits.clear()
            if st.unconfirmed > 0:
                self._pipelined_failed(st, PeerLostError(
                    f"channel {st.name!r} is gone (its worker {st.worker} was lost) with "
                    f"{st.unconfirmed} pipelined put(s) not yet in their queue: {exc}"))
            st.unconfirmed = 0
            if st.rank == 0:  # learn the channel's shape and routes again (it may be re-created)
                st.world_size = None
                st.key_ranks.clear()
            for stream in st.streams.values():  # prefetched items were lost with it
                self._stream_failed(stream, PeerLostError(
                    f"channel {st.name!r} is gone (its worker {st.worker} was lost): {exc}"))
        for op in [op for op in self._pending.values() if op.address == address]:  # oldest first
            self._fail(op, PeerLostError(
                f"channel {op.state.name!r} is gone (its worker {op.state.worker} was lost): "
                f"{exc}"))

    # ------------------------------------------------------------------ gets (loop thread)
    def _stream(self, st: _ChannelState, queue: QueueKey) -> _GetStream:
        stream = st.streams.get(queue)
        if stream is None:
            stream = st.streams[queue] = _GetStream(st, queue)
        return stream

    def _accept_get(self, op: _Op) -> None:
        stream = self._stream(op.state, op.queue)
        if stream.held is not None:
            stream.held.append(op)
            return
        if stream.can_serve():
            self._serve_ready(stream, op)
            return
        now = self.loop.time()
        if now - stream.last_get < P.PREFETCH_IDLE:  # streaming, and it has to wait:
            stream.depth = min(P.PREFETCH_MAX, max(2, stream.depth * 2))  # prefetch deeper
        stream.last_get = now
        stream.waiting.append(op)
        self._top_up(stream)

    def _serve_ready(self, stream: _GetStream, fut: asyncio.Future[Any]) -> None:
        """Complete a user get with the oldest prefetched item (see _GetStream.can_serve)."""
        stream.last_get = self.loop.time()
        self._resolve(fut, stream.ready.popleft())
        self._top_up(stream)

    def _top_up(self, stream: _GetStream) -> None:
        """Cover every waiting user get by a slot, and prefetch up to ``depth`` items.

        A user get is covered by a prefetch in flight, or else by a parkable GET of its
        own. A GET is sent only when no prefetch can serve the get, so no GET stays
        parked at the channel worker for a get already served (it would take an item
        that a getter of another process may be waiting for).

        Nothing is sent while withdrawn requests are ``settling``: an item one of them
        took goes back to the queue when its answer arrives, and a slot sent before
        that would take the items behind it (``_slot_withdrawn`` tops up then).
        """
        if stream.settling:
            return
        for _ in range(len(stream.waiting) - len(stream.demand) - stream.requested_total):
            slot = _Op(self, stream.state, P.GET, stream.queue, 0, 0, (), stream)
            stream.demand.append(slot)
            self._issue(slot)
        if not stream.depth:
            return
        wanted = stream.depth - len(stream.ready) - stream.in_flight()
        if wanted >= max(1, stream.depth // 2):  # ask in chunks: fewer, fuller messages
            slot = _Op(self, stream.state, P.PREFETCH, stream.queue, wanted, 0, (), stream)
            stream.requested[slot] = wanted
            stream.requested_total += wanted
            self._issue(slot)
        if stream.timer is None:
            stream.timer = self.loop.call_later(P.PREFETCH_IDLE, self._idle, stream)

    def _resolve(self, op: asyncio.Future[Any], item: Received) -> None:
        payload, _, frames = item
        try:
            value = decode_item(payload, frames)
        except BaseException as exc:  # noqa: BLE001 - the consumer learns why
            op.set_exception(exc)
            return
        op.set_result(value)

    def _slot_items(self, slot: _Op, items: list[Received]) -> None:
        stream = slot.stream
        assert stream is not None
        if slot.kind == P.GET:
            stream.demand.remove(slot)  # the oldest: answers come in order
        else:
            stream.requested_total -= stream.requested.pop(slot)
            if not items:
                stream.depth //= 2  # the queue ran dry: the consumer is not behind
        for item in items:
            self._item_arrived(stream, item)
        if stream.held is None and stream.waiting:
            self._top_up(stream)  # a prefetch brought less than the waiting gets need
        self._settled(stream)

    def _item_arrived(self, stream: _GetStream, item: Received) -> None:
        waiting = stream.waiting
        if waiting:
            stream.last_get = self.loop.time()  # waiting for an item is not being idle
            if stream.fences:
                self._passed_fences(stream, 0)
            self._resolve(waiting.popleft(), item)
        elif stream.held is None:
            # Kept for the next get even if prefetching stopped meanwhile: returning it now
            # and asking again would only churn. The idle timer returns what stays unused.
            stream.ready.append(item)
            if stream.timer is None:
                stream.timer = self.loop.call_later(P.PREFETCH_IDLE, self._idle, stream)
        elif stream.state.address is not None:  # held operations must see it in the queue
            self._unget(stream.state.address, stream.state, stream.queue, [item])

    def _slot_answered(self, slot: _Op, status: int, info: Any) -> None:
        """A slot's answer without items (ERROR): the oldest waiting user get fails."""
        stream = slot.stream
        assert stream is not None
        if slot.kind == P.GET:
            stream.demand.remove(slot)
        else:
            stream.requested_total -= stream.requested.pop(slot)
        if stream.waiting:
            if stream.fences:
                self._passed_fences(stream, 0)
            stream.waiting.popleft().set_exception(RemoteError(
                stream.state.worker, stream.state.rank, "ChannelError", str(info), ""))
        self._settled(stream)

    def _slot_withdrawn(self, stream: _GetStream) -> None:
        """A withdrawn request was answered (its items, if any, are on their way back)."""
        stream.settling -= 1
        if not stream.settling and stream.held is None and stream.waiting:
            self._top_up(stream)  # the slots held back while it settled (see _top_up)
        self._settled(stream)

    def _withdraw_get(self, op: _Op) -> None:
        """A user get was cancelled: forget it, and withdraw a GET slot it no longer needs."""
        stream = op.state.streams.get(op.queue)
        if stream is None:
            return
        if stream.held is not None and op in stream.held:
            stream.held.remove(op)
            return
        if op in stream.waiting:
            place = stream.waiting.index(op)
            del stream.waiting[place]
            fence = self._passed_fences(stream, place)
            if fence:  # a slot ahead of a get_batch/get_nowait is one too many: withdraw one
                for slot in reversed(stream.demand):
                    if slot.token < fence:
                        stream.demand.remove(slot)
                        self._withdraw_slot(stream, slot)
                        break
            elif not stream.depth:
                self._withdraw_slots(stream)

    def _passed_fences(self, stream: _GetStream, place: int) -> int:
        """The waiting user get at ``place`` left (served, failed or cancelled): count it
        out of the fences it was made before. Returns the token of the oldest of them
        (0: none)."""
        oldest = 0
        for fence in stream.fences:
            if fence[1] > place:
                fence[1] -= 1
                oldest = oldest or fence[0]
        while stream.fences and not stream.fences[0][1]:
            stream.fences.popleft()
        return oldest

    def _withdraw_slot(self, stream: _GetStream, slot: _Op) -> None:
        """Cancel GET slot ``slot`` (just taken out of ``demand``) at the channel worker."""
        if slot.address is not None:
            stream.settling += 1  # its answer (CANCELLED or the item) is still to come
        slot.cancel()

    def _withdraw_slots(self, stream: _GetStream) -> None:
        """Cancel the newest GET slots beyond what the waiting user gets need.

        Only GET slots sent after every prefetch still out: a withdrawn slot's item goes
        back to the queue, so it must be newer than the items those prefetches bring,
        which may go to waiting user gets (an older GET stays, and its item is used or
        returned like a prefetched one).
        """
        newest_prefetch = next(reversed(stream.requested)).token if stream.requested else 0
        while (stream.demand and stream.demand[-1].token > newest_prefetch
               and len(stream.demand) + stream.requested_total > len(stream.waiting)):
            self._withdraw_slot(stream, stream.demand.pop())

    def _return_prefetch(self, stream: _GetStream) -> None:
        """Stop prefetching; prefetched items go back to their places in the queue.

        Only when no prefetch is out, or with ``held`` set: a prefetch still out brings
        items newer than these, which must not reach a user get before them.
        """
        stream.depth = 0
        self._withdraw_slots(stream)
        if stream.ready:
            items, stream.ready = list(stream.ready), collections.deque()
            if stream.state.address is not None:
                self._unget(stream.state.address, stream.state, stream.queue, items)

    def _prefetch_returned(self, stream: _GetStream, op: _Op) -> bool:
        """Before ``op`` (get_nowait, get_batch, qsize, statistics) sees the queue: return
        prefetched items.

        False if ``op`` was taken care of (served from prefetched items, or held
        until slots in flight are answered and their items returned too).
        """
        if stream.held is not None:
            stream.held.append(op)
            return False
        if op.kind == P.GET_NOWAIT and stream.ready and not stream.waiting:
            self._resolve(op, stream.ready.popleft())
            return False
        self._return_prefetch(stream)
        if stream.settling or stream.requested:
            stream.held = [op]
            return False
        return True

    def _settled(self, stream: _GetStream) -> None:
        if stream.held is None or stream.settling or stream.requested:
            return
        held, stream.held = stream.held, None
        self._return_prefetch(stream)  # what arrived meanwhile goes back first
        # User gets still waiting were made before the held operations: their slots go
        # first (a prefetch that was to serve them may have come back short).
        self._top_up(stream)
        for op in held:
            self._accept(op)

    def _idle(self, stream: _GetStream) -> None:
        stream.timer = None
        if stream.waiting:
            return  # nothing is prefetched; the next arrival or get arms the timer again
        idle_for = self.loop.time() - stream.last_get
        if idle_for < P.PREFETCH_IDLE:
            if stream.depth or stream.ready:
                stream.timer = self.loop.call_later(
                    max(P.PREFETCH_IDLE - idle_for, 0.001), self._idle, stream)
            return
        if stream.requested:
            # A prefetch is still out with items newer than ``ready``'s: returning these
            # now would let those reach the next gets first. Stop prefetching, keep serving
            # gets from what is here, and return everything once the prefetch is answered.
            stream.depth = 0
            stream.timer = self.loop.call_later(P.PREFETCH_IDLE, self._idle, stream)
            return
        self._return_prefetch(stream)

    def _stream_failed(self, stream: _GetStream, exc: BaseException) -> None:
        """Its channel is lost (or cannot be resolved): every user get waiting fails."""
        stream.demand.clear()
        stream.requested.clear()
        stream.requested_total = 0
        stream.ready.clear()  # lost with the channel worker, like the items still queued
        stream.settling = 0
        stream.depth = 0
        stream.fences.clear()
        waiting, stream.waiting = stream.waiting, collections.deque()
        held, stream.held = stream.held or [], None
        for op in [*waiting, *held]:
            if not op.done():
                op.set_exception(exc)

    # ------------------------------------------------------------------ resolution (loop)
    def _ensure_resolving(self, st: _ChannelState) -> None:
        if st.address is None and st.task is None:
            self._start(st, self._connect(st, DEFAULT_CONNECT_TIMEOUT))

    def _start(self, st: _ChannelState, coro: Coroutine[Any, Any, dict[str, Any]]) -> None:
        task = self.loop.create_task(coro)
        st.task = task
        task.add_done_callback(functools.partial(self._resolved, st))

    def _resolved(self, st: _ChannelState, task: asyncio.Task[dict[str, Any]]) -> None:
        exc = task.exception() if not task.cancelled() else PeerLostError("resolution cancelled")
        if exc is None:
            if st.address is None:
                info = task.result()
                st.address = str(info["endpoint"])
                st.node_rank = int(info["node_rank"])
                self._by_address[st.address] = st
                if st.rank == 0:
                    self._learn_replicas(st, int(info["group_world_size"]))
            if st.task is task:
                st.task = None
            if st.unrouted:  # before the backlog: they were issued first, or concern other keys
                self._route_waiting(st)
            backlog, st.backlog = st.backlog, []
            for op in backlog:
                self._enqueue(st.address, op)
            waiters, st.ready_waiters = st.ready_waiters, []
            for w in waiters:
                resolve(w, None)
            return
        if st.task is not task or st.address is not None:
            return  # a newer attempt decides (or another attempt already succeeded)
        st.task = None
        unrouted, st.unrouted = st.unrouted, {}
        for ops in unrouted.values():
            for op in ops:
                if not op.done():
                    op.set_exception(exc)
        backlog, st.backlog = st.backlog, []
        for op in backlog:
            self._fail(op, exc)
        waiters, st.ready_waiters = st.ready_waiters, []
        for w in waiters:
            reject(w, exc)

    def _learn_replicas(self, st: _ChannelState, world_size: int) -> None:
        """Replica 0 of channel ``st`` says the channel has ``world_size`` replicas."""
        if len(st.replicas) != world_size:
            st.replicas = [st] + [self.state(st.name, r) for r in range(1, world_size)]
        st.world_size = world_size

    def ready(self, st: _ChannelState) -> AsyncChannelWork[None]:
        """A work done once ``st`` is resolved (starting a connect if nothing is under way)."""
        work: AsyncChannelWork[None] = AsyncChannelWork(self.loop)

        def check() -> None:
            if st.address is not None:
                resolve(work, None)
                return
            st.ready_waiters.append(work)
            self._ensure_resolving(st)

        self.runtime.submit(check)
        return work

    async def _connect(self, st: _ChannelState, timeout: float,
                       launched: bool = False) -> dict[str, Any]:
        """The registry's info on the channel worker of ``st`` once it is ready."""
        name = st.worker
        try:
            # Also makes this runtime watch the channel worker: when it dies, the endpoint
            # marks it lost and _on_lost fails what waits on it.
            info = await self.runtime.resolve_worker(name, timeout, wait_for_group=True)
        except PeerLostError:
            # This process may remember an earlier channel worker of this name that died
            # (the channel was destroyed and created again): ask the registry, which knows
            # the newest one; after our own launch, wait for it.
            newest = await self._lookup_ready(name, timeout if launched else 0.0)
            if newest is None or self.endpoint.is_lost(str(newest["endpoint"])):
                raise
            info = newest
        return info

    async def _lookup_ready(self, name: str, wait: float) -> dict[str, Any] | None:
        """The registry's info on worker ``name`` once ready (None if not within ``wait`` s).

        Raises [`WorkerInitError`][aiorl.WorkerInitError] if it failed to start.
        """
        deadline = self.loop.time() + wait
        delay = 0.01
        while True:
            try:
                record = await self.runtime.registry.lookup(name)
            except NotFoundError:
                record = None  # not registered (yet)
            if record is not None and record.state == WorkerState.READY:
                return record.info.to_wire()
            if record is not None and record.state == WorkerState.FAILED:
                d = record.detail
                raise WorkerInitError(name, record.info.rank, str(d.get("type", "Exception")),
                                      str(d.get("message", "")), str(d.get("traceback", "")))
            if self.loop.time() + delay > deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def _create(self, st: _ChannelState, session: Session, maxsize: int,
                      where: NodeChoice, distributed: bool, timeout: float,
                      policy: dict[str, Any] | None = None) -> dict[str, Any]:
        """Launch the channel's worker group (one rank per node ``where`` gives), or
        connect to the channel of that name if it exists, as RLinf does, with a warning."""
        launched = False
        if not await self._group_exists(st.group):
            if isinstance(session, WorkerSession):
                await session.refresh()  # its node list must be current for the placement
            nodes = await where(session)
            args = (st.name, maxsize, nodes) if distributed else (st.name, maxsize)
            builder = WorkerGroupBuilder(ChannelHost, args, {})
            try:
                await builder.launch_async(session, NodePlacementStrategy(nodes), st.group,
                                           **(policy or {}))
                launched = True
            except GroupExistsError:
                pass  # another creator won the race: connect to its channel
        if not launched:
            _warn_exists(st.name)
        return await self._connect(st, timeout, launched)

    async def _group_exists(self, group: str) -> bool:
        try:
            await self.runtime.registry.lookup_group(group)
        except GroupNotFoundError:
            return False
        return True


_cores: weakref.WeakKeyDictionary[Runtime, _ClientCore] = weakref.WeakKeyDictionary()
_cores_lock = threading.Lock()


def _core_for(runtime: Runtime) -> _ClientCore:
    with _cores_lock:
        core = _cores.get(runtime)
        if core is None:
            core = _cores[runtime] = _ClientCore(runtime)
        return core


# ---------------------------------------------------------------------- placement of new channels
def _affinity_node(runtime: Runtime, group: str | None, rank: int | None, default: int,
                   own: tuple[str, int] | None, timeout: float) -> NodeChoice:
    """Where a new plain channel lives: the affine worker's node, else ``default``."""

    async def where(session: Session) -> list[int]:
        if group is None:
            return [default]
        name = f"{group}:{rank or 0}"
        if own is not None and name == own[0]:
            return [own[1]]  # ourselves: possibly still in __init__, so not yet registered
        try:
            return [int((await runtime.registry.lookup(name)).info.node_rank)]
        except NotFoundError:
            pass  # not registered yet: wait until it is ready
        info = await runtime.resolve_worker(name, timeout, wait_for_group=True)
        return [int(info["node_rank"])]

    return where


def _replica_nodes(node_ranks: Sequence[int] | None) -> NodeChoice:
    """Where the replicas of a new distributed channel live: ``node_ranks``, else every node."""
    if node_ranks is not None:
        nodes = [int(n) for n in node_ranks]
        if not nodes or len(set(nodes)) != len(nodes):
            raise ValueError(f"node_ranks must name distinct nodes, one per replica, "
                             f"got {list(node_ranks)!r}")

    async def where(session: Session) -> list[int]:
        return nodes if node_ranks is not None else list(range(session.spec.num_nodes))

    return where


def _check_weight(weight: Any, what: str) -> float:
    try:
        value = float(weight)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {type(weight).__name__}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{what} must be a finite number >= 0, got {weight!r}")
    return value


# ---------------------------------------------------------------------- the handle
class ReplicaStatistics(NamedTuple):
    """What [`Channel.replica_statistics`][aiorl.Channel.replica_statistics] reports for one channel
    worker."""

    rank: int  #: the replica (0 for a plain channel)
    node_rank: int  #: the node it runs on
    queues: dict[Any, QueueStats]  #: the queues of the keys it holds, as ``statistics()``


class Channel:
    """A handle on a named, distributed set of weighted FIFO queues.

    Get one with [`Channel.create`][aiorl.Channel.create] /
    [`Channel.connect`][aiorl.Channel.connect] (driver) or ``self.create_channel`` /
    ``self.connect_channel`` (inside a worker). A handle is cheap, thread-safe and picklable: pass
    it to worker methods and use it there (it binds to the receiving process's runtime).

    Every queue of the channel is named by a *key* (any hashable; ``"default"``
    when none is given; ``queue_name=`` is an alias of ``key=``) and created on
    first use with the channel's ``maxsize`` (0 = unbounded). ``put``/``get``/
    ``get_batch``/``statistics`` return an [`AsyncChannelWork`][aiorl.AsyncChannelWork]
    (``await`` it, or ``.wait()`` from synchronous code); with ``async_op=False``
    ``put``/``get``/``get_batch`` wait and return the result, as in RLinf.
    ``put_nowait``, ``get_nowait``, ``qsize``, ``empty``, ``full`` and
    ``peek_all`` return plain values when called from synchronous code; see each
    method for the event-loop thread. See ``docs/channels.md``.

    Example:
        ```python
        channel = aiorl.Channel.create(cluster, "trajectories", maxsize=32)   # driver

        class Trainer(aiorl.Worker):
            def __init__(self):
                super().__init__()
                self.channel = self.connect_channel("trajectories")

            async def step(self):
                batch = await self.channel.get_batch(4096)   # items until weights >= 4096
        ```
    """

    def __init__(self, name: str, runtime: Runtime | None = None,
                 session: Session | None = None) -> None:
        group_name_for(name)  # validates the name
        self._name = name
        self._runtime = runtime
        self._session = session  # the cluster it was created or connected through, if any
        self._group: WorkerGroup[ChannelHost] | None = None  # worker_group, once asked for
        self._core: _ClientCore | None = None
        self._state: _ChannelState | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        cluster: Any,
        name: str,
        maxsize: int = 0,
        distributed: bool = False,
        node_rank: int | None = None,
        *,
        node_ranks: Sequence[int] | None = None,
        group_affinity: str | None = None,
        group_rank_affinity: int | None = None,
        timeout: float = DEFAULT_CONNECT_TIMEOUT,
        restart: str = "never",
        max_restarts: int = 3,
        backoff: float = 0.5,
    ) -> Channel:
        """Create channel ``name`` (or connect to it, with a warning, if it already exists)
        from the driver.

        ``restart="on_failure"`` starts an **empty** replacement under the same name when
        a channel worker dies (at most ``max_restarts`` times, after ``backoff`` seconds
        doubling, as [`WorkerGroupBuilder.launch`][aiorl.group.WorkerGroupBuilder.launch]): every
        item queued in it then (up to ``maxsize`` per queue, plus prefetched ones) is lost. Each
        client's operations pending on the dead worker fail with
        [`PeerLostError`][aiorl.PeerLostError] naming the channel; later ones reach the replacement
        once it is ready (docs/failures.md).

        A plain channel's worker runs on the node of worker
        ``group_affinity:group_rank_affinity`` when given, else on ``node_rank``
        (default 0). A ``distributed`` channel runs one worker (replica) on each node
        of ``node_ranks`` (default: every node); each key lives on one replica, the
        one on the node of the first process that uses it (replica 0 if that node has
        none), so producers and consumers on that node stay local. ``node_rank`` and
        the affinities do not apply to it. ``maxsize`` bounds every queue (0 =
        unbounded); when the channel exists already, its own ``maxsize`` and replicas
        stay. Blocks until the channel is ready (from the runtime loop's thread it
        returns at once; operations then wait for readiness).

        Raises [`PlacementError`][aiorl.PlacementError] for a node outside the cluster,
        `ValueError` for repeated ``node_ranks``,
        [`WorkerInitError`][aiorl.WorkerInitError] if a channel worker cannot start and
        `TimeoutError` if it is not ready within ``timeout`` seconds.
        """
        ch = cls(name, cluster.runtime, cluster)
        maxsize = _check_maxsize(maxsize)
        where = _replica_nodes(node_ranks) if distributed else _affinity_node(
            cluster.runtime, group_affinity, group_rank_affinity,
            0 if node_rank is None else int(node_rank), None, timeout)
        ch._start_create(cluster, maxsize, where, distributed, timeout,
                         {"restart": restart, "max_restarts": max_restarts, "backoff": backoff})
        return ch._settle()

    @classmethod
    def connect(cls, cluster: Any, name: str, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> Channel:
        """Connect to channel ``name`` (plain or distributed) from the driver.

        Waits up to ``timeout`` seconds for the channel to exist and be ready (so
        a consumer may connect before its producer created the channel), then
        raises `TimeoutError`.
        """
        ch = cls(name, cluster.runtime, cluster)
        ch._start_connect(timeout)
        return ch._settle()

    def _bind(self) -> tuple[_ClientCore, _ChannelState]:
        core = self._core
        if core is None:
            runtime = self._runtime or current_runtime()
            if runtime is None:
                raise RuntimeError(
                    f"channel {self._name!r} is used in a process without an aiorl runtime; "
                    "use it in a driver that created a Cluster, or inside a worker")
            core = _core_for(runtime)
            self._state = core.state(self._name)
            self._core = core
        assert self._state is not None
        return core, self._state

    def _start_create(self, session: Session, maxsize: int, where: NodeChoice,
                      distributed: bool, timeout: float,
                      policy: dict[str, Any] | None = None) -> None:
        """Create from a driver or a worker; ``policy``: the channel group's supervision
        (``restart``, ``max_restarts``, ``backoff`` of ``launch``)."""
        core, st = self._bind()

        def start() -> None:
            if st.address is None:
                core._start(st, core._create(st, session, maxsize, where, distributed, timeout,
                                             policy))
            else:
                _warn_exists(st.name)

        core.runtime.submit(start)

    def _start_connect(self, timeout: float) -> None:
        core, st = self._bind()

        def start() -> None:
            if st.address is None and st.task is None:
                core._start(st, core._connect(st, timeout))

        core.runtime.submit(start)

    def _settle(self) -> Channel:
        core, _ = self._bind()
        if not core.runtime.on_loop_thread():
            self.wait_ready().wait()
        return self

    def wait_ready(self) -> AsyncChannelWork[None]:
        """A work that completes once the channel worker is ready (fails if it cannot be).

        ``await channel`` does the same and gives the channel back, so
        ``ch = await self.create_channel("x")`` works in ``async`` worker methods.
        """
        core, st = self._bind()
        return core.ready(st)

    def __await__(self) -> Generator[Any, None, Channel]:
        yield from self.wait_ready().__await__()
        return self

    # ------------------------------------------------------------------ identity
    @property
    def name(self) -> str:
        """The channel's name."""
        return self._name

    @property
    def worker_group(self) -> WorkerGroup[ChannelHost]:
        """The channel's worker group (``channel.<name>``; one rank per replica), for
        ``world_size``, ``close()`` and the like. Blocks: synchronous code only.

        Raises `RuntimeError` for a handle that came to the driver as an
        argument or result (it knows no cluster there: use ``Channel.connect``).
        """
        if self._group is None:
            _, st = self._bind()
            session = self._session
            if session is None:
                if "AIORL_WORKER_NAME" not in os.environ:
                    raise RuntimeError(
                        f"channel {self._name!r} was not created or connected through a "
                        "cluster in this process; use Channel.connect(cluster, name).worker_group")
                session = WorkerSession.current()
            self._group = WorkerGroup.from_group_name(session, ChannelHost, st.group)
        return self._group

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle_channel, (self._name,))

    def __repr__(self) -> str:
        st = self._state
        address = st.address if st is not None else None
        replicas = f" x{st.world_size}" if st is not None and (st.world_size or 1) > 1 else ""
        return f"<Channel {self._name!r}{replicas}{' at ' + address if address else ''}>"

    def __str__(self) -> str:
        """A readable snapshot of what is queued (counts, weights, the first items of every
        queue), taken without removing anything. On the runtime loop's thread, where
        nothing may block, and if the channel cannot answer, it is ``repr(channel)``."""
        core, _ = self._bind()
        if core.runtime.on_loop_thread():
            return repr(self)
        try:
            replicas = self.replica_statistics().wait(STR_TIMEOUT)
            peeks = {key: self._peek(_queue_key(key, None), STR_ITEMS_PER_QUEUE)
                     for replica in replicas for key in replica.queues}
            shown = {key: work.wait(STR_TIMEOUT) for key, work in peeks.items()}
        except (AiorlError, TimeoutError) as exc:
            return f"{self!r} (no snapshot: {exc})"
        return _describe(self._name, replicas, shown)

    # ------------------------------------------------------------------ operations
    def _submit(self, kind: int, key: QueueKey, number: Any, payload: Any = 0,
                frames: Sequence[Any] = ()) -> AsyncChannelWork[Any]:
        """Submit an operation on queue ``key`` to the replica that holds it."""
        core, st = self._bind()
        if st.world_size == 1:  # a plain channel: everything goes to its one worker
            work = core.submit(st, kind, key, number, payload, frames)
        elif (rank := st.key_ranks.get(key) if st.world_size is not None else None) is None:
            work = core.submit_routed(st, kind, key, number, payload, frames)
        else:
            work = core.submit(st.replicas[rank], kind, key, number, payload, frames)
        if _trace.ON and kind in _TRACED_KINDS:
            span = _trace.begin("channel", f"{_TRACED_KINDS[kind]} {self._name}",
                                f"channel {self._name}", queue=key_from_wire(key))
            span.nbytes = len(payload) if payload.__class__ is bytes else _trace.payload_bytes(
                frames)
            trace_until_settled(work, span)
        return work

    def _everywhere(self, kind: int, combine: Combine) -> AsyncChannelWork[Any]:
        """``kind`` (``STATS``, ``FLUSH``) at every replica, answers combined by ``combine``;
        a plain channel's one answer as it is."""
        core, st = self._bind()
        if st.world_size == 1:
            return core.submit(st, kind, "", 0)
        return core.fan_out(st, kind, combine)

    @overload
    def put(self, item: Any, weight: float = 0, key: Hashable = DEFAULT_KEY,
            async_op: Literal[True] = True, *,
            queue_name: Hashable | None = None) -> AsyncChannelWork[None]: ...

    @overload
    def put(self, item: Any, weight: float, key: Hashable, async_op: Literal[False], *,
            queue_name: Hashable | None = None) -> None: ...

    @overload
    def put(self, item: Any, weight: float = 0, key: Hashable = DEFAULT_KEY, *,
            async_op: Literal[False], queue_name: Hashable | None = None) -> None: ...

    @overload
    def put(self, item: Any, weight: float = 0, key: Hashable = DEFAULT_KEY,
            async_op: bool = True, *,
            queue_name: Hashable | None = None) -> AsyncChannelWork[None] | None: ...

    def put(self, item: Any, weight: float = 0, key: Hashable = DEFAULT_KEY,
            async_op: bool = True, *,
            queue_name: Hashable | None = None) -> AsyncChannelWork[None] | None:
        """Put ``item`` into queue ``key``; the work completes once the item is accepted.

        Accepted means: in the queue, or, while this process holds a *credit* for
        the queue, promised room there. The channel worker grants credits for
        free room only, so with credits a put completes at once and travels
        pipelined; without (a full queue) the work waits (backpressure) until a
        get makes room. Puts from one process enter the queue in call order.
        ``item`` is pickled now; an item with out-of-band buffers (a tensor of
        64 KiB or more, sent zero-copy) always waits for the channel worker's
        answer, so it may be modified once its put is done. With
        ``async_op=False`` this waits for the work and returns None (RLinf's
        default; synchronous code only).

        Raises `SerializationError` at once
        for an item that cannot be pickled; the work fails with
        [`PeerLostError`][aiorl.PeerLostError] if the channel worker dies. If a pipelined
        put cannot reach its queue, the next operation on the channel from this
        process (or [`flush`][aiorl.Channel.flush]) fails with that error.
        """
        payload, frames = encode_item(item)
        work = self._submit(P.PUT, _queue_key(key, queue_name), _check_weight(weight, "weight"),
                            payload, frames)
        return work if async_op else work.wait()

    def put_nowait(self, item: Any, weight: float = 0, key: Hashable = DEFAULT_KEY, *,
                   queue_name: Hashable | None = None) -> Any:
        """Put ``item`` only if its queue has room, else raise [`QueueFull`][aiorl.QueueFull].

        From synchronous code this blocks for one round trip (none while this process
        holds a credit for the queue, see [`put`][aiorl.Channel.put]) and returns None.
        On the runtime loop's thread (``async`` worker methods) it returns an
        [`AsyncChannelWork`][aiorl.AsyncChannelWork] to await, which raises ``QueueFull``.
        """
        core, _ = self._bind()
        payload, frames = encode_item(item)
        work = self._submit(P.PUT_NOWAIT, _queue_key(key, queue_name),
                            _check_weight(weight, "weight"), payload, frames)
        return work if core.runtime.on_loop_thread() else work.wait()

    @overload
    def get(self, key: Hashable = DEFAULT_KEY, async_op: Literal[True] = True, *,
            queue_name: Hashable | None = None) -> AsyncChannelWork[Any]: ...

    @overload
    def get(self, key: Hashable, async_op: Literal[False], *,
            queue_name: Hashable | None = None) -> Any: ...

    @overload
    def get(self, key: Hashable = DEFAULT_KEY, *, async_op: Literal[False],
            queue_name: Hashable | None = None) -> Any: ...

    @overload
    def get(self, key: Hashable = DEFAULT_KEY, async_op: bool = True, *,
            queue_name: Hashable | None = None) -> Any: ...

    def get(self, key: Hashable = DEFAULT_KEY, async_op: bool = True, *,
            queue_name: Hashable | None = None) -> Any:
        """Take the first item of queue ``key``, waiting while the queue is empty.

        Returns an [`AsyncChannelWork`][aiorl.AsyncChannelWork] of the item; with
        ``async_op=False`` it waits and returns the item itself (synchronous code).
        Waiting getters are served in the order their requests reached the channel.
        Gets that follow each other closely prefetch items already queued, so a
        loop of ``await ch.get()`` streams without a round trip per item.
        """
        work = self._submit(_USER_GET, _queue_key(key, queue_name), 0)
        return work if async_op else work.wait()

    def flush(self) -> AsyncChannelWork[None]:
        """A work that completes once every put this process issued to the channel before
        it is in its queue; it fails with the error of a pipelined put that could not be."""
        return self._everywhere(P.FLUSH, lambda _replicas, _answers: None)

    def get_nowait(self, key: Hashable = DEFAULT_KEY, *,
                   queue_name: Hashable | None = None) -> Any:
        """Take the first item at once, or raise [`QueueEmpty`][aiorl.QueueEmpty].

        From synchronous code this blocks for one round trip and returns the
        item; on the runtime loop's thread it returns an
        [`AsyncChannelWork`][aiorl.AsyncChannelWork] to await.
        """
        core, _ = self._bind()
        work = self._submit(P.GET_NOWAIT, _queue_key(key, queue_name), 0)
        return work if core.runtime.on_loop_thread() else work.wait()

    @overload
    def get_batch(self, batch_weight: float | None = None, key: Hashable = DEFAULT_KEY,
                  async_op: Literal[True] = True, *, target_weight: float | None = None,
                  queue_name: Hashable | None = None) -> AsyncChannelWork[list[Any]]: ...

    @overload
    def get_batch(self, batch_weight: float | None, key: Hashable, async_op: Literal[False], *,
                  target_weight: float | None = None,
                  queue_name: Hashable | None = None) -> list[Any]: ...

    @overload
    def get_batch(self, batch_weight: float | None = None, key: Hashable = DEFAULT_KEY, *,
                  async_op: Literal[False], target_weight: float | None = None,
                  queue_name: Hashable | None = None) -> list[Any]: ...

    @overload
    def get_batch(self, batch_weight: float | None = None, key: Hashable = DEFAULT_KEY,
                  async_op: bool = True, *, target_weight: float | None = None,
                  queue_name: Hashable | None = None
                  ) -> AsyncChannelWork[list[Any]] | list[Any]: ...

    def get_batch(self, batch_weight: float | None = None, key: Hashable = DEFAULT_KEY,
                  async_op: bool = True, *, target_weight: float | None = None,
                  queue_name: Hashable | None = None) -> Any:
        """Take items in FIFO order until their summed weight reaches or exceeds ``batch_weight``.

        The work completes with the list of items as soon as the sum reaches
        ``batch_weight`` and waits for more items while it is below (weights
        1, 2, 3 and ``batch_weight=3`` give the first two; one item heavier than
        ``batch_weight`` comes alone). Items of weight 0 never complete a batch.
        ``target_weight`` is RLinf's name of ``batch_weight``; ``async_op=False``
        waits and returns the list. Raises `ValueError` unless the weight
        is > 0, and `TypeError` if neither or both names are given.
        """
        if (batch_weight is None) == (target_weight is None):
            raise TypeError("get_batch() takes batch_weight (or its alias target_weight), "
                            "exactly one of them")
        w = _check_weight(batch_weight if batch_weight is not None else target_weight,
                          "batch_weight")
        if not w > 0:
            raise ValueError(f"batch_weight must be > 0, got {w!r}")
        work = self._submit(P.GET_BATCH, _queue_key(key, queue_name), w)
        return work if async_op else work.wait()

    def statistics(self) -> AsyncChannelWork[dict[Any, QueueStats]]:
        """Per-queue counters: ``{key: QueueStats(qsize, weight, maxsize, waiting_putters,
        waiting_getters, reserved)}`` for every queue used so far (of every replica)."""
        return self._everywhere(P.STATS, lambda _replicas, answers: {
            key: s for answer in answers for key, s in answer.items()})

    def replica_statistics(self) -> AsyncChannelWork[list[ReplicaStatistics]]:
        """[`statistics`][aiorl.Channel.statistics] per channel worker, in replica order, with the
        node each runs on: where the keys of a distributed channel live (one entry when plain)."""
        core, st = self._bind()
        return core.fan_out(st, P.STATS, lambda replicas, answers: [
            ReplicaStatistics(replica.rank, replica.node_rank or 0, answer)
            for replica, answer in zip(replicas, answers, strict=True)])

    def peek_all(self, key: Hashable = DEFAULT_KEY, *, queue_name: Hashable | None = None,
                 limit: int | None = None) -> Any:
        """The items queued in ``key`` now, oldest first, each as ``QueuedItem(item,
        weight)``, without taking them (the first ``limit`` only, when given).

        Items a waiting ``get_batch`` has reserved are not shown (nor counted by
        [`qsize`][aiorl.Channel.qsize]). Each item is copied and unpickled here, so keep ``limit``
        small for large queues. From synchronous code this blocks for one round trip
        and returns the list; on the runtime loop's thread it returns an
        [`AsyncChannelWork`][aiorl.AsyncChannelWork] to await.
        """
        core, _ = self._bind()
        work = self._peek(_queue_key(key, queue_name), -1 if limit is None else max(0, int(limit)))
        return work if core.runtime.on_loop_thread() else work.wait()

    def _peek(self, key: QueueKey, limit: int) -> AsyncChannelWork[list[QueuedItem]]:
        return self._submit(P.PEEK, key, limit)

    def _info(self, key: Hashable, queue_name: Hashable | None, what: str) -> tuple[int, int]:
        core, _ = self._bind()
        if core.runtime.on_loop_thread():
            raise RuntimeError(
                f"Channel.{what}() blocks and cannot run on the aiorl event loop's thread; "
                "in async code use 'stats = await channel.statistics()'")
        qsize, maxsize = self._submit(P.INFO, _queue_key(key, queue_name), 0).wait()
        return int(qsize), int(maxsize)

    def qsize(self, key: Hashable = DEFAULT_KEY, *, queue_name: Hashable | None = None) -> int:
        """Items in queue ``key`` now (0 for a queue never used). Synchronous code only."""
        return self._info(key, queue_name, "qsize")[0]

    def empty(self, key: Hashable = DEFAULT_KEY, *, queue_name: Hashable | None = None) -> bool:
        """Whether queue ``key`` holds no item. Synchronous code only."""
        return self._info(key, queue_name, "empty")[0] == 0

    def full(self, key: Hashable = DEFAULT_KEY, *, queue_name: Hashable | None = None) -> bool:
        """Whether a put to queue ``key`` would wait now. Synchronous code only."""
        qsize, maxsize = self._info(key, queue_name, "full")
        return maxsize > 0 and qsize >= maxsize

    def destroy(self) -> AsyncChannelWork[None]:
        """Stop the channel's workers: pending and later operations, everywhere, fail with
        [`PeerLostError`][aiorl.PeerLostError]. Items still queued are dropped."""
        core, st = self._bind()
        work: AsyncChannelWork[None] = AsyncChannelWork(core.loop)

        async def destroy() -> None:
            try:
                await core.runtime.registry.close_group(st.group)
            except GroupNotFoundError:
                pass  # destroyed already
            for replica in st.replicas:
                if replica.address is not None:
                    replica.unconfirmed = 0  # pipelined puts are dropped with the queues
                    core.endpoint.mark_peer_lost(replica.address,
                                                 f"channel {st.name!r} was destroyed")

        def start() -> None:
            task = core.loop.create_task(destroy())
            task.add_done_callback(lambda t: settle_from(work, t))

        core.runtime.submit(start)
        return work


def _queue_key(key: Hashable, queue_name: Hashable | None) -> QueueKey:
    """The wire form of the queue an operation names (``queue_name`` is ``key``'s alias)."""
    if queue_name is not None:
        if key is not DEFAULT_KEY and key != DEFAULT_KEY:
            raise TypeError("give the queue as key= or as its alias queue_name=, not both")
        key = queue_name
    return key if isinstance(key, str) and key.__class__ is str else wire_key(key)


def _warn_exists(name: str) -> None:
    log.warning("channel %r already exists; connecting to it (its maxsize and replicas stay "
                "as they are)", name)


def _check_maxsize(maxsize: Any) -> int:
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
        raise ValueError(f"maxsize must be an int >= 0 (0 = unbounded), got {maxsize!r}")
    return maxsize


def _unpickle_channel(name: str) -> Channel:
    ch = Channel(name)
    if current_runtime() is not None:
        ch._start_connect(DEFAULT_CONNECT_TIMEOUT)  # resolve early; operations wait for it
    return ch


def _short_reprs() -> reprlib.Repr:
    """A ``reprlib.Repr`` whose reprs fit on one line of ``str(channel)``."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 48
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 4
    short.maxlevel = 2
    return short


_SHORT = _short_reprs()


def _short_repr(item: Any) -> str:
    """One line about ``item``: shape and dtype for a tensor or array, else a short repr."""
    shape, dtype = getattr(item, "shape", None), getattr(item, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(item).__name__}(shape={tuple(shape)}, dtype={dtype})"
    return _SHORT.repr(item)


def _describe(name: str, replicas: list[ReplicaStatistics],
              shown: dict[Any, list[QueuedItem]]) -> str:
    """The text of ``str(channel)``."""
    distributed = len(replicas) > 1
    queues = sum(len(r.queues) for r in replicas)
    head = f"Channel {name!r}: {queues} queue{'s' if queues != 1 else ''}"
    lines = [head + (f" on {len(replicas)} replicas" if distributed else "")]
    for replica in replicas:
        where = f" (replica {replica.rank}, node {replica.node_rank})" if distributed else ""
        for key, s in replica.queues.items():
            bound = f"/{s.maxsize}" if s.maxsize else ""
            waiting = "".join([f", {s.waiting_putters} put(s) waiting" if s.waiting_putters else "",
                               f", {s.waiting_getters} get(s) waiting" if s.waiting_getters else "",
                               f", {s.reserved} reserved" if s.reserved else ""])
            lines.append(f"  {key!r}{where}: {s.qsize}{bound} item(s), weight {s.weight:g}"
                         f"{waiting}")
            items = shown.get(key, [])
            lines.extend(f"    [{i}] weight {q.weight:g}: {_short_repr(q.item)}"
                         for i, q in enumerate(items))
            if s.qsize > len(items):
                lines.append(f"    ... {s.qsize - len(items)} more")
    return "\n".join(lines)


# ---------------------------------------------------------------------- inside workers
def create_channel_from_worker(
    runtime: Runtime,
    info: WorkerInfo,
    name: str,
    group_affinity: str | None = None,
    group_rank_affinity: int | None = None,
    maxsize: int = 0,
    distributed: bool = False,
    node_rank: int | None = None,
    node_ranks: Sequence[int] | None = None,
) -> Channel:
    """``Worker.create_channel``: create (or connect to) channel ``name`` from inside a worker.

    ``runtime`` and ``info`` are the calling worker's. A plain channel's worker
    runs on the node of ``group_affinity:group_rank_affinity`` (rank 0 if only the
    group is given, this worker's group if only the rank is), else on ``node_rank``,
    by default on this worker's node; a ``distributed`` one runs a replica on each
    node of ``node_ranks`` (default: every node), see [`Channel.create`][aiorl.Channel.create]. From
    a plain method (the method thread) this blocks until the channel is ready and
    raises creation errors; from an ``async`` method (the event loop) it returns
    the handle at once, its operations wait for readiness, and ``await`` on the
    handle waits explicitly.
    """
    if isinstance(group_affinity, int) and not isinstance(group_affinity, bool):
        raise TypeError("create_channel(name, group_affinity, group_rank_affinity, maxsize): "
                        "the second argument is a group name; pass maxsize by keyword "
                        "(RLinf's create_channel takes maxsize second)")
    maxsize = _check_maxsize(maxsize)
    session = WorkerSession.current()
    if group_affinity is None and group_rank_affinity is not None:
        group_affinity = info.address.root_group_name
    where = _replica_nodes(node_ranks) if distributed else _affinity_node(
        runtime, group_affinity, group_rank_affinity,
        int(info.node_rank) if node_rank is None else int(node_rank),
        (info.name, int(info.node_rank)), DEFAULT_CONNECT_TIMEOUT)
    ch = Channel(name, runtime, session)
    ch._start_create(session, maxsize, where, distributed, DEFAULT_CONNECT_TIMEOUT)
    return ch._settle()


def connect_channel_from_worker(runtime: Runtime, name: str) -> Channel:
    """``Worker.connect_channel``: connect to channel ``name`` from inside a worker.

    Waits (up to 60 s) for the channel to exist and be ready: blocking from a
    plain method, lazily (operations wait) from an ``async`` method.
    """
    ch = Channel(name, runtime, WorkerSession.current())
    ch._start_connect(DEFAULT_CONNECT_TIMEOUT)
    return ch._settle()
