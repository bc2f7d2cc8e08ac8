"""What every process that publishes or subscribes holds once: `WeightsService`.

It finds (or launches) the directory of a weight name, runs publish and pull coroutines on
the runtime loop as [`AsyncWork`][aiorl.AsyncWork]\\ s, owns the one thread that copies bulk
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
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from aiorl.errors import (
    GroupExistsError,
    GroupNotFoundError,
    PeerLostError,
    ProtocolError,
    RegistryUnavailable,
    WaitTimeout,
)
from aiorl.group import WorkerGroup, WorkerGroupBuilder
from aiorl.names import WorkerInfo
from aiorl.placement import NodePlacementStrategy
from aiorl.protocol.ops import WeightsOp, WorkerState
from aiorl.protocol.weights import SCHEMA, DirectoryRequest, FetchBucket, HostNotice
from aiorl.runtime import AsyncWork, Runtime, Session, WorkerSession
from aiorl.runtime.promise import link_threads, prepare_threads, settle_from
from aiorl.transport.endpoint import Incoming
from aiorl.util.threads import RuntimeThreadPool
from aiorl.weights.directory import WeightDirectory, directory_group
from aiorl.weights.segment import VersionedSegment, read_slot

__all__ = ["CHUNK", "DirectoryCall", "DirectoryLink", "WeightsService", "host_directory",
           "launch_directory", "weights_service"]

T = TypeVar("T")

log = logging.getLogger("aiorl.weights")

#: Frame size of a fetched bucket, as for P2P's bulk frames: one huge ZMQ frame is a fresh
#: allocation at each end, paid in page faults, where 1 MiB frames reuse memory.
CHUNK = 1 << 20
#: How long the directory may hold a subscriber's poll before answering unchanged.
POLL_S = 10.0
#: How long to wait for a launched directory to be ready.
CONNECT_TIMEOUT_S = 60.0
#: How long a directory call waits for a dead directory to be restarted before it fails.
DIRECTORY_RESTART_S = 60.0
#: Pause between two tries of a directory call while the directory restarts.
RETRY_S = 0.1
#: How long a directory call may go unanswered (beyond a poll's own wait) before this
#: process suspects it missed the directory's death: it renews its registry watches (a
#: registry restart may have lost them) and tries again.
ANSWER_S = 10.0
#: Restarts of one directory before its supervisor gives up (it is soft state: a restart
#: costs its clients a few messages, so only a directory that cannot start stops it).
DIRECTORY_MAX_RESTARTS = 10_000
#: Seconds before a directory's restart (doubling while restarts fail in a row).
DIRECTORY_BACKOFF_S = 0.1

#: ``call(request)``: sends one directory request and returns its typed reply.
DirectoryCall = Callable[[DirectoryRequest], Awaitable[Any]]
#: ``restore(call)``: tells a new directory incarnation what this process holds.
Restorer = Callable[[DirectoryCall], Awaitable[None]]


@dataclass(eq=False)
class DirectoryLink:
    """What this process knows of one weight name's directory: its worker name, the
    endpoint of the incarnation that has this process's state (None before the first
    call), the restorers that tell a new one, and the restore under way."""

    name: str
    worker: str
    endpoint: str | None = None
    restorers: list[Restorer] = field(default_factory=list)
    restoring: tuple[str, asyncio.Task[None]] | None = None


#: The supervision of every directory: a killed directory comes back under the same name,
#: empty, and its clients restore it (:meth:`WeightsService.on_directory_restart`).
DIRECTORY_SUPERVISION: dict[str, Any] = {
    "restart": "on_failure", "max_restarts": DIRECTORY_MAX_RESTARTS,
    "backoff": DIRECTORY_BACKOFF_S}


def host_directory(session: Session, name: str, node_rank: int = 0) -> WorkerGroup[Any]:
    """Launch weight ``name``'s directory from the driver, before any publisher or
    subscriber would launch it on demand (blocking; the driver's thread).

    The process that launches a directory supervises it: one launched on demand by a
    worker is no longer restarted once that worker is gone. Launched by the driver, it is
    restarted for as long as the job runs. Returns its one-rank group (``events()`` shows
    its restarts). Raises [`GroupExistsError`][aiorl.GroupExistsError] if the directory exists.
    """
    return WorkerGroupBuilder(WeightDirectory, (name,), {}).launch(
        session, NodePlacementStrategy([node_rank]), directory_group(name),
        **DIRECTORY_SUPERVISION)


async def launch_directory(session: Session, name: str, node_rank: int) -> WorkerGroup[Any]:
    """`host_directory` for code on the runtime loop (a first publisher or
    subscriber): the directory is supervised by this process."""
    return await WorkerGroupBuilder(WeightDirectory, (name,), {}).launch_async(
        session, NodePlacementStrategy([node_rank]), directory_group(name),
        **DIRECTORY_SUPERVISION)


class WeightsService:
    """Per-process weights machinery (one per runtime; see `weights_service`)."""

    def __init__(self, runtime: Runtime, info: WorkerInfo) -> None:
        self.runtime = runtime
        self.loop = runtime.loop
        self.info = info
        self.worker = info.name
        self.node_id = info.node_id or info.node_ip
        self.copier = RuntimeThreadPool(1, thread_name_prefix="aiorl-weights")
        #: Segments this process publishes, by (weight name, shard): what fetches read.
        self.segments: dict[tuple[str, int], VersionedSegment] = {}
        #: The GPU publishers here, by (weight name, shard): told whether host readers exist.
        self.host_handlers: dict[tuple[str, int], Callable[[bool, str, int], None]] = {}
        #: The publishers and subscribers made here, by key (the factories' cache).
        self.handles: dict[Any, Any] = {}
        self._directories: dict[str, asyncio.Future[DirectoryLink]] = {}
        self._closers: list[Callable[[], None]] = []
        self._renewing: asyncio.Task[None] | None = None
        runtime.submit(runtime.endpoint.handle, WeightsOp.FETCH, self._on_fetch)
        runtime.submit(runtime.endpoint.handle, WeightsOp.HOST, self._on_host)
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
    async def directory(self, name: str) -> DirectoryLink:
        """This process's link to weight ``name``'s directory, launched here if none exists."""
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

    async def _connect(self, name: str) -> DirectoryLink:
        group = directory_group(name)
        try:
            await self.runtime.registry.lookup_group(group)
        except GroupNotFoundError:
            session = WorkerSession.current()
            await session.refresh()
            try:
                await launch_directory(session, name, int(self.info.node_rank))
            except GroupExistsError:
                pass  # another process of the cluster launched it first
        link = DirectoryLink(name, f"{group}:0")
        # Hear of a new incarnation even while this process has nothing to tell it, so that
        # what it publishes or relays is listed again without waiting for its next publish.
        # (Readiness is awaited by each call, which also waits for a directory restarting.)
        try:
            await self.runtime.registry.watch(
                link.worker, lambda _name, state, info, _detail: self._on_directory_event(
                    link, state, info))
        except RegistryUnavailable as exc:  # kept: renewed with this process's other watches
            log.info("%s: weights %r: directory watch not yet registered: %r", self.worker,
                     name, exc)
        return link

    async def on_directory_restart(self, name: str, restore: Restorer) -> None:
        """Run ``restore(call)`` whenever weight ``name``'s directory has a new incarnation,
        before anything else of this process reaches it: the directory is soft state, and
        ``restore`` tells it again what this process holds (``call(request)`` sends one
        request to the directory and returns its reply)."""
        (await self.directory(name)).restorers.append(restore)

    async def call_directory(self, name: str, request: DirectoryRequest, *,
                             patience: float | None = None, wait_s: float = 0.0) -> Any:
        """Send ``request`` to weight ``name``'s directory and return its typed reply (the
        reply type `aiorl.protocol.weights.SCHEMA` pairs with the request's op).

        A directory that restarted gets this process's state back first (the restorers).
        While it is down (dead, or restarting under its ``restart="on_failure"`` policy)
        the call is tried again for up to ``patience`` seconds (default
        `DIRECTORY_RESTART_S`), then fails with
        [`PeerLostError`][aiorl.PeerLostError]. A call unanswered `ANSWER_S` seconds after
        the ``wait_s`` the directory may take (a poll's) counts as a failure too: the
        death of a directory whose node died while the registry was restarting may never
        reach this process's old watches, so they are renewed. Every directory method can
        be sent again safely: each states a fact (a source, a slot) or asks a question.
        """
        link = await self.directory(name)
        deadline = self.loop.time() + CONNECT_TIMEOUT_S  # until a first failure
        failing_since: float | None = None
        while True:
            try:
                await self._restored(link, deadline)
                return await self._send(link, request, wait_s + ANSWER_S)
            except (PeerLostError, WaitTimeout, TimeoutError) as exc:
                if not isinstance(exc, (PeerLostError, WaitTimeout)):  # unanswered
                    await self._renew_watches()
                now = self.loop.time()
                if failing_since is None:  # patience counts from the directory's death
                    failing_since = now
                    deadline = now + (DIRECTORY_RESTART_S if patience is None else patience)
                if now >= deadline:
                    raise PeerLostError(
                        f"the directory of weights {name!r} ({link.worker}) is gone and did "
                        f"not come back within {now - failing_since:.3g} s: {exc}") from exc
                await asyncio.sleep(RETRY_S)

    async def _send(self, link: DirectoryLink, request: DirectoryRequest, timeout: float) -> Any:
        """One try of ``request``: the directory method its op names, given its wire form;
        the answer read back as the op's reply type (ProtocolError if it is not one)."""
        answer = await asyncio.wait_for(
            self.runtime.call_worker(link.worker, request.op, request.to_wire()), timeout)
        return SCHEMA[request.op][1].from_wire(answer)

    async def _restored(self, link: DirectoryLink, deadline: float) -> None:
        """Wait (until ``deadline``) for the directory to be ready; if it is an incarnation
        this process's state has not reached, run the restorers first (once, shared by
        concurrent callers)."""
        info = await self.runtime.resolve_worker(
            link.worker, max(deadline - self.loop.time(), RETRY_S), wait_for_group=True)
        endpoint = str(info["endpoint"])
        if endpoint == link.endpoint:
            return
        if link.restoring is None or link.restoring[0] != endpoint:
            task = self.loop.create_task(self._restore(link, endpoint))
            link.restoring = (endpoint, task)
        await asyncio.shield(link.restoring[1])

    async def _restore(self, link: DirectoryLink, endpoint: str) -> None:
        try:
            if link.endpoint is not None:
                log.info("%s: the directory of weights %r restarted; telling it what this "
                         "process holds", self.worker, link.name)

            async def call(request: DirectoryRequest) -> Any:
                return await self._send(link, request, ANSWER_S)

            for restore in list(link.restorers):
                try:
                    await restore(call)
                except (PeerLostError, TimeoutError):
                    raise  # gone again: the next call restores the next incarnation
                except Exception as exc:  # e.g. another publisher took the shard meanwhile
                    log.warning("%s: weights %r: could not restore the directory: %r",
                                self.worker, link.name, exc)
            link.endpoint = endpoint
        finally:
            if link.restoring is not None and link.restoring[0] == endpoint:
                link.restoring = None

    async def _renew_watches(self) -> None:
        """Issue this process's registry watches again (one renewal at a time), so that the
        snapshot tells the runtime of a directory death or replacement it missed."""
        if self._renewing is None or self._renewing.done():
            self._renewing = self.loop.create_task(self.runtime.registry.resubscribe())
        try:
            await asyncio.shield(self._renewing)
        except (RegistryUnavailable, TimeoutError) as exc:  # the registry is down: tried again
            log.info("%s: registry watches not renewed: %r", self.worker, exc)

    def _on_directory_event(self, link: DirectoryLink, state: str, info: dict[str, Any]) -> None:
        endpoint = info.get("endpoint")
        if state != WorkerState.READY or not endpoint or endpoint == link.endpoint or not link.restorers:
            return

        async def restore_now() -> None:
            try:
                await self._restored(link, self.loop.time() + DIRECTORY_RESTART_S)
            except Exception as exc:  # the next directory call tries again
                log.info("%s: weights %r not restored to the new directory yet: %r",
                         self.worker, link.name, exc)

        self.loop.create_task(restore_now())

    # ------------------------------------------------------------------ serving relays
    def _on_host(self, msg: Incoming) -> None:
        try:
            notice = HostNotice.from_wire(msg.meta)
        except ProtocolError as exc:  # one-way: nobody to answer, so say it here
            log.warning("%s: a malformed %s message: %s", self.worker, WeightsOp.HOST, exc)
            return
        handler = self.host_handlers.get((notice.name, notice.shard))
        if handler is not None:
            handler(notice.host.wanted, notice.host.incarnation, notice.host.counter)

    def _on_fetch(self, msg: Incoming) -> None:
        try:
            fetch = FetchBucket.from_wire(msg.meta)
        except ProtocolError as exc:
            msg.reply_error(exc)
            return
        name, shard, version, start, end = (fetch.name, fetch.shard, fetch.version, fetch.start,
                                            fetch.end)
        segment = self.segments.get((name, shard))
        # Only host bytes can be sent: a version on the GPU only is not here for a relay
        # (the directory asks for host copies while a relay exists, so one follows).
        slot = None if segment is None else segment.host_slot_of(version)
        if segment is None or slot is None:
            msg.reply(False)  # that version is no longer (or not yet) here
            return
        self.loop.create_task(self._answer_fetch(msg, segment, slot, version, start, end))

    async def _answer_fetch(self, msg: Incoming, segment: VersionedSegment, slot: int,
                            version: int, start: int, end: int) -> None:
        """Reply with a private copy of the bucket, taken under the slot's seqlock (so the
        answer says whether it is intact), as `CHUNK`-sized frames."""
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
        self.host_handlers.clear()
        self.copier.shutdown(wait=False)


def settle_on_done(work: AsyncWork[T], task: asyncio.Future[T]) -> None:
    task.add_done_callback(lambda t: settle_from(work, t))




def weights_service(runtime: Runtime, info: WorkerInfo) -> WeightsService:
    """The weights service of this worker's runtime, created once."""
    return runtime.service(WeightsService, runtime, info)
