"""The channel host: the worker process that holds one channel's queues.

A channel is served by a worker group named ``channel.<name>``
(`group_name_for`), one rank for a plain channel and one per node for a
distributed one, whose instances are each a `ChannelHost`: a plain
class (not an [`aiorl.Worker`][aiorl.Worker], which lives in a layer above channels)
that registers the channel operations on the process's endpoint, so items go
straight from a producer's endpoint to this process and from here to a
consumer's, one ZMQ message per direction per event-loop turn however many
operations it carries (see `aiorl.protocol.channels`). Items are never
unpickled here: the server stores and forwards the producer's frames (pickle
stream plus out-of-band tensor buffers) as they arrived.

All state lives on the worker's event loop; the queue rules themselves are in
`aiorl.channels.weighted_queue`. Besides answering operations, the server grants
producers *credits* (room it promises to accept) so that their puts complete
without a round trip each; see `ChannelServer`.

Distributed channels
    Every replica serves the queues of the keys assigned to it exactly as a plain
    channel does; the replicas never talk to each other. Replica 0 alone assigns
    keys (``ROUTE``): the first process to use a key gets the replica on its own
    node, and every later process is told the same, because one event loop
    decides each first assignment in turn.
"""

# HOT PATH: _on_ops, _dispatch, _deliver and _flush run per item.

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, cast

from aiorl.channels import settings
from aiorl.channels.weighted_queue import Done, Entry, WeightedQueue
from aiorl.errors import ProtocolError, QueueEmpty, QueueFull
from aiorl.names import WorkerAddress
from aiorl.protocol import channels as chan
from aiorl.protocol.channels import QueueKey, Refused
from aiorl.protocol.ops import ChannelOp
from aiorl.runtime import current_runtime
from aiorl.transport.endpoint import Endpoint, Incoming

__all__ = ["GROUP_PREFIX", "ChannelHost", "ChannelServer", "group_name_for"]

log = logging.getLogger("aiorl.channels")

#: Channel ``x`` is hosted by the worker group ``channel.x`` (rank 0).
GROUP_PREFIX = "channel."

#: One stored item: its pickle as bytes (sent inline) or the tuple of its frames.
Item = Any
Waiter = tuple[bytes, int]  # (client routing identity, client token)
CreditKey = tuple[bytes, QueueKey]  # (client routing identity, queue key)


def group_name_for(channel_name: str) -> str:
    """The worker group that hosts channel ``channel_name``; validates the name."""
    if not isinstance(channel_name, str) or not channel_name:
        raise ValueError("a channel name must be a non-empty string")
    group = GROUP_PREFIX + channel_name
    WorkerAddress(group)  # raises ValueError for ':' (it separates ranks in worker names)
    return group


class _Chunk:
    """Answers for one client that leave as one message."""

    __slots__ = ("meta", "frames", "inline", "handed_out")

    def __init__(self) -> None:
        self.meta: list[Any] = []
        self.frames: list[Any] = []
        self.inline = 0  # bytes of items inline in meta (the header is capped at 1 MiB)
        # Items in this message, so they can be re-queued if the client is gone.
        self.handed_out: list[tuple[QueueKey, list[Entry]]] = []


#: Operations that take items from a queue (whose takers `_Takers` follows).
_TAKING = frozenset((chan.GET, chan.GET_BATCH, chan.GET_NOWAIT, chan.PREFETCH))
#: A taking operation held back: ``(client identity, kind, token, number)``.
Held = tuple[bytes, int, int, Any]


class _Takers:
    """The processes that take from one queue, for prefetch (`aiorl.protocol.channels`,
    Prefetch).

    Items a process prefetched and gives back return to the head of the queue. Were
    another process served meanwhile, it would get them after newer items of the same
    producer; so while a process holds prefetched items (``lent``) the gets of every
    other process wait here (``held``, in arrival order) until it says ``DRAINED``, and
    prefetch is refused while a second process takes from the queue.
    """

    __slots__ = ("last", "shared_until", "lent", "held", "timer")

    def __init__(self) -> None:
        self.last: bytes | None = None  # the process that took last
        self.shared_until = 0.0  # prefetch is refused until then (loop time)
        self.lent: set[bytes] = set()  # processes that hold prefetched items
        self.held: list[Held] = []
        self.timer: asyncio.TimerHandle | None = None  # ends the hold (LENT_HOLD_MAX)

    def others_lent(self, identity: bytes) -> bool:
        """Whether a process other than ``identity`` holds prefetched items."""
        return bool(self.lent) and (len(self.lent) > 1 or identity not in self.lent)


class ChannelServer:
    """Serves `OPS` on ``endpoint`` (its loop thread only).

    Credits: every client that puts into a queue holds up to
    `CREDIT_WINDOW` credits for it, topped up at
    the end of each loop turn in which its puts entered the queue. In a bounded
    queue the credits of all clients together never exceed the free room
    (``maxsize`` minus queued items, parked puts and credits already out), so a
    full queue grants none and puts wait for room as uncredited ``PUT`` operations. A
    credited put that still finds the queue full (another client's uncredited put
    took the room) is parked like any put and admitted in order; it stays even if
    its producer goes away, since the producer already counted it as accepted.
    """

    def __init__(self, endpoint: Endpoint, name: str, maxsize: int = 0,
                  replica_nodes: list[int] | None = None, rank: int = 0) -> None:
        self.endpoint = endpoint
        self.name = name
        self.maxsize = max(0, int(maxsize))
        self.rank = rank
        #: node rank of each replica, in replica order (one entry for a plain channel)
        self.replica_nodes = list(replica_nodes) if replica_nodes else [0]
        #: key -> replica rank: the assignments this replica decided (replica 0 only)
        self.routes: dict[QueueKey, int] = {}
        self.queues: dict[QueueKey, WeightedQueue[Item]] = {}
        self._parked: dict[Waiter, QueueKey] = {}  # waiting put/get -> its queue (for CANCEL)
        self._out: dict[bytes, list[_Chunk]] = {}
        self._flush_scheduled = False
        # Credits (see the class docstring).
        self._credits: dict[CreditKey, int] = {}  # granted and not yet used
        self._credits_in_queue: dict[QueueKey, int] = {}  # the same, summed per queue
        self._credited: set[Waiter] = set()  # credited puts not yet admitted
        self._credited_parked: dict[bytes, int] = {}  # per client: credited puts not admitted
        self._admitted: dict[CreditKey, int] = {}  # credited puts admitted, not yet reported
        self._grant_due: set[CreditKey] = set()  # (client, queue) whose credits to top up
        self._flushes: dict[bytes, list[int]] = {}  # FLUSH tokens waiting for credited puts
        self._takers: dict[QueueKey, _Takers] = {}  # per queue: prefetch and held gets
        #: Per queue, every process that took (or asked to take) from it, gone ones included:
        #: ``aiorl doctor`` names a full queue whose consumers are all dead, which no put can
        #: ever leave.
        self.consumers: dict[QueueKey, set[bytes]] = {}
        endpoint.handle(ChannelOp.OPS, self._on_ops)

    def snapshot(self) -> list[dict[str, Any]]:
        """Each queue as ``aiorl doctor`` shows it: its sizes and waiters, and the routing ids
        of the clients that wait to get (``getters``), put into it (``producers``) and ever
        took from it (``consumers``)."""
        out = []
        for queue, q in self.queues.items():
            stats = q.stats()
            out.append({
                "queue": queue, "size": stats.qsize, "weight": stats.weight,
                "maxsize": stats.maxsize, "waiting_getters": stats.waiting_getters,
                "waiting_putters": stats.waiting_putters,
                "getters": {w[0] for w, qn in self._parked.items()
                            if qn == queue and w not in self._credited},
                "producers": {key[0] for key in (*self._credits, *self._admitted)
                              if key[1] == queue},
                "consumers": set(self.consumers.get(queue, ())),
            })
        return out

    # ------------------------------------------------------------------ requests
    def _queue(self, name: QueueKey) -> WeightedQueue[Item]:
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = WeightedQueue(self.maxsize)
        return q

    def _on_ops(self, msg: Incoming) -> None:
        identity, frames, pos = msg.identity, msg.frames, 0
        try:
            requests = chan.read_requests(msg.meta, len(frames))
        except ProtocolError as exc:  # not a batch at all: nothing in it can be answered
            log.warning("channel %s: dropped a malformed message: %s", self.name, exc)
            return
        for request in requests:
            if isinstance(request, Refused):
                self._refused(identity, request)
                continue
            kind, token, qname, number, payload = request
            try:
                if kind == chan.UNGET:
                    items, pos = _take_items(payload, number, frames, pos)
                    self._deliver(qname, self._queue(qname).unget(items))
                    continue
                if payload.__class__ is int:  # the item owns that many frames
                    count: int = payload
                    payload = tuple(frames[pos:pos + count])
                    pos += count
                self._dispatch(identity, kind, token, qname, number, payload)
            except Exception as exc:  # an operation the queue refuses fails alone
                log.debug("channel %s: operation %r failed", self.name, (kind, token, qname),
                          exc_info=True)
                self._answer(identity, token, chan.ERROR, f"{type(exc).__name__}: {exc}")
        self._schedule_flush()

    def _refused(self, identity: bytes, refused: Refused) -> None:
        """A request that failed its checks fails alone, answered ``ERROR`` naming why."""
        log.debug("channel %s: refused a request: %s", self.name, refused.error)
        if refused.token is not None:
            self._answer(identity, refused.token, chan.ERROR, f"ProtocolError: {refused.error}")

    def _dispatch(self, identity: bytes, kind: int, token: int, qname: QueueKey, number: Any,
                  item: Item) -> None:
        waiter = (identity, token)
        if kind in _TAKING:
            seen = self.consumers.get(qname)
            if seen is None:
                seen = self.consumers[qname] = set()
            seen.add(identity)
            if self._hold(identity, kind, token, qname, number):
                return
        if kind == chan.PUT_CREDITED:
            self._put_credited(identity, waiter, qname, float(number), item)
        elif kind == chan.PUT:
            q = self._queue(qname)
            self._parked[waiter] = qname
            self._deliver(qname, q.put(item, float(number), waiter))
        elif kind == chan.GET or kind == chan.GET_BATCH:
            q = self._queue(qname)
            batch = None if kind == chan.GET else float(number)
            self._parked[waiter] = qname
            try:
                done = q.get(waiter, batch)
            except ValueError:
                del self._parked[waiter]
                raise
            self._deliver(qname, done)
        elif kind == chan.PUT_NOWAIT:
            q = self._queue(qname)
            try:
                done = q.put_nowait(item, float(number))
            except QueueFull:
                self._answer(identity, token, chan.FULL, None)
                return
            self._answer(identity, token, chan.OK, None)
            self._deliver(qname, done)
        elif kind == chan.GET_NOWAIT:
            existing = self.queues.get(qname)
            try:
                if existing is None:
                    raise QueueEmpty(qname)
                entry, done = existing.get_nowait()
            except QueueEmpty:
                self._answer(identity, token, chan.EMPTY, None)
                return
            self._answer_items(identity, token, qname, [entry])
            self._deliver(qname, done)
        elif kind == chan.CANCEL:
            if self._withdraw_held(identity, token, qname):
                self._answer(identity, token, chan.CANCELLED, None)
                return
            parked_in = self._parked.pop(waiter, None)
            if parked_in is None:
                return  # already answered: the result is on its way
            found, done = self.queues[parked_in].cancel(waiter)
            if found:
                self._answer(identity, token, chan.CANCELLED, None)
            self._deliver(parked_in, done)
        elif kind == chan.PREFETCH:
            existing = self.queues.get(qname)
            taken: list[Entry] = []
            while existing is not None and len(taken) < number and not existing.empty():
                entry, done = existing.get_nowait()
                taken.append(entry)
                if done:  # parked putters admitted into the room it made
                    self._deliver(qname, done)
            if taken:
                self._takers[qname].lent.add(identity)
            self._answer_items(identity, token, qname, taken)
        elif kind == chan.DRAINED:
            takers = self._takers.get(qname)
            if takers is not None and identity in takers.lent:
                takers.lent.discard(identity)
                if takers.held:
                    self._release(qname)
        elif kind == chan.FLUSH:
            if self._credited_parked.get(identity):
                self._flushes.setdefault(identity, []).append(token)
            else:
                self._answer(identity, token, chan.OK, None)
        elif kind == chan.STATS:
            self._answer(identity, token, chan.OK, self.statistics().to_wire())
        elif kind == chan.PEEK:
            existing = self.queues.get(qname)
            entries = existing.peek(int(number)) if existing is not None else []
            self._answer_entries(identity, token, chan.PEEKED, entries)
        elif kind == chan.ROUTE:
            self._answer(identity, token, chan.OK, chan.Route(self._route(qname, number)).to_wire())
        elif kind == chan.INFO:
            existing = self.queues.get(qname)
            size = existing.qsize() if existing is not None else 0
            self._answer(identity, token, chan.OK, chan.QueueInfo(size, self.maxsize).to_wire())
        else:
            raise ValueError(f"unknown channel operation kind {kind!r}")

    # ------------------------------------------------------------------ takers
    def _hold(self, identity: bytes, kind: int, token: int, qname: QueueKey, number: Any) -> bool:
        """Whether taking operation ``kind`` must wait or is answered ``NO_PREFETCH``."""
        takers = self._takers.get(qname)
        if takers is None:
            takers = self._takers[qname] = _Takers()
        now = self.endpoint.loop.time()
        if takers.last != identity:
            if takers.last is not None:
                takers.shared_until = now + settings.SHARED_WINDOW
            takers.last = identity
        if kind == chan.PREFETCH:
            if takers.others_lent(identity) or now < takers.shared_until:
                self._answer(identity, token, chan.NO_PREFETCH, None)
                return True
            return False
        if takers.others_lent(identity) or any(h[0] == identity for h in takers.held):
            takers.held.append((identity, kind, token, number))
            if takers.timer is None:
                takers.timer = self.endpoint.loop.call_later(settings.LENT_HOLD_MAX,
                                                             self._hold_expired, qname)
            return True
        return False

    def _release(self, qname: QueueKey) -> None:
        """Handle the held operations of ``qname`` again, in arrival order (some may wait on)."""
        takers = self._takers[qname]
        if takers.timer is not None:
            takers.timer.cancel()
            takers.timer = None
        held, takers.held = takers.held, []
        for identity, kind, token, number in held:
            try:
                self._dispatch(identity, kind, token, qname, number, None)
            except Exception as exc:  # as in _on_ops: that operation fails alone
                self._answer(identity, token, chan.ERROR, f"{type(exc).__name__}: {exc}")
        self._schedule_flush()

    def _hold_expired(self, qname: QueueKey) -> None:
        """A process held prefetched items for `LENT_HOLD_MAX` s without a word (its loop is
        stuck, or it died): serve the others; its items, if they come back, go to their
        places in the queue as any returned item."""
        takers = self._takers[qname]
        takers.timer = None
        log.warning("channel %s: %d process(es) held prefetched items of a queue for %.0f s; "
                    "serving %d waiting get(s) without them", self.name, len(takers.lent),
                    settings.LENT_HOLD_MAX, len(takers.held))
        takers.lent.clear()
        self._release(qname)

    def _withdraw_held(self, identity: bytes, token: int, qname: QueueKey) -> bool:
        takers = self._takers.get(qname)
        if takers is None:
            return False
        for i, held in enumerate(takers.held):
            if held[0] == identity and held[2] == token:
                del takers.held[i]
                return True
        return False

    def _route(self, key: QueueKey, node_rank: int) -> int:
        """The replica that holds ``key``: assigned on first use, to the asker's node's."""
        if self.rank != 0:
            raise ValueError(f"replica {self.rank} was asked to route a key; only replica 0 "
                             "assigns keys")
        rank = self.routes.get(key)
        if rank is None:
            nodes = self.replica_nodes
            rank = self.routes[key] = nodes.index(node_rank) if node_rank in nodes else 0
        return rank

    def _put_credited(self, identity: bytes, waiter: Waiter, qname: QueueKey, weight: float,
                      item: Item) -> None:
        """A put its producer already completed with a credit: accept it, never answer it."""
        key = (identity, qname)
        held = self._credits.get(key, 0)
        if held:
            self._credits[key] = held - 1
            self._credits_in_queue[qname] -= 1
        q = self._queue(qname)
        if q.full():  # parked until there is room; _deliver admits it later
            self._parked[waiter] = qname
            self._credited.add(waiter)
            self._credited_parked[identity] = self._credited_parked.get(identity, 0) + 1
            self._deliver(qname, q.put(item, weight, waiter))
            return
        done = q.put(item, weight, waiter)  # admitted: done[0] is this put, then getters served
        self._admitted[key] = self._admitted.get(key, 0) + 1
        self._grant_due.add(key)
        if len(done) > 1:
            self._deliver(qname, done[1:])

    def _credited_admitted(self, identity: bytes, key: CreditKey) -> None:
        self._admitted[key] = self._admitted.get(key, 0) + 1
        left = self._credited_parked.get(identity, 0) - 1
        if left > 0:
            self._credited_parked[identity] = left
            return
        self._credited_parked.pop(identity, None)
        for token in self._flushes.pop(identity, ()):
            self._answer(identity, token, chan.OK, None)

    def _grant_credits(self) -> None:
        """Top up the credits of every (client, queue) whose puts entered a queue this turn."""
        due, self._grant_due = self._grant_due, set()
        for key in due:
            identity, qname = key
            held = self._credits.get(key, 0)
            grant = settings.CREDIT_WINDOW - held
            if self.maxsize:
                q = self.queues[qname]
                room = (self.maxsize - q.qsize() - q.waiting_putters()
                        - self._credits_in_queue.get(qname, 0))
                grant = min(grant, room)
            admitted = self._admitted.pop(key, 0)
            if grant > 0:
                self._credits[key] = held + grant
                self._credits_in_queue[qname] = self._credits_in_queue.get(qname, 0) + grant
            elif not admitted:
                continue
            self._answer(identity, 0, chan.CREDIT,
                         chan.credit_entry(qname, max(grant, 0), admitted))

    def statistics(self) -> chan.Statistics:
        """Each queue's counters (a held get counts as a waiting getter)."""
        out: dict[QueueKey, chan.Counters] = {}
        for name, q in self.queues.items():
            s = q.stats()
            takers = self._takers.get(name)
            held = len(takers.held) if takers is not None else 0
            out[name] = (s.qsize, s.weight, s.maxsize, s.waiting_putters,
                         s.waiting_getters + held, s.reserved)
        return chan.Statistics(out)

    # ------------------------------------------------------------------ answers
    def _deliver(self, qname: QueueKey, done: list[Done]) -> None:
        for completed, items in done:
            waiter = cast(Waiter, completed)
            identity, token = waiter
            self._parked.pop(waiter, None)
            if items is not None:
                self._answer_items(identity, token, qname, items)
                continue
            key = (identity, qname)
            self._grant_due.add(key)
            if waiter in self._credited:
                self._credited.discard(waiter)
                self._credited_admitted(identity, key)
            else:
                self._answer(identity, token, chan.OK, None)

    def _chunk(self, identity: bytes, inline: int = 0) -> _Chunk:
        chunks = self._out.get(identity)
        if chunks is None:
            chunks = self._out[identity] = [_Chunk()]
            self._schedule_flush()
        chunk = chunks[-1]
        if inline and chunk.inline + inline > settings.MAX_INLINE_BYTES and chunk.meta:
            chunk = _Chunk()
            chunks.append(chunk)
        return chunk

    def _answer(self, identity: bytes, token: int, status: int, info: Any) -> None:
        self._chunk(identity).meta.append(chan.answer_entry(token, status, info))

    def _answer_items(self, identity: bytes, token: int, qname: QueueKey, items: list[Entry]) -> None:
        """Hand ``items`` (taken from ``qname``) to a getter; re-queued if it is gone."""
        self._answer_entries(identity, token, chan.ITEMS, items).handed_out.append((qname, items))

    def _answer_entries(self, identity: bytes, token: int, status: int,
                        items: list[Entry]) -> _Chunk:
        stored: list[Any] = [item for item, _, _ in items]  # bytes, or a tuple of frames
        inline = sum(len(item) for item in stored if item.__class__ is bytes)
        chunk = self._chunk(identity, inline)
        info: list[tuple[Any, float, int]] = []
        for item, (_, weight, seq) in zip(stored, items, strict=True):
            if item.__class__ is bytes:
                info.append((item, weight, seq))
            else:
                info.append((len(item), weight, seq))
                chunk.frames.extend(item)
        chunk.meta.append(chan.answer_entry(token, status, info))
        chunk.inline += inline
        return chunk

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            # Runs after the endpoint finished draining this wake-up's messages, so the
            # answers to everything that arrived together leave together.
            self.endpoint.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._grant_due:
            self._grant_credits()
        out, self._out = self._out, {}
        for identity, chunks in out.items():
            for i, chunk in enumerate(chunks):
                try:
                    sent = self.endpoint.push_event(identity, ChannelOp.DONE, chunk.meta,
                                                    chunk.frames)
                except Exception:
                    log.exception("channel %s: could not answer a client", self.name)
                    sent = False
                if not sent:
                    self._client_gone(identity, chunks[i:])
                    break

    def _client_gone(self, identity: bytes, chunks: list[_Chunk]) -> None:
        """A client disconnected: withdraw what it waits for and re-queue what it was sent."""
        handed_out = [h for chunk in chunks for h in chunk.handed_out]
        if handed_out:  # items go back in the queue: worth a line; a bare departure is not
            log.warning("channel %s: a client went away; re-queueing %d undelivered answer(s)",
                        self.name, len(handed_out))
        else:
            log.debug("channel %s: a client went away with no items in flight", self.name)
        self._flushes.pop(identity, None)
        for key in [k for k in self._credits if k[0] == identity]:
            self._credits_in_queue[key[1]] -= self._credits.pop(key)
        for key in [k for k in self._admitted if k[0] == identity]:
            del self._admitted[key]
        # Its credited puts stay parked: the producer counted them as accepted.
        for waiter in [w for w in self._parked if w[0] == identity and w not in self._credited]:
            qname = self._parked.pop(waiter)
            _, done = self.queues[qname].cancel(waiter)
            self._deliver(qname, done)
        # Most recent first: each unget goes to the front, so the original order is restored.
        for qname, items in reversed(handed_out):
            self._deliver(qname, self._queue(qname).unget(items))
        # Whatever it held, it holds no longer (what it was sent came back above).
        for qname, takers in self._takers.items():
            takers.lent.discard(identity)
            takers.held = [h for h in takers.held if h[0] != identity]
            if takers.held:
                self._release(qname)
        self._schedule_flush()


def _take_items(payloads: list[Any], places: list[Any], frames: list[Any],
                pos: int) -> tuple[list[Entry], int]:
    """Decode an UNGET entry's items (``places`` = their ``[weight, seq]``)."""
    items: list[Entry] = []
    for payload, (weight, seq) in zip(payloads, places, strict=True):
        item: Any = payload
        if payload.__class__ is int:
            item = tuple(frames[pos:pos + payload])
            pos += payload
        items.append((item, float(weight), int(seq)))
    return items, pos


class ChannelHost:
    """The instance a channel's worker process hosts (``Channel.create`` launches it).

    A plain class: the worker process builds it like any worker instance, and it
    serves the channel through the process's runtime rather than through worker
    methods (it has none). ``replica_nodes`` is the node rank of every replica of
    a distributed channel, in rank order (``None``: a plain channel); this
    process's rank comes from the ``RANK`` its group launched it with.
    """

    def __init__(self, channel_name: str, maxsize: int = 0,
                 replica_nodes: list[int] | None = None) -> None:
        runtime = current_runtime()
        if runtime is None:
            raise RuntimeError("a ChannelHost runs inside an aiorl worker process; "
                               "create channels with Channel.create or Worker.create_channel")
        self.channel_name = channel_name
        self.maxsize = maxsize
        self.replica_nodes = replica_nodes
        self.rank = int(os.environ.get("RANK", "0"))
        self.server: ChannelServer | None = None
        # The worker process builds this instance on its method thread, while the endpoint
        # belongs to the loop. ``call_soon`` queues the registration without blocking this
        # thread, and the loop runs it before it learns that construction finished (both
        # are loop callbacks, run in order), so the handlers exist before the worker
        # reports ready and any client can send to it.
        runtime.submit(self._serve, runtime.endpoint)

    def _serve(self, endpoint: Endpoint) -> None:
        self.server = ChannelServer(endpoint, self.channel_name, self.maxsize,
                                    self.replica_nodes, self.rank)
