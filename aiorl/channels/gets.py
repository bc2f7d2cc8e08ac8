"""The gets of one process: user gets per queue, served by slots and prefetching.

`Gets` is the half of the per-process channel engine (`aiorl.channels.engine`) that turns
user ``get`` calls into the slots the channel worker sees (``GET`` and ``PREFETCH``) and
keeps the order docs/ordering.md promises; `GetStream` (in `aiorl.channels.client_state`) is
its state for one queue, and its docstring gives the rules.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from aiorl.channels import settings
from aiorl.channels.client_state import ChannelState, Engine, GetStream, Op
from aiorl.channels.items import decode_item
from aiorl.errors import RemoteError
from aiorl.protocol import channels as chan
from aiorl.protocol.channels import QueueKey, Received

__all__ = ["Gets"]


class Gets:
    """User gets of one process, per queue (loop thread only)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop = engine.loop

    def stream(self, st: ChannelState, queue: QueueKey) -> GetStream:
        stream = st.streams.get(queue)
        if stream is None:
            stream = st.streams[queue] = GetStream(st, queue)
        return stream

    def accept_get(self, op: Op) -> None:
        stream = self.stream(op.state, op.queue)
        if stream.held is not None:
            stream.held.append(op)
            return
        if stream.can_serve():
            self.serve_ready(stream, op)
            return
        now = self.loop.time()
        if now - stream.last_get < settings.PREFETCH_IDLE and now >= stream.prefetch_off_until:
            # streaming, and it has to wait:
            stream.depth = min(settings.PREFETCH_MAX, max(2, stream.depth * 2))  # prefetch deeper
        stream.last_get = now
        stream.waiting.append(op)
        self.top_up(stream)

    def serve_ready(self, stream: GetStream, fut: asyncio.Future[Any]) -> None:
        """Complete a user get with the oldest prefetched item (see GetStream.can_serve)."""
        stream.last_get = self.loop.time()
        self.resolve(fut, stream.ready.popleft())
        self.top_up(stream)
        self.drained(stream)

    def top_up(self, stream: GetStream) -> None:
        """Cover every waiting user get by a slot, and prefetch up to ``depth`` items.

        A user get is covered by a prefetch in flight, or else by a parkable GET of its
        own. A GET is sent only when no prefetch can serve the get, so no GET stays
        parked at the channel worker for a get already served (it would take an item
        that a getter of another process may be waiting for).

        Nothing is sent while withdrawn requests are ``settling``: an item one of them
        took goes back to the queue when its answer arrives, and a slot sent before
        that would take the items behind it (`slot_withdrawn` tops up then).
        """
        if stream.settling:
            return
        for _ in range(len(stream.waiting) - len(stream.demand) - stream.requested_total):
            slot = Op(self.engine, stream.state, chan.GET, stream.queue, 0, 0, (), stream)
            stream.demand.append(slot)
            self.engine.issue(slot)
        if not stream.depth:
            return
        wanted = stream.depth - len(stream.ready) - stream.in_flight()
        if wanted >= max(1, stream.depth // 2):  # ask in chunks: fewer, fuller messages
            slot = Op(self.engine, stream.state, chan.PREFETCH, stream.queue, wanted, 0, (), stream)
            stream.requested[slot] = wanted
            stream.requested_total += wanted
            self.engine.issue(slot)
        if stream.timer is None:
            stream.timer = self.loop.call_later(settings.PREFETCH_IDLE, self.idle, stream)

    def resolve(self, op: asyncio.Future[Any], item: Received) -> None:
        payload, _, frames = item
        try:
            value = decode_item(payload, frames)
        except BaseException as exc:  # noqa: BLE001 - the consumer learns why
            op.set_exception(exc)
            return
        op.set_result(value)

    def slot_items(self, slot: Op, items: list[Received]) -> None:
        stream = slot.stream
        assert stream is not None
        if slot.kind == chan.GET:
            stream.demand.remove(slot)  # the oldest: answers come in order
        else:
            stream.requested_total -= stream.requested.pop(slot)
            if items:
                stream.lent = True  # the channel worker holds others' gets until DRAINED
            else:
                stream.depth //= 2  # the queue ran dry: the consumer is not behind
        for item in items:
            self.item_arrived(stream, item)
        if stream.held is None and stream.waiting:
            self.top_up(stream)  # a prefetch brought less than the waiting gets need
        self.settled(stream)
        self.drained(stream)

    def prefetch_refused(self, slot: Op) -> None:
        """``NO_PREFETCH``: another process takes from the queue too. Stop prefetching
        for `SHARED_WINDOW` s; gets take one request each meanwhile."""
        stream = slot.stream
        assert stream is not None
        stream.requested_total -= stream.requested.pop(slot)
        stream.depth = 0
        stream.prefetch_off_until = self.loop.time() + settings.SHARED_WINDOW
        if stream.held is None and stream.waiting:
            self.top_up(stream)  # the gets it was to serve need GET slots now
        self.settled(stream)
        self.drained(stream)

    def drained(self, stream: GetStream) -> None:
        """Tell the channel worker once no prefetched item is here or on its way: it holds
        the gets of other processes until then (`aiorl.protocol.channels`, Prefetch). An ``UNGET``
        of the items given back, if any, was sent before (one outbox, in order)."""
        if (stream.lent and not stream.ready and not stream.requested
                and stream.state.address is not None):
            stream.lent = False
            self.engine.enqueue(stream.state.address,
                               Op(self.engine, stream.state, chan.DRAINED, stream.queue, 0, 0, ()))

    def item_arrived(self, stream: GetStream, item: Received) -> None:
        waiting = stream.waiting
        if waiting:
            stream.last_get = self.loop.time()  # waiting for an item is not being idle
            if stream.fences:
                self.passed_fences(stream, 0)
            self.resolve(waiting.popleft(), item)
        elif stream.held is None:
            # Kept for the next get even if prefetching stopped meanwhile: returning it now
            # and asking again would only churn. The idle timer returns what stays unused.
            stream.ready.append(item)
            if stream.timer is None:
                stream.timer = self.loop.call_later(settings.PREFETCH_IDLE, self.idle, stream)
        elif stream.state.address is not None:  # held operations must see it in the queue
            self.engine.unget(stream.state.address, stream.state, stream.queue, [item])

    def slot_answered(self, slot: Op, status: int, info: Any) -> None:
        """A slot's answer without items (ERROR): the oldest waiting user get fails."""
        stream = slot.stream
        assert stream is not None
        if slot.kind == chan.GET:
            stream.demand.remove(slot)
        else:
            stream.requested_total -= stream.requested.pop(slot)
        if stream.waiting:
            if stream.fences:
                self.passed_fences(stream, 0)
            stream.waiting.popleft().set_exception(RemoteError(
                stream.state.worker, stream.state.rank, "ChannelError", str(info), ""))
        self.settled(stream)

    def slot_withdrawn(self, stream: GetStream) -> None:
        """A withdrawn request was answered (its items, if any, are on their way back)."""
        stream.settling -= 1
        if not stream.settling and stream.held is None and stream.waiting:
            self.top_up(stream)  # the slots held back while it settled (see top_up)
        self.settled(stream)

    def withdraw_get(self, op: Op) -> None:
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
            fence = self.passed_fences(stream, place)
            if fence:  # a slot ahead of a get_batch/get_nowait is one too many: withdraw one
                for slot in reversed(stream.demand):
                    if slot.token < fence:
                        stream.demand.remove(slot)
                        self.withdraw_slot(stream, slot)
                        break
            elif not stream.depth:
                self.withdraw_slots(stream)

    def passed_fences(self, stream: GetStream, place: int) -> int:
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

    def withdraw_slot(self, stream: GetStream, slot: Op) -> None:
        """Cancel GET slot ``slot`` (just taken out of ``demand``) at the channel worker."""
        if slot.address is not None:
            stream.settling += 1  # its answer (CANCELLED or the item) is still to come
        slot.cancel()

    def withdraw_slots(self, stream: GetStream) -> None:
        """Cancel the newest GET slots beyond what the waiting user gets need.

        Only GET slots sent after every prefetch still out: a withdrawn slot's item goes
        back to the queue, so it must be newer than the items those prefetches bring,
        which may go to waiting user gets (an older GET stays, and its item is used or
        returned like a prefetched one).
        """
        newest_prefetch = next(reversed(stream.requested)).token if stream.requested else 0
        while (stream.demand and stream.demand[-1].token > newest_prefetch
               and len(stream.demand) + stream.requested_total > len(stream.waiting)):
            self.withdraw_slot(stream, stream.demand.pop())

    def return_prefetch(self, stream: GetStream) -> None:
        """Stop prefetching; prefetched items go back to their places in the queue.

        Only when no prefetch is out, or with ``held`` set: a prefetch still out brings
        items newer than these, which must not reach a user get before them.
        """
        stream.depth = 0
        self.withdraw_slots(stream)
        if stream.ready:
            items, stream.ready = list(stream.ready), collections.deque()
            if stream.state.address is not None:
                self.engine.unget(stream.state.address, stream.state, stream.queue, items)
        self.drained(stream)

    def prefetch_returned(self, stream: GetStream, op: Op) -> bool:
        """Before ``op`` (get_nowait, get_batch, qsize, statistics) sees the queue: return
        prefetched items.

        False if ``op`` was taken care of (served from prefetched items, or held
        until slots in flight are answered and their items returned too).
        """
        if stream.held is not None:
            stream.held.append(op)
            return False
        if op.kind == chan.GET_NOWAIT and stream.ready and not stream.waiting:
            self.resolve(op, stream.ready.popleft())
            self.drained(stream)
            return False
        self.return_prefetch(stream)
        if stream.settling or stream.requested:
            stream.held = [op]
            return False
        return True

    def settled(self, stream: GetStream) -> None:
        if stream.held is None or stream.settling or stream.requested:
            return
        held, stream.held = stream.held, None
        self.return_prefetch(stream)  # what arrived meanwhile goes back first
        # User gets still waiting were made before the held operations: their slots go
        # first (a prefetch that was to serve them may have come back short).
        self.top_up(stream)
        for op in held:
            self.engine.accept(op)

    def idle(self, stream: GetStream) -> None:
        stream.timer = None
        if stream.waiting:
            return  # nothing is prefetched; the next arrival or get arms the timer again
        idle_for = self.loop.time() - stream.last_get
        if idle_for < settings.PREFETCH_IDLE:
            if stream.depth or stream.ready:
                stream.timer = self.loop.call_later(
                    max(settings.PREFETCH_IDLE - idle_for, 0.001), self.idle, stream)
            return
        if stream.requested:
            # A prefetch is still out with items newer than ``ready``'s: returning these
            # now would let those reach the next gets first. Stop prefetching, keep serving
            # gets from what is here, and return everything once the prefetch is answered.
            stream.depth = 0
            stream.timer = self.loop.call_later(settings.PREFETCH_IDLE, self.idle, stream)
            return
        self.return_prefetch(stream)

    def stream_failed(self, stream: GetStream, exc: BaseException) -> None:
        """Its channel is lost (or cannot be resolved): every user get waiting fails."""
        stream.demand.clear()
        stream.requested.clear()
        stream.requested_total = 0
        stream.ready.clear()  # lost with the channel worker, like the items still queued
        stream.settling = 0
        stream.depth = 0
        stream.lent = False  # the channel worker that lent them is gone
        stream.fences.clear()
        waiting, stream.waiting = stream.waiting, collections.deque()
        held, stream.held = stream.held or [], None
        for op in [*waiting, *held]:
            if not op.done():
                op.set_exception(exc)
