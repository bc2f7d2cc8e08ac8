"""The control plane at scale (issue 29): relayed group calls, descriptor limits, the registry
under many simulated workers. docs/scale.md; benchmarks/bench_scale.py and
benchmarks/bench_registry_scale.py measure the same paths at full size."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import aiorl
from aiorl.group import call_relay
from aiorl.runtime.descriptors import DESCRIPTORS_PER_PEER, open_descriptors

pytestmark = pytest.mark.timeout(180)

RANKS_PER_NODE = 3


class Ranked(aiorl.Worker):
    def __init__(self) -> None:
        self.my_rank = int(os.environ["RANK"])
        self.release = threading.Event()

    def scaled(self, x: int) -> int:
        return self.my_rank * x

    def tensor(self) -> object:
        import torch

        return torch.full((4096,), self.my_rank)  # a result with out-of-band frames

    def fail_on(self, bad: int) -> int:
        if self.my_rank == bad:
            raise KeyError(f"rank {self.my_rank} has no such key")
        return self.my_rank

    def exit_on(self, bad: int) -> int:
        if self.my_rank == bad:
            os._exit(3)
        return self.my_rank

    def hang_on_node(self, node: int) -> int:
        if int(os.environ["NODE_RANK"]) == node:
            self.release.wait(60)
        return self.my_rank

    def pids(self) -> tuple[int, int]:
        return os.getpid(), os.getppid()


class Answers(list):
    """How many ranks each answer that came back through an agent held, in arrival order."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()

    def add(self, n: int) -> None:
        with self.changed:
            self.append(n)
            self.changed.notify_all()

    def wait_for(self, count: int, timeout: float = 30) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self) >= count, timeout), list(self)


@pytest.fixture
def relayed(monkeypatch):
    """Relay even small calls, and count the answers that came back through agents."""
    monkeypatch.setattr(call_relay, "RELAY_MIN_RANKS", 2)
    answers = Answers()
    settle = call_relay.settle_relayed

    def counting(call, indices, error, reply):
        answers.add(len(indices))
        settle(call, indices, error, reply)

    monkeypatch.setattr(call_relay, "settle_relayed", counting)
    return answers


@pytest.fixture
def two_nodes():
    with aiorl.Cluster(num_nodes=2, timeout=60) as cluster:
        yield cluster


def test_relayed_call_keeps_rank_order_results_and_error_ranks(two_nodes, relayed):
    group = Ranked.create_group().launch(two_nodes, num_workers=2 * RANKS_PER_NODE, name="rel")
    # The first call is made before any rank is ready: it waits, then goes through the agents.
    assert group.scaled(10).wait(120) == [r * 10 for r in range(2 * RANKS_PER_NODE)]
    assert relayed == [RANKS_PER_NODE, RANKS_PER_NODE], "not one answer per node"
    tensors = group.tensor().wait(30)
    assert [int(t[0]) for t in tensors] == list(range(2 * RANKS_PER_NODE))
    assert len(relayed) == 4
    # A call on one node's ranks only is a direct call: nothing more came through an agent.
    assert group.on_ranks([0, 1]).scaled(1).wait(30) == [0, 1]
    assert len(relayed) == 4
    with pytest.raises(KeyError) as info:
        group.fail_on(4).wait(30)
    assert isinstance(info.value, aiorl.RemoteError)
    assert info.value.rank == 4 and "rel:4" in str(info.value)
    group.close()


def test_worker_dying_in_a_relayed_call_fails_only_that_rank(two_nodes, relayed):
    group = Ranked.create_group().launch(two_nodes, num_workers=2 * RANKS_PER_NODE, name="die")
    group.wait_ready(120)
    started = time.monotonic()
    with pytest.raises(aiorl.PeerLostError, match="die:4"):
        group.exit_on(4).wait(30)
    assert time.monotonic() - started < 10
    others = [r for r in range(2 * RANKS_PER_NODE) if r != 4]
    assert group.on_ranks(others).scaled(1).wait(30) == others
    group.close()


def test_dead_node_fails_only_its_ranks_of_a_pending_relayed_call(two_nodes, relayed):
    group = Ranked.create_group().launch(two_nodes, num_workers=2 * RANKS_PER_NODE, name="node")
    pids = group.pids().wait(120)
    pending = group.hang_on_node(1)
    agent_of_node_1 = _parent_of(pids[RANKS_PER_NODE][1])  # worker -> zygote -> agent
    os.kill(agent_of_node_1, signal.SIGKILL)
    with pytest.raises(aiorl.PeerLostError) as info:
        pending.wait(30)
    assert f"node:{RANKS_PER_NODE}" in str(info.value) or "node 1" in str(info.value)
    node_0 = list(range(RANKS_PER_NODE))
    assert group.on_ranks(node_0).hang_on_node(1).wait(30) == node_0
    group.close()


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_descriptors_per_peer_cover_what_a_peer_costs(cluster):
    peers = 16
    group = Ranked.create_group().launch(cluster, num_workers=peers, name="fds")
    group.wait_ready(120)
    before = open_descriptors()
    group.scaled(1).wait(30)  # the driver's first call to each rank opens its socket
    per_peer = (open_descriptors() - before) / peers
    group.close()
    # A stray descriptor or two opened meanwhile by another thread is not a peer's cost.
    assert 0 < per_peer <= DESCRIPTORS_PER_PEER + 2 / peers, per_peer


def test_too_low_a_descriptor_limit_is_raised_or_one_clear_error_at_start():
    probe = textwrap.dedent("""\
        import resource
        from aiorl.runtime.descriptors import DescriptorLimitError, check_descriptors_for
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        check_descriptors_for(10)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 256  # enough: left alone
        if hard == resource.RLIM_INFINITY or hard >= 10_000:  # room to raise it into
            check_descriptors_for(1000)  # the hard limit allows it: the soft one is raised
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 4000
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        try:
            check_descriptors_for(1000)
        except DescriptorLimitError as exc:
            print(exc)
        """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True)
    assert "may open 256 files" in out.stdout and "ulimit -n" in out.stdout, out.stdout


# ------------------------------------------------------------------ the registry at scale
BIG_GROUP = 5000  # ~1.2 MiB of records: more than a message header may hold


@pytest.fixture
def registry_process(tmp_path):
    from aiorl.transport.security import ClusterKeys

    key_file = str(tmp_path / "cluster.key")
    ClusterKeys.generate().save(key_file)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiorl.registry.service", "--host", "127.0.0.1", "--port", "0",
         "--print-address", "--key-file", key_file, "--expiry", "60", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip().split("=", 1)[1]
        yield address, ClusterKeys.load(key_file), proc
    finally:
        proc.terminate()
        proc.wait(10)


def test_registry_serves_a_group_too_large_for_one_message_header(registry_process):
    """5,000 workers registered with the real requests: a watch of their group and status()
    return every record (each reply is larger than the 1 MiB a header may carry), and the
    registry's memory grows by at most 2 KB per worker."""
    import asyncio

    from aiorl.names import WorkerAddress, WorkerInfo
    from aiorl.protocol.ops import WorkerState
    from aiorl.protocol.registry import DriverInfo, GroupSpec, NodeInfo, NodeRegistration
    from aiorl.registry.client import RegistryClient
    from aiorl.transport.endpoint import Endpoint

    address, keys, proc = registry_process

    def rss() -> int:
        with open(f"/proc/{proc.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    async def scenario() -> tuple[int, int, int, float]:
        endpoint = Endpoint("sim-node", keys=keys)
        registry = RegistryClient(endpoint, address)
        try:
            await registry.register_driver(DriverInfo("driver-big", os.getpid()))
            await registry.register_node(NodeRegistration(NodeInfo(
                node_id="sim-node-0", endpoint=endpoint.address, node_rank=0, ip="127.0.0.1",
                hostname="sim", cpus=1, num_accelerators=0, accelerator_type="cpu",
                hardware={}, labels={}, pid=os.getpid()), ()))
            await registry.create_group(GroupSpec("big", BIG_GROUP, "driver-big", "Sim"))
            before = rss()
            await asyncio.gather(*(registry.report_state(WorkerInfo(
                WorkerAddress("big", r), r, BIG_GROUP, 0, "127.0.0.1",
                f"{endpoint.address}#{r}", pid=10_000 + r, node_id="sim-node-0"),
                WorkerState.READY, timeout=60, incarnation=0) for r in range(BIG_GROUP)))
            per_worker = (rss() - before) / BIG_GROUP
            seen: list[str] = []
            snapshot = await registry.watch("big", lambda name, *_: seen.append(name))
            status = await registry.status(timeout=60)
            return len(snapshot), len(seen), len(status.workers), per_worker
        finally:
            registry.close()
            endpoint.close()

    snapshot, delivered, listed, per_worker = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert snapshot == delivered == listed == BIG_GROUP
    assert per_worker <= 2048, f"{per_worker:.0f} bytes of registry memory per worker"


def test_worker_table_index_follows_every_change():
    from aiorl.registry.table import WorkerTable

    table: WorkerTable[int] = WorkerTable()
    table["a:0"], table["a:1"], table["b:0"] = 1, 2, 3
    assert dict(table.members("a", "*")) == {"a:0": 1, "a:1": 2}
    assert dict(table.members("a:1", "*")) == {"a:1": 2}
    assert dict(table.members("*", "*")) == {"a:0": 1, "a:1": 2, "b:0": 3}
    table["a:1"] = 5
    del table["a:0"]
    assert table.pop("b:0") == 3 and table.pop("b:0", None) is None
    assert dict(table.members("a", "*")) == {"a:1": 5} and table.of_group("b") == {}
    with pytest.raises(TypeError):
        table.update({"c:0": 1})


class FailsOnRank4(Ranked):
    def __init__(self) -> None:
        super().__init__()
        if self.my_rank == 4:
            raise RuntimeError("rank 4 cannot start")


def test_relayed_call_waiting_for_ranks_fails_with_the_init_error(two_nodes, relayed):
    group = FailsOnRank4.create_group().launch(two_nodes, num_workers=2 * RANKS_PER_NODE,
                                               name="init")
    with pytest.raises(aiorl.WorkerInitError, match="rank 4 cannot start"):
        group.scaled(1).wait(120)
    others = [r for r in range(2 * RANKS_PER_NODE) if r != 4]
    assert group.on_ranks(others).scaled(2).wait(30) == [2 * r for r in others]
    group.close()


def test_relayed_call_to_a_restarting_rank_waits_only_for_that_rank(two_nodes, relayed):
    group = Ranked.create_group().launch(two_nodes, num_workers=2 * RANKS_PER_NODE,
                                         name="restart", restart="on_failure", backoff=2.0)
    group.wait_ready(120)
    events = group.events()
    with pytest.raises(aiorl.PeerLostError):
        group.exit_on(4).wait(30)
    relayed.wait_for(2)  # both nodes' answers to exit_on are in (the call failed at the first)
    for event in events:  # the restart is scheduled: rank 4 has no process for a while
        if event.kind == aiorl.EventKind.RESTARTING and event.rank == 4:
            break
    before = len(relayed)
    # Ranks 0-2 and 3, 5 go through their agents now; rank 4 directly once it is back.
    assert group.scaled(3).wait(60) == [3 * r for r in range(2 * RANKS_PER_NODE)]
    assert sorted(relayed[before:]) == [RANKS_PER_NODE - 1, RANKS_PER_NODE]
    group.close()
