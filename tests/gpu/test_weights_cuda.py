"""CUDA weight publication: a GPU publisher, subscribers on its GPU (CUDA IPC), on the host,
and on other GPUs (NCCL rounds to one representative per GPU, ``aiorl.weights.nccl``).

What needs what:

* the round schedule and the directory's election of GPU representatives run anywhere
  (real processes, no GPU: the directory never touches a GPU);
* ``test_gpu_publisher_to_gpu_and_cpu_subscribers``: one CUDA device;
* the NCCL tests: two CUDA devices on one machine (``needs_two_gpus``);
* ``test_two_nodes_each_gpu_receives_by_nccl``: two machines with a GPU each, given as a
  running cluster in ``AIORL_TEST_GPU_CLUSTER`` (``tcp://registry:port``, two nodes; the key
  file in ``AIORL_TEST_GPU_CLUSTER_KEY``); skipped otherwise.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import aiorl
from aiorl.placement import NodePlacementStrategy
from aiorl.weights.nccl import RoundSchedule, communicator_key

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0

pytestmark = [pytest.mark.timeout(180)]
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs (NCCL between them)")

SHAPES = {"w": (1 << 20, torch.float32), "h": (300_000, torch.bfloat16), "b": (7, torch.float32)}
#: A state dict of 1,000 tensors of mixed dtypes and odd sizes (copied a few kernels at a
#: time, `aiorl.cuda.bulk_copy`), plus a 2-d one a subscriber holds as a strided view.
MANY = {f"t{k}": (1 + (k * 37) % 515, [torch.float32, torch.bfloat16, torch.int32,
                                       torch.int8][k % 4]) for k in range(1000)}


def model(fill: float, device: str, shapes: str = "few") -> dict[str, torch.Tensor]:
    table = SHAPES if shapes == "few" else MANY
    out = {n: torch.full((numel,), fill, dtype=dt, device=device)
           for n, (numel, dt) in table.items()}
    if shapes == "strided":  # the subscriber's copy of "m" is a transposed view
        out["m"] = torch.full((33, 2), fill, device=device).t()
    elif shapes == "many":
        out["m"] = torch.full((2, 33), fill, device=device)
    return out


class GpuTrainer(aiorl.Worker):
    def __init__(self, device: int = 0, name: str = "gpu-w", shapes: str = "few") -> None:
        torch.cuda.set_device(device)
        self.name = name
        self.sd = model(0, f"cuda:{device}", shapes)

    async def publish(self, version: int) -> int:
        for t in self.sd.values():
            t.fill_(version)
        return int(await self.weight_publisher(self.name, bucket_mb=1).publish(self.sd, version))

    def rounds(self) -> tuple[int, int]:
        """NCCL rounds this publisher ran (intact, failed)."""
        fanout: Any = self.weight_publisher(self.name, bucket_mb=1)._fanout
        return (fanout.rounds_intact, fanout.rounds_failed) if fanout else (0, 0)

    def host_copies(self) -> tuple[int, int, bool, bool]:
        """(versions written to host memory, of those copied there after their publish,
        whether host copies are wanted now, whether the host slots are page-locked)."""
        publisher: Any = self.weight_publisher(self.name, bucket_mb=1)
        return (publisher.host_writes, publisher.host_backfills, publisher.host_wanted,
                publisher._pinned is not None)

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class GpuRollout(aiorl.Worker):
    def __init__(self, device: str, name: str = "gpu-w", shapes: str = "few") -> None:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        self.name = name
        self.sd = model(-1, device, shapes)

    def gpus(self) -> int:
        return torch.cuda.device_count()

    async def pull(self) -> tuple[int, list[float], str]:
        version = await self.weight_subscriber(self.name).pull(into=self.sd)
        values = sorted({float(v) for t in self.sd.values() for v in torch.unique(t.float())})
        return version, values, str(next(iter(self.sd.values())).device)

    async def pull_to_cpu(self) -> tuple[int, list[float]]:
        """Pull into CPU tensors (this subscriber's model stays where it is)."""
        into = model(-1, "cpu")
        version = await self.weight_subscriber(self.name).pull(into=into)
        return version, sorted({float(v) for t in into.values() for v in torch.unique(t.float())})

    async def on_my_gpu(self, version: int, timeout: float = 60.0) -> bool:
        """Wait until ``version`` (or newer) is on this worker's GPU: every shard either
        published from it or received there by its representative over NCCL."""
        sub: Any = self.weight_subscriber(self.name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            view = sub._view
            if view is not None and view.version is not None and view.version >= version \
                    and view.gpu_sources and all(
                        s is not None and view.version in s.slots for s in view.gpu_sources):
                return True
            await asyncio.sleep(0.05)
        return False

    async def wait_for(self, version: int, timeout: float) -> str:
        try:
            return str(await self.weight_subscriber(self.name).wait_for(version, timeout))
        except aiorl.AiorlError as exc:
            return type(exc).__name__

    def opened_gpu_slots(self) -> int:
        sub: Any = self.weight_subscriber(self.name)
        return len(sub._gpu_slots)

    def stats(self) -> dict[str, int]:
        return dict(vars(self.weight_subscriber(self.name).statistics()))

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster() -> Iterator[aiorl.Cluster]:
    with aiorl.Cluster(num_nodes=1) as c:
        yield c


# ----------------------------------------------------------------------------- anywhere
def test_round_schedule_runs_one_round_and_keeps_only_the_newest_pending() -> None:
    schedule = RoundSchedule()
    schedule.offer(1, 0)
    assert schedule.next([]) is None  # nobody to send to: v1 stays pending
    first = schedule.next(["rollout:1", "rollout:0"])
    assert first is not None and (first.version, first.slot) == (1, 0)
    assert first.members == ("rollout:0", "rollout:1")  # NCCL ranks in address order
    # Publishes while a round runs are never queued behind it: the newest replaces the rest.
    schedule.offer(2, 1)
    schedule.offer(3, 0)
    schedule.offer(2, 1)  # an older offer (a re-offer after a loss) does not go back
    assert schedule.next(["rollout:0"]) is None
    schedule.finished()
    second = schedule.next(["rollout:0"])
    assert second is not None and (second.number, second.version, second.slot) == (2, 3, 0)
    schedule.finished()
    assert schedule.next(["rollout:0"]) is None


def test_communicator_key_is_per_member_set_and_publisher() -> None:
    key = communicator_key("policy", 0, "trainer:0", ["rollout:0", "rollout:1"])
    assert key == communicator_key("policy", 0, "trainer:0", ["rollout:0", "rollout:1"])
    assert key != communicator_key("policy", 0, "trainer:0", ["rollout:0"])
    assert key != communicator_key("policy", 1, "trainer:0", ["rollout:0", "rollout:1"])
    assert key != communicator_key("policy", 0, "trainer:1", ["rollout:0", "rollout:1"])


class DirectoryProbe(aiorl.Worker):
    """Talks to a weight directory directly, as a GPU publisher and GPU subscribers would
    (fake device UUIDs: the directory only compares them)."""

    def _service(self) -> Any:
        from aiorl.weights.service import weights_service

        return weights_service(self._runtime, self.worker_info)

    async def register_gpu_publisher(self, name: str, uuid: str) -> None:
        from aiorl.protocol.weights import CudaExport, RegisterPublisher, ShardSource
        from aiorl.weights.layout import layout_of
        from aiorl.weights.segment import VersionedSegment

        service = self._service()
        sd = {"w": torch.zeros(1000)}
        layout = layout_of(sd, 1 << 20)
        self._segment = VersionedSegment(layout.nbytes)
        source = ShardSource(0, service.worker, service.info.endpoint, self._segment.ref,
                             cuda=CudaExport(uuid, ()))
        await service.call_directory(name, RegisterPublisher(source, 1, service.node_id, layout))

    async def subscribe(self, name: str, uuid: str) -> None:
        service = self._service()
        from aiorl.protocol.weights import GpuSubscribe

        await service.call_directory(name, GpuSubscribe(service.worker, service.node_id, uuid))

    async def view(self, name: str) -> tuple[list[tuple[int, str]], list[dict[int, int] | None]]:
        """((shard, its publisher) this worker represents its GPU for, each shard's copy on
        its GPU)."""
        service = self._service()
        from aiorl.protocol.weights import Poll

        view = await service.call_directory(name, Poll(service.worker, service.node_id, -1, 0.0))
        return [(s.shard, s.worker) for s in view.gpu_jobs], [None if s is None else dict(s.slots)
                                     for s in view.gpu_sources]

    async def announce(self, name: str, uuid: str, version: int) -> None:
        from aiorl.protocol.weights import AnnounceGpu, CudaExport
        from aiorl.weights.segment import VersionedSegment

        service = self._service()
        self._header = VersionedSegment(0)
        await service.call_directory(name, AnnounceGpu(service.worker, service.node_id, uuid, 0,
                                                       version, 1, self._header.ref,
                                                       CudaExport(uuid, ())))

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def test_directory_elects_one_representative_per_gpu_and_replaces_a_dead_one(
        cluster: aiorl.Cluster) -> None:
    name = "gpu-election"
    probes = DirectoryProbe.create_group().launch(cluster, NodePlacementStrategy([0, 0, 0, 0]),
                                                  name="probe")
    try:
        probes.execute_on(0).register_gpu_publisher(name, "GPU-a").wait(60)
        for rank, uuid in ((1, "GPU-b"), (2, "GPU-b"), (3, "GPU-a")):
            probes.execute_on(rank).subscribe(name, uuid).wait(30)
        # The first subscriber of GPU-b to ask represents it; the second copies from it;
        # a subscriber on the publisher's own GPU needs no representative.
        # (The representative joins the publisher itself, wherever the node's copy is.)
        assert probes.execute_on(1).view(name).wait(30) == [([(0, "probe:0")], [None])]
        assert probes.execute_on(2).view(name).wait(30) == [([], [None])]
        assert probes.execute_on(3).view(name).wait(30) == [([], [None])]
        probes.execute_on(1).announce(name, "GPU-b", 5).wait(30)
        assert probes.execute_on(2).view(name).wait(30) == [([], [{5: 1}])]
        # The representative dies: the GPU's next subscriber to ask takes over, and the
        # dead one's copy is no longer offered.
        probes.execute_on(1).die()
        deadline = time.monotonic() + 20
        while probes.execute_on(2).view(name).wait(30) != [([(0, "probe:0")], [None])]:
            assert time.monotonic() < deadline, "no new representative within 20 s"
            time.sleep(0.1)
    finally:
        probes.close()


# ----------------------------------------------------------------------------- one GPU
@needs_cuda
def test_gpu_publisher_to_gpu_and_cpu_subscribers(cluster: aiorl.Cluster) -> None:
    pub = GpuTrainer.create_group().launch(cluster, NodePlacementStrategy([0]), name="gpupub")
    on_gpu = GpuRollout.create_group("cuda:0").launch(
        cluster, NodePlacementStrategy([0, 0]), name="gpusub")
    on_cpu = GpuRollout.create_group("cpu").launch(cluster, NodePlacementStrategy([0]),
                                                   name="cpusub")
    try:
        for version in (1, 2, 3):
            assert pub.publish(version).wait(120) == [version]
            assert on_gpu.pull().wait(120) == [(version, [float(version)], "cuda:0")] * 2
            assert on_cpu.pull().wait(120) == [(version, [float(version)], "cpu")]
        # The subscribers on the publisher's GPU copied device to device (CUDA IPC).
        assert on_gpu.opened_gpu_slots().wait(30) == [1, 1]
        assert on_cpu.opened_gpu_slots().wait(30) == [0]
    finally:
        for g in (pub, on_gpu, on_cpu):
            g.close()


@needs_cuda
def test_a_thousand_tensors_of_mixed_dtypes_pulled_on_the_publishers_gpu(
        cluster: aiorl.Cluster) -> None:
    pub = GpuTrainer.create_group(0, "gpu-many", "many").launch(
        cluster, NodePlacementStrategy([0]), name="manypub")
    subs = [GpuRollout.create_group("cuda:0", "gpu-many", shapes).launch(
        cluster, NodePlacementStrategy([0]), name=f"manysub-{shapes}")
        for shapes in ("many", "strided")]
    try:
        for version in (1, 2, 3):
            assert pub.publish(version).wait(120) == [version]
            for sub in subs:
                assert sub.pull().wait(120) == [(version, [float(version)], "cuda:0")]
        assert [sub.opened_gpu_slots().wait(30) for sub in subs] == [[1], [1]]
    finally:
        for g in (pub, *subs):
            g.close()


@needs_cuda
def test_gpu_subscribers_only_no_host_copies_and_a_host_reader_gets_one(
        cluster: aiorl.Cluster) -> None:
    """Every subscriber on the publisher's GPU: versions stay on the GPU (no host write per
    publish). A CPU subscriber arriving later gets the newest version (copied to host memory
    once, beside publish), host copies go on while it lives and stop once it is gone; a GPU
    subscriber that pulls into CPU tensors once gets the newest version too."""
    name = "gpu-only"
    pub = GpuTrainer.create_group(0, name).launch(cluster, NodePlacementStrategy([0]),
                                                  name="gopub")
    subs = GpuRollout.create_group("cuda:0", name).launch(
        cluster, NodePlacementStrategy([0, 0]), name="gosub")
    cpu: Any = None
    try:
        # First pulls name the subscribers' GPU; until then a host copy is written.
        for version in (1, 2):
            assert pub.publish(version).wait(120) == [version]
            assert subs.pull().wait(120) == [(version, [float(version)], "cuda:0")] * 2
        ((writes, backfills, wanted, _pinned),) = pub.host_copies().wait(30)
        assert not wanted
        for version in (3, 4, 5):
            assert pub.publish(version).wait(120) == [version]
            assert subs.pull().wait(120) == [(version, [float(version)], "cuda:0")] * 2
        assert pub.host_copies().wait(30)[0][:2] == (writes, backfills)
        # A CPU subscriber: version 5 is copied to host memory for it, then every version.
        cpu = GpuRollout.create_group("cpu", name).launch(cluster, NodePlacementStrategy([0]),
                                                          name="gocpu")
        assert cpu.pull().wait(120) == [(5, [5.0], "cpu")]
        assert pub.publish(6).wait(120) == [6]
        assert cpu.pull().wait(120) == [(6, [6.0], "cpu")]
        assert subs.pull().wait(120) == [(6, [6.0], "cuda:0")] * 2
        ((writes6, backfills6, wanted6, pinned),) = pub.host_copies().wait(30)
        assert (writes6, backfills6, wanted6) == (writes + 1, backfills + 1, True)
        assert pinned, "the host slots were not page-locked (cudaHostRegister refused)"
        # It goes: host copies stop once the directory learnt of its death.
        cpu.close()
        cpu = None
        deadline = time.monotonic() + 30
        while pub.host_copies().wait(30)[0][2]:
            assert time.monotonic() < deadline, "host copies still wanted 30 s after"
            time.sleep(0.1)
        assert pub.publish(7).wait(120) == [7]
        assert pub.host_copies().wait(30)[0][0] == writes6
        # A GPU subscriber pulls into CPU tensors once: it gets version 7 all the same.
        assert subs.execute_on(0).pull_to_cpu().wait(120) == [(7, [7.0])]
        assert subs.pull().wait(120) == [(7, [7.0], "cuda:0")] * 2
    finally:
        for g in (pub, subs, cpu):
            if g is not None:
                g.close()


# ----------------------------------------------------------------------------- two GPUs
def _nccl_groups(cluster: aiorl.Cluster, name: str, tag: str) -> tuple[Any, Any]:
    """A publisher on GPU 0 and two subscribers on GPU 1 (one represents the GPU)."""
    pub = GpuTrainer.create_group(0, name).launch(cluster, NodePlacementStrategy([0]),
                                                  name=f"{tag}pub")
    subs = GpuRollout.create_group("cuda:1", name).launch(
        cluster, NodePlacementStrategy([0, 0]), name=f"{tag}sub")
    if min(subs.gpus().wait(120)) < 2:
        pub.close()
        subs.close()
        pytest.skip("the workers do not see two GPUs")
    return pub, subs


def _publish_and_pull_on_gpu(pub: Any, subs: Any, version: int) -> None:
    assert pub.publish(version).wait(120) == [version]
    assert subs.on_my_gpu(version).wait(90) == [True, True], f"v{version} never reached GPU 1"
    assert subs.pull().wait(120) == [(version, [float(version)], "cuda:1")] * 2


@needs_two_gpus
def test_subscribers_on_another_gpu_receive_by_nccl(cluster: aiorl.Cluster) -> None:
    pub, subs = _nccl_groups(cluster, "nccl-w", "nc")
    try:
        # The first pull names the subscribers' GPU (it copies from the host meanwhile):
        # one of them becomes its representative and joins the publisher's rounds.
        assert pub.publish(1).wait(120) == [1]
        assert subs.pull().wait(120) == [(1, [1.0], "cuda:1")] * 2
        for version in (2, 3, 4):
            _publish_and_pull_on_gpu(pub, subs, version)
        stats = subs.stats().wait(30)
        rep, other = sorted(stats, key=lambda s: -s["gpu_versions"])
        # One representative received the versions by NCCL, each byte once per version;
        # the other subscriber of the GPU received nothing itself.
        assert rep["gpu_versions"] >= 3 and other["gpu_versions"] == 0
        assert rep["gpu_bytes"] >= 3 * sum(n * dt.itemsize for n, dt in SHAPES.values())
        # Both copied device to device out of the representative's slots.
        assert subs.opened_gpu_slots().wait(30) == [1, 1]
        intact, _failed = pub.rounds().wait(30)[0]
        assert intact >= 3
    finally:
        pub.close()
        subs.close()


@needs_two_gpus
def test_dead_representative_never_blocks_publish_and_is_replaced(cluster: aiorl.Cluster) -> None:
    pub, subs = _nccl_groups(cluster, "nccl-dead-rep", "nd")
    try:
        assert pub.publish(1).wait(120) == [1]
        subs.pull().wait(120)
        _publish_and_pull_on_gpu(pub, subs, 2)
        stats = subs.stats().wait(30)
        rep = 0 if stats[0]["gpu_versions"] else 1
        subs.execute_on(rep).die()
        survivor = subs.execute_on(1 - rep)
        for version in (3, 4, 5):  # publish goes on at once, whatever the dead member
            t0 = time.monotonic()
            assert pub.publish(version).wait(60) == [version]
            assert time.monotonic() - t0 < 10
        # The survivor becomes GPU 1's representative and receives by NCCL again.
        assert survivor.pull().wait(60) == [(5, [5.0], "cuda:1")]
        assert survivor.on_my_gpu(5).wait(90) == [True]
        assert survivor.pull().wait(60) == [(5, [5.0], "cuda:1")]
        assert survivor.stats().wait(30)[0]["gpu_versions"] >= 1
    finally:
        pub.close()
        subs.close()


@needs_two_gpus
def test_publisher_killed_leaves_the_last_version_and_fails_waits(cluster: aiorl.Cluster) -> None:
    pub, subs = _nccl_groups(cluster, "nccl-dead-pub", "np")
    try:
        assert pub.publish(1).wait(120) == [1]
        subs.pull().wait(120)
        _publish_and_pull_on_gpu(pub, subs, 2)
        pub.execute_on(0).die()
        t0 = time.monotonic()
        assert subs.wait_for(3, 60).wait(90) == ["PeerLostError"] * 2
        assert time.monotonic() - t0 < 30
        assert subs.pull().wait(60) == [(2, [2.0], "cuda:1")] * 2
    finally:
        pub.close()
        subs.close()


# ----------------------------------------------------------------------------- two machines
GPU_CLUSTER = os.environ.get("AIORL_TEST_GPU_CLUSTER")


@pytest.mark.skipif(not GPU_CLUSTER, reason="needs two machines with a GPU each: set "
                    "AIORL_TEST_GPU_CLUSTER=tcp://registry:port (and AIORL_TEST_GPU_CLUSTER_KEY)")
def test_two_nodes_each_gpu_receives_by_nccl() -> None:
    with aiorl.Cluster(registry=GPU_CLUSTER, num_nodes=2,
                       key_file=os.environ.get("AIORL_TEST_GPU_CLUSTER_KEY"), timeout=60) as c:
        pub = GpuTrainer.create_group(0, "nccl-nodes").launch(c, NodePlacementStrategy([0]),
                                                              name="nnpub")
        subs = GpuRollout.create_group("cuda:0", "nccl-nodes").launch(
            c, NodePlacementStrategy([1, 1]), name="nnsub")
        try:
            assert pub.publish(1).wait(120) == [1]
            subs.pull().wait(120)
            for version in (2, 3):
                assert pub.publish(version).wait(120) == [version]
                assert subs.on_my_gpu(version).wait(90) == [True, True]
                assert subs.pull().wait(120) == [(version, [float(version)], "cuda:0")] * 2
            stats = subs.stats().wait(30)
            assert sorted(s["gpu_versions"] >= 2 for s in stats) == [False, True]
        finally:
            pub.close()
            subs.close()
