"""A lane facing a broken or hostile peer of its own machine (docs/security.md, invariant 14):
every call still ends (answered, or failed with a typed error), no core spins, what a peer
announces is not what it costs, a routing id is not taken over, and connections that never
say hello do not pile up. Real endpoints and sockets; the hostile clients are raw sockets.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil
import pytest

import aiorl
from aiorl.transport import lane as lane_module
from aiorl.transport import lane_setup, large_message
from aiorl.transport.endpoint import Endpoint
from aiorl.transport.lane_setup import lane_path
from aiorl.transport.large_message import GROWTH
from aiorl.transport.security import ClusterKeys
from tests.system.test_lane import lane_hello

pytestmark = pytest.mark.timeout(90)


def _run(tmp_path: Path, body: Callable[[Endpoint, Endpoint, ClusterKeys, str], Awaitable[None]],
         hello_deadline: float | None = None) -> None:
    """``body(server, client, keys, lane path)``: a lane-serving endpoint and a client."""
    os.chmod(tmp_path, 0o700)

    async def main() -> None:
        keys = ClusterKeys.generate("plain")
        server = Endpoint("server", host=f"ipc://{tmp_path}", keys=keys, lane=True,
                          hello_deadline=hello_deadline)
        client = Endpoint("client", host=f"ipc://{tmp_path}", keys=keys)
        server.handle("ping", lambda m: m.reply("pong"))
        path = lane_path(server.address)
        assert path is not None
        try:
            assert (await client.request(server.address, "ping", timeout=10))[0] == "pong"
            await body(server, client, keys, path)
        finally:
            client.close()
            server.close()

    asyncio.run(main())


async def _in_thread(fn: Callable[[], object]) -> object:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed the connection (an end of stream, or a reset when it
    closed with our bytes unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


async def _until(check: Callable[[], bool], within: float) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "not within the bound"
        await asyncio.sleep(0.02)


async def _cpu_while_idle(seconds: float) -> float:
    """This process's CPU seconds while its loop has nothing to do for ``seconds``."""
    before = time.process_time()
    await asyncio.sleep(seconds)
    return time.process_time() - before


def test_calls_of_a_refused_client_fail_with_authentication_error_never_hang(
        tmp_path: Path) -> None:
    """Its calls are written before its loop reads the refusal (and may hit a closed
    socket): each still ends, with AuthenticationError, and so do later ones (through ZMQ,
    whose handshake refuses the key too)."""
    async def body(server: Endpoint, client: Endpoint, keys: ClusterKeys, path: str) -> None:
        other = Endpoint("other", host=server.address.rsplit("/", 1)[0],
                         keys=ClusterKeys.generate("plain"), verdict_wait=2.0)
        try:
            first = [other.request(server.address, "ping") for _ in range(20)]
            results = await asyncio.wait_for(asyncio.gather(*first, return_exceptions=True), 15)
            assert all(isinstance(r, aiorl.AuthenticationError) for r in results), results
            later = await asyncio.wait_for(asyncio.gather(
                *(other.request(server.address, "ping") for _ in range(5)),
                return_exceptions=True), 15)
            assert all(isinstance(r, aiorl.AuthenticationError) for r in later), later
        finally:
            other.close()
        assert (await client.request(server.address, "ping", timeout=10))[0] == "pong"

    _run(tmp_path, body)


def test_a_head_announcing_a_terabyte_costs_what_arrived_and_spins_nothing(
        tmp_path: Path) -> None:
    async def body(server: Endpoint, client: Endpoint, keys: ClusterKeys, path: str) -> None:
        sock = lane_hello(path, keys, b"huge")
        assert await _in_thread(lambda: sock.recv(1)) == b"\x01"
        size = (1 << 40) - 12
        sock.sendall(struct.pack("<IQ", 1, size) + b"\0" * 16384)
        (conn,) = [c for c in server._lane_listener._clients  # type: ignore[union-attr]
                   if c.peer_identity == b"huge"]
        # Read into memory of its own (aiorl/transport/large_message.py), bounded the same.
        await _until(lambda: conn._large is not None and conn._large.have >= 16384, 10)
        large = conn._large
        assert large is not None and large.total == 1 << 40
        assert large.capacity <= GROWTH * large.have + 256 * 1024
        assert len(conn._buf) <= lane_module._READ_CHUNK
        assert await _cpu_while_idle(1.0) < 0.5  # nobody spins on it
        assert (await client.request(server.address, "ping", timeout=10))[0] == "pong"
        sock.close()
        await _until(lambda: conn.closed and len(conn._buf) == 0 and conn._large is None, 1.0)

    _run(tmp_path, body)


def test_a_reader_that_fails_closes_its_lane_and_is_not_run_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large message's memory allowed to grow to what a head announces (a terabyte): the
    allocation fails, and that lane closes instead of its reader being called again for ever."""
    monkeypatch.setattr(large_message, "GROWTH", 1 << 62)

    async def body(server: Endpoint, client: Endpoint, keys: ClusterKeys, path: str) -> None:
        sock = lane_hello(path, keys, b"wedge")
        assert await _in_thread(lambda: sock.recv(1)) == b"\x01"
        sock.sendall(struct.pack("<IQ", 1, (1 << 40) - 12) + b"\0" * 16384)
        assert await _in_thread(lambda: _closed_by_server(sock))
        sock.close()
        assert await _cpu_while_idle(1.0) < 0.5
        assert (await client.request(server.address, "ping", timeout=10))[0] == "pong"
        assert b"wedge" not in server._lanes

    _run(tmp_path, body)


def test_a_head_announcing_a_gibibyte_does_not_cost_one(tmp_path: Path) -> None:
    async def body(server: Endpoint, client: Endpoint, keys: ClusterKeys, path: str) -> None:
        rss = psutil.Process().memory_info().rss
        sock = lane_hello(path, keys, b"gib")
        assert await _in_thread(lambda: sock.recv(1)) == b"\x01"
        sock.sendall(struct.pack("<IQ", 1, 1 << 30) + b"\1" * 40_000)
        (conn,) = [c for c in server._lane_listener._clients  # type: ignore[union-attr]
                   if c.peer_identity == b"gib"]
        await _until(lambda: conn._large is not None and conn._large.have >= 40_000, 10)
        assert len(conn._buf) < 1 << 20 and conn._large.capacity < 1 << 20
        assert psutil.Process().memory_info().rss - rss < 64 << 20
        sock.close()
        await _until(lambda: conn.closed and len(conn._buf) == 0 and conn._large is None, 1.0)

    _run(tmp_path, body)


def test_a_second_client_with_someones_routing_id_is_refused_and_they_keep_working(
        tmp_path: Path) -> None:
    async def body(server: Endpoint, client: Endpoint, keys: ClusterKeys, path: str) -> None:
        impostor = lane_hello(path, keys, client.identity)
        try:
            assert await _in_thread(lambda: impostor.recv(1)) == bytes((lane_module.TAKEN,))
            assert await _in_thread(lambda: _closed_by_server(impostor))
        finally:
            impostor.close()
        replies = await asyncio.gather(*(client.request(server.address, "ping", timeout=10)
                                         for _ in range(100)))
        assert [meta for meta, _ in replies] == ["pong"] * 100
        assert client.connection_kind(server.address) == "lane"

    _run(tmp_path, body)


def test_connections_that_never_say_hello_are_bounded_and_closed(tmp_path: Path) -> None:
    async def body(server: Endpoint, client: Endpoint, keys: ClusterKeys, path: str) -> None:
        listener = server._lane_listener
        assert listener is not None
        fds = len(os.listdir("/proc/self/fd"))
        silent = []
        for _ in range(400):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            silent.append(sock)
        try:
            await _until(lambda: listener.clients >= lane_setup.MAX_UNGREETED, 10)
            await asyncio.sleep(0.1)  # the rest of the backlog is accepted and closed
            assert listener.clients <= lane_setup.MAX_UNGREETED + 1  # the client's own lane
            await _until(lambda: listener.clients == 1, 5)  # past the hello deadline
            assert (await client.request(server.address, "ping", timeout=10))[0] == "pong"
        finally:
            for sock in silent:
                sock.close()
        assert len(os.listdir("/proc/self/fd")) <= fds + 2

    _run(tmp_path, body, hello_deadline=1.0)
