"""Point-to-point messages relayed through the node agents (issue 29: O(N) connections).

One embedded two-node cluster for the module. The ``relayed`` group's workers run with
``AIORL_P2P_DIRECT_PEERS=0``: every destination on the other node is reached through
the two node agents. The ``direct`` group keeps the default budget, which every existing
test runs under: its cross-node pair holds a connection, as before.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import aiorl
from aiorl.errors import ProtocolError
from aiorl.node.p2p_relay import P2PRelay, RelayBounds
from aiorl.p2p.p2p_relay import (
    DEFAULT_DIRECT_PEERS,
    DEFAULT_RELAY_WINDOW,
    direct_peers,
    relay_window,
)
from aiorl.placement import NodePlacementStrategy
from aiorl.protocol.ops import AgentOp, P2POp
from aiorl.protocol.p2p_relay import (
    ENVELOPE_COST,
    P2P_CREDIT,
    P2P_TAKEN,
    P2P_UNDELIVERED,
    RELAYED_P2P_OPS,
    RelayedP2P,
    ViaP2P,
    envelope_bytes,
)
from aiorl.protocol.registry import NodeInfo
from tests.system.test_p2p import P

RELAY_ENV = {"AIORL_P2P_DIRECT_PEERS": "0"}
OP_DATA, OP_BATCH, OP_VIA = P2POp.DATA.value, P2POp.BATCH.value, P2POp.VIA.value


def tensor_of(kind: str) -> torch.Tensor:
    if kind.startswith("cuda_"):
        return tensor_of(kind[5:]).cuda()
    return {
        "small": torch.arange(10, dtype=torch.float32),
        "mib": torch.arange(3 << 18, dtype=torch.float32),  # 3 MiB: frames, not inline
        "big": torch.arange(24 << 20, dtype=torch.float32) % 1000,  # 96 MiB: over the window
        "empty": torch.empty(0, 3),
    }[kind]


class R(P):
    """`tests.system.test_p2p.P` (``pid``, ``node``, ``exchange``, ``recv_expect_loss``,
    ``after_loss``), and what the relayed route needs checked."""

    def address(self) -> str:
        return self._runtime.endpoint.address

    async def connected_to(self, address: str) -> bool:
        """Whether this process holds a connection (DEALER or lane) to ``address``."""
        return address in self._runtime.endpoint._peers

    async def route_to(self, dst: int) -> list[Any]:
        """(relayed, direct connections to other nodes) of the Sender toward ``dst``."""
        from aiorl.p2p import get_p2p

        stats = get_p2p(self._runtime).statistics()
        return [stats.senders[f"{self.worker_group_name}:{dst}"].relayed, stats.direct_remote]

    async def wait_posted(self, src: int, n: int) -> int:
        """Until ``n`` receives from ``src`` are posted (a recv started by another call)."""
        from aiorl.p2p import get_p2p

        engine = get_p2p(self._runtime)
        name = f"{self.worker_group_name}:{src}"
        while True:
            inbox = engine.statistics().inboxes.get(name)
            if inbox is not None and inbox.posted >= n:
                return inbox.posted
            await asyncio.sleep(0.005)

    async def send_objects(self, dst: int, n: int) -> int:
        for i in range(n):
            await self.send({"i": i, "s": "x" * i, "nested": [i, (i, None)]},
                            self.worker_group_name, dst)
        return n

    async def recv_objects(self, src: int, n: int) -> list[int]:
        bad = []
        for i in range(n):
            got = await self.recv(self.worker_group_name, src)
            if got != {"i": i, "s": "x" * i, "nested": [i, (i, None)]}:
                bad.append(i)
        return bad

    async def send_tensors(self, dst: int, kinds: list[str], into: bool) -> int:
        g = self.worker_group_name
        for k in kinds:
            await (self.send_tensor(tensor_of(k), g, dst) if into else self.send(tensor_of(k), g, dst))
        return len(kinds)

    async def recv_tensors(self, src: int, kinds: list[str], into: bool) -> list[str]:
        bad = []
        for k in kinds:
            want = tensor_of(k)
            if into:
                buf = torch.empty_like(want)
                got = await self.recv_tensor(buf, self.worker_group_name, src)
                ok = got is buf and torch.equal(buf, want)
            else:
                got = await self.recv(self.worker_group_name, src)
                ok = isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
            if not ok:
                bad.append(k)
        return bad


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def cluster2():
    with aiorl.Cluster(num_nodes=2) as c:
        yield c


def _launch(cluster: Any, name: str, nodes: list[int], env: dict[str, str] | None) -> Any:
    g = R.create_group().launch(cluster, name=name, placement_strategy=NodePlacementStrategy(nodes),
                                env=env)
    where = g.node().wait(60)
    assert where[0] != where[1]
    return g


@pytest.fixture(scope="module")
def relayed(cluster2):
    g = _launch(cluster2, "relayed", [0, 1], RELAY_ENV)
    yield g
    g.close()


@pytest.fixture(scope="module")
def direct(cluster2):
    g = _launch(cluster2, "direct", [0, 1], None)
    yield g
    g.close()


def on(g: Any, rank: int) -> Any:
    return g.execute_on(rank)


# ----------------------------------------------------------------------------- real processes
@pytest.mark.timeout(90)
@pytest.mark.parametrize("src,dst", [(0, 1), (1, 0)], ids=["node0_to_node1", "node1_to_node0"])
def test_objects_recv_posted_first_and_sent_first(relayed: Any, src: int, dst: int) -> None:
    recv = on(relayed, dst).recv_objects(src, 50)
    assert on(relayed, dst).wait_posted(src, 1).wait(30) == [1]
    assert on(relayed, src).send_objects(dst, 50).wait(30) == [50]
    assert recv.wait(30) == [[]]
    # Sent first: the messages wait at the receiver.
    assert on(relayed, src).send_objects(dst, 50).wait(30) == [50]
    assert on(relayed, dst).recv_objects(src, 50).wait(30) == [[]]
    assert on(relayed, src).route_to(dst).wait(30) == [[True, 0]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("into", [False, True], ids=["send", "send_tensor"])
@pytest.mark.parametrize("kinds", [
    pytest.param(["small", "mib", "empty", "mib", "small"], id="cpu"),
    # CUDA tensors travel staged through pinned host memory; "big" is over the window.
    pytest.param(["cuda_small", "cuda_mib", "cuda_empty", "cuda_big", "cuda_small"], id="cuda",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                          reason="needs a CUDA GPU")),
])
def test_tensors_small_and_mib(relayed: Any, into: bool, kinds: list[str]) -> None:
    recv = on(relayed, 1).recv_tensors(0, kinds, into)
    assert on(relayed, 1).wait_posted(0, 1).wait(30) == [1]
    assert on(relayed, 0).send_tensors(1, kinds, into).wait(90) == [len(kinds)]
    assert recv.wait(90) == [[]]
    assert on(relayed, 1).send_tensors(0, kinds, into).wait(90) == [len(kinds)]
    assert on(relayed, 0).recv_tensors(1, kinds, into).wait(90) == [[]]


@pytest.mark.timeout(120)
def test_thousand_interleaved_messages_keep_order_both_directions(relayed: Any) -> None:
    both = [on(relayed, 0).exchange(1000), on(relayed, 1).exchange(1000)]
    assert [w.wait(90) for w in both] == [[1000], [1000]]


@pytest.mark.timeout(90)
def test_relayed_sender_holds_no_connection_direct_one_does(relayed: Any, direct: Any) -> None:
    for g, relay in ((relayed, True), (direct, False)):
        assert on(g, 0).send_objects(1, 3).wait(30) == [3]
        assert on(g, 1).recv_objects(0, 3).wait(30) == [[]]
        dst = on(g, 1).address().wait(30)[0]
        assert on(g, 0).route_to(1).wait(30) == [[relay, 0 if relay else 1]]
        assert on(g, 0).connected_to(dst).wait(30) == [not relay]


@pytest.mark.timeout(90)
def test_destination_that_dies_fails_pending_recv_then_every_operation(cluster2: Any) -> None:
    g = _launch(cluster2, "relaykill", [0, 1], RELAY_ENV)
    try:
        victim = on(g, 1).pid().wait(60)[0]
        # A relayed route exists before the death: rank 0 has sent through it.
        assert on(g, 0).send_objects(1, 2).wait(30) == [2]
        assert on(g, 1).recv_objects(0, 2).wait(30) == [[]]
        pending = on(g, 0).recv_expect_loss(1)
        assert on(g, 0).wait_posted(1, 1).wait(30) == [1]
        t = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        name, text = pending.wait(10)[0]
        assert name == "PeerLostError", (name, text)
        assert time.monotonic() - t <= 5.0
        assert on(g, 0).after_loss(1).wait(30)[0] == ["PeerLostError"] * 3
    finally:
        g.close()


# ----------------------------------------------------------------------------- units
@pytest.mark.timeout(10)
def test_direct_peer_budget_parses_strictly() -> None:
    assert direct_peers({}) == DEFAULT_DIRECT_PEERS == 64
    assert direct_peers({"AIORL_P2P_DIRECT_PEERS": " "}) == 64
    assert direct_peers({"AIORL_P2P_DIRECT_PEERS": "0"}) == 0
    assert direct_peers({"AIORL_P2P_DIRECT_PEERS": " 7 "}) == 7
    for junk in ("x", "1.5", "-1", "64k"):
        with pytest.raises(ValueError, match="AIORL_P2P_DIRECT_PEERS"):
            direct_peers({"AIORL_P2P_DIRECT_PEERS": junk})


@pytest.mark.timeout(10)
def test_envelopes_round_trip_and_refuse_what_may_not_be_relayed() -> None:
    assert {P2POp.DATA, P2POp.BATCH, P2P_CREDIT, P2P_TAKEN, P2P_UNDELIVERED} == RELAYED_P2P_OPS
    assert P2POp.VIA == "p2p.via"
    inner = ["g:0", 0, None, None, None]
    src = ["node-a", "ipc:///x/s"]
    r = RelayedP2P.from_wire(["node-b", "ipc:///x/w", b"g:0/42/abcd", OP_DATA, inner, *src])
    assert r.to_wire() == ["node-b", "ipc:///x/w", b"g:0/42/abcd", OP_DATA, inner, *src]
    assert ViaP2P.from_wire(r.via().to_wire()) == ViaP2P(b"g:0/42/abcd", OP_DATA, inner, *src)
    credit = ["node-a", "ipc:///x/s", b"g:1/7/ef", P2P_CREDIT, [4096], "node-b", "ipc:///x/w"]
    assert RelayedP2P.from_wire(credit).meta == [4096]
    taken = [*credit[:3], P2P_TAKEN, ["g:1", 3], *credit[5:]]
    assert RelayedP2P.from_wire(taken).meta == ["g:1", 3]
    bad = [
        None,
        {"dst_node": "n"},
        ["node-b", "ipc:///x/w", b"id", OP_DATA, inner, "node-a"],  # a field missing
        ["", "ipc:///x/w", b"id", OP_DATA, inner, *src],  # no node
        ["node-b", 5, b"id", OP_DATA, inner, *src],
        ["node-b", "ipc:///x/w", "id", OP_DATA, inner, *src],  # identity not bytes
        ["node-b", "ipc:///x/w", b"", OP_DATA, inner, *src],
        ["node-b", "ipc:///x/w", b"id", "p2p.hello", inner, *src],  # needs an answer: never relayed
        ["node-b", "ipc:///x/w", b"id", OP_BATCH, {"src": "g:0"}, *src],
        ["n" * 5000, "ipc:///x/w", b"id", OP_DATA, inner, *src],
        ["node-b", "ipc:///x/w", b"id", OP_DATA, inner, "", "ipc:///x/s"],  # no source node
        ["node-b", "ipc:///x/w", b"id", OP_DATA, inner, "node-a", None],  # no source address
        [*credit[:4], [0], *credit[5:]],  # a credit of nothing
        [*credit[:4], [-5], *credit[5:]],
        [*credit[:4], [True], *credit[5:]],
        [*credit[:4], ["5"], *credit[5:]],
        [*credit[:4], [5, 5], *credit[5:]],
        [*taken[:4], ["g:1", 0], *taken[5:]],  # took nothing
        [*taken[:4], ["g:1"], *taken[5:]],
        [*taken[:4], ["", 3], *taken[5:]],  # taken by nobody
        [*taken[:4], [4096], *taken[5:]],  # a credit's meta
    ]
    for meta in bad:
        with pytest.raises(ProtocolError):
            RelayedP2P.from_wire(meta)
    for meta in ([b"id", OP_DATA], [b"id", "p2p.ack", inner, *src], ["id", OP_DATA, inner, *src],
                 [b"id", OP_DATA, inner]):
        with pytest.raises(ProtocolError):
            ViaP2P.from_wire(meta)
    assert envelope_bytes([]) == ENVELOPE_COST
    t = torch.zeros(10, dtype=torch.float32)
    assert envelope_bytes([b"abc", memoryview(t.numpy()), bytearray(5)]) == ENVELOPE_COST + 48


class _FakeEndpoint:
    """What `P2PRelay` uses of an endpoint, recording what it sends (the units below check
    its bookkeeping; the tests above and test_relay_flow.py run real agents)."""

    identity = b"node-b/1/agent"

    def __init__(self, gone: frozenset[str] = frozenset()) -> None:
        self.sent: list[tuple[str, str, Any, list[Any]]] = []
        self.gone = gone

    def send_oneway(self, peer: str, op: str, meta: Any = None, frames: Any = ()) -> None:
        if peer in self.gone:
            from aiorl.errors import PeerLostError

            raise PeerLostError(f"{peer} is gone")
        self.sent.append((peer, op, meta, list(frames)))


def _incoming(meta: Any, frames: list[Any]) -> Any:
    return SimpleNamespace(meta=meta, frames=frames)


@pytest.mark.timeout(10)
def test_agent_forwards_in_order_and_drops_what_it_cannot() -> None:
    async def run() -> None:
        looked_up = asyncio.Event()
        release = asyncio.Event()

        async def nodes() -> list[NodeInfo]:
            looked_up.set()
            await release.wait()
            return [NodeInfo("a", "tcp://agent-a"), NodeInfo("b", "tcp://agent-b")]

        ep = _FakeEndpoint(gone=frozenset({"ipc:///dead"}))
        local = {"ipc:///w", "ipc:///dead"}
        relay = P2PRelay(ep, "a", nodes, local.__contains__)  # type: ignore[arg-type]

        def msg(node: str, addr: str, i: int) -> Any:
            return _incoming([node, addr, b"g:0/1/x", OP_DATA, ["g:0", i], "a", "ipc:///s"],
                             [b"f%d" % i])

        # This node: handed to the worker as p2p.via, frames unchanged.
        relay.on_relay_p2p(msg("a", "ipc:///w", 0))
        assert ep.sent == [("ipc:///w", OP_VIA, [b"g:0/1/x", OP_DATA, ["g:0", 0], "a", "ipc:///s"],
                            [b"f0"])]
        assert relay.held["ipc:///w"].pairs == {("a", "ipc:///s"): ENVELOPE_COST + 2}
        # A worker of this node nobody serves: dropped, nothing sent (no connection).
        relay.on_relay_p2p(msg("a", "ipc:///nobody", 0))
        assert len(ep.sent) == 1
        # Another node, its agent not known yet: held, in order, behind the look-up.
        for i in range(1, 4):
            relay.on_relay_p2p(msg("b", "ipc:///v", i))
        await looked_up.wait()
        assert len(ep.sent) == 1
        release.set()
        while len(ep.sent) < 4:
            await asyncio.sleep(0)
        relay.on_relay_p2p(msg("b", "ipc:///v", 4))  # known now: forwarded at once
        assert [(p, op, m[4][1]) for p, op, m, _ in ep.sent[1:]] == [
            ("tcp://agent-b", AgentOp.RELAY_P2P.value, i) for i in range(1, 5)
        ]
        # Malformed, to a dead worker, to an unknown node: dropped, the agent goes on.
        relay.on_relay_p2p(_incoming(["b", "ipc:///v"], []))
        relay.on_relay_p2p(_incoming(["a", "ipc:///v", b"id", "p2p.hello", {}, "a", "s"], []))
        relay.on_relay_p2p(msg("a", "ipc:///dead", 5))
        relay.on_relay_p2p(msg("zz", "ipc:///v", 6))
        while relay._tasks:
            await asyncio.sleep(0)
        assert len(ep.sent) == 5
        relay.close()

    asyncio.run(run())


@pytest.mark.timeout(10)
def test_agent_counts_each_pair_and_keeps_credit_back_past_its_bounds() -> None:
    """Node "b"'s agent: receiver R (local) gets data from senders S1, S2 on node "a". Over
    the per-receiver bound, R's credits stay in the agent (one entry per pair) and go on,
    oldest first, once R's count falls below (its counts of messages taken never wait);
    R's exit grants back what it never consumed."""
    R = "ipc:///r"

    async def run() -> None:
        async def nodes() -> list[NodeInfo]:
            return [NodeInfo("a", "tcp://agent-a"), NodeInfo("b", "tcp://agent-b")]

        ep = _FakeEndpoint()
        local = {R}
        relay = P2PRelay(ep, "b", nodes, local.__contains__,  # type: ignore[arg-type]
                         RelayBounds(dest_bytes=3000, total_bytes=10_000))
        relay.on_nodes([{"node_id": "a", "endpoint": "tcp://agent-a"},
                        {"node_id": "b", "endpoint": "tcp://agent-b"}])

        def data(sender: str, n: int) -> Any:
            return _incoming(["b", R, b"g:0/1/x", OP_DATA, ["g:0"], "a", sender], [b"x" * n])

        def credit(sender: str, n: int) -> Any:
            return _incoming(["a", sender, b"g:1/2/y", P2P_CREDIT, [n], "b", R], [])

        size = 1000 - ENVELOPE_COST  # each envelope counts 1000
        for sender in ("ipc:///s1", "ipc:///s2", "ipc:///s1", "ipc:///s2"):
            relay.on_relay_p2p(data(sender, size))
        assert relay.held_total == 4000 and relay.held[R].pairs == {
            ("a", "ipc:///s1"): 2000, ("a", "ipc:///s2"): 2000}
        ep.sent.clear()
        # R consumed one of S1's: 3000 left, at the bound: the credit stays here.
        relay.on_relay_p2p(credit("ipc:///s1", 1000))
        assert ep.sent == [] and list(relay.kept.values())[0][1] == 1000
        # R's receives took two of S1's messages: the count carries no message, so it goes
        # on at once, over the bound or not, and changes no count.
        relay.on_relay_p2p(_incoming(["a", "ipc:///s1", b"g:1/2/y", P2P_TAKEN, ["g:1", 2], "b", R],
                                     []))
        assert [(m[0], m[2][3], m[2][4]) for m in ep.sent] == [
            ("tcp://agent-a", P2P_TAKEN, ["g:1", 2])]
        assert relay.held_total == 3000 and len(relay.kept) == 1
        ep.sent.clear()
        relay.on_relay_p2p(credit("ipc:///s1", 1000))  # same pair: one entry, summed
        assert ep.sent == [] or [m[2][4] for m in ep.sent] == [[2000]]
        assert relay.held_total == 2000 and not relay.kept  # below the bound: released
        relay.on_relay_p2p(credit("ipc:///s2", 500))
        assert [(m[0], m[2][1], m[2][4]) for m in ep.sent] == [
            ("tcp://agent-a", "ipc:///s1", [2000]), ("tcp://agent-a", "ipc:///s2", [500])]
        # R exits with 1500 of S2's unconsumed: granted back, nothing counted any more.
        ep.sent.clear()
        local.clear()
        relay.worker_exited(R)
        assert [(m[2][1], m[2][4]) for m in ep.sent] == [("ipc:///s2", [1500])]
        assert relay.held == {} and relay.held_total == 0 and relay.kept == {}
        # A message for R now: dropped (unknown), its bytes granted back at once, and its
        # sender told that it was not delivered (its pair fails).
        ep.sent.clear()
        relay.on_relay_p2p(data("ipc:///s1", size))
        assert [(m[2][1], m[2][3]) for m in ep.sent] == [("ipc:///s1", P2P_CREDIT),
                                                         ("ipc:///s1", P2P_UNDELIVERED)]
        assert ep.sent[0][2][4] == [1000] and R in ep.sent[1][2][4][0]
        assert relay.held == {} and relay.undelivered == 1
        relay.close()

    asyncio.run(run())


@pytest.mark.timeout(10)
def test_agent_holds_messages_for_a_worker_that_is_starting(monkeypatch: Any) -> None:
    """Node "b"'s agent while one of its workers is starting: a message (and a credit) for an
    address it does not know yet waits, in order, and goes on when the worker says it
    serves that address; with nobody ready in time, the sender is told it was not delivered;
    with nobody starting, at once."""
    import aiorl.node.p2p_relay as node_relay

    monkeypatch.setattr(node_relay, "HOLD_FOR_READY_S", 0.2)
    W = "ipc:///w"

    async def run() -> None:
        async def nodes() -> list[NodeInfo]:
            return [NodeInfo("a", "tcp://agent-a"), NodeInfo("b", "tcp://agent-b")]

        ep = _FakeEndpoint()
        local: set[str] = set()
        starting = [True]
        relay = P2PRelay(ep, "b", nodes, local.__contains__,  # type: ignore[arg-type]
                         starting=lambda: starting[0])
        relay.on_nodes([{"node_id": "a", "endpoint": "tcp://agent-a"},
                        {"node_id": "b", "endpoint": "tcp://agent-b"}])

        def data(i: int, to: str = W) -> Any:
            return _incoming(["b", to, b"g:0/1/x", OP_DATA, ["g:0", i], "a", "ipc:///s"], [b"x"])

        for i in range(3):
            relay.on_relay_p2p(data(i))
        relay.on_relay_p2p(_incoming(["b", W, b"g:1/2/y", P2P_CREDIT, [100], "a", "ipc:///s"], []))
        assert ep.sent == []  # held: the worker has not said where it listens
        local.add(W)
        relay.worker_ready(W)
        assert [(peer, op, m[1], m[2]) for peer, op, m, _ in ep.sent] == [
            (W, OP_VIA, OP_DATA, ["g:0", i]) for i in range(3)] + [(W, OP_VIA, P2P_CREDIT, [100])]
        relay.on_relay_p2p(data(3))  # known now: on at once
        assert len(ep.sent) == 5

        # Another address that nobody claims in time: undelivered, its sender told.
        ep.sent.clear()
        relay.on_relay_p2p(data(0, "ipc:///never"))
        assert ep.sent == []
        while not ep.sent:
            await asyncio.sleep(0.02)
        assert [(m[2][3], m[2][1]) for m in ep.sent] == [(P2P_CREDIT, "ipc:///s"),
                                                         (P2P_UNDELIVERED, "ipc:///s")]
        # Nobody starting: undelivered at once.
        ep.sent.clear()
        starting[0] = False
        relay.on_relay_p2p(data(0, "ipc:///nobody"))
        assert [m[2][3] for m in ep.sent] == [P2P_CREDIT, P2P_UNDELIVERED]
        assert relay.undelivered == 2
        relay.close()

    asyncio.run(run())


@pytest.mark.timeout(10)
def test_agent_bounds_parse_strictly() -> None:
    assert RelayBounds.from_environment({}) == RelayBounds(64 << 20, 256 << 20)
    assert RelayBounds.from_environment({"AIORL_NODE_RELAY_DEST_BYTES": " 4096 ",
                                         "AIORL_NODE_RELAY_BYTES": "8192"}) == RelayBounds(4096, 8192)
    for name in ("AIORL_NODE_RELAY_DEST_BYTES", "AIORL_NODE_RELAY_BYTES"):
        for junk in ("0", "x", "1.5", "-1", "64M"):
            with pytest.raises(ValueError, match=name):
                RelayBounds.from_environment({name: junk})
    assert relay_window({}) == DEFAULT_RELAY_WINDOW == 8 << 20
    assert relay_window({"AIORL_P2P_RELAY_WINDOW": "65536"}) == 65536
    for junk in ("0", "x", "-3", "8MiB"):
        with pytest.raises(ValueError, match="AIORL_P2P_RELAY_WINDOW"):
            relay_window({"AIORL_P2P_RELAY_WINDOW": junk})
