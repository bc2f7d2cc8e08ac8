"""Multi-node for real: registry and node agents in separate network namespaces.

Topology (made by this test, inside this machine; skipped where namespaces cannot be made):

    root namespace (driver) -- bridge aiorlbr0 10.251.0.1/24
        ns aiorl-reg   10.251.0.2  aiorl-registry
        ns aiorl-n0    10.251.0.3  aiorl-node --node-rank 0
        ns aiorl-n1    10.251.0.4  aiorl-node --node-rank 1

The test launches a group across the two "machines", exercises calls, point-to-point tensors
and a channel between them, then cuts node 1's link and checks that callers fail fast.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

import aiorl
from aiorl.transport.security import ClusterKeys

pytestmark = pytest.mark.timeout(180)

SUBNET = "10.251.0"
BRIDGE = "aiorlbr0"


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def _netns_available() -> bool:
    if shutil.which("ip") is None or os.geteuid() != 0:
        return False
    name = f"aiorl-probe-{uuid.uuid4().hex[:6]}"
    ok = _sh("ip", "netns", "add", name, check=False).returncode == 0
    if ok:
        _sh("ip", "netns", "del", name, check=False)
    return ok


class Topology:
    def __init__(self) -> None:
        self.namespaces = {"aiorl-reg": 2, "aiorl-n0": 3, "aiorl-n1": 4}
        self.procs: list[subprocess.Popen[bytes]] = []

    def ip(self, ns: str) -> str:
        return f"{SUBNET}.{self.namespaces[ns]}"

    def up(self) -> None:
        self.down()
        _sh("ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _sh("ip", "link", "set", BRIDGE, "up")
        for ns, host in self.namespaces.items():
            veth, peer = f"v{host}h", f"v{host}n"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
            _sh("ip", "link", "set", peer, "netns", ns)
            _sh("ip", "link", "set", veth, "master", BRIDGE)
            _sh("ip", "link", "set", veth, "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{SUBNET}.{host}/24", "dev", peer)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", peer, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")

    def cut(self, ns: str) -> None:
        """Pull node ``ns``'s cable: its link goes down on the bridge side."""
        _sh("ip", "link", "set", f"v{self.namespaces[ns]}h", "down")

    def run(self, ns: str, *args: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args])
        self.procs.append(proc)
        return proc

    def down(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        for ns in self.namespaces:
            # Anything still running in the namespace (workers of a cut node) goes too.
            pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _sh("ip", "netns", "del", ns, check=False)
        for host in self.namespaces.values():
            _sh("ip", "link", "del", f"v{host}h", check=False)
        _sh("ip", "link", "del", BRIDGE, check=False)


class Member(aiorl.Worker):
    def where(self) -> tuple[str, int]:
        return self.worker_info.node_ip, self.worker_info.node_rank

    def echo(self, x: object) -> object:
        return x

    def shout(self, text: str) -> None:
        print(text, flush=True)  # forwarded to the driver's stderr by this node's agent

    def drain(self, channel: aiorl.Channel, n: int) -> list[object]:
        return [channel.get().wait(30) for _ in range(n)]

    async def exchange(self, peer_group: str, size: int) -> float:
        """Rank 0 sends a tensor to rank 1, which sends back its sum (a P2P round trip)."""
        import torch

        if self.rank == 0:
            await self.send(torch.arange(size, dtype=torch.float32), peer_group, 1)
            return float(await self.recv(peer_group, 1))
        tensor = await self.recv(peer_group, 0)
        await self.send(float(tensor.sum()), peer_group, 0)
        return float(tensor.sum())


@pytest.fixture
def topology(tmp_path):
    if not _netns_available():
        pytest.skip("network namespaces cannot be created here (needs root and iproute2)")
    # One topology at a time on this machine: test files run in parallel processes (make test)
    # and the namespaces, bridge, addresses and ports are fixed names. The lock is held on the
    # temp directory itself, machine-wide and leaving no file behind.
    lock = os.open(tempfile.gettempdir(), os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        topo = Topology()
        try:
            topo.up()
            yield topo
        finally:
            topo.down()
    finally:
        os.close(lock)  # releases the lock


def test_group_p2p_and_channel_across_namespaces_then_cut_link(topology, tmp_path, monkeypatch,
                                                               capfd):
    key_file = str(tmp_path / "cluster.key")
    ClusterKeys.generate().save(key_file)  # CURVE: traffic crosses a (virtual) network
    registry = f"tcp://{topology.ip('aiorl-reg')}:6390"
    topology.run("aiorl-reg", "-m", "aiorl.registry.service", "--host", topology.ip("aiorl-reg"),
                 "--port", "6390", "--key-file", key_file, "--log-level", "WARNING")
    for rank, ns in enumerate(["aiorl-n0", "aiorl-n1"]):
        topology.run(ns, "-m", "aiorl.node.agent", "--registry", registry, "--host", topology.ip(ns),
                     "--node-rank", str(rank), "--key-file", key_file, "--log-level", "WARNING")
    monkeypatch.setenv("AIORL_NODE_IP", f"{SUBNET}.1")
    with aiorl.Cluster(registry=registry, num_nodes=2, key_file=key_file, timeout=60) as cluster:
        assert [n["ip"] for n in cluster.nodes] == [topology.ip("aiorl-n0"), topology.ip("aiorl-n1")]
        group = Member.create_group().launch(
            cluster, aiorl.placement.NodePlacementStrategy([0, 1]), name="members")
        assert group.where().wait(90) == [(topology.ip("aiorl-n0"), 0), (topology.ip("aiorl-n1"), 1)]
        assert group.echo("across").wait(10) == ["across", "across"]
        # Workers' output reaches a driver on another host: it binds where they reach it
        # (AIORL_NODE_IP here: the bridge's side of this host), not on loopback.
        group.execute_on(1).shout("hello from the other machine").wait(10)
        seen = ""
        deadline = time.monotonic() + 15
        while "hello from the other machine" not in seen:
            assert time.monotonic() < deadline, f"no output from node 1 reached the driver: {seen}"
            time.sleep(0.1)
            seen += capfd.readouterr().err
        assert "(members:1 pid=" in seen
        # P2P tensors between the machines (1 MB each way).
        size = 256 * 1024
        expected = float(size * (size - 1) / 2)
        assert group.exchange("members", size).wait(60) == [expected, expected]
        # A channel hosted on node 0, fed by the driver, drained by the worker on node 1
        # (the handle travels as a method argument).
        channel = aiorl.Channel.create(cluster, "across-machines")
        for i in range(100):
            channel.put(i, weight=1).wait(30)
        assert group.execute_on(1).drain(channel, 100).wait(60) == [list(range(100))]

        # Pull node 1's cable: the registry declares it dead, callers fail fast.
        topology.cut("aiorl-n1")
        start = time.monotonic()
        with pytest.raises(aiorl.PeerLostError):
            group.execute_on(1).echo(1).wait(15)
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 10
        while cluster.num_nodes != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster.num_nodes == 1
        # Node 0 is unaffected.
        assert group.execute_on(0).echo("still up").wait(10) == ["still up"]


def test_a_working_directory_reaches_nodes_that_lack_the_code(topology, tmp_path, monkeypatch):
    """The worker's module exists only in the driver's directory: each node gets the packed
    copy once, imports the module from it, and a second job finds it cached; the agents
    remove their caches when they stop."""
    from tests.system.test_working_dir import importable, names, write_project

    key_file = str(tmp_path / "cluster.key")
    ClusterKeys.generate().save(key_file)
    registry = f"tcp://{topology.ip('aiorl-reg')}:6390"
    topology.run("aiorl-reg", "-m", "aiorl.registry.service", "--host", topology.ip("aiorl-reg"),
                 "--port", "6390", "--key-file", key_file, "--log-level", "WARNING")
    log_dirs = [tmp_path / "n0-logs", tmp_path / "n1-logs"]
    agents = [
        topology.run(ns, "-m", "aiorl.node.agent", "--registry", registry, "--host",
                     topology.ip(ns), "--node-rank", str(rank), "--key-file", key_file,
                     "--log-dir", str(log_dirs[rank]), "--log-level", "WARNING")
        for rank, ns in enumerate(["aiorl-n0", "aiorl-n1"])
    ]
    monkeypatch.setenv("AIORL_NODE_IP", f"{SUBNET}.1")
    module, helper = names()
    root = write_project(tmp_path / "project", module, helper)
    shipped = aiorl.WorkingDir(str(root), chdir=True)
    runs = []
    with importable(root, module) as mod:
        for job in ("first", "second"):
            with aiorl.Cluster(registry=registry, num_nodes=2, key_file=key_file, timeout=60,
                               working_dir=shipped) as cluster:
                group = mod.Shipped.create_group().launch(
                    cluster, aiorl.placement.NodePlacementStrategy([0, 1]), name=job)
                runs.append(group.where().wait(90))
                digest = cluster.working_dir.digest
        with pytest.raises(aiorl.WorkingDirError, match="more than its limit"):
            aiorl.Cluster(registry=registry, num_nodes=2, key_file=key_file,
                          working_dir=aiorl.WorkingDir(str(root), max_bytes=100))
    first, second = runs
    for rank, r in enumerate(first):
        copy = str(log_dirs[rank] / "working_dirs" / digest)
        assert (r["node"], r["working_dir"], r["cwd"]) == (rank, copy, copy)
        assert r["module"] == os.path.join(copy, f"{module}.py")
        assert r["greeting"] == "from the shipped helper" and r["data"] == "lr=0.1\n"
    # The second job sent no archive: the same entry, never unpacked again.
    assert [(r["working_dir"], r["inode"]) for r in second] == [
        (r["working_dir"], r["inode"]) for r in first]
    for agent in agents:
        agent.terminate()  # a clean stop: the agent removes its cache
    for agent in agents:
        agent.wait(timeout=30)
    assert not any((d / "working_dirs").exists() for d in log_dirs)
