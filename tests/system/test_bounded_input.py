"""Issue 28, "Hardening, round 2": items 3, 6 and 8, with real processes and sockets.

* 3: the registry's metrics port listens on loopback unless ``--metrics-host`` says
  otherwise, serves at most 64 clients at once, closes a client that has not sent its
  request within 5 s; the registry and the node agent raise their open-file limit.
* 6: what outsiders and members can repeat (refused handshakes, over-long metrics request
  lines, headers with a map for a field, malformed ``worker_ready``) is logged once a second
  at most, with a count, never as a traceback each; the services keep serving.
* 8: a snapshot describes a bounded number of asyncio tasks; the directory a worker starts
  in no longer shadows installed modules; a planted symbolic link is not a private directory.
"""

from __future__ import annotations

import os
import re
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest
import zmq

import aiorl
from aiorl.actors import inspection
from aiorl.errors import AuthenticationError, ProtocolError
from aiorl.node import agent as agent_mod
from aiorl.registry import metrics
from aiorl.transport import security
from aiorl.transport.security import ClusterKeys
from aiorl.transport.wire import (
    PROTOCOL_VERSION,
    Kind,
    decode_header,
    encode_header,
    split_batch,
    unpack,
)

pytestmark = pytest.mark.timeout(180)

_REFUSED = re.compile(r"refused a connection from .* (?:key|secret)(?: \(and (\d+) more like it)?")


# ---------------------------------------------------------------------------- helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until(check: Callable[[], Any], within: float, what: str, step: float = 0.05) -> Any:
    """Wait for ``check()`` to return something truthy (a condition, polled), or fail."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        time.sleep(step)


def _lower_open_file_limit() -> None:  # preexec_fn: start the service with a small soft limit
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))


def _hard_open_file_limit() -> int:
    """The soft limit a service should raise itself to: the hard limit (the kernel's ceiling
    where the hard limit is unlimited)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    return hard


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Registry:
    """A real ``aiorl-registry`` on all interfaces (CURVE) with ``--metrics-port 0``."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.key_file = str(tmp / "cluster.key")
        if not os.path.exists(self.key_file):
            ClusterKeys.generate().save(self.key_file)
        self.keys = ClusterKeys.load(self.key_file)
        self.port = _free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.log_path = tmp / f"registry-{self.port}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "aiorl.registry.service", "--host", "0.0.0.0",
                 "--port", str(self.port), "--key-file", self.key_file, "--log-level", "INFO",
                 "--metrics-port", "0", *extra],
                stderr=log, preexec_fn=_lower_open_file_limit)
        found = _until(lambda: self._metrics_address() or self.process.poll() is not None,
                       60, "the registry serves metrics")
        assert self.process.poll() is None, self.log()
        self.metrics_host, self.metrics_port = found

    def _metrics_address(self) -> tuple[str, int] | None:
        m = re.search(r"metrics on http://([^:/]+):(\d+)/metrics", self.log())
        return (m.group(1), int(m.group(2))) if m else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def fds(self) -> int:
        return psutil.Process(self.process.pid).num_fds()

    def get_metrics(self) -> str:
        with socket.create_connection(("127.0.0.1", self.metrics_port), timeout=30) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            return _read_all(s).decode()

    def stop(self) -> None:
        _stop(self.process)


def _read_all(s: socket.socket) -> bytes:
    chunks = []
    while chunk := s.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _messages(frames: list[bytes]) -> list[list[bytes]]:
    """The messages in what arrived: one, or those of a (PACKED) BATCH."""
    header = decode_header(frames[0])
    if header.kind == Kind.PACKED:
        frames = unpack(header.meta, frames[1:])
        header = decode_header(frames[0])
    return split_batch(header.meta, frames[1:]) if header.kind == Kind.BATCH else [frames]


class RawClient:
    """An authenticated DEALER that sends raw frames, as a buggy or hostile member would."""

    def __init__(self, address: str, keys: ClusterKeys) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        security.enable_client(self.sock, keys)
        self.sock.connect(address)
        self.ids = iter(range(1, 1 << 30))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def request(self, op: str, meta: Any = None, timeout: float = 30) -> Any:
        request_id = next(self.ids)
        self.sock.send_multipart([encode_header(Kind.REQUEST, request_id, op, meta)])
        deadline = time.monotonic() + timeout
        while self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            for part in _messages(self.sock.recv_multipart()):
                h = decode_header(part[0])
                if h.request_id == request_id:
                    assert h.kind == Kind.REPLY, f"{op} failed: {h.meta}"
                    return h.meta
            if time.monotonic() > deadline:
                break
        raise TimeoutError(f"no answer to {op} within {timeout} s")

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    reg = Registry(tmp_path)
    try:
        yield reg
    finally:
        reg.stop()


def _listening(pid: int, port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


# ---------------------------------------------------------------------------- item 3
def test_metrics_listen_on_loopback_unless_told_and_services_raise_their_fd_limit(tmp_path):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    expected = _hard_open_file_limit()
    default = Registry(tmp_path)  # the registry itself listens on 0.0.0.0
    agent = None
    try:
        # Metrics ask for no key and name every worker: this machine only, by default.
        assert _listening(default.process.pid, default.metrics_port) == {"127.0.0.1"}
        assert _listening(default.process.pid, default.port) == {"0.0.0.0"}
        assert default.metrics_host == "127.0.0.1"
        # Started with a soft limit of 256, it raised it to the hard limit and said so.
        soft_now, _ = psutil.Process(default.process.pid).rlimit(psutil.RLIMIT_NOFILE)
        assert soft_now == expected
        assert f"open file limit: {soft_now} (hard limit {hard})" in default.log()

        agent_log = tmp_path / "agent.log"
        with open(agent_log, "wb") as log:
            agent = subprocess.Popen(
                [sys.executable, "-m", "aiorl.node.agent", "--registry", default.address,
                 "--key-file", default.key_file, "--log-level", "INFO",
                 "--log-dir", str(tmp_path / "logs")],
                stderr=log, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                preexec_fn=_lower_open_file_limit)
        _until(lambda: "open file limit" in agent_log.read_text(), 60, "the agent starts")
        soft_agent, _ = psutil.Process(agent.pid).rlimit(psutil.RLIMIT_NOFILE)
        assert soft_agent == soft_now
        assert f"open file limit: {soft_agent} (hard limit {hard})" in agent_log.read_text()
    finally:
        if agent is not None:
            _stop(agent)
        default.stop()
    everywhere = Registry(tmp_path, "--metrics-host", "0.0.0.0")
    try:
        assert _listening(everywhere.process.pid, everywhere.metrics_port) == {"0.0.0.0"}
        assert "aiorl_worker_up" in everywhere.get_metrics()
    finally:
        everywhere.stop()


def test_metrics_port_bounds_connections_and_closes_slow_requests(registry):
    """200 clients that trickle a header line every 0.3 s (each line well within any
    per-line timeout): 64 are served, the other 136 answered 503 and closed at once; the 64
    are closed once their 5 s are up; descriptors stay bounded throughout and a real scrape
    still works afterwards."""
    assert "200 OK" in registry.get_metrics()
    base_fds = registry.fds()
    most_fds = base_fds
    sel = selectors.DefaultSelector()
    clients: dict[socket.socket, float] = {}  # -> when it connected
    received: dict[socket.socket, bytes] = {}
    closed: dict[socket.socket, float] = {}
    started = time.monotonic()
    try:
        for _ in range(200):
            s = socket.create_connection(("127.0.0.1", registry.metrics_port), timeout=30)
            clients[s] = time.monotonic()
            s.sendall(b"GET /metrics HTTP/1.0\r\n")
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            received[s] = b""

        def all_closed() -> bool:
            """Read what the registry sent and note EOFs; trickle a header to the others;
            watch the registry's descriptors."""
            nonlocal most_fds
            for key, _ in sel.select(timeout=0.3):
                s: Any = key.fileobj
                try:
                    data = s.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except ConnectionError:
                    data = b""
                received[s] += data
                if not data:
                    sel.unregister(s)
                    closed[s] = time.monotonic()
            for s in clients:
                if s not in closed:
                    try:
                        s.send(b"X-Slow: 1\r\n")
                    except (BlockingIOError, ConnectionError):
                        pass
            most_fds = max(most_fds, registry.fds())
            return len(closed) == len(clients)

        _until(all_closed, 60, "every client is refused or closed after its deadline", step=0)
    finally:
        for s in clients:
            s.close()
    refused = [s for s in clients if received[s].startswith(b"HTTP/1.0 503")]
    held = [s for s in clients if s not in refused]
    assert len(refused) == 200 - metrics.MAX_CONNECTIONS, {v[:20] for v in received.values()}
    assert all(received[s] == b"" for s in held)  # closed without an answer...
    for s in held:  # ...once its deadline had passed, not before
        assert closed[s] - clients[s] >= metrics.REQUEST_DEADLINE - 0.5
    assert most_fds - base_fds <= metrics.MAX_CONNECTIONS + 8, f"{most_fds - base_fds} fds"
    _until(lambda: registry.fds() <= base_fds + 2, 30, "descriptors are released")
    assert "200 OK" in registry.get_metrics()
    lines = [x for x in registry.log().splitlines() if "metrics port:" in x]
    elapsed = time.monotonic() - started
    assert len(lines) <= 2 * (elapsed + 2), lines  # two kinds, each once a second at most
    assert "Traceback" not in registry.log()


def test_over_long_metrics_request_lines_are_refused_without_tracebacks(registry):
    for _ in range(40):
        with socket.create_connection(("127.0.0.1", registry.metrics_port), timeout=30) as s:
            try:
                s.sendall(b"GET /" + b"a" * 100_000 + b" HTTP/1.0\r\n\r\n")
                answer = _read_all(s)
            except ConnectionError:  # refused while we were still sending: as good
                answer = b"HTTP/1.0 400"
            assert answer.startswith(b"HTTP/1.0 400"), answer[:100]
    with socket.create_connection(("127.0.0.1", registry.metrics_port), timeout=30) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\n" + b"X: y\r\n" * 200 + b"\r\n")
        assert _read_all(s).startswith(b"HTTP/1.0 400")
    assert "200 OK" in registry.get_metrics()
    log = registry.log()
    assert "Traceback" not in log and "Unhandled exception" not in log, log[-3000:]
    malformed = [x for x in log.splitlines() if "refused a malformed request" in x]
    assert 1 <= len(malformed) <= 10, malformed


# ---------------------------------------------------------------------------- item 6
def _refusals(text: str) -> tuple[int, int]:
    """(refusal lines, refusals they count: each line one, plus its "and N more")."""
    lines = counted = 0
    for m in _REFUSED.finditer(text):
        lines += 1
        counted += 1 + int(m.group(1) or 0)
    return lines, counted


def _outsider(address: str, server_public: bytes) -> zmq.Socket[Any]:
    """A client with a key of its own (not the cluster's): its handshake is refused once."""
    public, secret = zmq.curve_keypair()
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.reconnect_ivl = -1  # one try each: the test counts tries
    s.curve_publickey, s.curve_secretkey, s.curve_serverkey = public, secret, server_public
    s.connect(address)
    return s


def test_refused_handshakes_are_logged_once_a_second_with_a_count(registry):
    tries = 300
    started = time.monotonic()
    sockets = [_outsider(registry.address, registry.keys.public) for _ in range(tries)]
    try:
        _until(lambda: _refusals(registry.log())[0] >= 1, 30, "a refusal is logged")

        def all_counted() -> bool:
            # A refusal after a second logs the count of those left out meanwhile.
            sockets.append(_outsider(registry.address, registry.keys.public))
            return _refusals(registry.log())[1] >= tries

        _until(all_counted, 60, f"{tries} refusals are counted", step=0.25)
    finally:
        for s in sockets:
            s.close(0)
    lines, counted = _refusals(registry.log())
    elapsed = time.monotonic() - started
    assert lines <= elapsed + 2, f"{lines} refusal lines in {elapsed:.1f} s"
    assert counted <= len(sockets)
    client = RawClient(registry.address, registry.keys)
    try:
        client.request("ping")  # members are still served
    finally:
        client.close()


def test_refused_plain_handshakes_are_rate_limited(caplog):
    """The PLAIN refusal (an embedded cluster's private sockets), in this process."""
    import asyncio

    from aiorl.transport.endpoint import Endpoint

    caplog.set_level("WARNING", logger="aiorl.security")
    directory = security.make_private_directory("aiorl-h2-")

    def refusals() -> tuple[int, int]:
        texts = [r.getMessage() for r in caplog.records]
        lines, counted = _refusals("\n".join(t for t in texts if "secret" in t))
        return lines, counted + security._refusals.suppressed("plain")

    async def main() -> None:
        keys = ClusterKeys.generate("plain")
        server = Endpoint("plain-server", host=f"ipc://{directory}", keys=keys)
        sockets = []
        try:
            for _ in range(200):
                s = zmq.Context.instance().socket(zmq.DEALER)
                s.linger = 0
                # Reconnecting: 200 connections at once overflow the listen backlog (100) on
                # a loaded machine, and a refused connect must try again to be refused by ZAP.
                s.reconnect_ivl = 200
                s.plain_username, s.plain_password = keys.public, b"not the secret"
                s.connect(server.address)
                sockets.append(s)
            deadline = time.monotonic() + 60
            while refusals()[1] < 200:
                assert time.monotonic() < deadline, f"only {refusals()} refusals seen"
                await asyncio.sleep(0.05)
        finally:
            for s in sockets:
                s.close(0)
            server.close()

    started = time.monotonic()
    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    lines, counted = refusals()
    assert 1 <= lines <= time.monotonic() - started + 2 and counted >= 200, (lines, counted)


@pytest.mark.parametrize("fields", [
    (PROTOCOL_VERSION, {"a": 1}, 1, "ping", None),  # kind a map: TypeError before
    (PROTOCOL_VERSION, [1], 1, "ping", None),
    (PROTOCOL_VERSION, 1.0, 1, "ping", None),
    (PROTOCOL_VERSION, True, 1, "ping", None),
    ({"v": 3}, 1, 1, "ping", None),
    (float(PROTOCOL_VERSION), 1, 1, "ping", None),
    (PROTOCOL_VERSION, 1, {"id": 1}, "ping", None),
    (PROTOCOL_VERSION, 1, True, "ping", None),
    (PROTOCOL_VERSION, 1, 1, {"op": 1}, None),
    (PROTOCOL_VERSION, 1, 1, b"ping", None),
])
def test_decode_header_refuses_every_malformed_field_with_protocol_error(fields):
    with pytest.raises(ProtocolError):
        decode_header(msgpack.packb(fields, use_bin_type=True))


def test_headers_with_a_map_for_a_field_are_dropped_without_tracebacks(registry):
    client = RawClient(registry.address, registry.keys)
    try:
        client.request("ping")
        for i in range(300):
            client.send_raw(msgpack.packb((PROTOCOL_VERSION, {"k": i}, i, "ping", None)))
        client.request("ping")  # served after all of them: they were all read
    finally:
        client.close()
    log = registry.log()
    assert "Traceback" not in log and "TypeError" not in log, log[-3000:]
    dropped = [x for x in log.splitlines() if "dropped a malformed message" in x]
    assert 1 <= len(dropped) <= 5, dropped


def test_malformed_worker_ready_is_logged_once_a_second_with_a_count(registry, tmp_path):
    agent_log = tmp_path / "agent.log"
    with open(agent_log, "wb") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "aiorl.node.agent", "--registry", registry.address,
             "--key-file", registry.key_file, "--log-level", "WARNING",
             "--log-dir", str(tmp_path / "logs")],
            stderr=log, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    to_registry = RawClient(registry.address, registry.keys)
    to_agent = None
    try:
        nodes = _until(lambda: to_registry.request("nodes")["nodes"], 60, "the agent joins")
        to_agent = RawClient(nodes[0]["endpoint"], registry.keys)
        started = time.monotonic()
        to_agent.request("ping")
        for i in range(300):
            to_agent.send_raw(encode_header(Kind.ONEWAY, 0, "worker_ready", {"info": i}))
        to_agent.request("ping")  # the agent read them all, and still serves

        def summarised() -> bool:
            # One more after a second: its line counts those left out in between.
            to_agent.send_raw(encode_header(Kind.ONEWAY, 0, "worker_ready", {"info": "x"}))
            return "more like it" in agent_log.read_text()

        _until(summarised, 30, "the count of the left-out warnings is logged", step=0.25)
        lines = [x for x in agent_log.read_text().splitlines() if "malformed worker_ready" in x]
        assert len(lines) <= time.monotonic() - started + 2, lines
        more = sum(int(m.group(1)) for x in lines if (m := re.search(r"and (\d+) more", x)))
        assert more >= 299 - len(lines)
    finally:
        if to_agent is not None:
            to_agent.close()
        to_registry.close()
        _stop(agent)


# ---------------------------------------------------------------------------- item 8
class ManyTasks(aiorl.Worker):
    async def spawn(self, n: int) -> int:
        import asyncio

        self._release = asyncio.Event()
        self._held = [asyncio.ensure_future(self._release.wait()) for _ in range(n)]
        await asyncio.sleep(0)
        return len(asyncio.all_tasks())

    async def release(self) -> int:
        import asyncio

        self._release.set()
        await asyncio.gather(*self._held)
        return len(self._held)


def test_a_snapshot_of_a_worker_with_100k_tasks_describes_a_bounded_number():
    with aiorl.Cluster(num_nodes=1) as cluster:
        group = ManyTasks.create_group().launch(cluster, num_workers=1, name="many-tasks")
        try:
            total = group.spawn(100_000).wait()[0]
            assert total > 100_000
            started = time.monotonic()
            report = cluster.doctor(timeout=60)
            took = time.monotonic() - started
            (worker,) = [p for p in report.processes if p["name"] == "many-tasks:0"]
            assert worker["answered"], report.unresponsive
            tasks = worker["tasks"]
            assert len(tasks) == inspection.MAX_TASKS + 1, len(tasks)
            assert tasks[-1]["left_out"] >= total - inspection.MAX_TASKS - 2
            assert "more tasks not described" in tasks[-1]["name"]
            assert "Event.wait" in tasks[-1]["coro"]  # what the left-out ones run, counted
            assert took < 30, took
            assert group.release().wait()[0] == 100_000
        finally:
            group.close()


_DRIVER = textwrap.dedent("""
    import sys
    import aiorl

    class Probe(aiorl.Worker):
        def where(self):
            import h2_shadowed, h2_only_in_cwd
            return h2_shadowed.ORIGIN, h2_only_in_cwd.ORIGIN

    if __name__ == "__main__":
        with aiorl.Cluster(num_nodes=1) as cluster:
            group = Probe.create_group().launch(cluster, num_workers=1, name="probe")
            print("RESULT", *group.where().wait()[0], flush=True)
            group.close()
""")


def test_the_working_directory_does_not_shadow_installed_modules_in_workers(tmp_path):
    """A module in the directory the driver (so the agent, the zygote) runs in, named like
    an installed one, used to come first on every worker's sys.path: AIORL_EXT_MODULE and
    the worker's own imports took it instead of the installed module."""
    installed, cwd, scripts = tmp_path / "site", tmp_path / "cwd", tmp_path / "scripts"
    for d in (installed, cwd, scripts):
        d.mkdir()
    (installed / "h2_shadowed.py").write_text("ORIGIN = 'installed'\ndef register(): pass\n")
    (cwd / "h2_shadowed.py").write_text("ORIGIN = 'shadow'\ndef register(): pass\n")
    (cwd / "h2_only_in_cwd.py").write_text("ORIGIN = 'cwd'\n")  # still importable, last
    (scripts / "driver.py").write_text(_DRIVER)
    pythonpath = os.pathsep.join(filter(None, [str(installed), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "AIORL_EXT_MODULE": "h2_shadowed"}
    out = subprocess.run([sys.executable, str(scripts / "driver.py")], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT installed cwd" in out.stdout, out.stdout + out.stderr[-3000:]


def test_a_planted_symlink_is_not_a_private_directory(monkeypatch):
    base = tempfile.mkdtemp(prefix="h2-", dir="/tmp")  # short: a runtime dir must be <= 70
    try:
        victim = os.path.join(base, "victim")  # one of our own private directories
        os.mkdir(victim, 0o700)
        planted = os.path.join(base, f"aiorl-node-logs-{os.getuid()}")
        os.symlink(victim, planted)
        for path in (planted, planted + "/"):
            with pytest.raises(AuthenticationError, match="symbolic link"):
                security.check_private_directory(path)
        security.check_private_directory(victim)  # the real thing still passes

        # An agent that prunes old log directories under the planted name must not
        # remove ours, nor put its logs there.
        ours = []
        for i in range(KEEP := agent_mod.KEPT_ENDED_AGENT_LOGS + 2):
            ours.append(os.path.join(victim, f"{2**22 + 1000 + i}-precious"))
            os.mkdir(ours[-1])
        assert KEEP > agent_mod.KEPT_ENDED_AGENT_LOGS
        monkeypatch.setenv("XDG_RUNTIME_DIR", base)
        log_dir = agent_mod.default_log_dir()
        assert all(os.path.isdir(p) for p in ours)
        assert not os.path.realpath(log_dir).startswith(os.path.realpath(victim) + os.sep)

        # The key file is never written through a link planted at its name.
        target = os.path.join(victim, "authorized_keys")
        Path(target).write_text("mine\n")
        link = os.path.join(base, "cluster.key")
        os.symlink(target, link)
        with pytest.raises(OSError):
            ClusterKeys.generate().save(link)
        assert Path(target).read_text() == "mine\n"
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- 28.1: liveness and user work
_SLOW_RESULT_DRIVER = textwrap.dedent("""\
    import sys, time
    sys.path.insert(0, {modules!r})
    import aiorl

    class Maker(aiorl.Worker):
        def make(self):
            import slow_result  # its import takes 5 s (in the method thread here)
            return slow_result.Result(7)

        def ping(self):
            return "pong"

    with aiorl.Cluster(num_nodes=1) as cluster:
        slow = Maker.create_group().launch(cluster, name="slow")
        bystander = Maker.create_group().launch(cluster, name="bystander")
        assert bystander.ping().wait(120) == ["pong"]
        started = time.monotonic()
        # The driver decodes the result: importing its class holds the driver's event loop
        # for 5 s, longer than the registry's 3 s expiry.
        (result,) = slow.make().wait(120)
        print("decoded", result.value, "after", round(time.monotonic() - started, 1), flush=True)
        print("bystander", bystander.ping().wait(30), flush=True)
        print("slow", slow.ping().wait(30), flush=True)
    """)


def test_a_driver_busy_importing_a_results_class_is_not_declared_dead(tmp_path) -> None:
    """Liveness does not depend on user work: the driver's heartbeats come from a thread of
    their own, so a result whose class takes longer than the expiry to import (on the
    driver's loop) kills no group of that driver."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "slow_result.py").write_text(textwrap.dedent("""\
        import time
        time.sleep(5)

        class Result:
            def __init__(self, value):
                self.value = value
        """))
    script = _SLOW_RESULT_DRIVER.format(modules=str(modules))
    env = {k: v for k, v in os.environ.items() if k != "AIORL_REGISTRY"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=170, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "decoded 7 after" in out.stdout
    assert "bystander ['pong']" in out.stdout and "slow ['pong']" in out.stdout, out.stdout
    assert "missed heartbeats" not in out.stderr and "declared the driver dead" not in out.stderr


# ---------------------------------------------------------------- 28.2: one message, one turn
def _answered_ids(client: RawClient, until_id: int, within: float) -> list[int]:
    """Request ids of the replies that reach ``client`` until the one for ``until_id``."""
    ids: list[int] = []
    deadline = time.monotonic() + within
    while until_id not in ids:
        assert client.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), \
            f"no answer to request {until_id} within {within} s"
        ids += [decode_header(part[0]).request_id
                for part in _messages(client.sock.recv_multipart())]
    return ids


def test_a_batch_longer_than_senders_make_is_refused_whole(registry) -> None:
    """One BATCH of a million pings from a member (1 MB of header) held the registry's loop
    for seconds, long enough for every agent to give it up. Senders batch at most
    MAX_BATCH_MESSAGES: a longer batch is dropped whole, unread, and the registry answers the
    next request at once; a batch as long as senders make is served."""
    from aiorl.transport.wire import MAX_BATCH_MESSAGES, encode_batch

    client = RawClient(registry.address, registry.keys)
    try:
        client.request("ping")  # connected and authenticated
        for count in (100_000, MAX_BATCH_MESSAGES):
            client.send_raw(*encode_batch([[encode_header(Kind.REQUEST, i + 1, "ping", None)]
                                           for i in range(count)]))
            started = time.monotonic()
            client.sock.send_multipart([encode_header(Kind.REQUEST, 10**9, "ping", None)])
            answered = _answered_ids(client, 10**9, within=30)
            if count > MAX_BATCH_MESSAGES:
                assert answered == [10**9], f"{len(answered) - 1} pings of a refused batch"
                # Reading the batch's 100,000 frames still takes libzmq and the loop a moment
                # (more on a loaded machine); answering them took seconds more.
                assert time.monotonic() - started < 10, "the registry was held by the batch"
            else:
                assert sorted(answered) == [*range(1, count + 1), 10**9]
    finally:
        client.close()
    assert "a BATCH of 100000 messages" in registry.log()


# ---------------------------------------------------------------- 28.5: a peer that never reads
def test_a_peer_that_never_reads_its_replies_cannot_grow_the_registry(registry) -> None:
    """A member sends a million pings and never reads a reply: the registry's queue to it is
    bounded (ROUTER_HWM), the replies beyond are dropped and counted in one warning, its
    memory stays put, and it answers everyone else."""
    flooder = RawClient(registry.address, registry.keys)
    other = RawClient(registry.address, registry.keys)
    process = psutil.Process(registry.process.pid)
    try:
        flooder.request("ping")
        other.request("ping")
        before = process.memory_info().rss
        head = encode_header(Kind.REQUEST, 1, "ping", None)
        for _ in range(1_000_000):
            flooder.sock.send(head)
        # The registry has worked through the flood once its CPU time stops growing.
        cpu, quiet_since = process.cpu_times(), time.monotonic()
        peak = process.memory_info().rss
        deadline = time.monotonic() + 120
        while time.monotonic() - quiet_since < 1.5:
            assert time.monotonic() < deadline, "the registry never finished the flood"
            time.sleep(0.25)
            peak = max(peak, process.memory_info().rss)
            now = process.cpu_times()
            if now.user + now.system - cpu.user - cpu.system > 0.05:
                cpu, quiet_since = now, time.monotonic()
        assert peak - before < 80 << 20, f"the registry grew by {(peak - before) >> 20} MB"
        started = time.monotonic()
        other.request("ping", timeout=10)
        assert time.monotonic() - started < 2
    finally:
        flooder.close()
        other.close()
    assert "a peer does not read what it is sent" in registry.log()
