"""The channel worker: the process that hosts one channel's queues.

A channel is served by a one-rank worker group named ``channel.<name>``
(:func:`group_name_for`). Its :class:`ChannelWorker` registers the channel
operations on the worker's own endpoint, so items go straight from a producer's
endpoint to this process and from here to a consumer's, one ZMQ message per
direction per event-loop turn however many operations it carries (see
:mod:`aiorl.channels._protocol`). Items are never unpickled here: the server
stores and forwards the producer's frames (pickle stream plus out-of-band tensor
buffers) as they arrived.

All state lives on the worker's event loop; the queue rules themselves are in
:mod:`aiorl.channels._queue`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any

from aiorl.actors.worker import Worker
from aiorl.channels import _protocol as P
from aiorl.channels._queue import Done, Entry, WeightedQueue
from aiorl.errors import QueueEmpty, QueueFull
from aiorl.names import WorkerAddress
from aiorl.transport.endpoint import Endpoint, Incoming

__all__ = ["GROUP_PREFIX", "ChannelServer", "ChannelWorker", "group_name_for"]

log = logging.getLogger("aiorl.channels")

#: Channel ``x`` is hosted by the worker group ``channel.x`` (rank 0).
GROUP_PREFIX = "channel."

#: One stored item: its pickle as bytes (sent inline) or the tuple of its frames.
Item = Any
Waiter = tuple[bytes, int]  # (client routing identity, client token)


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
        self.handed_out: list[tuple[str, list[Entry]]] = []


class ChannelServer:
    """Serves :data:`~aiorl.channels._protocol.OPS` on ``endpoint`` (its loop thread only)."""

    def __init__(self, endpoint: Endpoint, name: str, maxsize: int = 0) -> None:
        self.endpoint = endpoint
        self.name = name
        self.maxsize = max(0, int(maxsize))
        self.queues: dict[str, WeightedQueue[Item]] = {}
        self._parked: dict[Waiter, str] = {}  # waiting put/get -> its queue (for CANCEL)
        self._out: dict[bytes, list[_Chunk]] = {}
        self._flush_scheduled = False
        endpoint.handle(P.OPS, self._on_ops)

    # ------------------------------------------------------------------ requests
    def _queue(self, name: str) -> WeightedQueue[Item]:
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = WeightedQueue(self.maxsize)
        return q

    def _on_ops(self, msg: Incoming) -> None:
        identity, frames, pos = msg.identity, msg.frames, 0
        for entry in msg.meta:
            kind, token, qname, number, payload = entry
            try:
                if kind == P.UNGET:
                    items, pos = _take_items(payload, number, frames, pos)
                    self._deliver(qname, self._queue(qname).unget(items))
                    continue
                if payload.__class__ is int:  # the item owns that many frames
                    payload, pos = tuple(frames[pos:pos + payload]), pos + payload
                self._dispatch(identity, kind, token, qname, number, payload)
            except Exception as exc:  # a malformed entry fails that operation only
                log.debug("channel %s: operation %r failed", self.name, entry[:4], exc_info=True)
                self._answer(identity, token, P.ERROR, f"{type(exc).__name__}: {exc}")
        self._schedule_flush()

    def _dispatch(self, identity: bytes, kind: int, token: int, qname: str, number: Any,
                  item: Item) -> None:
        waiter = (identity, token)
        if kind == P.PUT:
            q = self._queue(qname)
            self._parked[waiter] = qname
            self._deliver(qname, q.put(item, float(number), waiter))
        elif kind == P.GET or kind == P.GET_BATCH:
            q = self._queue(qname)
            batch = None if kind == P.GET else float(number)
            self._parked[waiter] = qname
            try:
                done = q.get(waiter, batch)
            except ValueError:
                del self._parked[waiter]
                raise
            self._deliver(qname, done)
        elif kind == P.PUT_NOWAIT:
            q = self._queue(qname)
            try:
                done = q.put_nowait(item, float(number))
            except QueueFull:
                self._answer(identity, token, P.FULL, None)
                return
            self._answer(identity, token, P.OK, None)
            self._deliver(qname, done)
        elif kind == P.GET_NOWAIT:
            q = self.queues.get(qname)
            try:
                if q is None:
                    raise QueueEmpty(qname)
                entry, done = q.get_nowait()
            except QueueEmpty:
                self._answer(identity, token, P.EMPTY, None)
                return
            self._answer_items(identity, token, qname, [entry])
            self._deliver(qname, done)
        elif kind == P.CANCEL:
            parked_in = self._parked.pop(waiter, None)
            if parked_in is None:
                return  # already answered: the result is on its way
            found, done = self.queues[parked_in].cancel(waiter)
            if found:
                self._answer(identity, token, P.CANCELLED, None)
            self._deliver(parked_in, done)
        elif kind == P.STATS:
            self._answer(identity, token, P.OK, self.statistics())
        elif kind == P.INFO:
            q = self.queues.get(qname)
            self._answer(identity, token, P.OK, [q.qsize() if q is not None else 0, self.maxsize])
        else:
            raise ValueError(f"unknown channel operation kind {kind!r}")

    def statistics(self) -> dict[str, list[Any]]:
        """``queue name -> [qsize, weight, maxsize, waiting putters, waiting getters, reserved]``."""
        out = {}
        for name, q in self.queues.items():
            s = q.stats()
            out[name] = [s.qsize, s.weight, s.maxsize, s.waiting_putters, s.waiting_getters,
                         s.reserved]
        return out

    # ------------------------------------------------------------------ answers
    def _deliver(self, qname: str, done: list[Done]) -> None:
        for waiter, items in done:
            identity, token = waiter  # type: ignore[misc]
            self._parked.pop(waiter, None)  # type: ignore[arg-type]
            if items is None:
                self._answer(identity, token, P.OK, None)
            else:
                self._answer_items(identity, token, qname, items)

    def _chunk(self, identity: bytes, inline: int = 0) -> _Chunk:
        chunks = self._out.get(identity)
        if chunks is None:
            chunks = self._out[identity] = [_Chunk()]
            self._schedule_flush()
        chunk = chunks[-1]
        if inline and chunk.inline + inline > P.MAX_INLINE_BYTES and chunk.meta:
            chunk = _Chunk()
            chunks.append(chunk)
        return chunk

    def _answer(self, identity: bytes, token: int, status: int, info: Any) -> None:
        self._chunk(identity).meta.append((token, status, info))

    def _answer_items(self, identity: bytes, token: int, qname: str, items: list[Entry]) -> None:
        inline = sum(len(it) for it, _, _ in items if it.__class__ is bytes)  # type: ignore[arg-type]
        chunk = self._chunk(identity, inline)
        info = []
        for item, weight, seq in items:
            if item.__class__ is bytes:
                info.append((item, weight, seq))
            else:
                info.append((len(item), weight, seq))  # type: ignore[arg-type]
                chunk.frames.extend(item)  # type: ignore[call-overload]
        chunk.meta.append((token, P.ITEMS, info))
        chunk.inline += inline
        chunk.handed_out.append((qname, items))

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            # Runs after the endpoint finished draining this wake-up's messages, so the
            # answers to everything that arrived together leave together.
            self.endpoint.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, {}
        for identity, chunks in out.items():
            for i, chunk in enumerate(chunks):
                try:
                    sent = self.endpoint.push_event(identity, P.DONE, chunk.meta, chunk.frames)
                except Exception:
                    log.exception("channel %s: could not answer a client", self.name)
                    sent = False
                if not sent:
                    self._client_gone(identity, chunks[i:])
                    break

    def _client_gone(self, identity: bytes, chunks: list[_Chunk]) -> None:
        """A client disconnected: withdraw what it waits for and re-queue what it was sent."""
        handed_out = [h for chunk in chunks for h in chunk.handed_out]
        log.warning("channel %s: a client went away; re-queueing %d undelivered answer(s)",
                    self.name, len(handed_out))
        for waiter in [w for w in self._parked if w[0] == identity]:
            qname = self._parked.pop(waiter)
            _, done = self.queues[qname].cancel(waiter)
            self._deliver(qname, done)
        # Most recent first: each unget goes to the front, so the original order is restored.
        for qname, items in reversed(handed_out):
            self._deliver(qname, self._queue(qname).unget(items))


def _take_items(payloads: list[Any], places: list[Any], frames: list[Any],
                pos: int) -> tuple[list[Entry], int]:
    """Decode an UNGET entry's items (``places`` = their ``[weight, seq]``)."""
    items: list[Entry] = []
    for payload, (weight, seq) in zip(payloads, places, strict=True):
        if payload.__class__ is int:
            payload, pos = tuple(frames[pos:pos + payload]), pos + payload
        items.append((payload, float(weight), int(seq)))
    return items, pos


class ChannelWorker(Worker):
    """The worker that hosts a channel (launched by ``Channel.create``; not for direct use)."""

    def __init__(self, channel_name: str, maxsize: int = 0) -> None:
        super().__init__()
        runtime = self._runtime
        registered: concurrent.futures.Future[ChannelServer] = concurrent.futures.Future()

        def setup() -> None:
            try:
                registered.set_result(ChannelServer(runtime.endpoint, channel_name, maxsize))
            except BaseException as exc:  # noqa: BLE001 - re-raised in __init__ below
                registered.set_exception(exc)

        # __init__ runs on the method thread and the endpoint belongs to the loop: register
        # there, and wait, so the handlers exist before this worker reports ready.
        runtime.call_soon(setup)
        self._server = registered.result(timeout=30)
        # Process tuning (gc.freeze, mallopt) is done for every worker: worker_process.tune_process.
        self.channel_name = channel_name
        self.maxsize = maxsize

    async def queue_statistics(self) -> dict[str, list[Any]]:
        """The counters of every queue (see :meth:`ChannelServer.statistics`)."""
        return self._server.statistics()
