"""Which replica of a distributed channel holds each key (`KeyRouter`).

A distributed channel keeps each key on one replica: replica 0, the one authority,
assigns a new key to the replica on the node of the first process that uses it
(``ROUTE``), and every process caches the answers in replica 0's `ChannelState`
(``key_ranks``). An operation on a key this process has not routed yet (or on a channel
not resolved yet) waits in ``unrouted``, in call order with the others on that key, until
the answer comes; then it goes to the replica as any other operation. A plain channel
has one replica, so once it is resolved nothing waits here.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

from aiorl.channels.client_state import ChannelState, Engine, Op
from aiorl.channels.resolution import Resolver
from aiorl.errors import RemoteError
from aiorl.protocol import channels as chan
from aiorl.protocol.channels import QueueKey
from aiorl.runtime import AsyncChannelWork
from aiorl.runtime.promise import link_threads, prepare_threads, settle_from

__all__ = ["Combine", "KeyRouter"]

#: Combines the answers of every replica (in replica order) to a fanned-out operation.
Combine = Callable[[list[ChannelState], list[Any]], Any]


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


class KeyRouter:
    """Routes the operations of one process to the replicas that hold their keys (loop
    thread, except `submit_routed` and `fan_out`)."""

    def __init__(self, engine: Engine, resolver: Resolver) -> None:
        self.engine = engine
        self.resolver = resolver
        self.runtime = engine.runtime
        self.loop = engine.loop
        #: this process's node, which a distributed channel assigns new keys by
        self.node_rank = _process_node_rank()

    # ------------------------------------------------------------------ any thread
    def submit_routed(self, st: ChannelState, kind: int, key: QueueKey, number: Any,
                      payload: Any = 0, frames: Sequence[Any] = ()) -> AsyncChannelWork[Any]:
        """`Engine.submit` an operation on ``key`` of channel ``st`` (replica 0's state)
        whose replica this process does not know yet: the channel is not resolved, or
        it is distributed and ``key`` is new here. The operation waits, in call order
        with the others on ``key``, until the replica is known (`_route`)."""
        op = Op(self.engine, st, kind, key, number, payload, frames)
        work: AsyncChannelWork[Any] = AsyncChannelWork(self.loop, op)
        if self.runtime.on_loop_thread():
            self._route(op)
        else:
            prepare_threads(work)
            self.runtime.submit(self._route_from_thread, op, work)
        return work

    def fan_out(self, st: ChannelState, kind: int, combine: Combine) -> AsyncChannelWork[Any]:
        """``kind`` (``STATS`` or ``FLUSH``) sent to every replica of channel ``st``, once the
        channel is resolved and the routes this process asked for are known (so it comes
        after every earlier operation); the work gives ``combine(replicas, answers)``."""
        work: AsyncChannelWork[Any] = AsyncChannelWork(self.loop)

        async def run() -> Any:
            await self.resolver.ready(st)
            while st.routing:  # operations waiting for their route go out first
                await asyncio.gather(*st.routing.values(), return_exceptions=True)
            replicas = list(st.replicas)
            works = [self.engine.submit(replica, kind, "", 0) for replica in replicas]
            return combine(replicas, [await w for w in works])

        def start() -> None:
            task = self.loop.create_task(run())
            task.add_done_callback(lambda t: settle_from(work, t))

        self.runtime.submit(start)
        return work

    # ------------------------------------------------------------------ loop thread
    def _route_from_thread(self, op: Op, work: AsyncChannelWork[Any]) -> None:
        link_threads(work)
        self._route(op)

    def _route(self, op: Op) -> None:
        """Accept ``op`` at the replica that holds its key, or keep it until that is known."""
        if op.done():  # cancelled before it could leave
            return
        st = op.state
        rank = 0 if st.world_size == 1 else st.key_ranks.get(op.queue)
        if rank is not None:
            op.state = st.replicas[rank]
            self.engine.accept(op)
            return
        waiting = st.unrouted.get(op.queue)
        if waiting is None:
            waiting = st.unrouted[op.queue] = []
        waiting.append(op)
        if st.world_size is None:
            self.resolver.ensure_resolving(st)  # route_waiting routes what waits here
        elif op.queue not in st.routing:
            self._ask_route(st, op.queue)

    def _ask_route(self, st: ChannelState, key: QueueKey) -> None:
        """Ask replica 0, the one authority, which replica holds ``key`` (assigning it)."""
        ask = Op(self.engine, st, chan.ROUTE, key, self.node_rank, 0, ())
        st.routing[key] = ask
        ask.add_done_callback(functools.partial(self._route_failed, st, key))
        self.engine.issue(ask)

    def routed(self, ask: Op, rank: int) -> None:
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
                self.engine.accept(op)
        ask.set_result(rank)

    def _route_failed(self, st: ChannelState, key: QueueKey, ask: Op) -> None:
        if ask.cancelled() or ask.exception() is None:
            return
        if st.routing.get(key) is ask:
            del st.routing[key]
        exc = ask.exception()
        assert exc is not None
        for op in st.unrouted.pop(key, ()):
            if not op.done():
                op.set_exception(exc)

    def route_waiting(self, st: ChannelState) -> None:
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
                    self.engine.accept(op)

    def fail_waiting(self, st: ChannelState, exc: BaseException) -> None:
        """Replica 0 could not be resolved: what waited for its routes fails with ``exc``."""
        unrouted, st.unrouted = st.unrouted, {}
        for ops in unrouted.values():
            for op in ops:
                if not op.done():
                    op.set_exception(exc)
