"""The per-process runtime: one event loop, one endpoint, one registry client.

A worker process runs its runtime on its main thread (the loop that also runs
the worker's ``async def`` methods). A driver runs it on a private I/O thread,
so that synchronous user code can block in ``wait()`` while the loop keeps
serving heartbeats, events and replies.

The runtime also turns registry news into failures: when a watched worker is
reported dead, every pending request to it fails with
:class:`~aiorl.errors.PeerLostError` (see ``docs/failures.md``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aiorl.errors import (
    GroupNotFoundError,
    PeerLostError,
    RemoteError,
    WaitTimeout,
    WorkerNotFoundError,
)
from aiorl.names import WorkerAddress
from aiorl.registry.client import RegistryClient
from aiorl.transport.endpoint import Endpoint

__all__ = ["Runtime", "current_runtime", "set_current_runtime"]

log = logging.getLogger("aiorl.runtime")
T = TypeVar("T")

_current: Runtime | None = None


def current_runtime() -> Runtime | None:
    """The runtime of this process (a worker's, or the newest driver Cluster's)."""
    return _current


def set_current_runtime(runtime: Runtime | None) -> None:
    global _current
    _current = runtime


class Runtime:
    def __init__(self, loop: asyncio.AbstractEventLoop, endpoint: Endpoint, registry: RegistryClient,
                 name: str) -> None:
        self.loop = loop
        self.endpoint = endpoint
        self.registry = registry
        self.name = name
        self.thread: threading.Thread | None = None
        self._submissions: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque())
        self._wake_pending = False
        self._peer_watch: dict[str, asyncio.Future[dict[str, Any]]] = {}  # name -> info when ready
        self._peer_address: dict[str, str] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def start_in_thread(
        cls, registry_address: str, name: str, host: str = "127.0.0.1", keys: Any = None
    ) -> Runtime:
        """Start a runtime on a new daemon I/O thread (the driver's)."""
        import uvloop

        loop = uvloop.new_event_loop()
        ready: concurrent.futures.Future[Runtime] = concurrent.futures.Future()

        def main() -> None:
            asyncio.set_event_loop(loop)

            def setup() -> None:
                try:
                    endpoint = Endpoint(name, host=host, loop=loop, keys=keys)
                    ready.set_result(cls(loop, endpoint, RegistryClient(endpoint, registry_address), name))
                except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
                    ready.set_exception(exc)

            loop.call_soon(setup)
            loop.run_forever()

        thread = threading.Thread(target=main, name=f"aiorl-io-{name}", daemon=True)
        thread.start()
        runtime = ready.result(timeout=10)
        runtime.thread = thread
        return runtime

    # ------------------------------------------------------------------ crossing threads
    def on_loop_thread(self) -> bool:
        return asyncio._get_running_loop() is self.loop

    def run_sync(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the runtime loop and block this (non-loop) thread for its result."""
        if self.on_loop_thread():
            coro.close()
            raise RuntimeError("a blocking aiorl call was made on the aiorl event loop's thread; "
                               "use the async form (await) there")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise WaitTimeout(f"operation did not finish within {timeout} s") from None

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop: now when on the loop thread, else as soon as it can.

        Calls from other threads run in the order they were made. They are
        batched: only the first call of a batch wakes the loop (a wake-up costs
        tens of microseconds here; 1,000 calls in flight would pay it 1,000 times).
        """
        if self.on_loop_thread():
            fn(*args)
            return
        self._submissions.append((fn, args))
        if not self._wake_pending:
            self._wake_pending = True
            self.loop.call_soon_threadsafe(self._run_submissions)

    def _run_submissions(self) -> None:
        # Clear the flag before draining: a submission racing with the drain either
        # lands in this drain or schedules a new one; none is stranded.
        self._wake_pending = False
        queue = self._submissions
        while queue:
            fn, args = queue.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("callback submitted to the aiorl loop failed")

    # ------------------------------------------------------------------ peers
    async def resolve_worker(
        self, name: str, timeout: float = 60.0, wait_for_group: bool = False
    ) -> dict[str, Any]:
        """Wait until worker ``name`` is ready and return its info; watch it for death.

        Raises :class:`~aiorl.GroupNotFoundError` or :class:`~aiorl.WorkerNotFoundError`
        (both ``LookupError``) at once if its group does not exist or has no such rank
        (unless ``wait_for_group``: then a group that appears later is waited for, as a
        channel being created is), :class:`PeerLostError` if the worker is (or becomes)
        dead or failed, and :class:`~aiorl.WaitTimeout` if it is not ready within
        ``timeout``.

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
            return fut.result()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise WaitTimeout(f"worker {name} was not ready within {timeout:g} s") from None

    async def _check_exists(self, name: str) -> None:
        address = WorkerAddress.from_name(name)  # ValueError for a malformed name
        group = address.root_group_name
        try:
            reply = await self.registry.request("lookup_group", {"group": group})
        except GroupNotFoundError:
            raise GroupNotFoundError.from_message(
                f"no worker group named {group!r} exists (looking for worker {name})") from None
        except RemoteError as exc:
            if exc.exc_type.endswith("KeyError"):
                raise GroupNotFoundError.from_message(
                    f"no worker group named {group!r} exists (looking for worker {name})") from None
            raise
        if address.rank_path and address.rank_path[0] >= int(reply["world_size"]):
            raise WorkerNotFoundError.from_message(
                f"worker {name} does not exist: group {group!r} has ranks "
                f"0-{int(reply['world_size']) - 1}")

    def _on_peer_event(self, name: str, state: str, info: dict[str, Any], detail: dict[str, Any]) -> None:
        fut = self._peer_watch.get(name)
        if state == "ready":
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

    async def call_worker(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` of worker ``name`` (e.g. ``"channel-x:0"``) and return its result.

        Waits for the worker to be ready; raises RemoteError for an exception in
        the method and PeerLostError when the worker dies.
        """
        from aiorl.transport import serialization

        info = await self.resolve_worker(name)
        frames = serialization.dumps((args, kwargs)) if args or kwargs else []
        _, payload = await self.endpoint.request(info["endpoint"], "call", method, frames)
        return serialization.loads(payload) if payload else None

    # ------------------------------------------------------------------ shutdown
    def stop(self) -> None:
        """Close the endpoint and stop the I/O thread (driver runtimes)."""

        def stop_after(turns: int) -> None:
            # Closing fails pending requests; their callbacks (a group call's collect, the
            # AsyncWork's mirror to a waiting thread) run over the next few loop turns.
            # Stop only after them, so every waiter hears "closed" and nothing is left
            # with an unread exception.
            if turns:
                self.loop.call_soon(stop_after, turns - 1)
            else:
                self.loop.stop()

        def shutdown() -> None:
            self.registry.close()
            self.endpoint.close()
            stop_after(3)

        if self.thread is None:
            shutdown()
            return
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(shutdown)
            self.thread.join(timeout=5)


def describe_death(name: str, detail: dict[str, Any]) -> str:
    """One readable sentence (plus the last output lines) about why a worker is gone."""
    reason = detail.get("reason") or f"worker {name} is gone"
    if detail.get("message"):
        reason = f"worker {name} failed: {detail.get('type', 'error')}: {detail['message']}"
    tail = (detail.get("stderr_tail") or "").strip()
    if tail:
        reason += "\n--- last output lines ---\n" + tail
    return reason
