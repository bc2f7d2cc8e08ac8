"""The client side of the registry: typed requests with timeouts, watches, heartbeats.

One `RegistryClient` per process, on the process's `Endpoint`
(so its loop and thread rules apply). Each registry operation is a method
taking and returning the typed messages of `aiorl.protocol.registry`
(``create_group(spec)``, ``lookup(name) -> WorkerRecord``, ...); refusals
arrive as the registry raised them, by class: [`GroupExistsError`][aiorl.GroupExistsError],
[`GroupNotFoundError`][aiorl.GroupNotFoundError],
[`WorkerNotFoundError`][aiorl.WorkerNotFoundError], [`NodeRankTakenError`][aiorl.NodeRankTakenError]
(all [`RegistryError`][aiorl.RegistryError]), and [`ProtocolError`][aiorl.ProtocolError] for a
request the registry could not parse. Replies are checked as carefully as the registry checks
requests. ``request()`` stays as the untyped, low-level call.

Watches deliver each change of a worker to the callbacks registered for its
name or its group; the client also keeps the last state it saw of every
watched worker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from aiorl.errors import AuthenticationError, PeerLostError, ProtocolError, RegistryUnavailable
from aiorl.names import WorkerInfo
from aiorl.protocol.ops import RegistryEvent, RegistryOp, WorkerState
from aiorl.protocol.registry import (
    NODES_PATTERN,
    DriverInfo,
    DriverRef,
    GroupRecord,
    GroupRef,
    GroupSpec,
    Heartbeat,
    HeartbeatReply,
    Lease,
    NoArgs,
    NodeInfo,
    NodeList,
    NodeRef,
    NodeRegistered,
    NodeRegistration,
    Pong,
    StatusReport,
    WatchRequest,
    WatchSnapshot,
    WireMessage,
    WorkerChanged,
    WorkerExit,
    WorkerRecord,
    WorkerRef,
    WorkerStateReport,
    root_of,
)
from aiorl.registry.framing import unframe
from aiorl.transport.endpoint import Endpoint
from aiorl.transport.pulse import Pulse

__all__ = ["DEFAULT_TIMEOUT", "INCARNATION_VARIABLE", "RegistryClient", "WorkerEvent",
           "own_incarnation"]

log = logging.getLogger("aiorl.registry")

DEFAULT_TIMEOUT = 10.0
#: How long a worker keeps trying to renew its watches after a registry restart.
RESUBSCRIBE_PATIENCE_S = 120.0

#: The launch environment's record of which process of its name a worker is (0, 1, ...).
INCARNATION_VARIABLE = "AIORL_INCARNATION"


def own_incarnation() -> int:
    """This worker process's incarnation: 0 unless its group restarted this rank."""
    try:
        return max(0, int(os.environ.get(INCARNATION_VARIABLE, "0")))
    except ValueError:
        return 0

#: ``callback(name, state, info, detail)``
WorkerEvent = Callable[[str, str, dict[str, Any], dict[str, Any]], None]


def _unwatched(name: str, error: BaseException | None, _reply: Any) -> None:
    if error is not None:  # harmless: news of a name nobody here watches is ignored
        log.debug("unwatching %s: %s", name, error)


class RegistryClient:
    def __init__(self, endpoint: Endpoint, address: str) -> None:
        self.endpoint = endpoint
        self.address = address
        endpoint.verdicts_from = address  # the registry is never taken as gone with itself
        self._watch_callbacks: dict[str, list[WorkerEvent]] = {}
        self._node_callbacks: list[Callable[[list[dict[str, Any]]], None]] = []
        self.known: dict[str, WorkerRecord] = {}  # worker name -> the last record seen
        self._pulse: Pulse | None = None  # the heartbeat thread, once started
        self._beat_interval = 0.0
        self._expiry = 0.0
        #: When heartbeats were answered again after a silence (``time.monotonic()``).
        self._silence_ended = -float("inf")
        self._on_unknown: Callable[[], Any] | None = None
        self._reregister_task: asyncio.Task[None] | None = None
        self._reregistering = False
        self._reregister_pending = False  # the last re-registration failed halfway
        self._beats_failing = False  # error replies to heartbeats since the last answer
        self._silence_told = False  # the warning that the registry is silent, once a silence
        #: When (``time.monotonic()``) the registry last answered a heartbeat: a node agent
        #: fences its workers when this grows older than its lease's expiry.
        self.last_answered = time.monotonic()
        endpoint.on_event(RegistryEvent.WORKER, self._on_worker_event)
        endpoint.on_event(RegistryEvent.NODES, self._on_nodes_event)

    async def request(self, op: str, meta: Any = None, timeout: float = DEFAULT_TIMEOUT) -> Any:
        """Send ``op`` to the registry; returns the reply meta.

        Raises [`RegistryUnavailable`][aiorl.RegistryUnavailable] when no answer comes within
        ``timeout``; error replies raise what the registry raised, by class (the typed methods
        below say which).
        """
        try:
            reply_meta, frames = await self.endpoint.request(self.address, op, meta,
                                                             timeout=timeout)
        except (TimeoutError, PeerLostError, AuthenticationError) as exc:
            raise self._unavailable(op, timeout, exc) from exc
        return unframe(reply_meta, frames)  # a large reply travels as a frame (framing.py)

    def _unavailable(self, op: str, timeout: float, exc: BaseException) -> RegistryUnavailable:
        if isinstance(exc, AuthenticationError):  # whoever answers is not our registry (yet)
            return RegistryUnavailable(
                f"{self.address} refused '{op}': wrong or missing key ({exc})")
        return RegistryUnavailable(  # a CURVE key mismatch looks like silence here
            f"no answer from {self.address} to '{op}' within {timeout:g} s (wrong address, "
            "or a key mismatch: every process needs the registry's key file)")

    # ------------------------------------------------------------------ typed operations
    async def _call(self, op: RegistryOp, request: WireMessage,
                    timeout: float = DEFAULT_TIMEOUT) -> Any:
        return await self.request(op, request.to_wire(), timeout)

    async def register_node(self, registration: NodeRegistration,
                            timeout: float = DEFAULT_TIMEOUT) -> NodeRegistered:
        """Join (or re-join) as a node agent. Raises NodeRankTakenError for a held rank."""
        reply = await self._call(RegistryOp.REGISTER_NODE, registration, timeout)
        return NodeRegistered.from_wire(reply)

    async def unregister_node(self, node_id: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        await self._call(RegistryOp.UNREGISTER_NODE, NodeRef(node_id), timeout)

    async def register_driver(self, driver: DriverInfo,
                              timeout: float = DEFAULT_TIMEOUT) -> Lease:
        return Lease.from_wire(await self._call(RegistryOp.REGISTER_DRIVER, driver, timeout))

    async def unregister_driver(self, driver_id: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        await self._call(RegistryOp.UNREGISTER_DRIVER, DriverRef(driver_id), timeout)

    async def heartbeat(self, my_id: str, timeout: float = DEFAULT_TIMEOUT) -> bool:
        """One heartbeat; False when the registry does not know ``my_id`` (re-register)."""
        reply = await self._call(RegistryOp.HEARTBEAT, Heartbeat(my_id), timeout)
        return HeartbeatReply.from_wire(reply).known

    async def create_group(self, spec: GroupSpec, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Register a group. Raises GroupExistsError if a live group (of another owner, or
        this owner's when not ``spec.restore``) has the name."""
        await self._call(RegistryOp.CREATE_GROUP, spec, timeout)

    async def close_group(self, name: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Tear a group down (its agents kill its workers). Raises GroupNotFoundError."""
        await self._call(RegistryOp.CLOSE_GROUP, GroupRef(name), timeout)

    async def report_state(self, info: WorkerInfo, state: WorkerState,
                           detail: dict[str, Any] | None = None,
                           timeout: float = DEFAULT_TIMEOUT, *,
                           incarnation: int | None = None) -> None:
        """A worker is starting, ready or failed (``detail``: the error, for failed).

        ``incarnation`` defaults to this process's own (`own_incarnation`): a worker
        reports itself; a node agent replaying its workers passes theirs."""
        await self._call(RegistryOp.WORKER_STATE, WorkerStateReport(
            info, state, detail or {},
            own_incarnation() if incarnation is None else incarnation), timeout)

    async def report_exit(self, exit: WorkerExit, timeout: float = DEFAULT_TIMEOUT) -> None:
        """A node agent saw a worker process end."""
        await self._call(RegistryOp.WORKER_EXITED, exit, timeout)

    async def lookup(self, name: str, timeout: float = DEFAULT_TIMEOUT) -> WorkerRecord:
        """The registry's record of worker ``name``. Raises WorkerNotFoundError."""
        return WorkerRecord.from_wire(await self._call(RegistryOp.LOOKUP, WorkerRef(name), timeout))

    async def lookup_group(self, name: str, timeout: float = DEFAULT_TIMEOUT) -> GroupRecord:
        """Group ``name`` and its workers. Raises GroupNotFoundError."""
        reply = await self._call(RegistryOp.LOOKUP_GROUP, GroupRef(name), timeout)
        return GroupRecord.from_wire(reply)

    async def unwatch(self, name: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Stop watching ``name`` (every callback registered for it)."""
        self._watch_callbacks.pop(name, None)
        await self._call(RegistryOp.UNWATCH, WatchRequest(name), timeout)

    def drop_watch(self, name: str, callback: WorkerEvent) -> None:
        """Remove ``callback`` from the watch on ``name`` (loop thread; one not registered is
        ignored). Once no callback is left, the registry is told to stop sending its news:
        sent now, not awaited, so a later `watch` of the name reaches the registry after it."""
        callbacks = self._watch_callbacks.get(name)
        if callbacks is None or callback not in callbacks:
            return
        callbacks.remove(callback)
        if callbacks:
            return
        del self._watch_callbacks[name]
        self.endpoint.request_then(self.address, RegistryOp.UNWATCH, WatchRequest(name).to_wire(),
                                   (), functools.partial(_unwatched, name), DEFAULT_TIMEOUT)

    def watches(self) -> dict[str, int]:
        """How many callbacks watch each name (inspection: what this process subscribed to)."""
        return {name: len(callbacks) for name, callbacks in self._watch_callbacks.items()}

    async def nodes(self, timeout: float = DEFAULT_TIMEOUT) -> tuple[NodeInfo, ...]:
        """The live nodes, by rank."""
        return NodeList.from_wire(await self._call(RegistryOp.NODES, NoArgs(), timeout)).nodes

    async def status(self, timeout: float = DEFAULT_TIMEOUT) -> StatusReport:
        return StatusReport.from_wire(await self._call(RegistryOp.STATUS, NoArgs(), timeout))

    async def ping(self, timeout: float = DEFAULT_TIMEOUT) -> Pong:
        return Pong.from_wire(await self._call(RegistryOp.PING, NoArgs(), timeout))

    # ------------------------------------------------------------------ watches
    async def watch(self, name: str, callback: WorkerEvent) -> dict[str, WorkerRecord]:
        """Subscribe to changes of worker ``name``, group ``name`` or ``"*"``.

        ``callback`` runs for every current member (from the snapshot) and then for
        every change. Returns the snapshot.
        """
        self._watch_callbacks.setdefault(name, []).append(callback)

        def deliver(snapshot: WatchSnapshot) -> None:
            # Always a fresh snapshot (the registry's subscriber set makes re-watching
            # idempotent): the local cache may hold workers of a closed group of this name.
            for stale in [n for n in self.known if (n == name or root_of(n) == name)
                          and n not in snapshot.workers]:
                del self.known[stale]
            self._deliver(snapshot, [callback])

        return dict((await self._snapshot(name, deliver)).workers)

    async def _snapshot(self, name: str, deliver: Callable[[WatchSnapshot], None],
                        timeout: float = DEFAULT_TIMEOUT) -> WatchSnapshot:
        """Watch ``name``; ``deliver(snapshot)`` runs the moment the reply arrives.

        Not after an ``await``: the registry may push an event right after its reply, and
        the event is handled as soon as it is read, before an awaiting coroutine resumes;
        a snapshot delivered then would overwrite newer news with older (a node list one
        node short for ever, a dead worker shown ready). Delivered on arrival, the
        snapshot and the events reach the callbacks in the order the registry sent them.
        """
        fut: asyncio.Future[WatchSnapshot] = self.endpoint.loop.create_future()

        def settle(error: BaseException | None, reply: Any) -> None:
            if fut.done():
                return  # the caller gave up (cancelled)
            if error is None:
                try:
                    snapshot = WatchSnapshot.from_wire(unframe(reply[0], reply[1]))
                    deliver(snapshot)
                except Exception as exc:  # noqa: BLE001 - the watcher's caller gets it
                    error = exc
                else:
                    fut.set_result(snapshot)
                    return
            fut.set_exception(error)

        self.endpoint.request_then(self.address, RegistryOp.WATCH, WatchRequest(name).to_wire(),
                                   (), settle, timeout)
        try:
            return await fut
        except (TimeoutError, PeerLostError, AuthenticationError) as exc:
            raise self._unavailable(RegistryOp.WATCH, timeout, exc) from exc

    def _deliver(self, snapshot: WatchSnapshot, callbacks: list[WorkerEvent]) -> None:
        for wname, record in snapshot.workers.items():
            wire = record.to_wire()
            self.known[wname] = record
            for cb in tuple(callbacks):  # a callback may drop its watch (`drop_watch`)
                cb(wname, record.state, wire["info"], record.detail)

    async def watch_nodes(self, callback: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
        """Call ``callback`` with the live nodes (as wire maps) now and after every change."""
        self._node_callbacks.append(callback)
        snapshot = await self._snapshot(
            NODES_PATTERN, lambda snap: callback([n.to_wire() for n in snap.nodes]))
        return [n.to_wire() for n in snapshot.nodes]

    async def resubscribe(self) -> None:
        """Issue every watch again (the registry restarted and forgot its subscribers).

        Callbacks see the new snapshot; a watched worker that vanished while the
        registry was down is simply absent from it.
        """
        for name, callbacks in list(self._watch_callbacks.items()):
            await self._snapshot(name, functools.partial(self._deliver, callbacks=callbacks))
        if self._node_callbacks:
            await self._snapshot(NODES_PATTERN, self._deliver_nodes)

    async def resubscribe_patiently(self, patience: float = RESUBSCRIBE_PATIENCE_S) -> None:
        """`resubscribe`, tried again every half second while the registry does not
        answer (it may have died again while coming back), for up to ``patience`` seconds.

        For a worker told by its node agent that the registry restarted: nothing else would
        retry, and a worker without its watches never hears of a peer's death, so an
        operation on a dead peer would wait for ever. (A driver or agent re-subscribes from
        its heartbeat loop instead, which retries on the next beat.)"""
        deadline = self.endpoint.loop.time() + patience
        while True:
            try:
                await self.resubscribe()
                return
            except RegistryUnavailable as exc:
                if self.endpoint.loop.time() >= deadline:
                    log.error("could not renew this process's watches: %s", exc)
                    return
                await asyncio.sleep(0.5)

    def _deliver_nodes(self, snapshot: WatchSnapshot) -> None:
        nodes = [n.to_wire() for n in snapshot.nodes]
        for cb in self._node_callbacks:
            cb(nodes)

    def _on_worker_event(self, _peer: str, meta: Any, _frames: list[Any]) -> None:
        try:
            record = WorkerChanged.from_wire(meta).record
        except ProtocolError as exc:
            log.warning("ignored a malformed worker event from the registry: %s", exc)
            return
        name = record.name
        wire = record.to_wire()
        self.known[name] = record
        targets = self._watch_callbacks.get(name, []) + self._watch_callbacks.get(root_of(name), [])
        targets += self._watch_callbacks.get("*", [])
        for cb in targets:
            try:
                cb(name, record.state, wire["info"], record.detail)
            except Exception:
                log.exception("worker watch callback failed for %s", name)

    def _on_nodes_event(self, _peer: str, meta: Any, _frames: list[Any]) -> None:
        try:
            nodes = [n.to_wire() for n in NodeList.from_wire(meta).nodes]
        except ProtocolError as exc:
            log.warning("ignored a malformed nodes event from the registry: %s", exc)
            return
        for cb in self._node_callbacks:
            try:
                cb(nodes)
            except Exception:
                log.exception("node watch callback failed")

    # ------------------------------------------------------------------ heartbeats
    def start_heartbeats(
        self, my_id: str, interval: float, on_unknown: Callable[[], Any] | None = None,
        expiry: float = 0.0,
    ) -> None:
        """Send heartbeats for ``my_id`` every ``interval`` seconds from a thread of their own
        (`Pulse`): a loop busy with user work (a slow import
        while decoding a result, a huge result) does not stop them. When the registry no
        longer knows us (it restarted, or it declared us dead), ``on_unknown`` (a coroutine
        function) runs on the loop, so the caller can register again; one that failed halfway
        runs again after each later beat until it succeeds (the registry may know us by then
        while our watches are still missing). ``expiry`` is the lease's (`verdicts_late`)."""
        self._on_unknown = on_unknown
        self._beat_interval = interval
        self._expiry = expiry
        self._pulse = Pulse(self.endpoint.name, self.address, self.endpoint.keys,
                            RegistryOp.HEARTBEAT, Heartbeat(my_id).to_wire(), interval,
                            self._beat_answered, self._beat_refused, self._beat_due)
        self._pulse.start()

    def verdicts_late(self) -> bool:
        """Whether the registry may be late to declare a dead peer: it has not answered a
        heartbeat for two intervals (a second at least: it is down, restarting or cut off),
        or it answered again less than two expiries ago (a restarted registry declares dead,
        after two expiries, the workers nobody reports again). A process without heartbeats
        (a worker: its agent beats for it) judges by its connection to the registry
        instead: down (the registry's process ended, or its machine went) is late; up (it
        may be slow) is not."""
        if self._pulse is None:
            return self.endpoint.link_down_for(self.address) > 0.0
        now = time.monotonic()
        silence = max(2 * self._beat_interval, 1.0)
        return (now - self.last_answered > silence
                or now - self._silence_ended < 2 * self._expiry + silence)

    def answering(self) -> bool:
        """Whether the registry seems to be there: our connection to it is not down (a
        registry whose process ended drops it at once), and it answered a heartbeat within
        the last two intervals (a second at least; not asked in a process without
        heartbeats). A driver closing asks nothing of a registry that is not (its expiry
        cleans up after the driver, should it come back)."""
        if self.endpoint.link_down_for(self.address) > 0.0:
            return False
        if self._pulse is None:
            return True
        return time.monotonic() - self.last_answered <= max(2 * self._beat_interval, 1.0)

    def _beat_due(self) -> None:
        """A heartbeat is due (on the pulse thread): warn once per silence of two expiries
        (two intervals' worth of beats, a second at least, without a lease's expiry)."""
        silent_for = time.monotonic() - self.last_answered
        limit = 2 * self._expiry if self._expiry > 0 else max(2 * self._beat_interval, 1.0)
        if silent_for > limit and not self._silence_told:
            self._silence_told = True
            log.warning("the registry at %s has answered no heartbeat for %.0f s (two of its "
                        "expiries): it is down or cut off (a lost head node?); calls to a "
                        "worker that accepts no connection fail with PeerLostError, and no "
                        "new group can launch until it answers again", self.address,
                        silent_for)

    def _beat_answered(self, meta: Any) -> None:
        """A heartbeat's reply (on the pulse thread)."""
        try:
            known = HeartbeatReply.from_wire(meta).known
        except ProtocolError:
            return
        now = time.monotonic()
        if now - self.last_answered > max(2 * self._beat_interval, 1.0):
            self._silence_ended = now
        self.last_answered = now
        self._beats_failing = False
        self._silence_told = False
        if (not known or self._reregister_pending) and self._on_unknown is not None:
            self.endpoint.loop.call_soon_threadsafe(self._reregister)

    def _beat_refused(self, meta: Any) -> None:
        """A heartbeat's error reply (on the pulse thread): one warning per run of them."""
        if not self._beats_failing:
            text = meta.get("message") if isinstance(meta, dict) else None
            log.warning("heartbeat to %s failed: %s; still trying", self.address,
                        str(text or meta).splitlines()[0] if (text or meta) else "an error")
        self._beats_failing = True

    def _reregister(self) -> None:
        """On the loop: run ``on_unknown`` once at a time."""
        if self._reregistering or self._on_unknown is None or self.endpoint.closed:
            return
        self._reregistering = True
        on_unknown = self._on_unknown

        async def once() -> None:
            try:
                await on_unknown()
                self._reregister_pending = False
            except Exception as exc:  # noqa: BLE001 - tried again after the next beat
                self._reregister_pending = True
                log.warning("re-registering with the registry failed (%s: %s); trying again",
                            type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            finally:
                self._reregistering = False

        self._reregister_task = self.endpoint.loop.create_task(once())

    def close(self) -> None:
        if self._pulse is not None:
            self._pulse.stop()
        if self._reregister_task is not None:
            self._reregister_task.cancel()
