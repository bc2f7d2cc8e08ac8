"""A relayed call to a worker of the node that is still starting waits for its ready message
(bounded), then is called or fails: never sent to an address nobody may serve
(`aiorl.node.call_relay`, with the agent's real `NodeWorkers`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

import aiorl.node.call_relay as call_relay_module
from aiorl.names import WorkerAddress, WorkerInfo
from aiorl.node.call_relay import CallRelay
from aiorl.node.node_workers import NodeWorkers
from aiorl.protocol.call_relay import RelayedAnswers, RelayedCall


class _Endpoint:
    """What `CallRelay` uses of an endpoint: requests are recorded, never answered."""

    def __init__(self) -> None:
        self.requests: list[str] = []

    def request_then(self, endpoint: str, op: str, method: Any, frames: Any, then: Any) -> None:
        self.requests.append(endpoint)

    def mark_peer_lost(self, address: str, reason: str) -> None:
        pass


def _call(ranks: tuple[int, ...], endpoints: tuple[str, ...]) -> tuple[Any, list[Any]]:
    replies: list[Any] = []
    msg = SimpleNamespace(meta=RelayedCall("g", "m", ranks, endpoints).to_wire(), frames=[b"x"],
                          reply=lambda meta, frames=(): replies.append(meta),
                          reply_error=lambda exc: replies.append(exc))
    return msg, replies


def _ready(table: NodeWorkers, spawn_id: int, rank: int, endpoint: str) -> None:
    table.forked(spawn_id, 100 + rank)
    table.ready(WorkerInfo(address=WorkerAddress("g", rank), rank=rank, group_world_size=2,
                           node_rank=0, node_ip="127.0.0.1", endpoint=endpoint, pid=100 + rank))


@pytest.mark.timeout(10)
def test_calls_wait_for_a_starting_worker_then_go_or_fail(monkeypatch: Any) -> None:
    monkeypatch.setattr(call_relay_module, "HOLD_FOR_READY_S", 0.2)

    async def run() -> None:
        table, ep = NodeWorkers(), _Endpoint()
        relay = CallRelay(ep, table.serves)  # type: ignore[arg-type]
        table.on_ready(lambda info: relay.worker_ready(info.name))
        table.expect(1, "g:0", "g", "/log")
        table.expect(2, "g:1", "g", "/log")
        msg, replies = _call((0, 1, 7), ("ipc:///w0", "ipc:///wrong", "ipc:///w7"))
        relay.on_relay_call(msg)  # type: ignore[arg-type]
        assert ep.requests == [] and replies == []  # g:0, g:1 starting; g:7 not here
        _ready(table, 1, 0, "ipc:///w0")
        assert ep.requests == ["ipc:///w0"]  # its endpoint: called
        _ready(table, 2, 1, "ipc:///w1")  # another endpoint than the call's: fails
        assert ep.requests == ["ipc:///w0"] and replies == []

        # A worker that never says where it listens: its rank fails within the bound.
        table.expect(3, "g:2", "g", "/log")
        msg, replies = _call((2,), ("ipc:///w2",))
        relay.on_relay_call(msg)  # type: ignore[arg-type]
        for _ in range(100):
            if replies:
                break
            await asyncio.sleep(0.05)
        answers = RelayedAnswers.from_wire(replies[0], 1)
        assert answers.errors[0]["error"] == "PeerLostError"
        assert "did not say where it listens" in answers.errors[0]["message"]
        relay.close()

    asyncio.run(run())
