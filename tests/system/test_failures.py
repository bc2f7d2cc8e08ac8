"""Failure guarantees (docs/failures.md) and bad input, with real processes."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

import aiorl
from aiorl.transport import security
from aiorl.transport.security import ClusterKeys
from aiorl.transport.wire import Kind, encode_header
from tests._processes import gone_within, wait_listening

pytestmark = pytest.mark.timeout(120)


class Node(aiorl.Worker):
    def pid(self) -> int:
        return os.getpid()

    def echo(self, x: object) -> object:
        return x

    async def wait_long(self) -> None:
        import asyncio

        await asyncio.sleep(60)

    async def talk_to(self, group: str, rank: int) -> list[str]:
        """Errors from p2p and calls aimed at workers that do not exist."""
        errors = []
        for attempt in (lambda: self.send(1, group, rank), lambda: self.recv(group, rank),
                        lambda: self._runtime.call_worker(f"{group}:{rank}", "pid")):
            try:
                await attempt()
            except Exception as exc:  # noqa: BLE001 - the test inspects them
                errors.append(f"{type(exc).__name__}: {exc}")
        return errors

    async def call_peer_and_wait(self, peer: str) -> object:
        """Call another worker's long method: fails when that worker dies."""
        return await self._runtime.call_worker(peer, "wait_long")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each, then wait up to 10 s each, SIGKILL what is left (no process left behind)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class ClusterProcesses:
    """A registry and node agents started as separate programs, restartable."""

    def __init__(self, tmp_path, nodes: int = 2, expiry: float = 2.0) -> None:
        self.expiry = expiry
        self.key_file = str(tmp_path / "cluster.key")
        ClusterKeys.generate().save(self.key_file)
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.registry = self._start_registry()
        # Listening first: a registry program imports for seconds under load, and a driver
        # gives up on a port that refuses every connection for 3 s.
        wait_listening(self.address)
        self.agents = [
            subprocess.Popen([sys.executable, "-m", "aiorl.node.agent", "--registry", self.address,
                              "--node-rank", str(r), "--log-level", "WARNING", "--key-file",
                              self.key_file])
            for r in range(nodes)
        ]

    def _start_registry(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "aiorl.registry.service", "--host", "127.0.0.1", "--port",
             str(self.port), "--log-level", "WARNING", "--key-file", self.key_file, "--expiry",
             str(self.expiry)])

    def restart_registry(self) -> None:
        self.registry.kill()
        self.registry.wait()
        self.registry = self._start_registry()

    def close(self) -> None:
        stop_processes([*self.agents, self.registry])


@contextlib.contextmanager
def stoppable_processes(tmp_path, nodes: int = 1) -> Iterator[ClusterProcesses]:
    """`ClusterProcesses` whose registry a test may SIGSTOP: continued before it is closed."""
    procs = ClusterProcesses(tmp_path, nodes=nodes)
    try:
        yield procs
    finally:
        procs.registry.send_signal(signal.SIGCONT)
        procs.close()


@pytest.fixture
def processes(tmp_path):
    procs = ClusterProcesses(tmp_path)
    try:
        yield procs
    finally:
        procs.close()


@pytest.fixture
def patient_processes(tmp_path):
    """As ``processes``, with a 5 s expiry: agents fence their workers after 10 s without a
    registry, so a registry restarted under load (a new interpreter importing aiorl, which
    took over 4 s beside two CPU hogs) comes back before they do."""
    procs = ClusterProcesses(tmp_path, expiry=5.0)
    try:
        yield procs
    finally:
        procs.close()


def test_worker_killed_fails_peers_pending_calls_within_2s(cluster):
    group = Node.create_group().launch(cluster, aiorl.placement.NodePlacementStrategy([0, 0]),
                                       name="peers")
    try:
        pids = group.pid().wait(60)
        pending = group.execute_on(0).call_peer_and_wait("peers:1")
        time.sleep(0.3)
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(aiorl.RemoteError, match="PeerLostError") as info:
            pending.wait(10)
        assert time.monotonic() - start < 2.0
        assert "peers:1" in str(info.value) and "SIGKILL" in str(info.value)
    finally:
        group.close()


def test_registry_restart_workers_keep_talking_and_lookups_return(processes):
    with aiorl.Cluster(registry=processes.address, num_nodes=2, key_file=processes.key_file) as c:
        group = Node.create_group().launch(c, aiorl.placement.NodePlacementStrategy([0, 1]),
                                           name="survivors")
        assert len(group.pid().wait(60)) == 2
        processes.restart_registry()
        # Running workers keep answering while the registry is away and after it returns.
        assert group.echo(7).wait(10) == [7, 7]
        deadline = time.monotonic() + 5
        lookup = None
        while time.monotonic() < deadline:
            try:
                lookup = c.runtime.run_sync(c.runtime.registry.request(
                    "lookup", {"name": "survivors:1"}, timeout=1), timeout=2)
                break
            except (aiorl.RegistryUnavailable, aiorl.RemoteError, TimeoutError):
                time.sleep(0.1)
        assert lookup is not None and lookup["state"] == "ready", "lookup did not return within 5 s"
        # The driver restores its groups and each agent its node on their next heartbeat
        # (every 0.5 s); the two are independent, so wait for both.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            status = c.runtime.run_sync(c.runtime.registry.request("status"), timeout=5)
            restored = any(g["name"] == "survivors" for g in status["groups"])
            if restored and len(status["nodes"]) == 2:
                break
            time.sleep(0.1)
        assert len(status["nodes"]) == 2, "a node agent did not re-register in 5 s"
        assert restored, "group not restored in 5 s"
        # New work can be launched on the restarted registry.
        more = Node.create_group().launch(c, aiorl.placement.NodePlacementStrategy([0, 1]),
                                          name="after_restart")
        assert len(more.echo(1).wait(60)) == 2
        more.close()
        group.close()


def test_worker_death_while_registry_down_is_reported_when_it_returns(patient_processes):
    processes = patient_processes
    with aiorl.Cluster(registry=processes.address, num_nodes=2, key_file=processes.key_file) as c:
        group = Node.create_group().launch(c, aiorl.placement.NodePlacementStrategy([0, 1]),
                                           name="unlucky")
        pids = group.pid().wait(60)
        pending = group.execute_on(1).wait_long()
        processes.registry.kill()
        processes.registry.wait()
        os.kill(pids[1], signal.SIGKILL)  # nobody can hear of it now
        time.sleep(1.0)
        processes.registry = processes._start_registry()
        with pytest.raises(aiorl.PeerLostError, match="SIGKILL"):
            pending.wait(10)  # the agent's retried report reaches us through the new registry
        assert group.execute_on(0).echo(1).wait(10) == [1]


def test_node_agent_killed_node_declared_dead_and_callers_fail_fast(processes):
    with aiorl.Cluster(registry=processes.address, num_nodes=2, key_file=processes.key_file) as c:
        group = Node.create_group().launch(c, aiorl.placement.NodePlacementStrategy([1]),
                                           name="on_node1")
        (pid,) = group.pid().wait(60)
        processes.agents[1].kill()
        start = time.monotonic()
        assert gone_within([pid], within=5), "the worker outlived its node agent"
        while c.num_nodes != 1 and time.monotonic() - start < 5:
            time.sleep(0.05)
        assert c.num_nodes == 1, "node 1 was not declared dead within 5 s"
        with pytest.raises(aiorl.PeerLostError):
            group.echo(1).wait(5)


def test_a_driver_started_before_its_registry_waits_for_it(tmp_path, monkeypatch):
    """A job script starts the registry and the driver together: the driver keeps asking
    (one attempt per REGISTER_ATTEMPT_S, shortened here) until Cluster(timeout=...) instead
    of failing after one attempt, and says that it waits."""
    from aiorl.cluster import driver as driver_module

    monkeypatch.setattr(driver_module, "REGISTER_ATTEMPT_S", 1.0)
    # The registry starts only once the driver said it waits; on a loaded machine its start
    # outlasts the window after which a port that refuses every connection counts as wrong
    # (tests/system/test_porting_a_ray_program.py covers that window): this test is about the waiting.
    monkeypatch.setattr(driver_module, "REFUSED_GIVE_UP_S", 60.0)
    key_file = str(tmp_path / "cluster.key")
    ClusterKeys.generate().save(key_file)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    waiting = threading.Event()

    class _Waiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "no answer from the registry" in record.getMessage():
                waiting.set()

    handler = _Waiting()
    logging.getLogger("aiorl.cluster").addHandler(handler)
    outcome: list[object] = []

    def drive() -> None:
        try:
            with aiorl.Cluster(registry=address, num_nodes=1, key_file=key_file,
                               timeout=60) as c:
                group = Node.create_group().launch(c, name="late-registry")
                outcome.append(group.echo(7).wait(60))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            outcome.append(exc)

    thread = threading.Thread(target=drive)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        thread.start()
        assert waiting.wait(30), f"the driver did not say that it waits: {outcome}"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "aiorl.registry.service", "--host", "127.0.0.1", "--port",
             str(port), "--log-level", "WARNING", "--key-file", key_file]))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "aiorl.node.agent", "--registry", address, "--node-rank",
             "0", "--log-level", "WARNING", "--key-file", key_file]))
        thread.join(120)
        assert outcome == [[7]]
    finally:
        logging.getLogger("aiorl.cluster").removeHandler(handler)
        thread.join(120)
        stop_processes(procs)


DRIVER = textwrap.dedent("""
    import os, sys, time, aiorl
    sys.path.insert(0, {tests!r})
    from test_failures import Node
    c = aiorl.Cluster(registry={address!r}, num_nodes=2, key_file={key_file!r})
    g = Node.create_group().launch(c, aiorl.placement.NodePlacementStrategy([0, 1]), name="orphaned")
    print(*g.pid().wait(60), flush=True)
    time.sleep(60)
""")


def test_driver_killed_in_attach_mode_tears_down_its_groups(processes):
    script = DRIVER.format(tests=os.path.dirname(__file__), address=processes.address,
                           key_file=processes.key_file)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2
        driver.kill()
        driver.wait()
        # Expiry (2 s) + a sweep + the agents' 1 s kill grace is about 3.5 s; the margin is for a
        # loaded machine (make test-stress), where every one of those processes waits for a CPU.
        assert gone_within(pids, within=15), "workers of a dead driver were not torn down"
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.stdout.close()


def _fuzz_messages(rng: random.Random, ops: list[str], n: int) -> list[list[bytes]]:
    def junk_value(depth: int = 0) -> object:
        kind = rng.randrange(8)
        if kind == 0 or depth > 2:
            return rng.randrange(-(2**40), 2**40)
        if kind == 1:
            return rng.randbytes(rng.randrange(20))
        if kind == 2:
            return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(12)))
        if kind == 3:
            return [junk_value(depth + 1) for _ in range(rng.randrange(4))]
        if kind == 4:
            return {str(junk_value(depth + 1)): junk_value(depth + 1) for _ in range(rng.randrange(4))}
        if kind == 5:
            return None
        if kind == 6:
            return rng.random()
        return {"name": "x:0", "group": "fuzz", "node_id": "n", "info": {"address": 5}}

    messages = []
    for i in range(n):
        shape = rng.randrange(6)
        if shape == 0:
            frames = [rng.randbytes(rng.randrange(1, 64)) for _ in range(rng.randrange(1, 4))]
        elif shape == 1:
            frames = [msgpack.packb([1, rng.randrange(-3, 9), i, rng.choice(ops), junk_value()])]
        elif shape == 2:
            frames = [encode_header(Kind.REQUEST, i, rng.choice(ops), junk_value()),
                      rng.randbytes(rng.randrange(64))]
        elif shape == 3:
            frames = [msgpack.packb([rng.randrange(3), 1, i, "x", None, "extra"])]
        elif shape == 4:
            frames = [encode_header(Kind.ONEWAY, 0, rng.choice(ops), junk_value())]
        else:
            frames = [msgpack.packb(junk_value())]
        messages.append(frames)
    return messages


def test_fuzz_registry_agent_and_worker_keep_serving(cluster):
    group = Node.create_group().launch(cluster, name="fuzzed")
    try:
        group.echo(0).wait(60)
        rt = cluster.runtime
        worker = rt.run_sync(rt.resolve_worker("fuzzed:0"))["endpoint"]
        agent = cluster.nodes[0]["endpoint"]
        targets = {
            "registry": (cluster.registry_address, ["heartbeat", "lookup", "lookup_group", "watch",
                                                    "status", "worker_state", "worker_exited",
                                                    "nodes", "unwatch", "ping", "bogus"]),
            "agent": (agent, ["free_port", "ping", "kill_group", "worker_ready", "bogus"]),
            "worker": (worker, ["call", "registry_restarted", "bogus"]),
        }
        rng = random.Random(1234)
        ctx = zmq.Context.instance()
        keys: ClusterKeys = cluster.keys
        for name, (address, ops) in targets.items():
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.sndhwm = 0
            sock.sndtimeo = 10_000  # a refused handshake must fail the test, not hang it
            security.enable_client(sock, keys)  # authenticated: the fuzz must reach the parsers
            sock.connect(address)
            for frames in _fuzz_messages(rng, ops, 10_000):
                sock.send_multipart(frames)
            # Oversized header: rejected without being parsed.
            sock.send_multipart([b"\x93" + b"\x00" * (2 << 20)])
            time.sleep(0.5)
            sock.close(0)
            # The target still answers correct requests.
            if name == "registry":
                assert rt.run_sync(rt.registry.request("ping", timeout=10), timeout=15)
            elif name == "agent":
                async def ping_agent() -> object:
                    return (await rt.endpoint.request(agent, "ping", timeout=10))[0]

                meta = rt.run_sync(ping_agent(), timeout=15)
                assert meta["node_id"]
        assert group.echo("still here").wait(30) == ["still here"]
    finally:
        group.close()


def test_zygote_that_cannot_start_fails_launches_fast(monkeypatch):
    # AIORL_ZYGOTE_PRELOAD names extra modules for the zygote to import; one that does not
    # exist makes the zygote die before it is ready.
    monkeypatch.setenv("AIORL_ZYGOTE_PRELOAD", "aiorl_no_such_module_for_the_test")
    with aiorl.Cluster(num_nodes=1) as c:
        group = Node.create_group().launch(c, name="stillborn")
        start = time.monotonic()
        with pytest.raises(aiorl.WorkerInitError, match="zygote"):
            group.pid().wait(30)
        # The zygote dies right after its own `import torch`: seconds on a quiet machine, more
        # under make test-stress; a zygote death not seen would run into wait(30) instead.
        assert time.monotonic() - start < 25


def test_unknown_workers_and_groups_are_clear_errors_at_once(cluster):
    group = Node.create_group().launch(cluster, name="asker")
    try:
        start = time.monotonic()
        errors = group.talk_to("no_such_group", 0).wait(60)[0]
        assert len(errors) == 3 and all("no worker group named 'no_such_group'" in e for e in errors)
        # Specific classes, and still LookupErrors for code written for the built-in.
        assert all(e.startswith("GroupNotFoundError") for e in errors)
        assert issubclass(aiorl.GroupNotFoundError, LookupError)
        errors = group.talk_to("asker", 5).wait(30)[0]
        assert len(errors) == 3 and all("asker:5 does not exist" in e for e in errors)
        assert all(e.startswith("WorkerNotFoundError") for e in errors)
        assert time.monotonic() - start < 20
        assert group.pid().wait(10)  # the worker is fine afterwards
    finally:
        group.close()
