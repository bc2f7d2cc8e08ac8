"""Weights published from a GPU reach host memory only when a reader needs it (issue 26).

What runs here without a GPU: the segment's host bytes (created sparse, reserved on first
use, a host word per slot beside the seqlock), the rule that decides who reads from host
memory (`reads_from_gpu`), and the directory's side with real processes: which versions
each subscriber is offered, and what a GPU publisher is told (``weights.host``), using
fake device UUIDs (the directory only compares them). The publisher's and the
subscriber's CUDA copies run in ``tests/gpu/test_weights_cuda.py`` on a GPU machine.
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
from aiorl.protocol.ops import DirectoryOp
from aiorl.protocol.weights import SCHEMA, Announce, CudaExport, RegisterPublisher, ShardSource
from aiorl.weights.directory import reads_from_gpu
from aiorl.weights.segment import SegmentReader, VersionedSegment

pytestmark = pytest.mark.timeout(120)

MB = 1 << 20


def _allocated(segment: VersionedSegment) -> int:
    """Bytes of the segment's memfd that are backed by memory."""
    return os.fstat(segment.ref.fd).st_blocks * 512


# ----------------------------------------------------------------------------- the segment
def test_gpu_publisher_segment_holds_no_host_memory_until_a_version_must_reach_it() -> None:
    seg = VersionedSegment(64 * MB, host=False)
    try:
        assert not seg.host_backed and _allocated(seg) < MB  # the header page only
        reader = SegmentReader(seg.ref)
        seg.begin_write(0, 1)
        seg.end_write(0, host=False)  # written to the GPU slot only
        assert seg.version(0) == 1 and seg.host_version(0) == -1
        assert seg.host_slot_of(1) is None and seg.slot_of(1) == 0
        # A host reader is refused without touching the slot; a GPU reader gets the seqlock.
        copies: list[Any] = []
        assert not reader.read(0, 1, copies.append)
        assert reader.read(0, 1, copies.append, host=False) and copies == [None]
        assert reader._bytes is None and _allocated(seg) < MB  # nothing mapped, nothing used
        with pytest.raises(RuntimeError, match="not allocated"):
            seg.slot(0)
        # A host reader appears: the bytes are reserved once, the version copied, marked.
        assert seg.ensure_host() and not seg.ensure_host()
        assert _allocated(seg) >= seg.size - MB
        seg.slot(0)[:] = 1
        assert seg.mark_host(0, 1) and seg.host_version(0) == 1 and seg.host_slot_of(1) == 0
        assert reader.read(0, 1, lambda src: copies.append(int(src[0]) + int(src[-1])))
        assert copies[-1] == 2
        assert seg.host_bytes().size == seg.size - 4096
    finally:
        seg.close()


def test_host_bytes_follow_the_seqlock_and_never_outlive_their_version() -> None:
    seg = VersionedSegment(4096, host=False)
    try:
        seg.ensure_host()
        reader = SegmentReader(seg.ref)
        seg.begin_write(0, 1)
        seg.slot(0)[:] = 1
        seg.end_write(0, host=True)
        assert seg.host_version(0) == 1
        # The slot is reused for a GPU-only version: its stale host bytes are not version 1
        # nor version 3 any more.
        seg.begin_write(0, 3)
        seg.end_write(0, host=False)
        assert not reader.read(0, 1, lambda src: None)
        assert not reader.read(0, 3, lambda src: None)
        # A copy to host memory that finished after the slot was rewritten is not marked.
        seg.begin_write(0, 5)
        seg.end_write(0, host=False)
        assert not seg.mark_host(0, 3) and seg.host_version(0) == -1

        def rewritten_during_copy(src: Any) -> None:
            seg.begin_write(0, 7)  # the publisher reuses the slot while a host reader copies
            seg.end_write(0, host=True)

        assert seg.mark_host(0, 5)
        assert not reader.read(0, 5, rewritten_during_copy)  # torn: refused
        assert seg.host_version(0) == 7 and reader.read(0, 7, lambda src: None)
        # An aborted write leaves no version, on the GPU or in host memory.
        seg.begin_write(1, 9)
        seg.end_write(1, complete=False, host=True)
        assert seg.version(1) == -1 and seg.host_version(1) == -1
    finally:
        seg.close()


# ----------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(("worker", "node", "gpu_of", "host_pulls", "expected"), [
    ("r:0", "n0", {"r:0": "GPU-a"}, set(), True),   # pulls into the publisher's GPU
    ("r:0", "n0", {}, set(), False),                # has not said where it pulls to yet
    ("r:0", "n0", {"r:0": "GPU-b"}, set(), False),  # another GPU: host while a round runs
    ("r:0", "n1", {"r:0": "GPU-a"}, set(), False),  # another node: its relay reads host
    ("r:0", "n0", {"r:0": "GPU-a"}, {"r:0"}, False),  # also pulled into host memory
])
def test_who_reads_a_gpu_publisher_without_host_memory(
        worker: str, node: str, gpu_of: dict[str, str], host_pulls: set[str],
        expected: bool) -> None:
    assert reads_from_gpu(worker, node, "n0", "GPU-a", gpu_of, host_pulls) is expected
    assert not reads_from_gpu(worker, node, "n0", None, gpu_of, host_pulls)  # CPU publisher


# ----------------------------------------------------------------------------- the directory
class HostProbe(aiorl.Worker):
    """Talks to a weight directory as a GPU publisher (rank 0) and subscribers would."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[tuple[bool, int]] = []

    def _service(self) -> Any:
        from aiorl.weights.service import weights_service

        return weights_service(self._runtime, self.worker_info)

    async def register_gpu_publisher(self, name: str, uuid: str) -> None:
        from aiorl.weights.layout import layout_of

        service = self._service()
        layout = layout_of({"w": torch.zeros(1000)}, MB)
        self._segment = VersionedSegment(layout.nbytes, host=False)
        # What the publisher is told, in the order it applies it (as WeightPublisher does).
        service.host_handlers[(name, 0)] = lambda wanted, _inc, counter: self.told.append(
            (wanted, counter))
        source = ShardSource(0, service.worker, service.info.endpoint, self._segment.ref,
                             cuda=CudaExport(uuid, ()))
        await service.call_directory(name, RegisterPublisher(source, 1, service.node_id, layout))

    async def announce(self, name: str, version: int, slot: int, host: bool) -> list[Any]:
        service = self._service()
        reply = await service.call_directory(name, Announce(service.worker, 0, version, slot,
                                                            host=host))
        told = reply.host
        return [] if told is None else [told.wanted, told.incarnation, told.counter]

    def wanted(self) -> bool | None:
        """What the publisher was last told (None: nothing yet)."""
        return max(self.told, key=lambda t: t[1])[0] if self.told else None

    def last_counter(self) -> int:
        return max(counter for _, counter in self.told)

    async def call(self, name: str, op: str, *args: Any) -> Any:
        """Send the directory request of ``op`` as this worker, with ``args`` after its worker
        name and node."""
        service = self._service()
        request = SCHEMA[DirectoryOp(op)][0](service.worker, service.node_id, *args)
        return await service.call_directory(name, request)

    async def version(self, name: str) -> int | None:
        """The version the directory offers this subscriber now."""
        view = await self.call(name, "poll", -1, 0.0)
        return view.version

    async def write(self, name: str, version: int, slot: int, fill: float,
                    host: bool) -> None:
        """Publish ``version`` into ``slot`` as a GPU publisher would: ``host=False``, to
        the GPU only (the host bytes get ``fill``, garbage a host reader must never see)."""
        seg = self._segment
        seg.ensure_host()
        seg.begin_write(slot, version)
        seg.slot(slot).view("float32")[:] = fill
        seg.end_write(slot, host=host)
        await self.announce(name, version, slot, host)

    async def fill_host(self, name: str, version: int, slot: int) -> None:
        """Copy ``version`` to its host bytes after its publish, as a publisher asked for
        host copies does (`WeightPublisher._fill_host`)."""
        seg = self._segment
        seg.slot(slot).view("float32")[:] = version
        assert seg.mark_host(slot, version)
        await self.announce(name, version, slot, True)

    async def pull_to_cpu(self, name: str) -> tuple[int, list[float]]:
        into = {"w": torch.full((1000,), -1.0)}
        version = await self.weight_subscriber(name).pull(into=into)
        return version, sorted({float(v) for v in into["w"]})

    async def latest(self, name: str, version: int) -> int:
        return int(await self.weight_subscriber(name).wait_for(version, timeout=30))

    def slow_follow(self, name: str, delay: float) -> None:
        """From its next long poll on, this subscriber hears the directory ``delay`` s late
        (a busy process, a slow link): its view lags the directory."""
        service = self.weight_subscriber(name).service
        original = service.call_directory

        async def late(n: str, request: Any, **kwargs: Any) -> Any:
            answer = await original(n, request, **kwargs)
            if request.op == DirectoryOp.POLL and kwargs.get("wait_s"):
                await asyncio.sleep(delay)
            return answer

        service.call_directory = late

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster() -> Iterator[aiorl.Cluster]:
    with aiorl.Cluster(num_nodes=1) as c:
        yield c


def _until(probe: Any, expected: bool | None, what: str) -> None:
    deadline = time.monotonic() + 20
    while probe.wanted().wait(30) != [expected]:
        assert time.monotonic() < deadline, f"the publisher was not told {what} within 20 s"
        time.sleep(0.05)


def test_directory_asks_for_host_copies_only_while_a_host_reader_exists(
        cluster: aiorl.Cluster) -> None:
    name = "host-readers"
    probes = HostProbe.create_group().launch(cluster, NodePlacementStrategy([0, 0, 0]),
                                             name="hostprobe")
    pub, gpu_sub, cpu_sub = (probes.execute_on(r) for r in range(3))
    try:
        pub.register_gpu_publisher(name, "GPU-a").wait(60)
        _until(pub, False, "that nobody reads host memory")  # no subscriber yet
        # A subscriber that has not said where it pulls to may read host memory.
        assert gpu_sub.version(name).wait(30) == [None]
        _until(pub, True, "that a subscriber may read host memory")
        assert pub.announce(name, 1, 0, True).wait(30)[0][0] is True
        # It pulls into the publisher's GPU: host copies are no longer needed.
        gpu_sub.call(name, "gpu_subscribe", "GPU-a").wait(30)
        _until(pub, False, "that its only subscriber reads its GPU")
        answer = pub.announce(name, 2, 1, False).wait(30)[0]
        assert answer[0] is False and answer[2] == pub.last_counter().wait(30)[0]
        assert gpu_sub.version(name).wait(30) == [2]  # a GPU reader is offered the GPU copy
        # A CPU subscriber appears: it is never offered version 2 (on the GPU only), and the
        # publisher is asked for host copies.
        assert cpu_sub.version(name).wait(30) == [1]
        _until(pub, True, "that a host reader appeared")
        pub.announce(name, 2, 1, True).wait(30)  # the publisher copied it to host memory
        assert cpu_sub.version(name).wait(30) == [2]
        assert gpu_sub.version(name).wait(30) == [2]
        # The host reader dies: host copies stop.
        cpu_sub.die()
        _until(pub, False, "that the host reader died")
        pub.announce(name, 3, 0, False).wait(30)
        assert gpu_sub.version(name).wait(30) == [3]
        # The GPU subscriber pulls into host memory once: host copies again, and it is
        # offered only what host memory holds (the subscriber waits for 3's copy).
        gpu_sub.call(name, "host_pull").wait(30)
        _until(pub, True, "that the GPU subscriber reads host memory")
        assert gpu_sub.version(name).wait(30) == [2]
        pub.announce(name, 3, 0, True).wait(30)
        assert gpu_sub.version(name).wait(30) == [3]
    finally:
        probes.close()


def test_subscriber_offered_a_gpu_only_version_pulls_into_host_memory_after_its_copy(
        cluster: aiorl.Cluster) -> None:
    """A subscriber that named the publisher's GPU, offered a version its publisher wrote
    to the GPU only, pulls into CPU tensors: it tells the directory it reads host memory,
    waits (never taking the older version host memory holds, nor the stale host bytes) and
    returns the newest version once the publisher copied it there."""
    name = "host-late"
    probes = HostProbe.create_group().launch(cluster, NodePlacementStrategy([0, 0]),
                                             name="hostlate")
    pub, sub = probes.execute_on(0), probes.execute_on(1)
    try:
        pub.register_gpu_publisher(name, "GPU-a").wait(60)
        pub.write(name, 1, 0, 1.0, True).wait(30)
        sub.call(name, "gpu_subscribe", "GPU-a").wait(30)  # as its first pull into GPU-a did
        _until(pub, False, "that its only subscriber reads its GPU")
        pub.write(name, 2, 1, 99.0, False).wait(30)
        assert sub.latest(name, 2).wait(60) == [2]
        pulled = sub.pull_to_cpu(name)
        _until(pub, True, "that the subscriber reads host memory")
        time.sleep(0.5)
        assert not pulled.done()  # version 1 is in host memory, but 2 was offered already
        pub.fill_host(name, 2, 1).wait(30)
        assert pulled.wait(60) == [(2, [2.0])]
        # From now on it is a host reader: offered only versions in host memory.
        pub.write(name, 3, 0, 99.0, False).wait(30)
        pub.write(name, 4, 1, 4.0, True).wait(30)
        assert sub.pull_to_cpu(name).wait(60) == [(4, [4.0])]
    finally:
        probes.close()


def test_pull_after_publish_returned_gets_that_version_while_the_follow_lags(
        cluster: aiorl.Cluster) -> None:
    """Once publish(v) returned (the directory has v), every pull on the node returns v or
    newer, also from a subscriber that has not heard the directory's message yet: a pull
    whose segment's header holds a newer complete version asks the directory first (the
    CUDA test with a GPU publisher and three subscribers failed on this: the second GPU
    subscriber returned v - 1)."""
    name = "host-lag"
    probes = HostProbe.create_group().launch(cluster, NodePlacementStrategy([0, 0, 0]),
                                             name="hostlag")
    pub, lagging, prompt = (probes.execute_on(r) for r in range(3))
    try:
        pub.register_gpu_publisher(name, "GPU-a").wait(60)
        pub.write(name, 1, 0, 1.0, True).wait(30)  # host readers: written to host memory
        assert lagging.pull_to_cpu(name).wait(60) == [(1, [1.0])]
        assert prompt.pull_to_cpu(name).wait(60) == [(1, [1.0])]
        lagging.slow_follow(name, 5.0).wait(30)
        pub.write(name, 2, 1, 2.0, True).wait(30)  # answers the poll in flight, not slowed
        assert lagging.latest(name, 2).wait(30) == [2]
        for version, slot in ((3, 0), (4, 1)):
            pub.write(name, version, slot, float(version), True).wait(30)  # "publish" returned
            started = time.monotonic()
            assert lagging.pull_to_cpu(name).wait(60) == [(version, [float(version)])]
            assert time.monotonic() - started < 4.0  # asked the directory, did not wait
            assert prompt.pull_to_cpu(name).wait(60) == [(version, [float(version)])]
    finally:
        probes.close()
