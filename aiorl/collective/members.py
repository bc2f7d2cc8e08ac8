"""Who the members of this process's broadcasts are, and which are gone.

A broadcast needs every member's endpoint and must fail at once, on every surviving member,
when one dies: `MemberWatch` looks each member up in the registry once it is ready (which
watches it from then on), maps endpoints back to member names for the endpoint's loss
reports, and remembers the members that are lost (dead, or never existed) so that later
broadcasts over a set containing one fail at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from aiorl.collective.settings import RESOLVE_RETRY_S
from aiorl.errors import PeerLostError, RegistryUnavailable
from aiorl.runtime import Runtime

__all__ = ["MemberWatch"]

log = logging.getLogger("aiorl.collective")


class MemberWatch:
    """The members this process resolved and those it lost. ``on_lost(name, why)`` runs once
    per lost member (on the loop), to fail what involves it."""

    def __init__(self, runtime: Runtime, spawn: Callable[[Coroutine[Any, Any, None]], None],
                 on_lost: Callable[[str, PeerLostError | LookupError], None]) -> None:
        self.runtime = runtime
        self.name = runtime.name
        self._spawn = spawn
        self._on_lost = on_lost
        self._infos: dict[str, dict[str, Any]] = {}  # resolved members: registry info by name
        self._resolving: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._name_of: dict[str, str] = {}  # endpoint address -> member name
        self._lost: dict[str, PeerLostError | LookupError] = {}  # LookupError: never existed
        runtime.endpoint.on_peer_lost(self._on_peer_lost)

    async def resolve(self, name: str) -> dict[str, Any]:
        """The registry info of member ``name`` once it is ready (watched for death from then)."""
        info = self._infos.get(name)
        if info is not None:
            return info
        fut = self._resolving.get(name)
        if fut is None:
            fut = self._resolving[name] = self.runtime.loop.create_future()
            self._spawn(self._lookup(name, fut))
        return await asyncio.shield(fut)

    async def _lookup(self, name: str, fut: asyncio.Future[dict[str, Any]]) -> None:
        while True:
            try:
                info = await self.runtime.resolve_worker(name, timeout=RESOLVE_RETRY_S)
                break
            except TimeoutError:
                log.info("%s: broadcast still waiting for worker %s to be ready", self.name, name)
            except RegistryUnavailable:
                await asyncio.sleep(1.0)
            except (PeerLostError, LookupError) as exc:
                self.lose(name, exc)
                fut.set_exception(exc)
                fut.exception()
                return
        address = info["endpoint"]
        self._infos[name] = info
        self._name_of[address] = name
        fut.set_result(info)
        if self.runtime.endpoint.is_lost(address):
            self.lose(name, PeerLostError(f"worker {name} is gone"))

    async def resolve_all(self, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        infos = await asyncio.gather(*(self.resolve(n) for n in names))
        return dict(zip(names, infos, strict=True))

    async def watch(self, members: Sequence[str]) -> None:
        """Resolve (and so watch) every member but this one: any one's death fails its sets."""
        try:
            await self.resolve_all([n for n in members if n != self.name])
        except (PeerLostError, LookupError):
            pass  # _lookup already reported it lost

    def endpoint(self, member: str) -> str:
        """The endpoint of ``member``, which this process resolved (KeyError if it did not)."""
        address: str = self._infos[member]["endpoint"]
        return address

    def address_of(self, member: str) -> str | None:
        """The endpoint of a member this process resolved (None if it did not)."""
        info = self._infos.get(member)
        return info["endpoint"] if info is not None else None

    def lost_among(self, members: Sequence[str]) -> PeerLostError | LookupError | None:
        """Why the first lost one of ``members`` is lost (None if none is)."""
        for name in members:
            exc = self._lost.get(name)
            if exc is not None:
                return exc
        return None

    def _on_peer_lost(self, address: str, exc: BaseException) -> None:
        name = self._name_of.get(address)
        if name is not None:
            self.lose(name, PeerLostError(str(exc)))

    def lose(self, name: str, exc: PeerLostError | LookupError) -> None:
        """Member ``name`` is dead (`PeerLostError`) or never existed (`LookupError`)."""
        if name in self._lost:
            return
        self._lost[name] = exc
        self._on_lost(name, exc)
