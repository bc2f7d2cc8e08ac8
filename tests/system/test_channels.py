"""Channels: weighted FIFO queues hosted by a channel worker, on real processes.

One module-scoped embedded cluster of two nodes, each test with its own channel and group
names. The queue rules and the keys' wire form are tested in process by
tests/unit/channels/test_weighted_queue.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

import aiorl
from aiorl.channels import Channel, QueuedItem, QueueStats
from aiorl.errors import PeerLostError, QueueEmpty, QueueFull
from aiorl.placement import NodePlacementStrategy
from aiorl.transport.serialization import SerializationError

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------- workers for the system tests
class Producer(aiorl.Worker):
    async def produce(self, ch: Channel, n: int, window: int = 512) -> int:
        """Put (rank, i) for i < n with up to ``window`` puts in flight."""
        pending: list[Any] = []
        for i in range(n):
            pending.append(ch.put((self.rank, i), weight=1))
            if len(pending) >= window:
                await pending[window // 2]  # acks come in order: the older ones are done too
                pending = pending[window // 2 + 1:]
        for w in pending:
            await w
        # A put that completed on a credit may still be on its way; once flush() is done every
        # put is in the queue, so what the caller puts next from another process comes after.
        await ch.flush()
        return n

    async def puts_then_gets(self, ch: Channel, n: int) -> list[Any]:
        works = [ch.put(i, weight=1) for i in range(n)]  # all in flight at once
        for w in works:
            await w
        gets = [ch.get() for _ in range(n)]
        return [await g for g in gets]

    def use_sync(self, ch: Channel, item: Any) -> Any:
        """From the method thread: put, then get it back, plus nowait and sizes."""
        ch.put(item, queue_name="sync").wait(10)
        size = ch.qsize("sync")
        got = ch.get("sync").wait(10)
        try:
            ch.get_nowait("sync")
            empty_raised = False
        except aiorl.QueueEmpty:
            empty_raised = True
        return got, size, empty_raised

    async def use_async(self, ch: Channel, item: Any) -> Any:
        """From the event loop: the same with awaits."""
        await ch.put(item, queue_name="async")
        with pytest.raises(RuntimeError, match="statistics"):
            ch.qsize("async")  # would block the loop: refused with a pointer to statistics()
        stats = await ch.statistics()
        got = await ch.get("async")
        try:
            await ch.get_nowait("async")
            empty_raised = False
        except aiorl.QueueEmpty:
            empty_raised = True
        return got, stats["async"].qsize, empty_raised

    def create_sync(self, name: str, group: str | None = None, rank: int | None = None) -> Channel:
        ch: Channel = self.create_channel(name, group_affinity=group, group_rank_affinity=rank)
        ch.put(f"from {self.worker_name}").wait(10)
        return ch

    async def create_lazily(self, name: str, item: Any) -> Channel:
        ch: Channel = self.create_channel(name, maxsize=3)  # returns at once on the loop
        work = ch.put(item)  # waits for the channel worker to be ready
        await work
        return await ch  # awaiting the handle waits for readiness and gives it back

    async def connect_and_get(self, name: str) -> Any:
        ch = self.connect_channel(name)  # may not exist yet: operations wait for it
        return await ch.get()

    async def cancel_after_dispatch(self, ch: Channel) -> list[Any]:
        """Cancel gets in the loop turn that issued them: the worker answers them anyway
        (items already there), and the handle must send those items back, in order."""
        for item in ["a", "b", "c"]:
            await ch.put(item, weight=1, queue_name="race")
        single = ch.get("race")
        single.cancel()
        batch = ch.get_batch(2, "race")
        batch.cancel()
        await asyncio.sleep(0.2)  # the answers arrive for cancelled works and are returned
        return [await ch.get("race") for _ in range(3)]

    async def put_until_blocked(self, ch: Channel, limit: int) -> int:
        """``await ch.put(i)`` one after the other; how many completed before one blocked."""
        for i in range(limit):
            try:
                await asyncio.wait_for(ch.put(i, weight=1), 0.5)
            except TimeoutError:  # cancelled: withdrawn at the channel worker
                return i
        return limit

    async def stream_out(self, ch: Channel, n: int) -> None:
        for i in range(n):
            await ch.put((self.rank, i), weight=1)
        await ch.flush()

    async def stream_in(self, ch: Channel, n: int) -> list[Any]:
        return [await ch.get() for _ in range(n)]

    async def gets_then_batch(self, ch: Channel) -> list[Any]:
        """Streaming gets prefetch; a get_batch after them must still take the oldest items."""
        for i in range(10):
            await ch.put(i, weight=1, queue_name="mixed")
        first = [await ch.get("mixed"), await ch.get("mixed"), await ch.get("mixed")]
        batch = await ch.get_batch(3, "mixed")
        after = await ch.get("mixed")
        stats = await ch.statistics()
        return [first, batch, after, stats["mixed"].qsize]

    async def peek_on_loop(self, ch: Channel) -> tuple[str, list[Any]]:
        """On the event loop str() cannot block (it is the repr) and peek_all is awaited."""
        return str(ch), await ch.peek_all("shown")

    async def pending_get(self, ch: Channel) -> str:
        try:
            await ch.get("never")
        except PeerLostError:
            return "PeerLostError"
        return "no error"


class Consumer(aiorl.Worker):
    async def consume_until_stop(self, ch: Channel, batch: float = 64) -> list[Any]:
        got: list[Any] = []
        while True:
            for item in await ch.get_batch(batch):
                if item == "STOP":
                    return got
                got.append(item)


@pytest.fixture(scope="module")
def cluster() -> Any:
    with aiorl.Cluster(num_nodes=2) as c:
        yield c


def _channel_pid(c: aiorl.Cluster, name: str) -> tuple[int, int]:
    reply = c.runtime.run_sync(c.runtime.registry.request("lookup", {"name": f"channel.{name}:0"}))
    return int(reply["info"]["pid"]), int(reply["info"]["node_rank"])


# ---------------------------------------------------------------------- system tests
def test_payload_kinds_round_trip(cluster: aiorl.Cluster) -> None:
    ch = Channel.create(cluster, "kinds")
    try:
        big = torch.arange(256 * 1024, dtype=torch.float32)  # 1 MiB: zero-copy frames
        payloads: list[Any] = [
            {"obj": [1, "two", (3.0, None)]},
            torch.tensor([1, 2, 3], dtype=torch.int64),
            big,
            {"obs": torch.randn(4, 3), "act": big.clone(), "meta": "m"},
            b"x" * 100_000,
        ]
        for p in payloads:
            ch.put(p)
        got = [ch.get().wait(30) for _ in payloads]
        assert got[0] == payloads[0]
        assert torch.equal(got[1], payloads[1]) and got[1].dtype == torch.int64
        assert torch.equal(got[2], big)
        assert torch.equal(got[3]["obs"], payloads[3]["obs"])
        assert torch.equal(got[3]["act"], big) and got[3]["meta"] == "m"
        assert got[4] == payloads[4]
        got[2][0] = -1.0  # a received tensor is writable and owns its memory
        with pytest.raises(SerializationError):
            ch.put(threading.Lock())
    finally:
        ch.destroy().wait(10)


def test_get_batch_rule(cluster: aiorl.Cluster) -> None:
    ch = Channel.create(cluster, "batches")
    try:
        for name, w in [("a", 1), ("b", 2), ("c", 3)]:
            ch.put(name, weight=w)
        assert ch.get_batch(3).wait(10) == ["a", "b"]
        assert ch.get_batch(3).wait(10) == ["c"]
        ch.put("heavy", weight=10)
        ch.put("light", weight=1)
        assert ch.get_batch(3).wait(10) == ["heavy"]
        waiting = ch.get_batch(4)  # has "light" (1): waits for 3 more
        time.sleep(0.2)
        assert not waiting.done()
        ch.put("m", weight=2)
        time.sleep(0.1)
        assert not waiting.done()
        ch.put("n", weight=1.5)
        assert waiting.wait(10) == ["light", "m", "n"]
        with pytest.raises(ValueError):
            ch.get_batch(0)
        with pytest.raises(ValueError):
            ch.put("x", weight=-1)
    finally:
        ch.destroy().wait(10)


def test_maxsize_full_empty_qsize_and_nowait(cluster: aiorl.Cluster) -> None:
    ch = Channel.create(cluster, "bounded", maxsize=2)
    try:
        # A queue never used exists implicitly, empty, with the channel's maxsize.
        assert (ch.qsize("unused"), ch.empty("unused"), ch.full("unused")) == (0, True, False)
        with pytest.raises(QueueEmpty):
            ch.get_nowait("unused")
        ch.put(0).wait(10)
        ch.put_nowait(1)
        assert (ch.qsize(), ch.empty(), ch.full()) == (2, False, True)
        with pytest.raises(QueueFull):
            ch.put_nowait(2)
        blocked = ch.put(2)  # backpressure: waits for room
        time.sleep(0.3)
        assert not blocked.done()
        stats = ch.statistics().wait(10)
        assert stats["default"].waiting_putters == 1 and stats["default"].qsize == 2
        assert ch.get().wait(10) == 0
        blocked.wait(10)
        assert ch.qsize() == 2
        assert [ch.get_nowait(), ch.get_nowait()] == [1, 2]
        with pytest.raises(QueueEmpty):
            ch.get_nowait()
        assert ch.empty() and not ch.full()
        # A cancelled put that still waited is withdrawn; a timed-out get loses nothing.
        ch.put("a").wait(10)
        ch.put("b").wait(10)
        withdrawn = ch.put("c")
        time.sleep(0.1)
        withdrawn.cancel()
        with pytest.raises(TimeoutError):
            ch.get("other").wait(0.2)
        ch.put("late", queue_name="other").wait(10)
        assert ch.get("other").wait(10) == "late"
        assert [ch.get().wait(10), ch.get().wait(10)] == ["a", "b"]
        assert ch.qsize() == 0
    finally:
        ch.destroy().wait(10)


def test_async_puts_then_gets_in_order(cluster: aiorl.Cluster) -> None:
    ch = Channel.create(cluster, "ordered")
    group = Producer.create_group().launch(cluster, name="ordered-prod")
    try:
        assert group.puts_then_gets(ch, 1000).wait(60) == [list(range(1000))]
        # The same from the driver's thread.
        works = [ch.put(i) for i in range(1000)]
        for w in works:
            w.wait(30)
        gets = [ch.get() for _ in range(1000)]
        assert [g.wait(30) for g in gets] == list(range(1000))
    finally:
        group.close()
        ch.destroy().wait(10)


def test_many_producers_many_consumers_exactly_once(cluster: aiorl.Cluster) -> None:
    n_per_producer, n_producers, n_consumers = 10_000, 4, 4
    ch = Channel.create(cluster, "mpmc", maxsize=1000)
    producers = Producer.create_group().launch(
        cluster, NodePlacementStrategy([0, 1, 0, 1]), name="mpmc-prod")
    consumers = Consumer.create_group().launch(
        cluster, NodePlacementStrategy([1, 0, 1, 0]), name="mpmc-cons")
    try:
        producers.wait_ready()
        consumers.wait_ready()
        start = time.monotonic()
        consumed = consumers.consume_until_stop(ch, 64)
        assert producers.produce(ch, n_per_producer).wait(90) == [n_per_producer] * n_producers
        for _ in range(n_consumers):
            ch.put("STOP", weight=1e9)  # after every item (FIFO); ends exactly one batch
        per_consumer = consumed.wait(90)
        elapsed = time.monotonic() - start
        everything = [item for got in per_consumer for item in got]
        assert len(everything) == n_producers * n_per_producer
        assert set(everything) == {(p, i) for p in range(n_producers) for i in range(n_per_producer)}
        for got in per_consumer:  # per-producer FIFO, as seen by each consumer
            for p in range(n_producers):
                seq = [i for (src, i) in got if src == p]
                assert seq == sorted(seq)
        assert ch.qsize() == 0
        print(f"4x4 x {n_per_producer}: {len(everything) / elapsed:.0f} items/s")
    finally:
        producers.close()
        consumers.close()
        ch.destroy().wait(10)


def test_queue_isolation_with_reordered_gets(cluster: aiorl.Cluster) -> None:
    ch = Channel.create(cluster, "isolation")
    try:
        early = {q: ch.get(q) for q in ["b", "a", "c"]}  # waiting before any put
        batch_c = ch.get_batch(2, "c")
        for i in range(3):
            for q in ["a", "b", "c"]:
                ch.put(f"{q}{i}", weight=1, queue_name=q)
        assert {q: w.wait(10) for q, w in early.items()} == {"a": "a0", "b": "b0", "c": "c0"}
        assert batch_c.wait(10) == ["c1", "c2"]
        assert [ch.get("b").wait(10), ch.get("a").wait(10)] == ["b1", "a1"]
        assert [ch.get("a").wait(10), ch.get("b").wait(10)] == ["a2", "b2"]
        stats = ch.statistics().wait(10)
        assert set(stats) == {"a", "b", "c"} and all(s.qsize == 0 for s in stats.values())
    finally:
        ch.destroy().wait(10)


def test_handle_passed_to_another_group(cluster: aiorl.Cluster) -> None:
    ch = Channel.create(cluster, "shared")
    group = Producer.create_group().launch(cluster, NodePlacementStrategy([1]), name="shared-w")
    try:
        assert group.use_sync(ch, {"x": 1}).wait(30) == [({"x": 1}, 1, True)]
        assert group.use_async(ch, torch.ones(2)).wait(30)[0][1:] == (1, True)
        assert group.produce(ch, 5, 2).wait(30) == [5]
        assert [ch.get().wait(10) for _ in range(5)] == [(0, i) for i in range(5)]
        assert "shared" in repr(ch)
    finally:
        group.close()
        ch.destroy().wait(10)


def test_create_from_workers_affinity_and_race(cluster: aiorl.Cluster) -> None:
    on_node1 = Producer.create_group().launch(cluster, NodePlacementStrategy([1]), name="aff-1")
    racers = Producer.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name="aff-r")
    try:
        # Default: the creator's node. With affinity: the named worker's node.
        on_node1.create_sync("near-me").wait(30)
        assert _channel_pid(cluster, "near-me")[1] == 1
        racers.execute_on(0).create_sync("near-aff", "aff-1", 0).wait(30)
        assert _channel_pid(cluster, "near-aff")[1] == 1
        from_driver = Channel.create(cluster, "aff-driver", group_affinity="aff-1")
        assert _channel_pid(cluster, "aff-driver")[1] == 1
        # Two workers creating the same name at once end up on one channel.
        racers.create_sync("raced").wait(30)
        raced = Channel.connect(cluster, "raced")
        assert sorted([raced.get().wait(10), raced.get().wait(10)]) == [
            "from aff-r:0", "from aff-r:1"]
        # Creating a name that exists connects to it.
        again = Channel.create(cluster, "near-me")
        assert again.get().wait(10) == "from aff-1:0"
        # From an async method, create_channel returns at once and operations wait.
        lazy = on_node1.create_lazily("lazy", "early").wait(30)[0]
        assert lazy.get().wait(10) == "early"
        assert Channel.connect(cluster, "lazy").full() is False
        # Connect before the channel exists: the operation waits for it.
        waiting = on_node1.connect_and_get("late")
        time.sleep(0.3)
        late = Channel.create(cluster, "late")
        late.put("hello").wait(10)
        assert waiting.wait(30) == ["hello"]
        for name in ["near-me", "near-aff", "raced", "lazy", "late"]:
            Channel.connect(cluster, name).destroy().wait(10)
        from_driver.destroy().wait(10)
    finally:
        on_node1.close()
        racers.close()


def test_channel_worker_killed_fails_pending_operations(cluster: aiorl.Cluster) -> None:
    ch = Channel.create(cluster, "doomed", maxsize=1)
    group = Producer.create_group().launch(cluster, name="doomed-w")
    try:
        group.wait_ready()
        ch.put("fill").wait(10)
        pending_put = ch.put("blocked")
        pending_get = ch.get("empty")
        remote_get = group.pending_get(ch)
        time.sleep(0.5)
        assert not (pending_put.done() or pending_get.done() or remote_get.done())
        pid, _ = _channel_pid(cluster, "doomed")
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(PeerLostError):
            pending_put.wait(5)
        with pytest.raises(PeerLostError):
            pending_get.wait(5)
        assert remote_get.wait(5) == ["PeerLostError"]
        assert time.monotonic() - start < 5
        with pytest.raises(PeerLostError):  # later operations fail at once
            ch.put("after").wait(5)
    finally:
        group.close()


def test_cancelled_gets_lose_nothing_and_dead_consumers_return_items(
        cluster: aiorl.Cluster) -> None:
    ch = Channel.create(cluster, "refunds")
    group = Producer.create_group().launch(cluster, name="refunds-w")
    try:
        assert group.cancel_after_dispatch(ch).wait(30) == [["a", "b", "c"]]
        # A consumer that dies with a get parked: the next item goes to a live consumer.
        doomed = group.pending_get(ch)
        time.sleep(0.3)
        assert ch.statistics().wait(10)["never"].waiting_getters == 1
        group.close()
        with pytest.raises(PeerLostError):
            doomed.wait(10)
        time.sleep(0.3)  # the worker's connection to the channel is gone
        ch.put("survivor", queue_name="never").wait(10)
        assert ch.get("never").wait(10) == "survivor"
    finally:
        group.close()
        ch.destroy().wait(10)


def test_credited_puts_still_block_at_maxsize(cluster: aiorl.Cluster) -> None:
    ch = Channel.create(cluster, "credits", maxsize=5)
    group = Producer.create_group().launch(cluster, NodePlacementStrategy([1]), name="credits-w")
    try:
        # Sequential awaited puts complete at once while credits last, and credits never
        # exceed the room: the sixth put waits (and is withdrawn when its wait times out).
        assert group.put_until_blocked(ch, 20).wait(30) == [5]
        stats = ch.statistics().wait(10)["default"]
        assert (stats.qsize, stats.waiting_putters) == (5, 0)
        # The same from the driver's thread.
        assert [ch.get().wait(10) for _ in range(5)] == [0, 1, 2, 3, 4]
        for i in range(5):
            ch.put(i).wait(10)
        blocked = ch.put("sixth")
        time.sleep(0.3)
        assert not blocked.done()
        assert ch.get().wait(10) == 0
        blocked.wait(10)  # a get made room: the waiting put is admitted
        assert [ch.get().wait(10) for _ in range(5)] == [1, 2, 3, 4, "sixth"]
        ch.flush().wait(10)
        assert ch.qsize() == 0
    finally:
        group.close()
        ch.destroy().wait(10)


def test_sequential_streaming_keeps_order_and_get_batch_rules(cluster: aiorl.Cluster) -> None:
    n = 5000
    ch = Channel.create(cluster, "streaming")
    producer = Producer.create_group().launch(cluster, NodePlacementStrategy([0]), name="stream-p")
    consumer = Producer.create_group().launch(cluster, NodePlacementStrategy([1]), name="stream-c")
    try:
        producer.wait_ready()
        consumer.wait_ready()
        start = time.monotonic()
        got = consumer.stream_in(ch, n)
        producer.stream_out(ch, n).wait(60)
        assert got.wait(60) == [[(0, i) for i in range(n)]]
        print(f"sequential put/get 1->1 across nodes: {n / (time.monotonic() - start):.0f} items/s")
        # Prefetched items go back before a get_batch of the same process: it takes the
        # oldest items, with the usual weight rule, and nothing is lost.
        assert consumer.gets_then_batch(ch).wait(30) == [[[0, 1, 2], [3, 4, 5], 6, 3]]
        assert [ch.get("mixed").wait(10) for _ in range(3)] == [7, 8, 9]
    finally:
        producer.close()
        consumer.close()
        ch.destroy().wait(10)


def test_puts_sent_on_credits_complete_only_once_in_the_queue(cluster: aiorl.Cluster) -> None:
    """Issue 27, item 5: a put sent at once on a credit used to complete before its item
    left the process. Now it travels at once and completes when the channel worker has
    it: with that worker stopped, no put completes; when it dies, each fails and says so."""
    ch = Channel.create(cluster, "pipelined")
    ch.put(0).wait(10)  # answered, with credits for the next ones
    ch.flush().wait(10)
    pid, _ = _channel_pid(cluster, "pipelined")
    os.kill(pid, signal.SIGSTOP)
    try:
        works = [ch.put(i) for i in range(1, 50)]
        with pytest.raises(aiorl.WaitTimeout):
            works[0].wait(0.3)  # sent, but nobody has it yet: not done
        assert not any(w.done() for w in works[1:])
    finally:
        os.kill(pid, signal.SIGKILL)
    for w in works[1:]:
        with pytest.raises(PeerLostError, match="not yet admitted"):
            w.wait(10)
    with pytest.raises(PeerLostError):  # and later operations fail as for any dead channel
        ch.put("after").wait(10)


class SuddenDeath(aiorl.Worker):
    async def put_then_die(self, ch: Channel, n: int) -> None:
        for i in range(n):
            await ch.put(i, weight=1)
        os.kill(os.getpid(), signal.SIGKILL)  # no flush, no goodbye


def test_every_put_that_returned_stays_when_its_producer_is_killed(
        cluster: aiorl.Cluster) -> None:
    """Issue 27, item 5: 5,000 awaited puts, then SIGKILL: the channel held 4,098 (the
    rest had completed on credits while still in the producer's process)."""
    n = 5000
    ch = Channel.create(cluster, "survives-its-producer")
    group = SuddenDeath.create_group().launch(cluster, NodePlacementStrategy([1]),
                                              name="sudden-death")
    try:
        with pytest.raises(aiorl.AiorlError):
            group.put_then_die(ch, n).wait(120)
        assert ch.qsize() == n
        assert [ch.get().wait(10) for _ in range(3)] == [0, 1, 2]
    finally:
        group.close()
        ch.destroy().wait(10)


def test_invalid_arguments(cluster: aiorl.Cluster) -> None:
    with pytest.raises(ValueError):
        Channel.create(cluster, "bad:name")
    with pytest.raises(ValueError):
        Channel.create(cluster, "neg", maxsize=-1)
    with pytest.raises(TimeoutError):
        Channel.connect(cluster, "does-not-exist", timeout=0.5)
    with pytest.raises(aiorl.PlacementError):
        Channel.create(cluster, "nowhere", node_rank=7)


def test_destroy_then_create_again(cluster: aiorl.Cluster) -> None:
    group = Producer.create_group().launch(cluster, name="again-w")
    try:
        ch = Channel.create(cluster, "again")
        assert group.use_sync(ch, 1).wait(30) == [(1, 1, True)]
        ch.destroy().wait(10)
        with pytest.raises(PeerLostError):
            ch.put("lost").wait(10)
        ch2 = Channel.create(cluster, "again")
        ch2.put("new").wait(10)
        assert ch.get().wait(10) == "new"  # the old handle finds the new channel by name
        assert group.use_sync(ch2, 2).wait(30) == [(2, 1, True)]  # so does the worker
        ch2.destroy().wait(10)
    finally:
        group.close()


def test_destroy_is_an_end_not_a_death(cluster: aiorl.Cluster,
                                       caplog: pytest.LogCaptureFixture) -> None:
    """Destroying a channel ends its worker group: no "died" warnings for its ranks, and
    the driver forgets the group (a registry restart must not bring it back)."""
    ch = Channel.create(cluster, "ended")
    ch.put(1).wait(10)
    group_name = ch.worker_group.worker_group_name
    assert group_name in cluster.groups
    with caplog.at_level(logging.INFO, logger="aiorl.group"):
        ch.destroy().wait(10)
        deadline = time.monotonic() + 10
        while group_name in cluster.groups and time.monotonic() < deadline:
            time.sleep(0.05)
    assert group_name not in cluster.groups
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_statistics_from_a_coroutine_on_another_loop(cluster: aiorl.Cluster) -> None:
    ch = Channel.create(cluster, "aio")

    async def main() -> dict[str, QueueStats]:
        await ch.put("x", weight=2.5)
        getter = ch.get("idle")
        await asyncio.sleep(0.1)
        stats = await ch.statistics()
        getter.cancel()
        return stats

    try:
        stats = asyncio.run(main())
        assert stats["default"] == QueueStats(1, 2.5, 0, 0, 0, 0)
        assert stats["idle"].waiting_getters == 1
        assert ch.get().wait(10) == "x"
    finally:
        ch.destroy().wait(10)


def test_str_and_peek_all_on_a_plain_channel(cluster: aiorl.Cluster) -> None:
    ch = Channel.create(cluster, "shown", maxsize=5)
    group = Producer.create_group().launch(cluster, name="shown-w")
    try:
        ch.put({"obs": list(range(100))}, weight=3, key="shown")
        ch.put("second", weight=1, key="shown")
        assert [q.item for q in ch.peek_all(queue_name="shown")] == [
            {"obs": list(range(100))}, "second"]
        assert str(ch).splitlines() == [
            "Channel 'shown': 1 queue",
            "  'shown': 2/5 item(s), weight 4",
            "    [0] weight 3: {'obs': [0, 1, 2, 3, ...]}",
            "    [1] weight 1: 'second'",
        ]
        text, peeked = group.peek_on_loop(ch).wait(30)[0]
        assert text.startswith("<Channel 'shown'")  # the repr: no blocking snapshot
        assert peeked == [QueuedItem({"obs": list(range(100))}, 3.0), QueuedItem("second", 1.0)]
        assert ch.qsize("shown") == 2  # nothing was taken
    finally:
        group.close()
        ch.destroy().wait(10)
