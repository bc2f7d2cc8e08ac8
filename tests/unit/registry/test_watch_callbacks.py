"""A process's registry watches follow what it uses: `RegistryClient.drop_watch` removes one
callback, and the registry is told to stop sending a name's news once none is left (issue 51:
a worker kept a watch for every group handle that ever arrived)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiorl.protocol.ops import RegistryOp
from aiorl.protocol.registry import WatchRequest, WatchSnapshot
from aiorl.registry.client import RegistryClient


class _Endpoint:
    """Answers every request at once (a watch with an empty snapshot) and records it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sent: list[tuple[str, Any]] = []

    def on_event(self, _event: Any, _handler: Any) -> None:
        pass

    def request_then(self, _peer: str, op: str, meta: Any, _frames: Any, settle: Any,
                     _timeout: float | None = None) -> int:
        self.sent.append((op, meta))
        settle(None, (WatchSnapshot().to_wire() if op == RegistryOp.WATCH else None, []))
        return len(self.sent)


def _news(*_args: Any) -> None:
    pass


def _other_news(*_args: Any) -> None:
    pass


async def test_the_registry_hears_unwatch_once_the_last_callback_on_a_name_goes() -> None:
    endpoint = _Endpoint(asyncio.get_running_loop())
    client = RegistryClient(endpoint, "tcp://registry")  # type: ignore[arg-type]
    await client.watch("g", _news)
    await client.watch("g", _other_news)
    assert client.watches() == {"g": 2}

    client.drop_watch("g", _news)
    client.drop_watch("g", _news)  # not registered any more: ignored
    client.drop_watch("unknown", _news)
    assert client.watches() == {"g": 1}
    assert [op for op, _ in endpoint.sent] == [RegistryOp.WATCH, RegistryOp.WATCH]

    client.drop_watch("g", _other_news)  # the last one: sent at once, not awaited
    assert client.watches() == {}
    assert endpoint.sent[-1] == (RegistryOp.UNWATCH, WatchRequest("g").to_wire())

    await client.watch("g", _news)  # watched again: the registry hears it after the unwatch
    assert [op for op, _ in endpoint.sent][-2:] == [RegistryOp.UNWATCH, RegistryOp.WATCH]
    assert client.watches() == {"g": 1}
