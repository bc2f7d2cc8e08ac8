"""Relayed fan-out and fan-in, straight after a launch: every message delivered, in order.

Two node agents on one machine (an embedded cluster). One sender on node 0 streams to four
receivers on node 1 at once (fan-out), or four senders on node 0 stream to one receiver on
node 1 (fan-in), each pair 60 messages of 1 MiB; every destination on the other node is
reached through the two agents (``AIORL_P2P_DIRECT_PEERS=0``) or, for comparison, directly.
Each repetition launches a fresh group, so a worker's first messages cross its agent while
the agent may still be recording the fork of its siblings: the agent must know every one
of its workers whatever order the fork report and the worker's ready message reach it in.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

import aiorl
from aiorl.placement import NodePlacementStrategy
from tests.system.test_p2p_relay import RELAY_ENV

MESSAGES = 60
ELEMENTS = 1 << 18  # float32: 1 MiB a message
#: Every message delivered, or a typed error on both ends, within this.
BOUND_S = 10.0
REPEATS = int(os.environ.get("AIORL_FAN_REPEATS", "3"))


class Fan(aiorl.Worker):
    async def stream_to(self, dsts: list[int], n: int) -> int:
        """Send ``n`` tensors to each of ``dsts`` at once (message i holds the value i)."""
        import asyncio

        async def one(dst: int) -> None:
            for i in range(n):
                await self.send(torch.full((ELEMENTS,), float(i)), self.worker_group_name, dst)

        await asyncio.gather(*(one(d) for d in dsts))
        return n * len(dsts)

    async def take_from(self, srcs: list[int], n: int) -> list[int]:
        """Receive ``n`` from each of ``srcs`` at once; per source, how many came in order."""
        import asyncio

        async def one(src: int) -> int:
            for i in range(n):
                got = await self.recv(self.worker_group_name, src)
                if got.shape != (ELEMENTS,) or int(got[0]) != i or int(got[-1]) != i:
                    return i
            return n

        return list(await asyncio.gather(*(one(s) for s in srcs)))


    async def block_loop(self, seconds: float) -> None:
        """Hold this worker's event loop (nothing it receives is read meanwhile)."""
        import time

        time.sleep(seconds)

    def where(self) -> list[str]:
        return [self.worker_info.node_id, self._runtime.endpoint.address]

    async def say_undelivered(self, dst: list[str], reason: str) -> None:
        """As the agent of this node would for a message it could not deliver to us: tell
        the sender at ``dst`` (node, address), through the agents."""
        from aiorl.p2p import get_p2p
        from aiorl.protocol.ops import AgentOp
        from aiorl.protocol.p2p_relay import P2P_UNDELIVERED, RelayedP2P

        engine = get_p2p(self._runtime)
        agent = await engine._agent if engine._agent is not None else None
        assert agent is not None
        node, address = self.where()
        back = RelayedP2P(dst[0], dst[1], self._runtime.endpoint.identity, P2P_UNDELIVERED,
                          [reason], node, address)
        self._runtime.endpoint.send_oneway(agent, AgentOp.RELAY_P2P.value, back.to_wire())

    async def send_until_failed(self, dst: int, within: float) -> str:
        """Send small messages to ``dst`` until one fails; the error's type and text."""
        import asyncio
        import time

        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                await self.send(0, self.worker_group_name, dst)
            except aiorl.AiorlError as exc:
                return f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.01)
        return "no error"


def agent_status(cluster: Any) -> list[dict[str, Any]]:
    """Each node agent's answer to a ping (`NodeAgent.status`), by node rank."""
    from aiorl.protocol.ops import AgentOp

    runtime = cluster.runtime

    async def ask() -> list[dict[str, Any]]:
        nodes = sorted(await runtime.registry.nodes(), key=lambda n: n.node_rank)
        return [await runtime.endpoint.request(n.endpoint, AgentOp.PING.value, None, timeout=10)
                for n in nodes]

    return [meta for meta, _frames in runtime.run_sync(ask(), 20)]


def _run(cluster: Any, env: dict[str, str] | None, nodes: list[int],
         senders: list[int], receivers: list[int]) -> None:
    dropped_before = [a["relay_undelivered"] for a in agent_status(cluster)]
    group = Fan.create_group().launch(cluster, name="fan", env=env,
                                      placement_strategy=NodePlacementStrategy(nodes))
    try:
        group.wait_ready(60)  # the bound is the messages', not the launch's (slow under load)
        takes = [group.execute_on(r).take_from(senders, MESSAGES) for r in receivers]
        sends = [group.execute_on(s).stream_to(receivers, MESSAGES) for s in senders]
        for s, work in zip(senders, sends, strict=True):
            assert work.wait(BOUND_S) == [MESSAGES * len(receivers)], f"sender {s}"
        for r, work in zip(receivers, takes, strict=True):
            assert work.wait(BOUND_S) == [[MESSAGES] * len(senders)], f"receiver {r}"
        status = agent_status(cluster)
        # Nothing dropped on the way, and every worker of the group known to its agent.
        assert [a["relay_undelivered"] for a in status] == dropped_before, status
        assert sum(a["workers"]["ready"] for a in status) >= len(nodes), status
    finally:
        group.close()


@pytest.fixture(scope="module")
def cluster2():
    with aiorl.Cluster(num_nodes=2) as c:
        yield c


ROUTES = [pytest.param(RELAY_ENV, id="relayed"), pytest.param(None, id="direct")]


@pytest.mark.timeout(60 + 30 * REPEATS)
@pytest.mark.parametrize("env", ROUTES)
def test_fan_out_to_four_receivers_on_the_other_node(cluster2: Any, env: Any) -> None:
    for _ in range(REPEATS):
        _run(cluster2, env, [0, 1, 1, 1, 1], senders=[0], receivers=[1, 2, 3, 4])


@pytest.mark.timeout(60 + 30 * REPEATS)
@pytest.mark.parametrize("env", ROUTES)
def test_fan_in_from_four_senders_on_the_other_node(cluster2: Any, env: Any) -> None:
    for _ in range(REPEATS):
        _run(cluster2, env, [0, 0, 0, 0, 1], senders=[0, 1, 2, 3], receivers=[4])


@pytest.mark.timeout(90)
def test_a_relayed_message_its_agent_could_not_deliver_fails_the_pair(cluster2: Any) -> None:
    """The receiving agent's word that a message was not delivered reaches the sender
    through both agents, and the pair fails with it: later sends raise, none is lost
    in silence."""
    group = Fan.create_group().launch(cluster2, name="told", env=RELAY_ENV,
                                      placement_strategy=NodePlacementStrategy([0, 1]))
    try:
        assert group.execute_on(0).stream_to([1], 1).wait(30) == [1]
        assert group.execute_on(1).take_from([0], 1).wait(30) == [[1]]
        sender = group.execute_on(0).where().wait(30)[0]
        group.execute_on(1).say_undelivered(sender, "a test's reason").wait(30)
        error = group.execute_on(0).send_until_failed(1, BOUND_S).wait(30)[0]
        assert error.startswith("PeerLostError") and "a test's reason" in error, error
    finally:
        group.close()


@pytest.mark.timeout(120)
def test_a_relayed_pair_whose_credit_stops_fails_within_its_stall_bound(cluster2: Any) -> None:
    """A receiver whose loop is held reads nothing and grants nothing back: with a 2 s stall
    bound its sender's stream fails with a PeerLostError naming the pair, instead of
    waiting for ever; with the default bound, a receiver held 10 s before it reads gets
    every message, in order."""
    for stall, hold, ok in (("2", 8.0, False), (None, 10.0, True)):
        env = dict(RELAY_ENV) if stall is None else {**RELAY_ENV, "AIORL_P2P_RELAY_STALL_S": stall}
        group = Fan.create_group().launch(cluster2, name="stall", env=env,
                                          placement_strategy=NodePlacementStrategy([0, 1]))
        try:
            held = group.execute_on(1).block_loop(hold)
            started = time.monotonic()
            stream = group.execute_on(0).stream_to([1], MESSAGES)
            if ok:
                takes = group.execute_on(1).take_from([0], MESSAGES)
                assert stream.wait(hold + BOUND_S) == [MESSAGES]
                assert takes.wait(hold + BOUND_S) == [[MESSAGES]]
            else:
                with pytest.raises(aiorl.RemoteError, match="made no progress for 2 s") as caught:
                    stream.wait(hold)
                assert caught.value.exc_type.endswith("PeerLostError")
                assert time.monotonic() - started < hold
            held.wait(hold + BOUND_S)
        finally:
            group.close()


@pytest.mark.timeout(120)
def test_relayed_calls_to_unserved_endpoints_of_a_fresh_groups_node_are_answered(
        cluster2: Any) -> None:
    """A group of eight just launched on node 1, then 40 relayed calls (1 MiB argument each)
    naming its eight ranks at endpoints none of them serves, and 17 ranks that do not
    exist: every rank of every call is answered with PeerLostError within the bound (the
    agent knows each of its workers' endpoints, even those whose ready message came before
    the zygote's report of their fork)."""
    import asyncio

    from aiorl.protocol.call_relay import RelayedAnswers, RelayedCall
    from aiorl.protocol.ops import AgentOp

    group = Fan.create_group().launch(cluster2, name="nowhere",
                                      placement_strategy=NodePlacementStrategy([1] * 8))
    try:
        group.where().wait(30)
        runtime = cluster2.runtime
        nodes = sorted(runtime.run_sync(runtime.registry.nodes(), 10), key=lambda n: n.node_rank)
        ranks = tuple(range(8)) + tuple(range(100, 117))
        endpoints = tuple(f"ipc://{cluster2.session_dir}/nowhere-{r}" for r in ranks)
        call = RelayedCall("nowhere", "where", ranks, endpoints).to_wire()

        async def call_all(n: int = 40) -> list[Any]:
            return list(await asyncio.gather(*(
                runtime.endpoint.request(nodes[1].endpoint, AgentOp.RELAY_CALL.value, call,
                                         [b"a" * (1 << 20)], timeout=BOUND_S)
                for _ in range(n))))

        started = time.monotonic()
        replies = runtime.run_sync(call_all(), BOUND_S + 5)
        took = time.monotonic() - started
        for meta, frames in replies:
            answers = RelayedAnswers.from_wire(meta, len(ranks))
            assert sorted(answers.errors) == list(range(len(ranks))), answers
            assert {e["error"] for e in answers.errors.values()} == {"PeerLostError"}
            assert not frames
        assert took < BOUND_S, f"40 relayed calls answered in {took:.1f} s"
        assert group.where().wait(30)  # the real endpoints still answer
    finally:
        group.close()
