"""Authentication: nothing reaches a service (let alone pickle) without the cluster key."""

from __future__ import annotations

import asyncio
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


def _raw_request(address: str, frames: list[bytes], curve: ClusterKeys | None, timeout_ms: int = 800):
    """Send one request from a bare pyzmq DEALER; return the reply frames or None."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if curve is not None:
        sock.curve_secretkey, sock.curve_publickey = curve.secret, curve.public
        sock.curve_serverkey = curve.public
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        if sock.poll(timeout_ms):
            return sock.recv_multipart()
        return None
    finally:
        sock.close(0)


def test_unauthenticated_peers_are_refused_before_unpickling(cluster, tmp_path):
    group = Target.create_group().launch(cluster, name="target")
    try:
        group.was_touched().wait(60)
        endpoint = cluster.runtime.run_sync(cluster.runtime.resolve_worker("target:0"))["endpoint"]
        payload = pickle.dumps(((_Evil(),), {}))
        request = [encode_header(Kind.REQUEST, 1, "call", "touch"), payload]
        assert _raw_request(endpoint, request, curve=None) is None  # plain TCP: no handshake
        wrong = ClusterKeys.generate()
        # A client with other keys cannot even finish the CURVE handshake with our server key...
        assert _raw_request(endpoint, request, curve=wrong) is None
        # ...nor with the right server key but its own (unknown) client key.
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.curve_secretkey, sock.curve_publickey = wrong.secret, wrong.public
        sock.curve_serverkey = cluster.keys.public
        sock.connect(endpoint)
        sock.send_multipart(request)
        assert not sock.poll(800)
        sock.close(0)
        assert group.was_touched().wait(10) == [False]
        import os

        assert not os.path.exists("/tmp/aiorl-pwned")
        # The cluster keeps working for authenticated members.
        assert cluster.runtime.run_sync(cluster.runtime.registry.request("ping"), timeout=10)
    finally:
        group.close()


def test_curve_endpoints_talk_and_insecure_client_is_refused():
    async def main() -> None:
        keys = ClusterKeys.generate()
        server = Endpoint("server", keys=keys)
        server.handle("ping", lambda m: m.reply("pong"))
        client = Endpoint("client", keys=keys)
        outsider = Endpoint("outsider", keys=None)
        try:
            assert (await client.request(server.address, "ping", timeout=5))[0] == "pong"
            with pytest.raises(TimeoutError):
                await outsider.request(server.address, "ping", timeout=0.5)
        finally:
            for e in (client, outsider, server):
                e.close()

    asyncio.run(main())


def test_key_file_round_trip(tmp_path):
    keys = ClusterKeys.generate()
    path = tmp_path / "k"
    keys.save(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert ClusterKeys.load(path) == keys
    assert "secret" not in repr(keys)
    (tmp_path / "bad").write_text("nothing here")
    with pytest.raises(aiorl.AuthenticationError, match="not an aiorl key file"):
        ClusterKeys.load(tmp_path / "bad")
