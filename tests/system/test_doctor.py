"""``aiorl doctor``: planted hangs in real worker processes, diagnosed with the right names.

* two workers each waiting a receive from the other: a deadlock cycle;
* a consumer waiting on an empty channel whose only producer was killed: a wait on a dead
  peer, naming the consumer, the channel and the producer;
* a group call whose rank 2 sleeps 10x longer than the others: rank 2 is the straggler;
* the command line (``aiorl doctor --json``, ``aiorl doctor stack``) against the same
  cluster from another process, with its exit status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import aiorl

pytestmark = pytest.mark.timeout(90)


class Pair(aiorl.Worker):
    async def wait_for_other(self) -> object:
        return await self.recv(self.worker_group_name, 1 - self.rank)


class Producer(aiorl.Worker):
    def put_some(self, n: int) -> int:
        channel = self.connect_channel("batches")
        for i in range(n):
            channel.put(i, async_op=False)
        channel.flush().wait(30)
        return os.getpid()


class Consumer(aiorl.Worker):
    async def take(self, n: int) -> list[int]:
        channel = self.connect_channel("batches")
        return [await channel.get() for _ in range(n)]


class Sleepy(aiorl.Worker):
    def work(self) -> int:
        time.sleep(6.0 if self.rank == 2 else 0.3)
        return self.rank


@pytest.fixture(scope="module")
def cluster():
    with aiorl.Cluster(num_nodes=1) as c:
        yield c


def _until(predicate, timeout: float = 20.0, step: float = 0.3):
    """Poll ``predicate`` until it returns something truthy (the doctor, while a state forms)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


def _cli(cluster: aiorl.Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    key_file = cluster._embedded.key_file if cluster._embedded and cluster.keys else None
    extra = ["--key-file", key_file] if key_file else []
    return subprocess.run(
        [sys.executable, "-m", "aiorl.cli.main", *args, "--registry", cluster.registry_address,
         *extra], capture_output=True, text=True, timeout=60)


def test_a_receive_cycle_is_a_deadlock(cluster):
    pair = Pair.create_group().launch(cluster, num_workers=2, name="pair")
    try:
        pair.wait_ready(120)  # the doctor's time starts once both ranks run (slow under load)
        stuck = pair.wait_for_other()

        def found() -> aiorl.cluster.doctor.DoctorReport | None:
            report = cluster.doctor()
            return report if report.deadlocks else None

        report = _until(found)
        assert report is not None, "no deadlock found"
        assert report.exit_code == 1
        text = "\n".join(report.findings)
        assert ("DEADLOCK: pair:0 waits recv from pair:1, which waits recv from pair:0"
                in text), text
        assert not stuck.done()

        out = _cli(cluster, "doctor", "--json", "--interval", "0")
        assert out.returncode == 1, out.stderr
        data = json.loads(out.stdout)
        assert data["exit_code"] == 1 and data["deadlocks"]
        stacks = _cli(cluster, "doctor", "stack")
        assert stacks.returncode == 0, stacks.stderr
        assert "=== pair:0" in stacks.stdout and "wait_for_other" in stacks.stdout
    finally:
        pair.close()


def test_an_empty_channel_with_a_dead_producer(cluster):
    aiorl.Channel.create(cluster, "batches")
    producer = Producer.create_group().launch(cluster, num_workers=1, name="producer")
    consumer = Consumer.create_group().launch(cluster, num_workers=1, name="consumer")
    try:
        pid = producer.put_some(2).wait(60)[0]
        taking = consumer.take(3)  # two items exist: the third get waits for ever
        os.kill(pid, signal.SIGKILL)

        def found() -> aiorl.cluster.doctor.DoctorReport | None:
            report = cluster.doctor()
            # Until the registry has the producer's death, the doctor says it does not answer.
            return report if any("is dead" in w for w in report.dead_peer_waits) else None

        report = _until(found)
        assert report is not None, "no dead-peer wait found"
        assert report.exit_code == 1
        (text,) = report.dead_peer_waits
        assert text.startswith("consumer:0 waits get on channel 'batches'"), text
        assert "which is empty and has no producer alive (producer:0 is dead)" in text, text
        assert not taking.done()
    finally:
        producer.close()
        consumer.close()


def test_a_straggler_rank_is_named(cluster):
    sleepy = Sleepy.create_group().launch(cluster, num_workers=3, name="sleepy")
    try:
        sleepy.work().wait(30)  # warm: the next call's timing is the method's own
        work = sleepy.work()

        def found() -> aiorl.cluster.doctor.DoctorReport | None:
            # Once the two quick ranks answered (on a loaded machine their 0.3 s take longer).
            report = cluster.doctor()
            quick_done = all(s["answered"] == 2 for s in report.stragglers)
            return report if report.stragglers and quick_done else None

        report = _until(found, timeout=5.5, step=0.2)
        assert report is not None, "no straggler found"
        (straggler,) = report.stragglers
        assert straggler["waiting_for"] == ["sleepy:2"]
        assert straggler["answered"] == 2 and straggler["ranks"] == 3
        assert straggler["methods"] == ["work"]
        assert any("STRAGGLER" in f and "sleepy:2" in f for f in report.findings)
        assert report.exit_code == 0
        assert work.wait(30) == [0, 1, 2]
    finally:
        sleepy.close()


def test_cycles_are_found_once_whatever_the_start():
    from aiorl.cluster.doctor import Wait, _cycles, _sentence

    edges = [Wait("c:0", "a:0", "recv from"), Wait("a:0", "b:0", "a call answered by"),
             Wait("b:0", "c:0", "get on"), Wait("d:0", "a:0", "recv from")]
    (cycle,) = _cycles(edges)
    assert _sentence(cycle) == ("a:0 waits a call answered by b:0, which waits get on c:0, "
                                "which waits recv from a:0")
    assert _cycles(edges[1:]) == []
