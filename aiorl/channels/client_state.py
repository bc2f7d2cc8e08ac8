"""What the channel client keeps per operation, per channel worker and per queue.

`Op` is one operation (and the future its work wraps), `Outbox` what leaves for one
channel worker this loop turn, `GetStream` the gets of this process on one queue, and
`ChannelState` what this process knows about one channel worker. The engine that moves
them is `aiorl.channels.engine`; the gets' rules are in `aiorl.channels.gets`.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any, Protocol

from aiorl.channels.host import group_name_for
from aiorl.protocol import channels as chan
from aiorl.protocol.channels import QueueKey, Received
from aiorl.runtime import AsyncChannelWork, Runtime

__all__ = ["CREDITED", "SEES_PREFETCH", "TAKES", "USER_GET", "ChannelState", "Engine", "GetStream",
           "Op", "Outbox"]

#: Kinds the channel worker may hold back.
_PARKABLE = frozenset((chan.PUT, chan.GET, chan.GET_BATCH))
#: Client-side only, never on the wire: a user's ``get``, served by its queue's GetStream.
USER_GET = -1
#: Operations that must see the items this process prefetched back in their queue first
#: (``STATS`` too, for every queue of the channel).
SEES_PREFETCH = frozenset((chan.GET_NOWAIT, chan.GET_BATCH, chan.INFO, chan.PEEK))
#: Of those, the ones that take items: a queue's gets made after one are served after it.
TAKES = frozenset((chan.GET_NOWAIT, chan.GET_BATCH))
#: Puts that complete at once while their queue's credits last (`aiorl.protocol.channels`,
#: Credits).
CREDITED = frozenset((chan.PUT, chan.PUT_NOWAIT))


class Engine(Protocol):
    """What operations, the gets, the resolver and the router need of the per-process
    engine (`aiorl.channels.engine.ClientEngine`), which their modules cannot import (it
    imports them)."""

    runtime: Runtime
    loop: asyncio.AbstractEventLoop
    #: the state of each resolved channel worker, by its address
    by_address: dict[str, ChannelState]

    def state(self, name: str, rank: int = 0) -> ChannelState: ...

    def submit(self, state: ChannelState, kind: int, queue: QueueKey, number: Any,
               payload: Any = 0, frames: Sequence[Any] = ()) -> AsyncChannelWork[Any]: ...

    def issue(self, op: Op) -> None: ...

    def accept(self, op: Op) -> None: ...

    def unget(self, address: str, st: ChannelState, queue: QueueKey,
              items: Sequence[Received]) -> None: ...

    def enqueue(self, address: str, op: Op) -> None: ...

    def on_cancel(self, op: Op) -> None: ...

    def withdraw_get(self, op: Op) -> None: ...

    def release(self, st: ChannelState) -> None: ...

    def abandon(self, st: ChannelState, exc: BaseException) -> None: ...


class Op(asyncio.Future):  # type: ignore[type-arg]
    """One operation: the future its [`AsyncChannelWork`][aiorl.AsyncChannelWork] wraps, and its
    wire data.

    Being the future itself (rather than an object holding one) saves an
    allocation per operation, and overriding ``cancel`` catches every way a work
    gets cancelled (``work.cancel()``, ``wait(timeout)`` expiring, a task
    cancelled while awaiting it) without a done callback per operation.
    Operations that nobody awaits (``CANCEL``, ``UNGET``, the ``GET`` and
    ``PREFETCH`` slots of a `GetStream`) are never completed.
    """

    __slots__ = ("engine", "state", "kind", "queue", "number", "payload", "frames", "token",
                 "address", "stream")

    def __init__(self, engine: Engine, state: ChannelState, kind: int, queue: QueueKey,
                 number: Any, payload: Any, frames: Sequence[Any],
                 stream: GetStream | None = None) -> None:
        super().__init__(loop=engine.loop)
        self.engine = engine
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
        if self.kind == USER_GET:
            self.engine.withdraw_get(self)
        elif self.kind in _PARKABLE:
            self.engine.on_cancel(self)
        return True


class Outbox:
    """What leaves for one channel worker at the end of this loop turn."""

    __slots__ = ("meta", "frames", "ops", "nbytes", "inline")

    def __init__(self) -> None:
        self.meta: list[Any] = []
        self.frames: list[Any] = []
        self.ops: list[Op] = []  # the operations that await an answer, or are withdrawn
        self.nbytes = 0
        self.inline = 0


class GetStream:
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

    * ``ready`` goes back only when no ``PREFETCH`` is out (`Gets.idle`
      waits for it), or while ``held`` keeps every later operation back and the
      prefetch's items follow them back (`Gets.prefetch_returned`);
    * only ``GET`` slots newer than every ``PREFETCH`` out are withdrawn, so an item
      a withdrawn slot gives back is newer than every item still to arrive;
    * while a withdrawn request (a slot, or a cancelled ``get_batch``) may still give
      items back (``settling``), no new slot is sent (`Gets.top_up`);
    * before held operations are released, the user gets waiting since before them
      get their slots (`Gets.settled`);
    * slots serve whichever user get is oldest, so a slot sent for a get that was then
      cancelled serves a later get; that must not cross a ``get_batch`` or
      ``get_nowait`` sent in between (it is behind the slot at the channel worker, but
      was made before the later get): cancelling a get made before such a *fence*
      withdraws a GET slot ahead of it (`Gets.withdraw_get`).
    """

    __slots__ = ("state", "queue", "waiting", "ready", "demand", "requested", "requested_total",
                 "settling", "depth", "last_get", "held", "timer", "fences", "lent",
                 "prefetch_off_until")

    def __init__(self, state: ChannelState, queue: QueueKey) -> None:
        self.state = state
        self.queue = queue
        self.waiting: collections.deque[Op] = collections.deque()  # user gets, in call order
        self.ready: collections.deque[Received] = collections.deque()  # prefetched items
        self.demand: collections.deque[Op] = collections.deque()  # GET slots not answered
        self.requested: dict[Op, int] = {}  # PREFETCH slots not answered -> items asked for
        self.requested_total = 0
        #: withdrawn requests (CANCEL sent: GET slots, cancelled get_batches) whose answer
        #: (CANCELLED, or items that go back) has not arrived
        self.settling = 0
        self.depth = 0
        self.last_get = -1e9  # when a user get was last issued or served
        #: Operations on this queue held back until withdrawn and in-flight slots are
        #: answered, so that they see the prefetched items back in the queue.
        self.held: list[Op] | None = None
        self.timer: asyncio.TimerHandle | None = None
        #: ``[token, gets]`` of each get_batch or get_nowait sent for this queue while user
        #: gets waited, oldest first: ``gets`` of the oldest waiting user gets were made
        #: before it, and their GET slots, one each, are ahead of it at the channel worker.
        self.fences: collections.deque[list[int]] = collections.deque()
        #: prefetched items arrived since the channel worker was last told DRAINED
        self.lent = False
        #: no prefetching before then (loop time): the queue has another consumer
        self.prefetch_off_until = 0.0

    def can_serve(self) -> bool:
        """Whether a new user get takes a prefetched item now (nothing waits before it)."""
        return bool(self.ready) and not self.waiting and self.held is None

    def in_flight(self) -> int:
        """Items that slots may still bring beyond what waiting user gets need."""
        return len(self.demand) + self.requested_total - len(self.waiting)


class ChannelState:
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
        self.backlog: list[Op] = []  # operations issued before the address was known
        self.task: asyncio.Task[dict[str, Any]] | None = None  # the resolution whose outcome counts
        self.ready_waiters: list[AsyncChannelWork[Any]] = []
        self.credits: dict[QueueKey, int] = {}  # queue -> puts that may complete at once
        #: per queue: credited puts sent and not yet reported admitted, oldest first
        self.admitting: dict[QueueKey, collections.deque[Op]] = {}
        self.streams: dict[QueueKey, GetStream] = {}
        # ---- replica 0 only: the channel as a whole (see `aiorl.channels.routing`)
        #: replicas of the channel, learnt when replica 0 is resolved (None: not yet)
        self.world_size: int | None = None
        self.replicas: list[ChannelState] = [self]
        self.key_ranks: dict[QueueKey, int] = {}  # the routing cache: key -> replica rank
        #: operations on keys whose replica is not known yet, in call order per key
        self.unrouted: dict[QueueKey, list[Op]] = {}
        self.routing: dict[QueueKey, Op] = {}  # ROUTE requests in flight, per key
