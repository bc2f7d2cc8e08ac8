"""The client side of the registry: requests with timeouts, watches, heartbeats.

One :class:`RegistryClient` per process, on the process's :class:`Endpoint`
(so its loop and thread rules apply). Watches deliver each change of a worker
to the callbacks registered for its name or its group; the client also keeps
the last state it saw of every watched worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiorl.errors import PeerLostError, RegistryUnavailable
from aiorl.transport.endpoint import Endpoint

__all__ = ["DEFAULT_TIMEOUT", "RegistryClient", "WorkerEvent"]

log = logging.getLogger("aiorl.registry")

DEFAULT_TIMEOUT = 10.0

#: ``callback(name, state, info, detail)``
WorkerEvent = Callable[[str, str, dict[str, Any], dict[str, Any]], None]


class RegistryClient:
    def __init__(self, endpoint: Endpoint, address: str) -> None:
        self.endpoint = endpoint
        self.address = address
        self._watch_callbacks: dict[str, list[WorkerEvent]] = {}
        self._node_callbacks: list[Callable[[list[dict[str, Any]]], None]] = []
        self.known: dict[str, dict[str, Any]] = {}  # worker name -> {"info", "state", "detail"}
        self._heartbeat_task: asyncio.Task[None] | None = None
        endpoint.on_event("worker", self._on_worker_event)
        endpoint.on_event("nodes", self._on_nodes_event)

    async def request(self, op: str, meta: Any = None, timeout: float = DEFAULT_TIMEOUT) -> Any:
        """Send ``op`` to the registry; returns the reply meta.

        Raises :class:`RegistryUnavailable` when no answer comes within ``timeout``;
        error replies raise what the registry raised (``KeyError`` for unknown
        names arrives as a RemoteError naming it).
        """
        try:
            reply_meta, _ = await self.endpoint.request(self.address, op, meta, timeout=timeout)
        except (TimeoutError, PeerLostError) as exc:
            raise RegistryUnavailable(
                f"the registry at {self.address} did not answer {op!r} within {timeout:g} s"
            ) from exc
        return reply_meta

    # ------------------------------------------------------------------ watches
    async def watch(self, name: str, callback: WorkerEvent) -> dict[str, dict[str, Any]]:
        """Subscribe to changes of worker ``name``, group ``name`` or ``"*"``.

        ``callback`` runs for every current member (from the snapshot) and then for
        every change. Returns the snapshot.
        """
        self._watch_callbacks.setdefault(name, []).append(callback)
        # Always a fresh snapshot (the registry's subscriber set makes re-watching
        # idempotent): the local cache may hold workers of a closed group of this name.
        reply = await self.request("watch", {"name": name})
        snapshot = reply["workers"]
        for stale in [n for n in self.known if (n == name or n.split(":")[0] == name)
                      and n not in snapshot]:
            del self.known[stale]
        for wname, w in snapshot.items():
            self.known[wname] = w
            callback(wname, w["state"], w["info"], w.get("detail") or {})
        return snapshot

    async def watch_nodes(self, callback: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
        self._node_callbacks.append(callback)
        reply = await self.request("watch", {"name": "@nodes"})
        callback(reply["nodes"])
        return reply["nodes"]

    async def resubscribe(self) -> None:
        """Issue every watch again (the registry restarted and forgot its subscribers).

        Callbacks see the new snapshot; a watched worker that vanished while the
        registry was down is simply absent from it.
        """
        for name, callbacks in list(self._watch_callbacks.items()):
            reply = await self.request("watch", {"name": name})
            for wname, w in reply["workers"].items():
                self.known[wname] = w
                for cb in callbacks:
                    cb(wname, w["state"], w["info"], w.get("detail") or {})
        if self._node_callbacks:
            reply = await self.request("watch", {"name": "@nodes"})
            for cb in self._node_callbacks:
                cb(reply["nodes"])

    def _on_worker_event(self, _peer: str, meta: Any, _frames: list[Any]) -> None:
        name = meta["name"]
        self.known[name] = meta
        targets = self._watch_callbacks.get(name, []) + self._watch_callbacks.get(name.split(":")[0], [])
        targets += self._watch_callbacks.get("*", [])
        for cb in targets:
            try:
                cb(name, meta["state"], meta["info"], meta.get("detail") or {})
            except Exception:
                log.exception("worker watch callback failed for %s", name)

    def _on_nodes_event(self, _peer: str, meta: Any, _frames: list[Any]) -> None:
        for cb in self._node_callbacks:
            try:
                cb(meta["nodes"])
            except Exception:
                log.exception("node watch callback failed")

    # ------------------------------------------------------------------ heartbeats
    def start_heartbeats(
        self, my_id: str, interval: float, on_unknown: Callable[[], Any] | None = None
    ) -> None:
        """Send heartbeats for ``my_id``; call ``on_unknown`` (a coroutine function) when the
        registry no longer knows us (it restarted), so the caller can register again."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    # A short timeout: after a registry restart the next beat should not wait
                    # behind one sent to the old process.
                    reply = await self.request("heartbeat", {"id": my_id}, timeout=max(interval * 2, 0.5))
                except RegistryUnavailable:
                    log.debug("heartbeat to %s got no answer", self.address)
                    continue
                if not reply.get("known") and on_unknown is not None:
                    try:
                        await on_unknown()
                    except Exception:
                        log.exception("re-registering with the registry failed")

        self._heartbeat_task = self.endpoint.loop.create_task(beat())

    def close(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
