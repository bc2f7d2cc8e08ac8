"""Every pair's receive window: a receiver holds at most ``AIORL_P2P_WINDOW`` bytes of one
sender's messages that no receive has taken (plus one message), and the sender's later sends
wait, in order, until receives take some (`aiorl.p2p.window`).

One contract, every route: real workers on one node (shared memory and CMA paths), on two
(ZMQ frames; the count comes back over the sender's own connection), and on two relayed
through the node agents (the count comes back through them); the groups set a small window
in their environment so that the bound shows with megabytes.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

import aiorl
from aiorl.p2p import get_p2p
from aiorl.placement import NodePlacementStrategy

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20
#: The routes a pair's messages can take: (the receiver's node, the group's environment).
ROUTES = {
    "one node": (0, {}),
    "two nodes": (1, {}),
    "relayed": (1, {"AIORL_P2P_DIRECT_PEERS": "0"}),  # through both nodes' agents
}


class Pair(aiorl.Worker):
    """Rank 0 sends, rank 1 receives."""

    def __init__(self) -> None:
        super().__init__()
        self.works: list[Any] = []

    def pid(self) -> int:
        return os.getpid()

    def start_sends(self, count: int, nbytes: int) -> None:
        """Start ``count`` sends to rank 1, message k a tensor of ``nbytes`` filled with k."""
        for k in range(len(self.works), len(self.works) + count):
            t = torch.full((max(1, nbytes // 4),), float(k))
            self.works.append(self.send(t, self.worker_group_name, 1))

    def sends(self) -> dict[str, Any]:
        """How many sends completed, how they ended, and the window toward rank 1."""
        stats = get_p2p(self._runtime).statistics().senders.get(f"{self.worker_group_name}:1")
        ended = [w for w in self.works if w.done()]
        errors = []
        for w in ended:
            try:
                w.wait(0)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                errors.append(type(exc).__name__)
        return {"done": len(ended), "errors": errors,
                "backlog": 0 if stats is None else stats.backlog,
                "relayed": stats is not None and stats.relayed,
                "outstanding": 0 if stats is None else stats.outstanding}

    async def take(self, count: int) -> list[float]:
        """Receive ``count`` messages from rank 0: the value each was filled with."""
        out = []
        for _ in range(count):
            t = await self.recv(self.worker_group_name, 0)
            assert bool((t == t[0]).all())
            out.append(float(t[0]))
        return out


def _until(check: Any, what: str, timeout: float = 30.0) -> Any:
    """Poll the sender's state until ``check(state)`` holds (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        state = GROUP["g"].execute_on(0).sends().wait(30)[0]
        if check(state):
            return state
        assert time.monotonic() < deadline, f"never {what}: {state}"
        time.sleep(0.05)


GROUP: dict[str, Any] = {}


@pytest.fixture(scope="module")
def cluster():
    with aiorl.Cluster(num_nodes=2) as c:
        yield c


@pytest.fixture
def pair(cluster: Any, request: Any) -> Any:
    window, route = request.param
    nodes, env = ROUTES[route]
    g = Pair.create_group().launch(cluster, name=f"win{window}-{route.replace(' ', '-')}",
                                   placement_strategy=NodePlacementStrategy([0, nodes]),
                                   env={"AIORL_P2P_WINDOW": str(window), **env})
    GROUP["g"], GROUP["route"] = g, route
    try:
        yield g
    finally:
        g.close()


def _on_every_route(window: int) -> Any:
    return pytest.mark.parametrize("pair", [(window, route) for route in ROUTES], indirect=True,
                                   ids=list(ROUTES))


@_on_every_route(4 * MiB)
def test_sends_wait_while_the_receiver_holds_a_window_and_go_as_receives_take(pair: Any) -> None:
    pair.execute_on(0).start_sends(8, MiB).wait(30)
    # Four 1 MiB messages (each also counts its header and 1 KiB) fill 4 MiB: the fifth waits.
    state = _until(lambda s: s["backlog"] == 4 and s["done"] == 4, "four sends done, four waiting")
    assert state["outstanding"] >= 4 * MiB and not state["errors"]
    assert state["relayed"] == (GROUP["route"] == "relayed")
    assert pair.execute_on(1).take(2).wait(30)[0] == [0.0, 1.0]
    state = _until(lambda s: s["done"] == 6, "two more sends done once two were taken")
    assert state["backlog"] == 2
    assert pair.execute_on(1).take(6).wait(30)[0] == [float(k) for k in range(2, 8)]
    state = _until(lambda s: s["done"] == 8 and s["outstanding"] == 0, "every send done")
    assert not state["errors"]


@_on_every_route(64 << 10)
def test_small_messages_count_too(pair: Any) -> None:
    """Each message counts at least 1 KiB: a sender of tiny messages is bounded as well."""
    pair.execute_on(0).start_sends(100, 4).wait(30)
    # (Before the receiver is resolved every send waits in the backlog with nothing charged.)
    state = _until(lambda s: s["done"] + s["backlog"] == 100 and s["backlog"] > 0
                   and s["outstanding"] > 0, "tiny sends waiting for the window")
    assert 50 <= state["done"] <= 64, state
    assert pair.execute_on(1).take(100).wait(60)[0] == [float(k) for k in range(100)]
    _until(lambda s: s["done"] == 100, "every tiny send done")


@_on_every_route(MiB)
def test_a_message_larger_than_the_window_goes_when_nothing_is_held(pair: Any) -> None:
    pair.execute_on(0).start_sends(2, 3 * MiB).wait(30)
    state = _until(lambda s: s["done"] == 1 and s["backlog"] == 1, "the first sent alone")
    assert not state["errors"]
    assert pair.execute_on(1).take(1).wait(30)[0] == [0.0]
    _until(lambda s: s["done"] == 2, "the second sent once the first was taken")
    assert pair.execute_on(1).take(1).wait(30)[0] == [1.0]


@_on_every_route(MiB)
def test_sends_waiting_for_a_dead_receiver_fail(pair: Any) -> None:
    pair.execute_on(0).start_sends(3, MiB).wait(30)
    _until(lambda s: s["done"] == 1 and s["backlog"] == 2, "two sends waiting")
    victim = pair.execute_on(1).pid().wait(30)[0]
    t = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    state = _until(lambda s: s["done"] == 3, "the waiting sends ended")
    assert state["errors"] == ["PeerLostError", "PeerLostError"], state
    assert time.monotonic() - t < 15
