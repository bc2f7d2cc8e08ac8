"""The registry under malformed, hostile and unlucky input, with real processes (issue 12).

Each test talks to a real ``aiorl-registry`` (and node agents, workers, drivers where
the scenario needs them). Raw requests go through an authenticated DEALER socket,
as a buggy or compromised cluster member would send them.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from typing import Any

import psutil
import pytest
import zmq

import aiorl
from aiorl.transport import security
from aiorl.transport.security import ClusterKeys
from aiorl.transport.wire import Kind, decode_header, encode_header, split_batch, unpack
from tests._processes import alive as running
from tests._processes import wait_listening

pytestmark = pytest.mark.timeout(120)

EXPIRY = 1.5
GRACE = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Registry:
    """One registry process on a fixed port (restartable), with its stderr in a file."""

    def __init__(self, tmp_path: Any) -> None:
        self.key_file = str(tmp_path / "cluster.key")
        ClusterKeys.generate().save(self.key_file)
        self.keys = ClusterKeys.load(self.key_file)
        self.port = _free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "registry.log"
        self.process = self.start()
        wait_listening(self.address)  # imports take seconds under load; drivers wait 3 s

    def start(self) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "aiorl.registry.service", "--host", "127.0.0.1",
                 "--port", str(self.port), "--log-level", "WARNING", "--key-file", self.key_file,
                 "--expiry", str(EXPIRY), "--grace", str(GRACE)],
                stderr=log)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def agent(self, rank: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "aiorl.node.agent", "--registry", self.address, "--node-rank",
             str(rank), "--log-level", "WARNING", "--key-file", self.key_file])


class RawClient:
    """Requests as plain wire messages on an authenticated socket: nothing checks them first."""

    def __init__(self, registry: Registry) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.sndtimeo = 10_000
        security.enable_client(self.sock, registry.keys)
        self.sock.connect(registry.address)
        self.ids = iter(range(1, 1 << 30))

    def send(self, op: str, meta: Any) -> None:
        self.sock.send_multipart([encode_header(Kind.REQUEST, next(self.ids), op, meta)])

    def request(self, op: str, meta: Any = None, timeout: float = 10) -> tuple[Kind, Any]:
        """(REPLY, meta) or (ERROR, error meta); events and replies to earlier sends are skipped."""
        request_id = next(self.ids)
        self.sock.send_multipart([encode_header(Kind.REQUEST, request_id, op, meta)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(int(max(deadline - time.monotonic(), 0) * 1000) + 1):
                break
            frames = self.sock.recv_multipart()
            header = decode_header(frames[0])
            if header.kind == Kind.PACKED:  # many small frames travel as one
                frames = unpack(header.meta, frames[1:])
                header = decode_header(frames[0])
            # The registry batches the answers of one loop turn into one BATCH message.
            parts = (split_batch(header.meta, frames[1:]) if header.kind == Kind.BATCH
                     else [frames])
            for part in parts:
                header = decode_header(part[0])
                if header.request_id == request_id and header.kind in (Kind.REPLY, Kind.ERROR):
                    return Kind(header.kind), header.meta
        raise TimeoutError(f"the registry did not answer {op} within {timeout} s")

    def ok(self, op: str, meta: Any = None) -> Any:
        kind, reply = self.request(op, meta)
        assert kind == Kind.REPLY, f"{op} failed: {reply}"
        return reply

    def refused(self, op: str, meta: Any) -> dict[str, Any]:
        kind, reply = self.request(op, meta)
        assert kind == Kind.ERROR, f"{op} {meta!r:.100} was accepted"
        return reply

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def registry(tmp_path):
    reg = Registry(tmp_path)
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture
def client(registry):
    c = RawClient(registry)
    try:
        yield c
    finally:
        c.close()


def _fake_node(client: RawClient, node_id: str) -> None:
    """A node registration that will never heartbeat (so it must expire)."""
    client.ok("register_node", {"node_id": node_id, "endpoint": "tcp://127.0.0.1:9",
                                "node_rank": None, "ip": "127.0.0.1"})


def _eventually(check: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _every_read_works(client: RawClient) -> None:
    """status, nodes, lookup, lookup_group, watch, create_group and close_group all answer."""
    status = client.ok("status")
    assert isinstance(status["workers"], list) and isinstance(status["groups"], list)
    client.ok("nodes")
    assert client.refused("lookup", {"name": "nobody:0"})["error"] == "WorkerNotFoundError"
    assert client.refused("lookup_group", {"group": "nobody"})["error"] == "GroupNotFoundError"
    client.ok("watch", {"name": "*"})
    group = f"probe{random.randrange(1 << 30)}"
    client.ok("create_group", {"group": group, "world_size": 1, "owner": "nobody"})
    assert client.ok("lookup_group", {"group": group})["world_size"] == 1
    refusal = client.refused("create_group", {"group": group, "world_size": 1, "owner": "other"})
    assert refusal["error"] == "GroupExistsError"
    client.ok("close_group", {"group": group})


def _expiry_works(client: RawClient) -> None:
    node_id = f"doomed-{random.randrange(1 << 30)}"
    _fake_node(client, node_id)
    assert any(n["node_id"] == node_id for n in client.ok("nodes")["nodes"])
    _eventually(lambda: all(n["node_id"] != node_id for n in client.ok("nodes")["nodes"]),
                EXPIRY + 5, "a silent node was not expired")


def test_malformed_worker_exited_is_refused_and_the_registry_keeps_working(client):
    bad_addresses = (5, b"g:0", ["g:0"], None, "g", "*")
    for address in bad_addresses:
        client.send("worker_exited", {"address": address, "pid": 1})
    # Nothing was stored (it used to be, and every later scan raised): every read still
    # works, and so does expiry.
    assert client.ok("status")["workers"] == []
    _every_read_works(client)
    _expiry_works(client)
    for address in bad_addresses:
        reply = client.refused("worker_exited", {"address": address, "pid": 1})
        assert reply["error"] == "ProtocolError" and "address" in reply["message"]


def _mutations(rng: random.Random) -> list[tuple[str, Any]]:
    """Requests shaped like the real ones with one field wrong (what parsers miss)."""
    info = {"address": "g:0", "rank": 0, "group_world_size": 1, "node_rank": 0,
            "node_ip": "127.0.0.1", "endpoint": "tcp://127.0.0.1:1", "pid": 5}
    templates: dict[str, dict[str, Any]] = {
        "worker_exited": {"address": "g:0", "pid": 1, "exit_code": 0, "signal": 0},
        "worker_state": {"info": info, "state": "ready", "detail": {}},
        "create_group": {"group": "g", "world_size": 1, "owner": "d"},
        "register_node": {"node_id": "n", "endpoint": "tcp://127.0.0.1:1", "node_rank": 0},
        "register_driver": {"driver_id": "d", "pid": 1},
        "heartbeat": {"id": "n"},
        "lookup": {"name": "g:0"},
        "lookup_group": {"group": "g"},
        "watch": {"name": "g"},
        "close_group": {"group": "g"},
    }
    junk = [5, -1, 2**70 // 2**7, b"\x00\xff", "", "*", "../../x", "a\x00b", "@nodes", None,
            [1, 2], {"a": 1}, 1.5, True, "x" * 5000, {"address": 5}, "g:-1", "g:0:0:0:0:0:0:0:0:0"]
    out = []
    for op, template in templates.items():
        for key in template:
            for value in junk:
                meta = dict(template)
                meta[key] = value
                out.append((op, meta))
        for key in info:
            for value in junk:
                if op == "worker_state":
                    out.append((op, {**template, "info": {**info, key: value}}))
    rng.shuffle(out)
    return out


def test_fuzzed_registry_keeps_every_operation_expiry_and_bounded_memory(registry, client):
    client.ok("status")  # warm up (imports, first allocations)
    client.ok("watch", {"name": "*"})
    process = psutil.Process(registry.process.pid)
    rss_before = process.memory_info().rss
    rng = random.Random(12)
    mutations = _mutations(rng)
    for _ in range(3):
        for op, meta in mutations:
            client.send(op, meta)
    for i in range(5000):  # bad heartbeats: each used to log a full traceback
        client.send("heartbeat", {"id": i} if i % 2 else [i])
    # Nodes that never heartbeat and tombstones of groups that never existed must not pile
    # up. (Fewer than ~2,500 of each: a status reply must fit the 1 MiB header limit.)
    for i in range(1000):
        client.send("register_node", {"node_id": f"fuzz-{i}", "endpoint": "tcp://127.0.0.1:1"})
        client.send("worker_exited", {"address": f"ghost{i}:0", "pid": i + 1})
        client.send("worker_exited", {"address": f"ghost{i}:1", "pid": i + 1})
    assert client.request("ping", timeout=60)[0] == Kind.REPLY  # everything above was handled
    _every_read_works(client)
    _expiry_works(client)
    # Fuzzed nodes expire and the ghosts' tombstones leave after the grace period.
    _eventually(lambda: client.ok("nodes")["nodes"] == [], EXPIRY + 5, "fuzzed nodes stayed")
    _eventually(lambda: not any(w["name"].startswith("ghost")
                                for w in client.ok("status")["workers"]),
                GRACE + 5, "tombstones of groups that do not exist were never dropped")
    grown = (process.memory_info().rss - rss_before) / 2**20
    assert grown < 30, f"the registry grew by {grown:.0f} MiB under fuzz"
    log = registry.log_path.read_text()
    assert log.count("Traceback") < 10, "warnings about bad requests are not rate-limited"
    assert registry.process.poll() is None


def test_dead_node_reason_names_the_lost_workers(tmp_path, registry):
    agents = [registry.agent(0), registry.agent(1)]
    try:
        with aiorl.Cluster(registry=registry.address, num_nodes=2,
                           key_file=registry.key_file) as c:
            group = Node.create_group().launch(
                c, aiorl.placement.NodePlacementStrategy([1, 1]), name="lost_with_node")
            group.pid().wait(60)
            agents[1].kill()
            # The caller's error says which node died and every worker lost with it.
            with pytest.raises(aiorl.PeerLostError,
                               match=r"node 1 .*lost with it: lost_with_node:0, lost_with_node:1"):
                group.on_ranks(0).wait_long().wait(30)
    finally:
        for a in agents:
            a.send_signal(signal.SIGTERM)
        for a in agents:
            a.wait(10)


class Node(aiorl.Worker):
    def pid(self) -> int:
        return os.getpid()

    async def wait_long(self) -> None:
        import asyncio

        await asyncio.sleep(60)


DRIVER = textwrap.dedent("""
    import os, sys, time, aiorl
    sys.path.insert(0, {tests!r})
    from test_registry_hostile_input import Node
    c = aiorl.Cluster(registry={address!r}, num_nodes=1, key_file={key_file!r})
    g = Node.create_group().launch(c, aiorl.placement.NodePlacementStrategy([0, 0]), name="leaky")
    print(*g.pid().wait(60), flush=True)
    time.sleep(120)
""")


def test_group_of_a_driver_killed_while_the_registry_was_down_expires(registry):
    agent = registry.agent(0)
    script = DRIVER.format(tests=os.path.dirname(__file__), address=registry.address,
                           key_file=registry.key_file)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    client = None
    try:
        assert driver.stdout is not None
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2
        registry.kill()
        driver.kill()
        driver.wait()
        registry.process = registry.start()
        # The agent restores the group (and its owner) when it re-registers; the owner never
        # comes back, so the group expires and the agent kills its workers.
        deadline = time.monotonic() + 30
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = list(running(pids))
            time.sleep(0.1)
        assert not alive, "the workers of a driver that died during the outage still run"
        client = RawClient(registry)
        assert client.refused("lookup_group", {"group": "leaky"})["error"] == "GroupNotFoundError"
        # A new driver can use the name, and is not answered by the old processes.
        client.ok("create_group", {"group": "leaky", "world_size": 1, "owner": "new-driver"})
    finally:
        if client is not None:
            client.close()
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        if driver.stdout is not None:
            driver.stdout.close()
        agent.send_signal(signal.SIGTERM)
        agent.wait(10)


@pytest.mark.parametrize("name", ["*", "a\x00b", "../../x", "@nodes", ""])
def test_hostile_names_are_refused_at_launch_and_at_the_registry(cluster, name):
    with pytest.raises(ValueError):
        Node.create_group().launch(cluster, name=name)
    assert not any(g.name == name for g in cluster.runtime.run_sync(
        cluster.runtime.registry.status()).groups)
    reg = cluster.runtime.registry
    with pytest.raises(aiorl.ProtocolError, match="group"):
        cluster.runtime.run_sync(reg.request("create_group", {"group": name, "world_size": 1,
                                                             "owner": cluster.driver_id}))
