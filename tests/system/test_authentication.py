"""Hardening of authentication and connections (issue: hardening, items 1 and 2, and extras).

Each test here failed before its fix, with real processes:
- a process that bound a dead embedded registry's address received the cluster secret
  (PLAIN over loopback TCP) and its ERROR reply, a pickle, ran code in the driver;
- ERROR replies were unpickled, from any peer;
- one failed handshake (a registry briefly restarted with another mechanism) cut the
  client off for good: libzmq does not reconnect, the dead socket was cached, the heartbeat
  task died on the first ERROR reply;
- every worker's environment held the cluster secret; agent logs were world-readable under
  a predictable /tmp path and never removed.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

import aiorl
from aiorl.registry.client import RegistryClient
from aiorl.transport.endpoint import Endpoint
from aiorl.transport.security import ClusterKeys, make_private_directory
from aiorl.transport.wire import Kind, decode_header, encode_header
from tests._processes import wait_listening

pytestmark = pytest.mark.timeout(120)

NOBODY = 65534


class Probe(aiorl.Worker):
    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def pid(self) -> int:
        return os.getpid()

    def log_path(self) -> str:
        return os.readlink("/proc/self/fd/1")

    def echo(self, x: object) -> object:
        return x


class _Pwn:
    """Unpickling this creates ``path``: proof that a peer's bytes ran as code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"import pathlib; pathlib.Path({self.path!r}).touch()",))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _when_port_free(make):
    """``make()``, retried while a just-closed socket still holds the port (libzmq closes
    sockets in its I/O thread, a moment later)."""
    for _ in range(50):
        try:
            return make()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            await asyncio.sleep(0.1)
    return make()


def _listening(address: str) -> bool:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def _wait_for(condition, within: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return condition()


# ---------------------------------------------------------------------------- item 1
SQUATTER = textwrap.dedent("""
    # Binds the address it is given, accepts any PLAIN credentials (printing them) or none,
    # and answers every request with an ERROR reply carrying a pickle that creates a file.
    import os, sys, msgpack, zmq
    from zmq.auth.thread import ThreadAuthenticator
    address, payload, uid = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
    if uid >= 0:  # become an unprivileged local user before touching the address
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)

    class Recorder(ThreadAuthenticator):
        def _authenticate_plain(self, domain, username, password):
            print("SECRET", username, password, flush=True)
            return True, b"OK"

    ctx = zmq.Context()
    auth = Recorder(ctx)
    auth.start()
    auth.configure_plain(domain="*", passwords={})
    sock = ctx.socket(zmq.ROUTER)
    sock.plain_server = True
    sock.zap_domain = b"aiorl"
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        print("BIND FAILED", exc, flush=True)
        sys.exit(3)
    print("BOUND", flush=True)
    error = {"error": "RemoteError", "type": "x.Evil", "message": "squatted", "traceback": ""}
    while True:
        frames = sock.recv_multipart()
        ident, header = frames[0], msgpack.unpackb(frames[1])
        if header[1] == 1:  # a request: answer ERROR, with the pickle as its payload
            reply = msgpack.packb([header[0], 3, header[2], header[3], error])
            sock.send_multipart([ident, reply, payload])
""")


def _start_squatter(address: str, marker: Path, as_user: int) -> subprocess.Popen[str]:
    payload = pickle.dumps(_Pwn(str(marker))).hex()
    return subprocess.Popen([sys.executable, "-c", SQUATTER, address, payload, str(as_user)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the squatter as another user")
def test_squatter_on_a_dead_registrys_address_gets_no_secret_and_runs_no_code(tmp_path):
    # An attached driver and agent on a registry's Unix socket (PLAIN, the local mechanism):
    # they outlive the registry and keep knocking at its address. (An embedded Cluster closes
    # itself when its registry dies, so its driver would never meet the squatter.)
    os.chmod(tmp_path, 0o755)  # the unprivileged squatter must be able to start here
    marker = tmp_path / "pwned"
    key_file = str(tmp_path / "cluster.key")
    keys = ClusterKeys.generate()
    keys.save(key_file)
    sockets = make_private_directory("aiorl-squatted-")
    registry = subprocess.Popen(
        [sys.executable, "-m", "aiorl.registry.service", "--host", f"ipc://{sockets}",
         "--port", "0", "--print-address", "--key-file", key_file, "--log-level", "ERROR"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    agent = squatter = None
    try:
        assert registry.stdout is not None
        address = registry.stdout.readline().decode().strip().split("=", 1)[1]
        agent = subprocess.Popen(
            [sys.executable, "-m", "aiorl.node.agent", "--registry", address, "--node-rank",
             "0", "--log-level", "ERROR", "--key-file", key_file])
        with aiorl.Cluster(registry=address, num_nodes=1, key_file=key_file) as cluster:
            secret = keys.secret.decode()
            registry.kill()
            registry.wait()
            # Another (unprivileged) local user takes the address the moment it is free.
            squatter = _start_squatter(address, marker, as_user=NOBODY)
            time.sleep(4)  # heartbeats of the driver and the agent, every 0.5 s, reach it
            # The driver's registry calls fail cleanly instead of running the squatter's pickle.
            with pytest.raises(aiorl.AiorlError) as failed:
                cluster.runtime.run_sync(cluster.runtime.registry.request("ping", timeout=1), 5)
            assert not isinstance(failed.value, aiorl.ClusterClosedError)
            squatter.kill()
            output, _ = squatter.communicate(timeout=10)
            assert secret not in output, "the squatter received the cluster secret"
            assert "SECRET" not in output
            assert not marker.exists(), "a squatter's ERROR reply ran code"
    finally:
        for p in (squatter, agent, registry):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if registry.stdout is not None:
            registry.stdout.close()
        shutil.rmtree(sockets, ignore_errors=True)


def test_error_replies_are_data_and_never_unpickled(tmp_path):
    """Whatever an ERROR reply carries, the caller rebuilds it from text: a pickle in it
    stays bytes, and an unknown type name becomes a RemoteError naming it."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Pwn(str(marker)))
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.linger = 0
    port = server.bind_to_random_port("tcp://127.0.0.1")
    replies = [
        {"error": "RemoteError", "type": "evil.Thing", "message": "boom", "traceback": "tb",
         "worker": "w:3", "rank": 3},
        {"error": "system", "type": "os.system", "message": "hi"},
        {"error": "GroupNotFoundError", "message": "no worker group 'x'"},
        "not a dict",
    ]

    def serve() -> None:
        for meta in replies:
            if not server.poll(10_000):
                return
            ident, head, *_ = server.recv_multipart()
            rid = decode_header(head).request_id
            server.send_multipart([ident, encode_header(Kind.ERROR, rid, "op", meta), payload])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def main() -> list[BaseException]:
        client = Endpoint("client", keys=None)
        got = []
        try:
            for _ in replies:
                try:
                    await client.request(f"tcp://127.0.0.1:{port}", "op", timeout=10)
                except BaseException as exc:  # noqa: BLE001 - the test inspects it
                    got.append(exc)
        finally:
            client.close()
        return got

    try:
        remote, unknown, registry, garbage = asyncio.run(main())
    finally:
        thread.join(10)
        server.close()
    assert not marker.exists()
    assert type(remote) is aiorl.RemoteError
    assert (remote.exc_type, remote.rank, remote.worker_name) == ("evil.Thing", 3, "w:3")
    assert remote.remote_traceback == "tb" and remote.cause is None
    assert type(unknown) is aiorl.RemoteError and unknown.exc_type == "os.system"
    assert type(registry) is aiorl.GroupNotFoundError and str(registry) == "no worker group 'x'"
    assert isinstance(garbage, aiorl.ProtocolError)


def test_error_codec_round_trips_remote_error_fields():
    try:
        raise ZeroDivisionError("division by zero")
    except ZeroDivisionError as exc:
        meta = aiorl.errors.to_wire(exc, error="RemoteError", worker="calc:2", rank=2)
    assert msgpack.unpackb(msgpack.packb(meta)) == meta  # plain data only
    rebuilt = aiorl.errors.from_wire(meta)
    assert isinstance(rebuilt, aiorl.RemoteError)
    assert (rebuilt.worker_name, rebuilt.rank) == ("calc:2", 2)
    assert rebuilt.exc_type == "builtins.ZeroDivisionError"
    assert "ZeroDivisionError" in rebuilt.remote_traceback
    # A RemoteError forwarded by a second process keeps the original worker and type.
    again = aiorl.errors.from_wire(aiorl.errors.to_wire(rebuilt))
    assert (again.worker_name, again.rank, again.exc_type) == ("calc:2", 2, rebuilt.exc_type)


def test_plain_is_refused_over_tcp_and_works_over_a_private_ipc_directory():
    keys = ClusterKeys.generate("plain")

    async def main() -> None:
        with pytest.raises(aiorl.AuthenticationError, match="PLAIN"):
            Endpoint("server", keys=keys)  # tcp://127.0.0.1
        directory = make_private_directory("aiorl-test-")
        try:
            server = Endpoint("server", keys=keys, host=f"ipc://{directory}")
            server.handle("ping", lambda m: m.reply("pong"))
            client = Endpoint("client", keys=keys, host=f"ipc://{directory}")
            try:
                assert (await client.request(server.address, "ping", timeout=5))[0] == "pong"
                with pytest.raises(aiorl.AuthenticationError, match="PLAIN"):
                    client.request("tcp://127.0.0.1:1", "ping")
            finally:
                client.close()
                server.close()
        finally:
            shutil.rmtree(directory)
        # A directory others can enter is refused for sockets.
        open_dir = make_private_directory("aiorl-test-")
        os.chmod(open_dir, 0o755)
        try:
            with pytest.raises(aiorl.AuthenticationError, match="not a private directory"):
                Endpoint("server", keys=keys, host=f"ipc://{open_dir}")
        finally:
            os.rmdir(open_dir)

    asyncio.run(main())


# ---------------------------------------------------------------------------- item 2
def test_endpoint_recovers_after_a_failed_handshake():
    """A peer address answered for a while by a server of another mechanism: requests fail
    at once with AuthenticationError (not a hang, not a zmq exception), and once the right
    server is back the same client gets through."""
    keys = ClusterKeys.generate("curve")
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"

    async def main() -> None:
        server = Endpoint("server", keys=keys, port=port)
        server.handle("ping", lambda m: m.reply("pong"))
        client = Endpoint("client", keys=keys)
        try:
            assert (await client.request(address, "ping", timeout=5))[0] == "pong"
            server.close()
            impostor = zmq.Context.instance().socket(zmq.ROUTER)  # no mechanism at all
            impostor.linger = 0
            await _when_port_free(lambda: impostor.bind(address))
            started = time.monotonic()
            with pytest.raises(aiorl.AuthenticationError, match="could not authenticate"):
                await client.request(address, "ping", timeout=10)
            assert time.monotonic() - started < 5
            with pytest.raises(aiorl.AuthenticationError):
                client.send_oneway(address, "ping")  # meanwhile: a clear error, at once
            impostor.close()
            server = await _when_port_free(lambda: Endpoint("server", keys=keys, port=port))
            server.handle("ping", lambda m: m.reply("pong"))
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert (await client.request(address, "ping", timeout=2))[0] == "pong"
                    break
                except (aiorl.AuthenticationError, TimeoutError):
                    assert time.monotonic() < deadline, "the client never reconnected"
                    await asyncio.sleep(0.2)
        finally:
            client.close()
            server.close()

    asyncio.run(main())


def test_heartbeats_survive_error_replies():
    """A registry answering heartbeats with ERROR replies does not end them: when it
    answers again (here: "unknown"), the client re-registers."""
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    fake.linger = 0
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        answered = 0
        while not stop.is_set():
            if not fake.poll(100):
                continue
            ident, head, *_ = fake.recv_multipart()
            h = decode_header(head)
            answered += 1
            if answered <= 3:
                reply = encode_header(Kind.ERROR, h.request_id, h.op,
                                      {"error": "ProtocolError", "message": "bad heartbeat"})
            else:
                reply = encode_header(Kind.REPLY, h.request_id, h.op, {"known": False})
            fake.send_multipart([ident, reply])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def main() -> None:
        endpoint = Endpoint("beater", keys=None)
        client = RegistryClient(endpoint, f"tcp://127.0.0.1:{port}")
        reregistered = asyncio.Event()

        async def on_unknown() -> None:
            reregistered.set()

        client.start_heartbeats("me", 0.1, on_unknown)
        try:
            await asyncio.wait_for(reregistered.wait(), 10)
        finally:
            client.close()
            endpoint.close()

    try:
        asyncio.run(main())
    finally:
        stop.set()
        thread.join(5)
        fake.close()


class AttachedCluster:
    """A registry (restartable, with or without authentication) and one node agent."""

    def __init__(self, tmp_path: Path, expiry: float = 3) -> None:
        self.expiry = expiry
        self.key_file = str(tmp_path / "cluster.key")
        ClusterKeys.generate().save(self.key_file)
        self.address = f"tcp://127.0.0.1:{_free_port()}"
        self.registry = self.start_registry()
        wait_listening(self.address)  # imports take seconds under load; drivers wait 3 s
        self.agent = subprocess.Popen(
            [sys.executable, "-m", "aiorl.node.agent", "--registry", self.address,
             "--node-rank", "0", "--log-level", "WARNING", "--key-file", self.key_file])

    def start_registry(self, insecure: bool = False) -> subprocess.Popen[bytes]:
        port = self.address.rsplit(":", 1)[1]
        auth = ["--insecure"] if insecure else ["--key-file", self.key_file]
        return subprocess.Popen(
            [sys.executable, "-m", "aiorl.registry.service", "--host", "127.0.0.1", "--port",
             port, "--log-level", "ERROR", "--expiry", str(self.expiry), *auth])

    def replace_registry(self, insecure: bool) -> None:
        self.registry.kill()
        self.registry.wait()
        self.registry = self.start_registry(insecure)

    def close(self) -> None:
        for p in (self.agent, self.registry):
            if p.poll() is None:
                p.terminate()
        for p in (self.agent, self.registry):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_registry_restarted_with_another_mechanism_then_right_again_clients_recover(tmp_path):
    # The registry is away for two restarts and the wrong-mechanism spell between them (about
    # 5 s, more on a loaded machine). With the default 3 s expiry the agent would rightly fence
    # its workers after 6 s without a registry (docs/failures.md); this test is about
    # recovering from the wrong mechanism, so the lease is long enough to outlast the spell.
    procs = AttachedCluster(tmp_path, expiry=20)
    try:
        with aiorl.Cluster(registry=procs.address, num_nodes=1, key_file=procs.key_file) as c:
            first = Probe.create_group().launch(c, name="before")
            assert first.echo(1).wait(60) == [1]
            agent_log_dir = os.path.dirname(first.log_path().wait(30)[0])
            procs.replace_registry(insecure=True)
            # Timed from when the new registry listens (its start-up is slow on a loaded
            # machine), after the driver's and the agent's heartbeats met the wrong mechanism.
            assert _wait_for(lambda: _listening(procs.address), 30), "the registry never started"

            def refused_clearly() -> bool:
                try:
                    c.runtime.run_sync(c.runtime.registry.request("ping", timeout=3), 5)
                except aiorl.RegistryUnavailable as exc:
                    return "authenticate" in str(exc)
                return False

            # The driver's requests fail with the clear error (not silence) once the wrong
            # mechanism answers: a few seconds, more on a loaded machine.
            assert _wait_for(refused_clearly, 30), "no clear error meanwhile"
            procs.replace_registry(insecure=False)

            def registry_answers() -> bool:
                try:
                    c.runtime.run_sync(c.runtime.registry.request("ping", timeout=1), 3)
                    return True
                except aiorl.AiorlError:
                    return False

            assert _wait_for(registry_answers, 15), "the driver never reached the registry again"
            # The agent recovered too: it registered again, so a new group can be launched.
            assert _wait_for(lambda: c.num_nodes == 1, 15)
            second = Probe.create_group().launch(c, name="after")
            assert second.echo(2).wait(60) == [2]
            assert first.echo(3).wait(30) == [3]
            second.close()
            first.close()
        # The agent's own log directory (no --log-dir) is private, and gone once it stops.
        assert stat.S_IMODE(os.stat(agent_log_dir).st_mode) == 0o700
        procs.agent.terminate()
        procs.agent.wait(10)
        assert not os.path.exists(agent_log_dir)
    finally:
        procs.close()


# ---------------------------------------------------------------------------- extras
def test_workers_and_agents_do_not_carry_the_secret_and_logs_are_private():
    cluster = aiorl.Cluster(num_nodes=1)
    try:
        secret = cluster.keys.secret.decode()
        group = Probe.create_group().launch(cluster, name="probe")
        environment = group.environment().wait(60)[0]
        assert not any(secret in value for value in environment.values())
        assert not any(name.startswith("AIORL_CURVE") for name in environment)
        for pid in (group.pid().wait(30)[0], cluster._embedded.children[1].pid):  # worker, agent
            assert secret.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
        log_path = group.log_path().wait(30)[0]
        session_dir = cluster.session_dir
        assert log_path.startswith(session_dir + os.sep)
        assert stat.S_IMODE(os.stat(session_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(os.path.dirname(log_path)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(log_path).st_mode) == 0o600
        assert cluster.registry_address.startswith(f"ipc://{session_dir}/")
        group.close()
    finally:
        cluster.close()
    assert not os.path.exists(session_dir)
