"""Correct under pressure (issue 27): a closed Cluster, a dead embedded registry, addresses,
and the files a killed driver leaves behind.

Real processes and sockets throughout: embedded clusters, a registry and a node agent started
as `aiorl-registry`/`aiorl-node` would be, drivers in subprocesses that are killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

import aiorl
from aiorl.channels import Channel
from aiorl.cluster.embedded import OWNER_FILE, remove_abandoned_sessions
from aiorl.transport.address import normalize_address
from aiorl.transport.security import make_private_directory
from tests._processes import gone_within

pytestmark = pytest.mark.timeout(180)


class Sleeper(aiorl.Worker):
    def f(self, x: int) -> int:
        return x

    def slow(self) -> None:
        time.sleep(120)

    def pid(self) -> int:
        return os.getpid()


def _closed_message(cluster: aiorl.Cluster) -> str:
    with pytest.raises(aiorl.ClusterClosedError) as info:
        cluster.session  # noqa: B018 - the property raises
    return str(info.value)


def _refused_at_once(what: str, fn: Any, message: str) -> None:
    """``fn()`` raises ClusterClosedError with ``message`` within a second (a wait inside it
    is bounded, so code that still hangs fails the test instead of the run)."""
    started = time.monotonic()
    with pytest.raises(aiorl.ClusterClosedError) as info:
        fn()
    took = time.monotonic() - started
    assert took < 1.0, f"{what} took {took:.1f} s to fail"
    assert str(info.value) == message, what
    assert isinstance(info.value, RuntimeError)  # what launch raised before, kept as a base


# ---------------------------------------------------------------------------- closed cluster
def test_every_operation_on_a_closed_cluster_fails_at_once_with_one_error() -> None:
    cluster = aiorl.Cluster(num_nodes=1)
    try:
        group = Sleeper.create_group().launch(cluster, num_workers=2, name="sleeper")
        assert group.f(1).wait(60) == [1, 1]
        channel = Channel.create(cluster, "closing")
        channel.put("x", async_op=False)
        pending_call = group.execute_on(0).slow()
        pending_get = channel.get(key="empty")
        # Made right after the launch: queued until the rank is ready (or sent, if it is).
        queued = Sleeper.create_group().launch(cluster, num_workers=1, name="late").slow()
    finally:
        started = time.monotonic()
        cluster.close()
    assert time.monotonic() - started < 30
    message = _closed_message(cluster)
    assert "this Cluster is closed" in message and "create a new aiorl.Cluster()" in message
    # What was pending fails (not hangs): the call, the channel get, the queued call.
    for work in (pending_call, pending_get, queued):
        with pytest.raises(aiorl.PeerLostError):
            work.wait(10)
    assert "this Cluster is closed" in str(pending_call.exception())
    assert "this Cluster is closed" in str(queued.exception())

    _refused_at_once("a group call", lambda: group.f(1).wait(5), message)
    _refused_at_once("a view's call", lambda: group.execute_on(1).f(1).wait(5), message)
    _refused_at_once("wait_ready", lambda: group.wait_ready(5), message)
    _refused_at_once("events", group.events, message)
    _refused_at_once("a channel put", lambda: channel.put("y", async_op=False), message)
    _refused_at_once("a channel get", lambda: channel.get(async_op=False), message)
    _refused_at_once("a channel's readiness", lambda: channel.wait_ready().wait(5), message)
    _refused_at_once("Channel.create", lambda: Channel.create(cluster, "after"), message)
    _refused_at_once("launch", lambda: Sleeper.create_group().launch(cluster, name="x"), message)
    _refused_at_once("from_group_name",
                     lambda: aiorl.WorkerGroup.from_group_name(cluster, Sleeper, "sleeper"),
                     message)

    async def from_a_coroutine() -> Any:
        return await group.f(1)

    _refused_at_once("await in a coroutine", lambda: asyncio.run(from_a_coroutine()), message)
    started = time.monotonic()
    group.close()  # nothing left to close: returns at once
    cluster.close()
    assert time.monotonic() - started < 1


def test_a_killed_embedded_registry_fails_pending_and_later_calls_in_bounded_time() -> None:
    cluster = aiorl.Cluster(num_nodes=1)
    try:
        group = Sleeper.create_group().launch(cluster, num_workers=2, name="sleeper")
        pids = [p for p in group.pid().wait(60)]
        registry = cluster._embedded.children[0] if cluster._embedded else None
        assert registry is not None
        pending = group.execute_on(0).slow()
        time.sleep(0.2)  # let the call reach the worker
        killed = time.monotonic()
        os.kill(registry.pid, signal.SIGKILL)
        with pytest.raises(aiorl.PeerLostError) as info:
            pending.wait(20)
        assert time.monotonic() - killed < 10
        reason = str(info.value)
        assert f"embedded registry of this Cluster (pid {registry.pid}) was killed by SIGKILL" \
            in reason and "create a new aiorl.Cluster()" in reason
        message = _closed_message(cluster)
        assert f"(pid {registry.pid}) was killed by SIGKILL" in message
        assert cluster.closed
        _refused_at_once("a call after the registry died", lambda: group.f(1).wait(5), message)
        _refused_at_once("a launch after the registry died",
                         lambda: Sleeper.create_group().launch(cluster, name="y"), message)
        assert gone_within(pids, 15), "the workers outlived their cluster"
    finally:
        started = time.monotonic()
        cluster.close()
        assert time.monotonic() - started < 30
    assert cluster.session_dir is not None and not os.path.exists(cluster.session_dir)


# ---------------------------------------------------------------------------- addresses
@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, str]]:
    """A registry on 127.0.0.1 as `aiorl-registry` runs it: (port, key file)."""
    key = str(tmp_path_factory.mktemp("keys") / "cluster.key")
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiorl.registry.service", "--host", "127.0.0.1", "--port", "0",
         "--print-address", "--key-file", key, "--exit-on-stdin-close"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().decode().strip().split("=", 1)[1]
        yield int(address.rsplit(":", 1)[1]), key
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream:
                stream.close()


def test_address_forms_normalise_and_mistakes_show_the_expected_form() -> None:
    assert normalize_address("head:6380") == "tcp://head:6380"
    assert normalize_address(" tcp://10.0.0.2:6380 ") == "tcp://10.0.0.2:6380"
    assert normalize_address("[::1]:6380") == "tcp://[::1]:6380"
    assert normalize_address("ipc:///run/aiorl/registry") == "ipc:///run/aiorl/registry"
    for bad, why in [("head", "it has no port"), ("head:http", "the port 'http'"),
                     ("head:0", "the port '0'"), ("http://head:6380", "not http://"),
                     ("tcp://*:6380", "'*' is what a server binds"),
                     ("::1:6380", "IPv6 address needs brackets"), (":6380", "no host"),
                     ("auto", "Ray's 'auto'"), ("ipc://", "path of the socket")]:
        with pytest.raises(aiorl.AddressError) as info:
            normalize_address(bad, "--registry")
        assert isinstance(info.value, ValueError)
        text = str(info.value)
        assert text.startswith(f"--registry: {bad!r} is not a registry address: "), text
        assert why in text and "Expected tcp://HOST:PORT" in text and "HOST:PORT (the same" \
            in text, text


def test_cluster_takes_host_port_and_rays_address_keyword(registry: tuple[int, str]) -> None:
    port, key = registry
    for kwargs in ({"registry": f"127.0.0.1:{port}"}, {"address": f"127.0.0.1:{port}"},
                   {"registry": f"127.0.0.1:{port}", "address": f"tcp://127.0.0.1:{port}"}):
        with aiorl.Cluster(num_nodes=0, key_file=key, timeout=30, **kwargs) as cluster:
            assert cluster.registry_address == f"tcp://127.0.0.1:{port}"
            assert not cluster.embedded
            assert cluster.nodes == []
    with pytest.raises(aiorl.AddressError, match=r"registry='127.0.0.1:1' and "
                       r"address='127.0.0.1:2', two different registries: address= is Ray's "
                       r"name for registry="):
        aiorl.Cluster(registry="127.0.0.1:1", address="127.0.0.1:2")
    with pytest.raises(aiorl.AddressError, match=r"^Cluster\(registry=...\): 'head' is not a "
                       r"registry address: it has no port. Expected tcp://HOST:PORT"):
        aiorl.Cluster(registry="head")
    with pytest.raises(ValueError, match=r"^Cluster\(address=...\): 'head:x'"):
        aiorl.Cluster(address="head:x")


def test_the_cli_and_the_agent_take_host_port_and_refuse_bad_addresses_in_one_line(
        registry: tuple[int, str]) -> None:
    port, key = registry
    env = {k: v for k, v in os.environ.items() if k != "AIORL_REGISTRY"}

    def status(address: str, timeout: str = "10") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "aiorl.cli.main", "status", "--registry",
                               address, "--key-file", key, "--timeout", timeout],
                              capture_output=True, text=True, timeout=60, env=env)

    ok = status(f"localhost:{port}")
    assert ok.returncode == 0, ok.stderr
    assert f"registry tcp://localhost:{port}" in ok.stdout
    for bad in ("localhost", "http://localhost:6391", "localhost:port"):
        out = status(bad)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --registry: {bad!r} is not a "
                                                       "registry address"), out.stderr
    nobody = status("localhost:1", timeout="1")  # an address, but nothing answers there
    assert nobody.returncode == 1 and "Traceback" not in nobody.stderr, nobody.stderr
    assert len(nobody.stderr.strip().splitlines()) == 1
    assert "no answer from tcp://localhost:1" in nobody.stderr
    doctor = subprocess.run([sys.executable, "-m", "aiorl.cli.main", "doctor", "--registry",
                             "localhost"], capture_output=True, text=True, timeout=60, env=env)
    assert doctor.returncode == 2 and "Traceback" not in doctor.stderr, doctor.stderr

    bad_agent = subprocess.run([sys.executable, "-m", "aiorl.node.agent", "--registry", "head",
                                "--key-file", key], capture_output=True, text=True, timeout=60,
                               env=env)
    assert bad_agent.returncode == 2 and "Traceback" not in bad_agent.stderr
    assert "--registry: 'head' is not a registry address" in bad_agent.stderr
    # The agent joins with HOST:PORT, and a driver attached the same way uses it.
    agent = subprocess.Popen(
        [sys.executable, "-m", "aiorl.node.agent", "--registry", f"127.0.0.1:{port}",
         "--key-file", key, "--node-rank", "0", "--exit-on-stdin-close", "--log-level",
         "WARNING"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    try:
        with aiorl.Cluster(registry=f"127.0.0.1:{port}", key_file=key, num_nodes=1,
                           timeout=60) as cluster:
            group = Sleeper.create_group().launch(cluster, num_workers=1, name="attached")
            assert group.f(7).wait(60) == [7]
    finally:
        agent.terminate()
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        if agent.stdin:
            agent.stdin.close()


# ---------------------------------------------------------------------------- files left
DRIVER = textwrap.dedent("""
    import sys
    import aiorl

    cluster = aiorl.Cluster(num_nodes=1)
    print(cluster.session_dir, flush=True)
    sys.stdin.readline()          # until the test says (or dies: EOF)
    cluster.close()
""")


def _start_driver() -> tuple[subprocess.Popen[bytes], str, list[psutil.Process]]:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    assert driver.stdout is not None
    session_dir = driver.stdout.readline().decode().strip()
    assert os.path.isdir(session_dir), session_dir
    return driver, session_dir, psutil.Process(driver.pid).children(recursive=True)


def _end(driver: subprocess.Popen[bytes]) -> None:
    if driver.poll() is None:
        driver.kill()
    driver.wait()
    for stream in (driver.stdin, driver.stdout):
        if stream:
            stream.close()


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A private runtime directory of this test's own ($XDG_RUNTIME_DIR, which session
    directories go under): embedded clusters of other test runs on the machine neither see
    nor sweep what this test makes there."""
    base = make_private_directory("aiorl-test-run-")
    monkeypatch.setenv("XDG_RUNTIME_DIR", base)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_next_cluster_removes_a_killed_drivers_session_directory_only(runtime_dir) -> None:
    live, live_dir, _ = _start_driver()
    assert os.path.dirname(live_dir) == runtime_dir
    drivers = [live]
    try:
        left = []
        for sig in (signal.SIGKILL, signal.SIGTERM):
            driver, session_dir, children = _start_driver()
            drivers.append(driver)
            with open(os.path.join(session_dir, OWNER_FILE)) as f:
                assert json.load(f)["pid"] == driver.pid
            os.kill(driver.pid, sig)
            driver.wait()
            assert gone_within([c.pid for c in children], 15)  # its registry and agent
            assert os.path.isdir(session_dir)  # what it could not remove
            left.append(session_dir)
        live_files = set(os.listdir(live_dir))
        with aiorl.Cluster(num_nodes=1) as cluster:
            for session_dir in left:
                assert not os.path.exists(session_dir), session_dir
            assert live_files <= set(os.listdir(live_dir))  # a live owner's: untouched
            assert os.path.isfile(os.path.join(live_dir, "cluster.key"))
            own = cluster.session_dir
            assert own is not None and os.path.isfile(os.path.join(own, OWNER_FILE))
        assert not os.path.exists(own)
        assert live.stdin is not None
        live.stdin.write(b"close\n")
        live.stdin.flush()
        assert live.wait(60) == 0
        assert not os.path.exists(live_dir)
    finally:
        for driver in drivers:
            _end(driver)
        remove_abandoned_sessions()  # what a failed run left (their owners are gone now)


def test_only_private_directories_of_dead_owners_are_removed() -> None:
    base = make_private_directory("aiorl-test-sweep-")
    try:
        finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                  capture_output=True, text=True, check=True, timeout=60)
        dead = int(finished.stdout)
        ns = os.readlink("/proc/self/ns/pid")

        def session(name: str, owner: dict[str, Any] | None, mode: int = 0o700) -> str:
            path = os.path.join(base, f"aiorl-{name}")
            os.mkdir(path, mode)
            os.chmod(path, mode)
            with open(os.path.join(path, "cluster.key"), "w") as f:
                f.write("secret")
            os.mkdir(os.path.join(path, "node0"))
            with open(os.path.join(path, "node0", "worker.log"), "w") as f:
                f.write("log")
            if owner is not None:
                with open(os.path.join(path, OWNER_FILE), "w") as f:
                    json.dump(owner, f)
            return path

        gone = session("gone", {"pid": dead, "start": None, "pidns": ns})
        kept_logs = session("kept", {"pid": dead, "start": None, "pidns": ns, "keep_logs": True})
        alive = session("alive", {"pid": os.getpid(), "start": None, "pidns": ns})
        reused = session("reused", {"pid": os.getpid(), "start": 1, "pidns": ns})
        no_owner = session("none", None)
        other_ns = session("otherns", {"pid": dead, "start": None, "pidns": "pid:[1]"})
        shared = session("shared", {"pid": dead, "start": None, "pidns": ns}, mode=0o755)
        link = os.path.join(base, "aiorl-link")
        os.symlink(gone, link)

        removed = remove_abandoned_sessions(base)
        assert sorted(removed) == sorted([gone, kept_logs, reused])
        assert not os.path.exists(gone) and not os.path.exists(reused)
        assert sorted(os.listdir(kept_logs)) == ["node0"]  # logs kept, key and owner gone
        for untouched in (alive, no_owner, other_ns, shared):
            assert "cluster.key" in os.listdir(untouched), untouched
        assert os.path.islink(link)
    finally:
        shutil.rmtree(base)
