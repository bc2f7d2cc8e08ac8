"""Authentication: nothing reaches a service (let alone pickle) without the cluster key."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest
import zmq

import aiorl
from aiorl.transport.endpoint import Endpoint
from aiorl.transport.security import ClusterKeys
from aiorl.transport.wire import Kind, encode_header

pytestmark = pytest.mark.timeout(60)


class Target(aiorl.Worker):
    def __init__(self) -> None:
        super().__init__()
        self.touched = False

    def touch(self, obj: object) -> bool:
        self.touched = True
        return True

    def was_touched(self) -> bool:
        return self.touched


class _Evil:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('/tmp/aiorl-pwned').touch()",))


def _raw_request(address: str, frames: list[bytes], setup=None, timeout_ms: int = 800):
    """Send one request from a bare pyzmq DEALER; return the reply frames or None."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    # A refused handshake can drop the connection before the send: a DEALER with no peer
    # then blocks in send for ever (seen once in CI), so the send has a deadline too.
    sock.sndtimeo = timeout_ms
    if setup is not None:
        setup(sock)
    sock.connect(address)
    try:
        try:
            sock.send_multipart(frames)
        except zmq.Again:
            return None  # nobody took it: refused
        return sock.recv_multipart() if sock.poll(timeout_ms) else None
    finally:
        sock.close(0)


def _plain(username: bytes, password: bytes):
    def setup(sock: zmq.Socket) -> None:
        sock.plain_username, sock.plain_password = username, password
    return setup


def _curve(keys: ClusterKeys, server_key: bytes):
    def setup(sock: zmq.Socket) -> None:
        sock.curve_secretkey, sock.curve_publickey = keys.secret, keys.public
        sock.curve_serverkey = server_key
    return setup


def test_unauthenticated_peers_are_refused_before_unpickling(cluster):
    assert cluster.keys.mechanism == "plain"  # embedded clusters: Unix sockets only
    assert cluster.registry_address.startswith("ipc://")
    group = Target.create_group().launch(cluster, name="target")
    try:
        group.was_touched().wait(60)
        endpoint = cluster.runtime.run_sync(cluster.runtime.resolve_worker("target:0"))["endpoint"]
        payload = pickle.dumps(((_Evil(),), {}))
        request = [encode_header(Kind.REQUEST, 1, "call", "touch"), payload]
        assert _raw_request(endpoint, request) is None  # no mechanism at all
        assert _raw_request(endpoint, request, _plain(cluster.keys.public, b"guess")) is None
        assert _raw_request(endpoint, request, _plain(b"someone", cluster.keys.public)) is None
        other = ClusterKeys.generate()
        assert _raw_request(endpoint, request, _curve(other, other.public)) is None
        assert group.was_touched().wait(10) == [False]
        assert not os.path.exists("/tmp/aiorl-pwned")
        # With the secret, the same bytes are served (and answered, not executed as code:
        # the call's pickle is loaded only after authentication, by design).
        good = _raw_request(endpoint, [encode_header(Kind.REQUEST, 2, "call", "was_touched")],
                            _plain(cluster.keys.public, cluster.keys.secret), timeout_ms=5000)
        assert good is not None
        assert cluster.runtime.run_sync(cluster.runtime.registry.request("ping"), timeout=10)
    finally:
        group.close()


@pytest.mark.parametrize("mechanism", ["curve", "plain"])
def test_endpoints_talk_and_outsiders_are_refused(mechanism, tmp_path):
    # PLAIN only ever runs over Unix sockets in a private directory (embedded clusters).
    host = "127.0.0.1"
    if mechanism == "plain":
        os.chmod(tmp_path, 0o700)
        host = f"ipc://{tmp_path}"

    async def main() -> None:
        keys = ClusterKeys.generate(mechanism)
        server = Endpoint("server", keys=keys, host=host)
        server.handle("ping", lambda m: m.reply("pong"))
        client = Endpoint("client", keys=keys, host=host)
        outsider = Endpoint("outsider", keys=None)
        try:
            assert (await client.request(server.address, "ping", timeout=5))[0] == "pong"
            # The mechanisms differ: the handshake fails and says so (no silent wait).
            with pytest.raises(aiorl.AuthenticationError, match="could not authenticate"):
                await outsider.request(server.address, "ping", timeout=5)
            # Right public key, wrong secret (a raw socket: an Endpoint would also serve).
            wrong = ClusterKeys.generate().secret
            impostor = (_plain(keys.public, wrong) if mechanism == "plain"
                        else _curve(ClusterKeys(keys.public, wrong), keys.public))
            ping = [encode_header(Kind.REQUEST, 1, "ping", None)]
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, _raw_request, server.address, ping, impostor) is None
        finally:
            for e in (client, outsider, server):
                e.close()

    asyncio.run(main())


def test_key_file_round_trip(tmp_path):
    keys = ClusterKeys.generate("plain")
    path = tmp_path / "k"
    keys.save(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert ClusterKeys.load(path) == keys
    assert "secret" not in repr(keys)
    (tmp_path / "bad").write_text("nothing here")
    with pytest.raises(aiorl.AuthenticationError, match="not an aiorl key file"):
        ClusterKeys.load(tmp_path / "bad")
