"""Finding a channel's workers by name, and launching them (`Resolver`).

A channel is reached by name: this process asks the registry for the worker that hosts
each replica (``channel.<name>:<rank>``) and, until it is known, keeps the operations for
it in the replica's ``backlog``. `Resolver` runs one resolution at a time per replica (or
the creation of the channel, which ends in one), records the worker's address, learns how
many replicas the channel has (from replica 0) and then hands the replica back to the
engine (`Engine.release`), which sends what waited in call order; a resolution that fails
fails what waited (`Engine.abandon`).

Resolving also makes this runtime watch the channel worker, so that the endpoint marks it
lost when it dies and the engine fails what is pending on it (the engine's docstring,
Failure).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from aiorl.channels.client_state import ChannelState, Engine
from aiorl.channels.host import ChannelHost
from aiorl.errors import (
    GroupExistsError,
    GroupNotFoundError,
    NotFoundError,
    PeerLostError,
    WorkerInitError,
)
from aiorl.group import WorkerGroupBuilder
from aiorl.placement import NodePlacementStrategy
from aiorl.protocol.ops import WorkerState
from aiorl.runtime import AsyncChannelWork, Session, WorkerSession
from aiorl.runtime.promise import reject, resolve

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "NodeChoice", "Resolver", "warn_exists"]

log = logging.getLogger("aiorl.channels")

#: How long connecting waits for a channel to exist and be ready, by default.
DEFAULT_CONNECT_TIMEOUT = 60.0

#: Gives the node ranks of a new channel's workers, one per replica, for a session.
NodeChoice = Callable[[Session], Coroutine[Any, Any, list[int]]]


def warn_exists(name: str) -> None:
    log.warning("channel %r already exists; connecting to it (its maxsize and replicas stay "
                "as they are)", name)


class Resolver:
    """Resolves (and creates) the channel workers of one process (loop thread, except
    `ready`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.runtime = engine.runtime
        self.loop = engine.loop

    def ensure_resolving(self, st: ChannelState) -> None:
        if st.address is None and st.task is None:
            self.start(st, self.connect(st, DEFAULT_CONNECT_TIMEOUT))

    def start(self, st: ChannelState, coro: Coroutine[Any, Any, dict[str, Any]]) -> None:
        """Run ``coro`` (`connect` or `create`) as the resolution of ``st`` that counts."""
        task = self.loop.create_task(coro)
        st.task = task
        task.add_done_callback(functools.partial(self._resolved, st))

    def _resolved(self, st: ChannelState, task: asyncio.Task[dict[str, Any]]) -> None:
        exc = task.exception() if not task.cancelled() else PeerLostError("resolution cancelled")
        if exc is None:
            if st.address is None:
                info = task.result()
                st.address = str(info["endpoint"])
                st.node_rank = int(info["node_rank"])
                self.engine.by_address[st.address] = st
                if st.rank == 0:
                    self._learn_replicas(st, int(info["group_world_size"]))
            if st.task is task:
                st.task = None
            self.engine.release(st)
            waiters, st.ready_waiters = st.ready_waiters, []
            for w in waiters:
                resolve(w, None)
            return
        if st.task is not task or st.address is not None:
            return  # a newer attempt decides (or another attempt already succeeded)
        st.task = None
        self.engine.abandon(st, exc)
        waiters, st.ready_waiters = st.ready_waiters, []
        for w in waiters:
            reject(w, exc)

    def _learn_replicas(self, st: ChannelState, world_size: int) -> None:
        """Replica 0 of channel ``st`` says the channel has ``world_size`` replicas."""
        if len(st.replicas) != world_size:
            st.replicas = [st] + [self.engine.state(st.name, r) for r in range(1, world_size)]
        st.world_size = world_size

    def ready(self, st: ChannelState) -> AsyncChannelWork[None]:
        """A work done once ``st`` is resolved (starting a connect if nothing is under way)."""
        work: AsyncChannelWork[None] = AsyncChannelWork(self.loop)

        def check() -> None:
            if st.address is not None:
                resolve(work, None)
                return
            st.ready_waiters.append(work)
            self.ensure_resolving(st)

        self.runtime.submit(check)
        return work

    async def connect(self, st: ChannelState, timeout: float,
                      launched: bool = False) -> dict[str, Any]:
        """The registry's info on the channel worker of ``st`` once it is ready."""
        name = st.worker
        try:
            # Also makes this runtime watch the channel worker: when it dies, the endpoint
            # marks it lost and the engine fails what waits on it.
            info = await self.runtime.resolve_worker(name, timeout, wait_for_group=True)
        except PeerLostError:
            # This process may remember an earlier channel worker of this name that died
            # (the channel was destroyed and created again): ask the registry, which knows
            # the newest one; after our own launch, wait for it.
            newest = await self._lookup_ready(name, timeout if launched else 0.0)
            if newest is None or self.runtime.endpoint.is_lost(str(newest["endpoint"])):
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

    async def create(self, st: ChannelState, session: Session, maxsize: int,
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
            warn_exists(st.name)
        return await self.connect(st, timeout, launched)

    async def _group_exists(self, group: str) -> bool:
        try:
            await self.runtime.registry.lookup_group(group)
        except GroupNotFoundError:
            return False
        return True
