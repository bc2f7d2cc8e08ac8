"""The per-process runtime: one event loop, one endpoint, one registry client.

A worker process runs its runtime on its main thread (the loop that also runs
the worker's ``async def`` methods). A driver runs it on a private I/O thread,
so that synchronous user code can block in ``wait()`` while the loop keeps
serving heartbeats, events and replies.

The runtime also turns registry news into failures: when a watched worker is
reported dead, every pending request to it fails with
[`PeerLostError`][aiorl.PeerLostError] (see ``docs/failures.md``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aiorl.errors import (
    ClusterClosedError,
    GroupNotFoundError,
    PeerLostError,
    WaitTimeout,
    WorkerNotFoundError,
)
from aiorl.names import WorkerAddress
from aiorl.protocol.ops import WorkerOp
from aiorl.registry.client import RegistryClient
from aiorl.runtime.loop import LoopThread
from aiorl.runtime.waiter import BlockingWaiter
from aiorl.trace import recorder as _trace
from aiorl.transport.endpoint import Endpoint

__all__ = ["Runtime", "current_runtime", "set_current_runtime"]

log = logging.getLogger("aiorl.runtime")
T = TypeVar("T")
#: How long a failed resolution waits for the registry to confirm it (`_after_registry_barrier`).
_BARRIER_TIMEOUT_S = 1.0
_S = TypeVar("_S")

_current: Runtime | None = None


def current_runtime() -> Runtime | None:
    """The runtime of this process (a worker's, or the newest driver Cluster's)."""
    return _current


def set_current_runtime(runtime: Runtime | None) -> None:
    global _current
    _current = runtime


class Runtime:
    """One process's loop thread, endpoint, registry client and peer watches."""

    def __init__(self, loop_thread: LoopThread, endpoint: Endpoint, registry: RegistryClient,
                 name: str) -> None:
        self.loop_thread = loop_thread
        self.loop = loop_thread.loop
        self.endpoint = endpoint
        self.registry = registry
        # Verdicts on dead peers come from the registry: while it does not answer, a call on
        # a broken connection waits for one instead of failing without saying how it died.
        endpoint.verdict_hold = registry.verdicts_late
        # A peer is taken as gone only while the registry is silent now: one that answers
        # again (restarted) gives its verdicts on the peers nobody reports.
        endpoint.verdicts_silent = lambda: not registry.answering()
        self.name = name
        self._peer_watch: dict[str, asyncio.Future[dict[str, Any]]] = {}  # name -> info when ready
        self._peer_address: dict[str, str] = {}
        self._closers: list[Callable[[], None]] = []
        #: Why this runtime stopped (None while it runs): what closers tell pending work.
        self.closed_reason: str | None = None
        #: One instance per service class built on this runtime (the P2P engine, ...), made
        #: through :meth:`service`; services close through ``on_close``.
        self.services: dict[type, object] = {}
        self._services_lock = threading.Lock()
        #: The waiter thread for completions only polling can observe (started on first use).
        self.waiter = BlockingWaiter(f"aiorl-waiter-{name}")
        # Bound once: these are on every call's path.
        self.on_loop_thread = loop_thread.on_loop
        self.submit = loop_thread.submit

    def service(self, kind: type[_S], *args: Any) -> _S:
        """This runtime's one ``kind`` service (P2P engine, broadcaster, weights), made by
        ``kind(*args)`` on first use; safe from any thread (two first callers get one service).

        Every send and receive looks its engine up here: the arguments are passed, not
        captured in a closure, so a look-up allocates nothing.
        """
        svc = self.services.get(kind)
        if svc is None:
            with self._services_lock:
                svc = self.services.get(kind)
                if svc is None:
                    svc = self.services[kind] = kind(*args)
        return svc  # type: ignore[return-value]  # stored under its own type

    # ------------------------------------------------------------------ construction
    @classmethod
    def start_in_thread(
        cls, registry_address: str, name: str, host: str = "127.0.0.1", keys: Any = None
    ) -> Runtime:
        """Start a runtime on a new daemon I/O thread (the driver's)."""

        def setup(lt: LoopThread) -> Runtime:
            endpoint = Endpoint(name, host=host, loop=lt.loop, keys=keys)
            return cls(lt, endpoint, RegistryClient(endpoint, registry_address), name)

        _, runtime = LoopThread.start(name, setup)
        return runtime

    def run_sync(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the runtime loop and block this (non-loop) thread for its result."""
        return self.loop_thread.run_sync(coro, timeout)

    def on_close(self, closer: Callable[[], None]) -> None:
        """Run ``closer`` (on the loop) when the runtime stops, before the endpoint closes.

        Services built on the runtime (the P2P engine, channel clients) register here;
        they close in reverse order of registration; `closed_reason` says why.
        """
        self._closers.append(closer)

    def discard_closer(self, closer: Callable[[], None]) -> None:
        """Forget a closer registered with `on_close` (its service closed on its own)."""
        try:
            self._closers.remove(closer)
        except ValueError:
            pass

    # ------------------------------------------------------------------ peers
    async def resolve_worker(
        self, name: str, timeout: float = 60.0, wait_for_group: bool = False
    ) -> dict[str, Any]:
        """Wait until worker ``name`` is ready and return its info; watch it for death.

        Raises [`GroupNotFoundError`][aiorl.GroupNotFoundError] or
        [`WorkerNotFoundError`][aiorl.WorkerNotFoundError] (both ``LookupError``) at once if its
        group does not exist or has no such rank (unless ``wait_for_group``: then a group that
        appears later is waited for, as a channel being created is),
        [`PeerLostError`][aiorl.PeerLostError] if the worker is (or becomes) dead or failed, and
        [`WaitTimeout`][aiorl.WaitTimeout] if it is not ready within ``timeout``.

        Concurrent first callers share one watch: the future is registered before the
        first ``await``, so every caller is answered by the same registry event.
        """
        fut = self._peer_watch.get(name)
        if fut is None:
            fut = self.loop.create_future()
            self._peer_watch[name] = fut
            try:
                if not wait_for_group:
                    await self._check_exists(name)
                await self.registry.watch(name, self._on_peer_event)
            except BaseException as exc:
                if self._peer_watch.get(name) is fut:
                    del self._peer_watch[name]
                if not fut.done():  # callers that joined meanwhile hear the same error
                    fut.set_exception(exc)
                    fut.exception()
                raise
        if fut.done():  # the common case: no timer, no shield
            if fut.exception() is None:
                return fut.result()
            fut = await self._after_registry_barrier(name, fut)
            if fut.done():
                return fut.result()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise WaitTimeout(f"worker {name} was not ready within {timeout:g} s") from None

    async def _after_registry_barrier(
        self, name: str, failed: asyncio.Future[dict[str, Any]]
    ) -> asyncio.Future[dict[str, Any]]:
        """The name's future once every event the registry sent before now has been handled.

        ``failed`` says the name's last process ended; a restarted rank may be ready already,
        with its ``ready`` event still on its way here: another process (a driver that saw
        the group's RESTARTED event) can hear of it first and ask us to reach the rank. The
        registry's events and replies travel on one connection, in order, and are handled on
        arrival, so once any reply is back every earlier event has run `_on_peer_event`:
        what the registry knew when it answered, we know. Only failures pay this round trip.
        """
        try:
            await self.registry.lookup(name, timeout=_BARRIER_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - no answer (or no such worker): the failure stands
            pass
        return self._peer_watch.get(name) or failed

    async def _check_exists(self, name: str) -> None:
        address = WorkerAddress.from_name(name)  # ValueError for a malformed name
        group = address.root_group_name
        try:
            record = await self.registry.lookup_group(group)
        except GroupNotFoundError:
            raise GroupNotFoundError.from_message(
                f"no worker group named {group!r} exists (looking for worker {name})") from None
        if address.rank_path and address.rank_path[0] >= record.world_size:
            raise WorkerNotFoundError.from_message(
                f"worker {name} does not exist: group {group!r} has ranks "
                f"0-{record.world_size - 1}")

    def _on_peer_event(self, name: str, state: str, info: dict[str, Any], detail: dict[str, Any]) -> None:
        fut = self._peer_watch.get(name)
        if state == "ready":
            previous = self._peer_address.get(name)
            if previous is not None and previous != info["endpoint"]:
                # A new process holds the name (a restart whose predecessor's death we did
                # not hear, e.g. it died while the registry was down): nothing more will come
                # from the old address, so what waits on it must fail, not wait for ever.
                self.endpoint.mark_peer_lost(previous, f"worker {name} was replaced by a new "
                                                       "process (its predecessor is gone)")
            self._peer_address[name] = info["endpoint"]
            if fut is not None and not fut.done():
                fut.set_result(info)
            elif fut is not None:
                # Re-registered (a registry restart) or a new worker of the same name
                # (a group closed and launched again): keep the newest info.
                new = self.loop.create_future()
                new.set_result(info)
                self._peer_watch[name] = new
        elif state in ("dead", "failed"):
            reason = describe_death(name, detail)
            address = info.get("endpoint") or self._peer_address.get(name)
            if address:
                self.endpoint.mark_peer_lost(address, reason)
            if fut is not None and not fut.done():
                fut.set_exception(PeerLostError(reason))
                fut.exception()  # nobody may be waiting any more; callers still see it raised
            elif fut is not None:
                failed = self.loop.create_future()
                failed.set_exception(PeerLostError(reason))
                failed.exception()  # mark retrieved: only later callers care
                self._peer_watch[name] = failed

    def peer_names(self) -> dict[str, str]:
        """The workers this process resolved, by their endpoint's address (a copy)."""
        return {address: name for name, address in self._peer_address.items()}

    async def call_worker(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` of worker ``name`` (e.g. ``"channel-x:0"``) and return its result.

        Waits for the worker to be ready; raises RemoteError for an exception in
        the method and PeerLostError when the worker dies.
        """
        from aiorl.transport import serialization

        info = await self.resolve_worker(name)
        frames = serialization.dumps_arguments(method, args, kwargs) if args or kwargs else []
        rid, fut = self.endpoint.request_numbered(info["endpoint"], WorkerOp.CALL, method, frames)
        if _trace.ON and rid:  # the flow is named by the request id, which the worker sees
            span = _trace.Span("call", method, name)
            span.flow_out = (f"{self.name}>{name}/call", rid)
            fut.add_done_callback(span.settled)
        _, payload = await fut
        return serialization.loads(payload) if payload else None

    # ------------------------------------------------------------------ shutdown
    def stop(self, reason: str | None = None) -> None:
        """Close the services, the registry client and the endpoint; stop a driver's I/O thread.

        From now on, work offered from other threads (a call, a channel operation, a blocking
        registry request) raises [`ClusterClosedError`][aiorl.ClusterClosedError] with ``reason`` at
        once; the closers fail what is pending with ``reason`` (`closed_reason`).
        """
        why = reason or f"the aiorl runtime of {self.name} is stopped"
        if self.closed_reason is None:
            self.closed_reason = why
        self.loop_thread.refuse(lambda: ClusterClosedError(why))

        def close_all() -> None:
            _quiet_closed_work(self.loop, why)
            for closer in list(reversed(self._closers)):  # a closer may discard itself
                try:
                    closer()
                except Exception:
                    log.exception("closing %s failed", closer)
            self._closers.clear()
            self.waiter.close()
            self.registry.close()
            self.endpoint.close()

        self.loop_thread.stop(close_all)


def _quiet_closed_work(loop: asyncio.AbstractEventLoop, reason: str) -> None:
    """Keep asyncio from printing "Future exception was never retrieved" for work that failed
    because this runtime stopped (a call nobody waited on, still pending at ``close()``): the
    program closed its Cluster itself, so the failure tells it nothing. Any other unread
    failure still reaches the loop's previous handler."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if (context.get("message") == "Future exception was never retrieved"
                and isinstance(exc, (PeerLostError, ClusterClosedError)) and reason in str(exc)):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def describe_death(name: str, detail: dict[str, Any]) -> str:
    """One readable sentence (plus the last output lines) about why a worker is gone."""
    reason = detail.get("reason") or f"worker {name} is gone"
    if detail.get("message"):
        reason = f"worker {name} failed: {detail.get('type', 'error')}: {detail['message']}"
    tail = (detail.get("stderr_tail") or "").strip()
    if tail:
        reason += "\n--- last output lines ---\n" + tail
    return reason
