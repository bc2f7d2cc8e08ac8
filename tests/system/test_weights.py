"""Versioned weight publication between real worker processes (``aiorl.weights``).

One embedded two-node cluster for the module: trainers and rollouts on node 0 (shared
memory), two more rollouts on node 1 (one of them relays each version to its node).
Every published tensor is filled with its version number, so a pull that mixed two
versions shows up as a tensor that is not uniform or not equal to the version returned.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

import aiorl
from aiorl.placement import NodePlacementStrategy
from aiorl.weights.segment import SegmentReader, VersionedSegment

pytestmark = pytest.mark.timeout(120)

#: name -> (numel, dtype) of the test model: mixed sizes and dtypes (bf16 holds ints < 256).
SHAPES: dict[str, tuple[int, torch.dtype]] = {
    "embed": (1 << 20, torch.float32),
    "layer.0.w": (300_000, torch.bfloat16),
    "layer.0.b": (1000, torch.float32),
    "layer.1.w": (2 << 20, torch.float32),
    "scale": (1, torch.int64),
    "empty": (0, torch.float32),
}


def model(fill: float, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    return {n: torch.full((numel,), fill, dtype=dt) for n, (numel, dt) in SHAPES.items()
            if names is None or n in names}


def shard_names(shard: int, num_shards: int) -> list[str]:
    return [n for i, n in enumerate(SHAPES) if i % num_shards == shard]


def model_bytes() -> int:
    return sum(numel * dt.itemsize for numel, dt in SHAPES.values())


def uniform_version(sd: dict[str, torch.Tensor]) -> set[float]:
    """The set of values found in the state dict (one value: one version)."""
    return {float(v) for t in sd.values() if t.numel() for v in torch.unique(t.float())}


class Trainer(aiorl.Worker):
    async def publish(self, name: str, version: int, num_shards: int = 1) -> int:
        shard = self.rank if num_shards > 1 else 0
        pub = self.weight_publisher(name, shard=shard, num_shards=num_shards, bucket_mb=1)
        return await pub.publish(model(version % 200, shard_names(shard, num_shards)), version)

    async def hammer(self, name: str, first: int, count: int) -> int:
        pub = self.weight_publisher(name, bucket_mb=1)
        sd = model(0)
        for v in range(first, first + count):
            for t in sd.values():
                t.fill_(v % 200)
            await pub.publish(sd, v)
        return first + count - 1

    async def publish_and_die_midway(self, name: str, version: int) -> None:
        """Start writing ``version`` and get SIGKILLed after half of the tensors."""
        import aiorl.weights.publisher as publisher

        def write_half_then_die(tensors: Any, places: Any, groups: Any) -> None:
            for place in places[: len(places) // 2]:
                place.fill_(0x7F)
            os.kill(os.getpid(), signal.SIGKILL)

        publisher.write_tensors = write_half_then_die
        await self.weight_publisher(name, bucket_mb=1).publish(model(version), version)


class Rollout(aiorl.Worker):
    def __init__(self) -> None:
        self.sd = model(-1)

    def node(self) -> int:
        return self.worker_info.node_rank

    async def pull(self, name: str) -> tuple[int, list[float]]:
        """Pull into this worker's model; the version and the values found."""
        for t in self.sd.values():
            t.fill_(-1)
        version = await self.weight_subscriber(name).pull(into=self.sd)
        return version, sorted(uniform_version(self.sd))

    async def wait_for(self, name: str, version: int, timeout: float = 30) -> int:
        return await self.weight_subscriber(name).wait_for(version, timeout=timeout)

    def latest(self, name: str) -> int | None:
        return self.weight_subscriber(name).latest_version

    async def pull_until(self, name: str, last: int, slow: bool) -> tuple[list[int], int]:
        """Pull in a loop until ``last``; every pull must be one uniform, newer version.

        ``slow`` makes this reader's copies slow (a pause after each tensor), so that the
        publisher rewrites slots under it: without the seqlock those copies would mix.
        """
        import aiorl.weights.subscriber as subscriber

        fast_read = subscriber.read_tensors

        def slow_read(places: Any, dsts: Any, groups: Any) -> None:
            for place, dst in zip(places, dsts, strict=True):
                fast_read([place], [dst], [[0]])
                time.sleep(0.02)

        if slow:
            subscriber.read_tensors = slow_read
        versions: list[int] = []
        sub = self.weight_subscriber(name)
        try:
            while not versions or versions[-1] < last:
                v = await sub.pull(into=self.sd)
                found = uniform_version(self.sd)
                assert found == {float(v % 200)}, f"pull of {v} mixed versions: {sorted(found)}"
                assert not versions or v >= versions[-1], f"went back: {versions[-1]} -> {v}"
                if not versions or v > versions[-1]:
                    versions.append(v)
                if v < last:
                    await sub.wait_for(v + 1)
        finally:
            subscriber.read_tensors = fast_read
        return versions, sub.statistics().torn_retries

    def stats(self, name: str) -> dict[str, int]:
        return vars(self.weight_subscriber(name).statistics())

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster2():
    with aiorl.Cluster(num_nodes=2) as c:
        yield c


@pytest.fixture(scope="module")
def trainers(cluster2):
    return Trainer.create_group().launch(cluster2, NodePlacementStrategy([0, 0]), name="trainer")


@pytest.fixture(scope="module")
def rollouts(cluster2):
    """Ranks 0-3 on node 0 (the trainers' node), ranks 4-5 on node 1."""
    return Rollout.create_group().launch(
        cluster2, NodePlacementStrategy([0, 0, 0, 0, 1, 1]), name="rollout")


LOCAL = [0, 1, 2, 3]
REMOTE = [4, 5]


# ----------------------------------------------------------------------------- the seqlock
def test_torn_read_detector_unit():
    """A copy the writer interleaves with is refused; clean, odd and wrong-version reads too."""
    seg = VersionedSegment(4096)
    try:
        reader = SegmentReader(seg.ref)
        seg.begin_write(0, 7)
        seg.slot(0)[:] = 7
        assert not reader.read(0, 7, lambda src: None)  # being written: odd sequence
        seg.end_write(0)
        copied: list[int] = []
        assert reader.read(0, 7, lambda src: copied.append(int(src[0])))
        assert copied == [7]
        assert not reader.read(0, 6, lambda src: None)  # the slot holds another version

        def copy_while_writer_starts(src: Any) -> None:
            first = int(src[0])
            seg.begin_write(0, 8)  # the publisher reuses the slot during the copy
            seg.slot(0)[:] = 8
            seg.end_write(0)
            copied.append(first + int(src[-1]))  # a mix of 7 and 8

        assert not reader.read(0, 7, copy_while_writer_starts)
        assert reader.read(0, 8, lambda src: None)
        # An aborted write leaves the slot holding no version at all.
        seg.begin_write(1, 9)
        seg.end_write(1, complete=False)
        assert seg.version(1) == -1 and seg.slot_of(9) is None and seg.spare_slot() == 1
    finally:
        seg.close()


def test_segment_is_read_only_for_subscribers():
    seg = VersionedSegment(4096)
    try:
        reader = SegmentReader(seg.ref)
        with pytest.raises((TypeError, ValueError)):
            reader.slot(0)[:] = 1
    finally:
        seg.close()


# ----------------------------------------------------------------------------- end to end
def test_one_publisher_four_subscribers(trainers, rollouts):
    four = rollouts.execute_on(LOCAL)
    assert trainers.execute_on(0).publish("w-fanout", 3).wait(60) == [3]
    assert four.pull("w-fanout").wait(60) == [(3, [3.0])] * 4
    assert four.latest("w-fanout").wait(10) == [3] * 4
    assert trainers.execute_on(0).publish("w-fanout", 4).wait(30) == [4]
    assert four.wait_for("w-fanout", 4).wait(30) == [4] * 4
    assert four.pull("w-fanout").wait(30) == [(4, [4.0])] * 4
    # Versions must increase.
    with pytest.raises(aiorl.RemoteError, match="newer"):
        trainers.execute_on(0).publish("w-fanout", 4).wait(30)


def test_sharded_publishers_assemble_one_version(trainers, rollouts):
    both = trainers  # rank r publishes shard r of 2
    assert both.publish("w-sharded", 1, num_shards=2).wait(60) == [1, 1]
    assert rollouts.execute_on(0).pull("w-sharded").wait(60) == [(1, [1.0])]
    # Only shard 0 has version 2: the newest complete version is still 1.
    trainers.execute_on(0).publish("w-sharded", 2, num_shards=2).wait(30)
    assert rollouts.execute_on(0).pull("w-sharded").wait(30) == [(1, [1.0])]
    trainers.execute_on(1).publish("w-sharded", 2, num_shards=2).wait(30)
    assert rollouts.execute_on(0).wait_for("w-sharded", 2).wait(30) == [2]
    assert rollouts.execute_on(0).pull("w-sharded").wait(30) == [(2, [2.0])]


def test_slow_subscriber_skips_to_newest(trainers, rollouts):
    one, pub = rollouts.execute_on(1), trainers.execute_on(0)
    pub.publish("w-slow", 1).wait(60)
    assert one.pull("w-slow").wait(60) == [(1, [1.0])]
    for v in range(2, 7):
        pub.publish("w-slow", v).wait(30)
    assert one.wait_for("w-slow", 6).wait(30) == [6]
    assert one.pull("w-slow").wait(30) == [(6, [6.0])]
    stats = one.stats("w-slow").wait(10)[0]
    assert stats["pulls"] == 2 and stats["versions_skipped"] == 4


def test_pulls_never_mix_versions_while_publisher_hammers(trainers, rollouts):
    """Four subscribers pull in a loop while versions are rewritten as fast as possible."""
    pub = trainers.execute_on(0)
    pub.publish("w-hammer", 1).wait(60)
    readers = rollouts.execute_on(LOCAL)
    readers.wait_for("w-hammer", 1).wait(30)
    pulls = [rollouts.execute_on(r).pull_until("w-hammer", 60, slow=r < 2) for r in LOCAL]
    assert pub.hammer("w-hammer", 2, 59).wait(60) == [60]
    results = [p.wait(60)[0] for p in pulls]
    for versions, _torn in results:
        assert versions[-1] == 60 and versions == sorted(versions)
    # The slow readers had copies overwritten under them, detected and retried.
    assert results[0][1] + results[1][1] > 0


def test_publisher_killed_mid_publish_keeps_previous_version(cluster2, rollouts):
    doomed = Trainer.create_group().launch(cluster2, NodePlacementStrategy([0]), name="doomed")
    try:
        doomed.publish("w-doomed", 5).wait(60)
        reader = rollouts.execute_on(2)
        assert reader.pull("w-doomed").wait(30) == [(5, [5.0])]
        with pytest.raises(aiorl.PeerLostError):
            doomed.publish_and_die_midway("w-doomed", 6).wait(30)
        with pytest.raises(aiorl.RemoteError) as lost:
            reader.wait_for("w-doomed", 6).wait(30)
        assert lost.value.exc_type.endswith("PeerLostError") and "doomed:0" in str(lost.value)
        # The previous version is intact (no 0x7F bytes of the half-written one).
        assert reader.pull("w-doomed").wait(30) == [(5, [5.0])]
        assert reader.latest("w-doomed").wait(10) == [5]
    finally:
        doomed.close()


def test_other_node_receives_each_version_once_through_one_relay(trainers, rollouts):
    pub = trainers.execute_on(0)
    for v in (1, 2):
        pub.publish("w-nodes", v).wait(60)
        assert rollouts.wait_for("w-nodes", v).wait(60) == [v] * 6
        assert rollouts.pull("w-nodes").wait(60) == [(v, [float(v)])] * 6
    stats = rollouts.stats("w-nodes").wait(10)
    local = [s for r, s in enumerate(stats) if r in LOCAL]
    remote = [s for r, s in enumerate(stats) if r in REMOTE]
    assert all(s["relayed_bytes"] == 0 for s in local)
    # Node 1 received each version's bytes exactly once, through one of its two rollouts.
    assert sum(s["relayed_versions"] for s in remote) == 2
    per_version = sum(s["relayed_bytes"] for s in remote) / 2
    assert model_bytes() <= per_version <= model_bytes() + 64 * len(SHAPES)  # + alignment
    assert sorted(s["relayed_versions"] for s in remote) == [0, 2]


def test_dead_relay_is_replaced_by_another_subscriber_of_its_node(cluster2, trainers):
    pair = Rollout.create_group().launch(cluster2, NodePlacementStrategy([1, 1]), name="pair")
    try:
        pub = trainers.execute_on(0)
        pub.publish("w-relay", 1).wait(60)
        assert pair.wait_for("w-relay", 1).wait(60) == [1, 1]
        assert pair.pull("w-relay").wait(60) == [(1, [1.0])] * 2
        relayed = [s["relayed_versions"] for s in pair.stats("w-relay").wait(30)]
        relay = relayed.index(1)
        with pytest.raises(aiorl.PeerLostError):
            pair.execute_on(relay).die().wait(30)
        survivor = pair.execute_on(1 - relay)
        pub.publish("w-relay", 2).wait(60)
        assert survivor.wait_for("w-relay", 2).wait(60) == [2]
        assert survivor.pull("w-relay").wait(60) == [(2, [2.0])]
        # It took over: it fetched v2 (and v1 too if it was elected before v2 existed,
        # since the node's copy died with the old relay).
        assert survivor.stats("w-relay").wait(30)[0]["relayed_versions"] in (1, 2)
    finally:
        pair.close()


# ----------------------------------------------------------------------------- layout, errors
def test_layout_buckets_cover_every_tensor_within_the_bucket_size():
    from aiorl.weights.layout import check_layout, layout_of

    sd = {"a": torch.zeros(10), "big": torch.zeros(1000, dtype=torch.bfloat16),
          "c": torch.zeros(300), "empty": torch.zeros(0), "scalar": torch.tensor(1.0)}
    layout = layout_of(sd, bucket_bytes=1024)
    assert all(0 < end - start <= 1024 for start, end in layout.buckets)
    assert all(s.offset % 64 == 0 for s in layout.tensors)
    covered = [(s, e) for s, e in layout.buckets]
    for spec in layout.tensors:  # every byte of every tensor is in exactly one bucket
        inside = sum(max(0, min(e, spec.offset + spec.nbytes) - max(s, spec.offset))
                     for s, e in covered)
        assert inside == spec.nbytes, spec.name
    check_layout(layout, {k: v.clone() for k, v in sd.items()})
    with pytest.raises(ValueError, match="changed"):
        check_layout(layout, {**sd, "c": torch.zeros(301)})
    with pytest.raises(ValueError, match="missing"):
        check_layout(layout, {k: v for k, v in sd.items() if k != "a"})


class Misuser(aiorl.Worker):
    async def misuse(self) -> list[str]:
        """Each wrong call, and the error it raised."""
        pub = self.weight_publisher("w-misuse", bucket_mb=1)
        sub = self.weight_subscriber("w-misuse")
        await pub.publish(model(1), 1)
        await sub.wait_for(1)
        errors = []
        for call in (lambda: pub.publish(model(2), "2"),                      # not an int
                     lambda: pub.publish({"x": [1.0]}, 2),                    # not a tensor
                     lambda: pub.publish(model(2, ["embed"]), 2),             # layout changed
                     lambda: sub.pull(into=model(0, ["embed"])),              # missing names
                     lambda: sub.pull(into={**model(0), "embed": torch.zeros(3)})):  # shape
            try:
                await call()
            except (TypeError, ValueError, KeyError) as exc:
                errors.append(type(exc).__name__)
        return errors


def test_misuse_raises_specific_errors(cluster2):
    g = Misuser.create_group().launch(cluster2, NodePlacementStrategy([0]), name="misuser")
    try:
        assert g.misuse().wait(60) == [["TypeError", "TypeError", "ValueError", "KeyError",
                                        "ValueError"]]
    finally:
        g.close()
