"""What every process that publishes or subscribes holds once: :class:`WeightsService`.

It finds (or launches) the directory of a weight name, runs publish and pull coroutines on
the runtime loop as :class:`~aiorl.AsyncWork`\\ s, owns the one thread that copies bulk
bytes (so the event loop keeps serving calls and heartbeats during a 1 GB copy), and serves
``weights.fetch``: a relay on another node asking this publisher for one bucket of a
version.

Why relays fetch with a request of their own rather than P2P ``send``/``recv``: P2P
matches messages to receives first-in first-out per worker pair, so weight buckets on that
pair would be matched by whatever ``recv`` the relay's user code posts toward the same
trainer. A fetch is a worker-to-worker request on the same endpoint connection P2P uses,
answered with the bucket as ~1 MiB frames, and the answer says whether the slot stayed
intact while it was copied (the seqlock check, done where the slot is).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np

from aiorl.errors import GroupExistsError, GroupNotFoundError
from aiorl.group import WorkerGroupBuilder
from aiorl.names import WorkerInfo
from aiorl.placement import NodePlacementStrategy
from aiorl.runtime import AsyncWork, Runtime, WorkerSession
from aiorl.runtime.promise import link_threads, prepare_threads, settle_from
from aiorl.transport.endpoint import Incoming
from aiorl.weights._directory import WeightDirectory, directory_group
from aiorl.weights._segment import VersionedSegment, read_slot

__all__ = ["CHUNK", "OP_FETCH", "WeightsService", "weights_service"]

T = TypeVar("T")

#: A relay's request for one bucket of one version of a shard.
OP_FETCH = "weights.fetch"
#: Frame size of a fetched bucket: one huge ZMQ frame costs page faults (PERF-NOTES.md).
CHUNK = 1 << 20
#: How long the directory may hold a subscriber's poll before answering unchanged.
POLL_S = 10.0
#: How long to wait for a launched directory to be ready.
CONNECT_TIMEOUT_S = 60.0


class WeightsService:
    """Per-process weights machinery (one per runtime; see :func:`weights_service`)."""

    def __init__(self, runtime: Runtime, info: WorkerInfo) -> None:
        self.runtime = runtime
        self.loop = runtime.loop
        self.info = info
        self.worker = info.name
        self.node_id = info.node_id or info.node_ip
        self.copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aiorl-weights")
        #: Segments this process publishes, by (weight name, shard): what fetches read.
        self.segments: dict[tuple[str, int], VersionedSegment] = {}
        #: The publishers and subscribers made here, by key (the factories' cache).
        self.handles: dict[Any, Any] = {}
        self._directories: dict[str, asyncio.Future[str]] = {}
        self._closers: list[Callable[[], None]] = []
        runtime.submit(runtime.endpoint.handle, OP_FETCH, self._on_fetch)
        runtime.on_close(self.close)

    # ------------------------------------------------------------------ running
    def run(self, coro: Coroutine[Any, Any, T]) -> AsyncWork[T]:
        """Run ``coro`` as a task on the loop; its outcome completes the returned work."""
        work: AsyncWork[T] = AsyncWork(self.loop)
        if self.runtime.on_loop_thread():
            settle_on_done(work, self.loop.create_task(coro))
            return work
        prepare_threads(work)

        def start() -> None:
            link_threads(work)
            settle_on_done(work, self.loop.create_task(coro))

        self.runtime.submit(start)
        return work

    async def copy(self, fn: Callable[[], T]) -> T:
        """Run the bulk copy ``fn`` on the copier thread (the loop stays responsive)."""
        return await self.loop.run_in_executor(self.copier, fn)

    def on_close(self, closer: Callable[[], None]) -> None:
        self._closers.append(closer)

    # ------------------------------------------------------------------ directory
    async def directory(self, name: str) -> str:
        """The worker name of weight ``name``'s directory, launched here if none exists."""
        fut = self._directories.get(name)
        if fut is None:
            fut = self._directories[name] = self.loop.create_future()
            try:
                fut.set_result(await self._connect(name))
            except BaseException as exc:
                del self._directories[name]
                fut.set_exception(exc)
                fut.exception()
                raise
        return await asyncio.shield(fut)

    async def _connect(self, name: str) -> str:
        group = directory_group(name)
        try:
            await self.runtime.registry.lookup_group(group)
        except GroupNotFoundError:
            session = WorkerSession.current()
            await session.refresh()
            builder = WorkerGroupBuilder(WeightDirectory, (name,), {})
            try:
                await builder.launch_async(
                    session, NodePlacementStrategy([int(self.info.node_rank)]), group)
            except GroupExistsError:
                pass  # another process of the cluster launched it first
        worker = f"{group}:0"
        await self.runtime.resolve_worker(worker, CONNECT_TIMEOUT_S, wait_for_group=True)
        return worker

    async def call_directory(self, name: str, method: str, *args: Any) -> Any:
        return await self.runtime.call_worker(await self.directory(name), method, *args)

    # ------------------------------------------------------------------ serving relays
    def _on_fetch(self, msg: Incoming) -> None:
        name, shard, version, start, end = msg.meta
        segment = self.segments.get((name, shard))
        slot = None if segment is None else segment.slot_of(version)
        if segment is None or slot is None:
            msg.reply(False)  # that version is no longer (or not yet) here
            return
        self.loop.create_task(self._answer_fetch(msg, segment, slot, version, start, end))

    async def _answer_fetch(self, msg: Incoming, segment: VersionedSegment, slot: int,
                            version: int, start: int, end: int) -> None:
        """Reply with a private copy of the bucket, taken under the slot's seqlock (so the
        answer says whether it is intact), as :data:`CHUNK`-sized frames."""
        copy = np.empty(end - start, dtype=np.uint8)

        def take() -> bool:
            return read_slot(segment.header, slot, version,
                             lambda: np.copyto(copy, segment.slot(slot)[start:end]))

        try:
            intact = await self.copy(take)
        except Exception as exc:  # e.g. the segment closed under us: the relay must hear
            msg.reply_error(exc)
            return
        if not intact:
            msg.reply(False)
            return
        msg.reply(True, [copy[i : i + CHUNK].data for i in range(0, len(copy), CHUNK)])

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        for closer in reversed(self._closers):
            closer()
        self._closers.clear()
        for segment in self.segments.values():
            segment.close()
        self.segments.clear()
        self.copier.shutdown(wait=False)


def settle_on_done(work: AsyncWork[T], task: asyncio.Future[T]) -> None:
    task.add_done_callback(lambda t: settle_from(work, t))




def weights_service(runtime: Runtime, info: WorkerInfo) -> WeightsService:
    """The weights service of this worker's runtime, created once."""
    return runtime.service(WeightsService, lambda: WeightsService(runtime, info))
