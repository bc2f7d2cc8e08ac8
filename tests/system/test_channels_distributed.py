"""Distributed channels, keys, peeks and RLinf's call names (issue 14, items 1, 2 and 8).

Everything runs on one module-scoped embedded cluster of two nodes (two node
agents on this machine, node ranks 0 and 1) with one worker on each node, so
"the first user's node" and "stays local" are checked with real processes on
distinct node ranks, through what the channel reports (``replica_statistics``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal
import time
from typing import Any

import pytest
import torch

import aiorl
from aiorl.channels import Channel, QueuedItem, QueueStats
from aiorl.errors import PeerLostError
from aiorl.placement import NodePlacementStrategy

pytestmark = pytest.mark.timeout(120)


class Color(enum.Enum):
    RED = "red"


class NodeWorker(aiorl.Worker):
    """One worker per node: puts and gets on behalf of its node."""

    def node(self) -> int:
        return int(self.worker_info.node_rank)

    def put_each(self, ch: Channel, keys: list[Any], per_key: int) -> None:
        for key in keys:
            for i in range(per_key):
                ch.put((self.node(), key, i), weight=1, key=key, async_op=False)

    def get_each(self, ch: Channel, key: Any, n: int) -> list[Any]:
        return [ch.get(key, async_op=False) for _ in range(n)]

    async def put_async(self, ch: Channel, key: Any, items: list[Any]) -> None:
        for item in items:
            await ch.put(item, weight=1, key=key)
        await ch.flush()

    def create(self, name: str, **kwargs: Any) -> None:
        ch: Channel = self.create_channel(channel_name=name, **kwargs)  # RLinf's keyword
        ch.put(f"from node {self.node()}", key="hello", async_op=False)

    async def create_lazily(self, name: str) -> list[Any]:
        """On the event loop create_channel returns at once; routed operations wait."""
        ch: Channel = self.create_channel(name, distributed=True, node_rank=0)
        await ch.put("early", key="lazy")
        stats = await ch.replica_statistics()
        return [(r.node_rank, sorted(r.queues)) for r in stats]

    def positional_maxsize(self, name: str) -> str:
        try:
            self.create_channel(name, 8)  # type: ignore[arg-type]  # RLinf: maxsize second
        except TypeError as exc:
            return str(exc)
        return "no error"

    def p2p_blocking(self, peer_group: str, obj: Any) -> Any:
        """RLinf's async_op=False on send/recv: the calls return the results themselves."""
        if self.rank == 0:
            assert self.send(obj, peer_group, 1, async_op=False) is None
            return self.recv(peer_group, 1, async_op=False)
        got = self.recv(peer_group, 0, async_op=False)
        self.send(("echo", got), peer_group, 0, async_op=False)
        return got


@pytest.fixture(scope="module")
def cluster() -> Any:
    with aiorl.Cluster(num_nodes=2) as c:
        yield c


@pytest.fixture(scope="module")
def nodes(cluster: aiorl.Cluster) -> Any:
    """``(worker on node 0, worker on node 1)``, one group each."""
    n0 = NodeWorker.create_group().launch(cluster, NodePlacementStrategy([0]), name="dist-n0")
    n1 = NodeWorker.create_group().launch(cluster, NodePlacementStrategy([1]), name="dist-n1")
    try:
        assert n0.node().wait(30) == [0] and n1.node().wait(30) == [1]
        yield n0, n1
    finally:
        n0.close()
        n1.close()


def _where(ch: Channel) -> dict[Any, int]:
    """key -> node rank of the replica that holds it, checking no key is on two replicas."""
    where: dict[Any, int] = {}
    for replica in ch.replica_statistics().wait(30):
        for key in replica.queues:
            assert key not in where, f"{key!r} is on two replicas"
            where[key] = replica.node_rank
    return where


# ---------------------------------------------------------------------- distributed channels
def test_keys_live_on_the_first_users_node(cluster: aiorl.Cluster, nodes: Any) -> None:
    n0, n1 = nodes
    ch = Channel.create(cluster, "dist", maxsize=4, distributed=True)
    try:
        assert ch.worker_group.world_size == 2  # one replica per node
        n1.put_each(ch, ["k1"], 3).wait(30)  # first used on node 1
        n0.put_each(ch, ["k0"], 2).wait(30)  # first used on node 0
        ch.put("driver", weight=1, key="k1", async_op=False)  # sticky: the driver is node 0
        assert _where(ch) == {"k1": 1, "k0": 0}
        # Per key, everything behaves as on a plain channel.
        assert (ch.qsize("k1"), ch.full("k1"), ch.empty("k0"), ch.qsize("never")) == (
            4, True, False, 0)
        with pytest.raises(asyncio.QueueFull):  # aiorl.QueueFull is asyncio's too
            ch.put_nowait("over", key="k1")
        stats = ch.statistics().wait(30)
        assert stats["k1"] == QueueStats(4, 4.0, 4, 0, 0, 0)
        assert stats["k0"].qsize == 2
        # The consumer on node 1 reads its node's replica, in FIFO order.
        assert n1.get_each(ch, "k1", 4).wait(30) == [[
            (1, "k1", 0), (1, "k1", 1), (1, "k1", 2), "driver"]]
        assert ch.get_batch(target_weight=2, key="k0", async_op=False) == [
            (0, "k0", 0), (0, "k0", 1)]
        with pytest.raises(asyncio.QueueEmpty):
            ch.get_nowait("k0")
        # A key first used by a get stays where that get was made.
        pending = n1.get_each(ch, "late", 1)
        deadline = time.monotonic() + 30
        while "late" not in _where(ch):  # the get reached its replica
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ch.put("x", key="late", async_op=False)
        assert pending.wait(30) == [["x"]]
        assert _where(ch)["late"] == 1
    finally:
        ch.destroy().wait(10)


def test_concurrent_first_use_agrees_on_one_replica(cluster: aiorl.Cluster, nodes: Any) -> None:
    """Replica 0 decides every first assignment: processes on both nodes racing to use
    the same new keys all end up in one queue per key."""
    n0, n1 = nodes
    ch = Channel.create(cluster, "dist-race", distributed=True)
    try:
        keys = [f"race-{i}" for i in range(24)]
        works = [n0.put_each(ch, keys, 1), n1.put_each(ch, keys, 1)]
        for w in works:
            w.wait(30)
        where = _where(ch)
        assert set(where) == set(keys)
        assert all(s.qsize == 2 for s in ch.statistics().wait(30).values())
    finally:
        ch.destroy().wait(10)


def test_replicas_on_given_nodes_map_by_node(cluster: aiorl.Cluster, nodes: Any) -> None:
    """With node_ranks=[1, 0], replica 0 runs on node 1: keys still go to their user's node."""
    n0, n1 = nodes
    ch = Channel.create(cluster, "dist-order", distributed=True, node_ranks=[1, 0])
    try:
        ch.put("from the driver", key="d")
        n1.put_each(ch, ["w1"], 1).wait(30)
        replicas = ch.replica_statistics().wait(30)
        assert [(r.rank, r.node_rank) for r in replicas] == [(0, 1), (1, 0)]
        assert _where(ch) == {"d": 0, "w1": 1}
    finally:
        ch.destroy().wait(10)


def test_create_existing_connects_with_a_warning(cluster: aiorl.Cluster, nodes: Any,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    n0, n1 = nodes
    n1.create("dist-w", distributed=True, node_rank=0).wait(30)
    ch = Channel.connect(cluster, "dist-w")
    try:
        with caplog.at_level(logging.WARNING, logger="aiorl.channels"):
            again = Channel.create(cluster, "dist-w", maxsize=3, distributed=True)
        assert "already exists" in caplog.text
        assert again.get("hello").wait(10) == "from node 1"
        assert _where(again) == {"hello": 1}
        assert again.worker_group.world_size == 2
        assert n0.positional_maxsize("dist-w-positional").wait(30)[0].startswith(
            "create_channel(name, group_affinity")
        # From an async method, a distributed create returns at once; operations wait.
        assert n0.create_lazily("dist-lazy").wait(30)[0] == [(0, ["lazy"]), (1, [])]
        Channel.connect(cluster, "dist-lazy").destroy().wait(10)
    finally:
        ch.destroy().wait(10)


def test_destroy_fails_operations_on_every_replica(cluster: aiorl.Cluster, nodes: Any) -> None:
    n0, n1 = nodes
    ch = Channel.create(cluster, "dist-gone", distributed=True)
    n1.put_each(ch, ["remote"], 1).wait(30)
    ch.put("local", key="here").wait(10)
    pending = n1.get_each(ch, "never", 1)
    ch.destroy().wait(10)
    with pytest.raises(aiorl.RemoteError, match="PeerLostError"):  # raised in the worker
        pending.wait(30)
    for key in ["remote", "here", "new"]:
        with pytest.raises(PeerLostError):
            ch.get(key).wait(10)


def test_a_lost_replica_fails_only_its_keys(cluster: aiorl.Cluster, nodes: Any) -> None:
    n0, n1 = nodes
    ch = Channel.create(cluster, "dist-kill", distributed=True)
    try:
        n1.put_each(ch, ["on-1"], 1).wait(30)
        ch.put("kept", key="on-0").wait(10)
        reply = cluster.runtime.run_sync(cluster.runtime.registry.request(
            "lookup", {"name": "channel.dist-kill:1"}))
        os.kill(int(reply["info"]["pid"]), signal.SIGKILL)  # replica 1, on node 1
        with pytest.raises(PeerLostError):
            ch.get("on-1").wait(10)
        assert ch.get("on-0").wait(10) == "kept"  # replica 0's keys keep working
    finally:
        ch.destroy().wait(10)


def test_invalid_distributed_arguments(cluster: aiorl.Cluster) -> None:
    with pytest.raises(ValueError, match="distinct"):
        Channel.create(cluster, "dist-dup", distributed=True, node_ranks=[0, 0])
    with pytest.raises(aiorl.PlacementError):
        Channel.create(cluster, "dist-nowhere", distributed=True, node_ranks=[0, 5])


# ---------------------------------------------------------------------- keys, peeks, names
def test_any_hashable_key_and_the_queue_name_alias(cluster: aiorl.Cluster) -> None:
    ch = Channel.create(cluster, "keys")
    try:
        keys: list[Any] = [("episode", 3, 1), 7, None, b"raw", Color.RED, "plain"]
        for i, key in enumerate(keys):
            ch.put(i, weight=1, key=key)
        ch.put("alias", weight=1, queue_name="plain")  # RLinf's old name for key=
        assert set(ch.statistics().wait(10)) == set(keys)
        # Equal keys built separately meet in one queue.
        assert ch.get(("episode", 3, 1)).wait(10) == 0
        assert [ch.get(k, async_op=False) for k in [7, None, b"raw", Color.RED]] == [1, 2, 3, 4]
        assert ch.get_batch(2, queue_name="plain").wait(10) == [5, "alias"]
        with pytest.raises(TypeError, match="hashable"):
            ch.put("x", key=["a", "list"])  # type: ignore[call-overload]
        with pytest.raises(TypeError, match="not both"):
            ch.get("a", queue_name="b")
        with pytest.raises(TypeError, match="exactly one"):
            ch.get_batch()
    finally:
        ch.destroy().wait(10)


def test_peek_all_and_str_show_without_taking(cluster: aiorl.Cluster, nodes: Any) -> None:
    n0, n1 = nodes
    ch = Channel.create(cluster, "peek", distributed=True)
    try:
        for i in range(12):
            ch.put(f"item-{i}", weight=i, key="many")
        ch.put(torch.zeros(3, 4), weight=2.5, key="tensor")
        n1.put_async(ch, ("pair", 1), ["remote"]).wait(30)
        assert ch.peek_all("many", limit=2) == [QueuedItem("item-0", 0.0), QueuedItem("item-1", 1.0)]
        (peeked,) = ch.peek_all("tensor")
        assert peeked.weight == 2.5 and torch.equal(peeked.item, torch.zeros(3, 4))
        assert ch.peek_all("unused") == []
        text = str(ch)
        assert text.splitlines()[0] == "Channel 'peek': 3 queues on 2 replicas"
        assert "'many' (replica 0, node 0): 12 item(s), weight 66" in text
        assert "[0] weight 0: 'item-0'" in text and "... 4 more" in text
        assert "Tensor(shape=(3, 4), dtype=torch.float32)" in text
        assert "('pair', 1) (replica 1, node 1): 1 item(s), weight 1" in text
        # Nothing was taken.
        assert ch.qsize("many") == 12 and ch.get("tensor").wait(10).shape == (3, 4)
    finally:
        ch.destroy().wait(10)


def test_async_op_false_on_p2p_calls(cluster: aiorl.Cluster) -> None:
    pair = NodeWorker.create_group().launch(cluster, NodePlacementStrategy([0, 1]),
                                            name="dist-p2p")
    try:
        assert pair.p2p_blocking("dist-p2p", {"t": 1}).wait(30) == [("echo", {"t": 1}),
                                                                     {"t": 1}]
    finally:
        pair.close()
