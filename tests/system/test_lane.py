"""Lanes (aiorl/transport/lane.py): a worker's messages from its own machine over a Unix stream.

Real endpoints and sockets in a private directory: what goes through a lane comes back as
through ZMQ (replies, errors, events, order, large frames, answers from another thread); a
client without the cluster's key is refused with a clear error and the server keeps serving;
a peer that sends garbage loses its lane, nobody else does; and a group's calls from the
driver to its workers do take their lanes.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import aiorl
from aiorl.transport import lane as lane_module
from aiorl.transport import lane_queue, lane_setup
from aiorl.transport.endpoint import Endpoint, Incoming
from aiorl.transport.lane import LaneConnection
from aiorl.transport.lane_setup import lane_path
from aiorl.transport.large_message import LARGE_MESSAGE
from aiorl.transport.security import ClusterKeys
from aiorl.util.batching import turn_clock_of

pytestmark = pytest.mark.timeout(120)


def _private(tmp_path: Path) -> str:
    os.chmod(tmp_path, 0o700)
    return f"ipc://{tmp_path}"


def _run(tmp_path: Path, body: Callable[[Endpoint, Endpoint, ClusterKeys, str],
                                        Awaitable[None]]) -> None:
    """``body(server, client, keys, host)`` with a lane-serving endpoint and a client."""
    host = _private(tmp_path)

    async def main() -> None:
        keys = ClusterKeys.generate("plain")
        server = Endpoint("server", host=host, keys=keys, lane=True)
        client = Endpoint("client", host=host, keys=keys)
        try:
            await body(server, client, keys, host)
        finally:
            client.close()
            server.close()

    asyncio.run(main())


def test_requests_replies_errors_events_and_order_go_through_the_lane(tmp_path: Path) -> None:
    async def body(server: Endpoint, client: Endpoint, keys: ClusterKeys, host: str) -> None:
        seen: list[int] = []
        events: list[Any] = []
        done = asyncio.Event()

        def echo(msg: Incoming) -> None:
            msg.reply(msg.meta, msg.frames)

        def fail(msg: Incoming) -> None:
            raise KeyError("no such thing")

        def note(msg: Incoming) -> None:
            seen.append(msg.meta)
            if msg.meta == 9_999:
                server.push_event(msg.identity, "tick", {"n": len(seen)})

        def tick(peer: str, meta: Any, frames: list[Any]) -> None:
            events.append((peer, meta))
            done.set()

        server.handle("echo", echo)
        server.handle("fail", fail)
        server.handle("note", note)
        client.on_event("tick", tick)
        meta, frames = await client.request(server.address, "echo", {"a": 1},
                                            [b"x", b"y" * 1000])
        assert meta == {"a": 1} and frames == [b"x", b"y" * 1000]
        assert isinstance(client._peers[server.address].connection, LaneConnection)
        assert Path(lane_path(server.address) or "").exists()
        with pytest.raises(aiorl.RemoteError, match="no such thing"):
            await client.request(server.address, "fail")
        for i in range(10_000):  # one-way, many per loop turn: they arrive in order
            client.send_oneway(server.address, "note", i)
        await asyncio.wait_for(done.wait(), 30)
        assert seen == list(range(10_000))
        assert events == [(server.address, {"n": 10_000})]
        replies = await asyncio.gather(*(client.request(server.address, "echo", i)
                                         for i in range(2_000)))
        assert [m for m, _ in replies] == list(range(2_000))

    _run(tmp_path, body)


def test_large_frames_and_answers_from_another_thread(tmp_path: Path) -> None:
    async def body(server: Endpoint, client: Endpoint, keys: ClusterKeys, host: str) -> None:
        def answer_later(msg: Incoming) -> None:  # as a worker's method thread answers
            threading.Thread(target=msg.reply, args=(len(msg.frames[0]), msg.frames)).start()

        server.handle("size", answer_later)
        big = os.urandom(1 << 20) * 64  # 64 MiB: many partial writes each way
        meta, frames = await client.request(server.address, "size", None, [big])
        assert meta == len(big) and frames[0] == big
        sizes = await asyncio.gather(*(client.request(server.address, "size", None,
                                                      [b"z" * n]) for n in range(0, 300_000, 997)))
        assert [m for m, _ in sizes] == list(range(0, 300_000, 997))

    _run(tmp_path, body)


@pytest.mark.parametrize("send", ["send_from_thread", "send_frame_from_thread"])
def test_a_threads_failed_write_reaches_the_owner_even_when_the_end_was_read_first(
        send: str) -> None:
    """A method thread's answer whose write fails before a byte of it left is handed to the
    owner with the news of the break (to go by ZMQ), also when the loop reads the stream's
    end before the thread's own news of the failure is run: the order a busy loop takes."""
    async def main() -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        told: list[tuple[str, list[Any]]] = []
        conn = LaneConnection(ours, asyncio.get_running_loop(), lambda frames: None,
                              lambda reason, unsent: told.append((reason, unsent)))
        theirs.sendall(bytes([lane_module.ADMITTED]))  # the server's answer to our hello...
        theirs.close()  # ...and it is gone
        if send == "send_from_thread":
            thread = threading.Thread(target=conn.send_from_thread, args=([b"answer"],))
        else:
            thread = threading.Thread(target=conn.send_frame_from_thread, args=(b"answer",))
        thread.start()
        thread.join()  # the write failed (EPIPE); its news waits for the loop
        conn._on_readable()  # what the loop runs first: the server's answer...
        conn._on_readable()  # ...then the stream's end
        for _ in range(3):
            await asyncio.sleep(0)  # the thread's news runs: the owner was told already
        assert [(reason, [list(m) for m in unsent]) for reason, unsent in told] == [
            ("the peer closed it", [[b"answer"]])]
        assert conn.closed

    asyncio.run(main())


def test_messages_queued_for_a_full_socket_that_never_left_reach_the_owner() -> None:
    """Messages wait in the lane's queue while the peer does not read. When the peer goes,
    every queued message not a byte of which left is handed to the owner (to go by ZMQ), in
    order: what the peer received, at most one message cut short, and those, are all that
    was sent, once each."""
    async def main() -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        told: asyncio.Future[tuple[str, list[Any]]] = asyncio.get_running_loop().create_future()
        conn = LaneConnection(ours, asyncio.get_running_loop(), lambda frames: None,
                              lambda reason, unsent: told.set_result((reason, unsent)))
        theirs.sendall(bytes([lane_module.ADMITTED]))
        sizes = [100, 70_000, 3, 200_000, 5_000]  # small ones copied, large ones referenced
        sent = 0
        while not conn._out or sent < 40:  # until the socket is full, and more after that
            payload = bytearray(sizes[sent % len(sizes)])
            payload[:4] = struct.pack("<I", sent)[:len(payload)]
            conn.send_direct([b"%06d" % sent, memoryview(payload)])
            if len(payload) < lane_queue.COPY_BELOW:  # larger ones are referenced, as ZMQ does
                payload[:4] = b"XXXX"  # the caller may reuse a small buffer once send returned
            sent += 1
        theirs.setblocking(False)
        stream = bytearray()
        while True:
            try:
                chunk = theirs.recv(1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                break
            stream += chunk
        theirs.close()  # the peer goes with the rest unread
        reason, unsent = await asyncio.wait_for(told, 20)
        received, pos = [], 0
        while len(stream) - pos >= 4:
            (count,) = struct.unpack_from("<I", stream, pos)
            lengths = struct.unpack_from(f"<{count}Q", stream, pos + 4)
            end = pos + 4 + 8 * count + sum(lengths)
            if end > len(stream):
                break  # the message cut short
            received.append(int(stream[pos + 4 + 8 * count:][:lengths[0]]))
            pos = end
        cut = pos < len(stream)
        again = [int(bytes(m[0])) for m in unsent]
        assert received == list(range(len(received)))
        assert again == list(range(len(received) + cut, sent)) and again, (reason, cut)
        for m in unsent:  # whole, and as they were when sent
            n = int(bytes(m[0]))
            assert len(m[1]) == sizes[n % len(sizes)]
            assert bytes(m[1][:4]) == struct.pack("<I", n)[:len(m[1])]

    asyncio.run(main())


def test_a_client_back_by_zmq_is_answered_by_zmq_before_its_lanes_end_is_read(
        tmp_path: Path) -> None:
    """A client whose lane broke comes back through the ROUTER (RESUME first). A server whose
    loop has not read the lane's end yet ends that lane when RESUME arrives: the answers to
    what the client sends next go back by ZMQ, from a method thread too, and never onto the
    lane, where they could be lost with nothing left to end the client's wait for them."""
    async def body(server: Endpoint, client: Endpoint, keys: ClusterKeys, host: str) -> None:
        def where(msg: Incoming) -> None:  # answers from a thread, as a method thread does
            state = {"by_lane": msg.lane is not None, "lane_held": msg.identity in server._lanes}
            threading.Thread(target=msg.reply, args=(state,)).start()

        server.handle("where", where)
        assert (await client.request(server.address, "where", timeout=10))[0] == {
            "by_lane": True, "lane_held": True}
        old = server._lanes[client.identity]
        old._pause_reading()  # a loop that has not read the lane's end yet
        client._peers[server.address].connection.sock.shutdown(socket.SHUT_RDWR)
        for _ in range(3):
            meta, _ = await client.request(server.address, "where", timeout=20)
            assert meta == {"by_lane": False, "lane_held": False}
        assert old.closed and client.connection_kind(server.address) == "zmq"

    _run(tmp_path, body)


def test_calls_to_many_lanes_in_one_turn_keep_each_lanes_order(tmp_path: Path) -> None:
    """One loop turn sends to several lanes (as a group call does): each lane's first
    message leaves at once and the rest at the turn's end (or every `_MAX_HELD`), all
    lanes of the loop sharing one end-of-turn callback; each lane keeps its order."""
    host = _private(tmp_path)

    async def main() -> None:
        keys = ClusterKeys.generate("plain")
        servers = [Endpoint(f"server{i}", host=host, keys=keys, lane=True) for i in range(3)]
        client = Endpoint("client", host=host, keys=keys)
        seen: dict[str, list[int]] = {s.name: [] for s in servers}
        try:
            for server in servers:
                def note(msg: Incoming, name: str = server.name) -> None:
                    seen[name].append(msg.meta)
                    msg.reply(msg.meta)

                server.handle("note", note)
            n = 3 * lane_module._MAX_HELD + 5
            # No await in between: one turn, interleaved across the lanes.
            calls = [client.request(s.address, "note", i) for i in range(n) for s in servers]
            clock = turn_clock_of(asyncio.get_running_loop())
            assert clock.scheduled and len(set(clock.holding)) == len(servers)
            replies = await asyncio.gather(*calls)
            assert [m for m, _ in replies] == [i for i in range(n) for _ in servers]
            assert all(order == list(range(n)) for order in seen.values()), seen
            assert all(isinstance(client._peers[s.address].connection, LaneConnection)
                       for s in servers)
        finally:
            client.close()
            for server in servers:
                server.close()

    asyncio.run(main())


def test_a_lanes_buffer_grown_for_a_large_message_is_given_back(tmp_path: Path) -> None:
    async def body(server: Endpoint, client: Endpoint, keys: ClusterKeys, host: str) -> None:
        server.handle("echo", lambda m: m.reply(None, m.frames))
        big = os.urandom(3 << 20)
        _, frames = await client.request(server.address, "echo", None, [big, b"tail"])
        assert frames == [big, b"tail"]
        (conn,) = server._lanes.values()
        assert len(conn._buf) == lane_module._READ_CHUNK  # given back once it was parsed
        mine = client._peers[server.address].connection
        assert isinstance(mine, LaneConnection) and len(mine._buf) == lane_module._READ_CHUNK
        for size in (0, 1, 100, 20_000):  # what follows is read into the new buffer
            _, frames = await client.request(server.address, "echo", None, [b"s" * size])
            assert frames == [b"s" * size]

    _run(tmp_path, body)


def test_a_client_without_the_key_is_refused_and_others_are_still_served(
        tmp_path: Path) -> None:
    async def body(server: Endpoint, client: Endpoint, keys: ClusterKeys, host: str) -> None:
        server.handle("ping", lambda m: m.reply("pong"))
        other = Endpoint("other", host=host, keys=ClusterKeys.generate("plain"))
        try:
            with pytest.raises(aiorl.AuthenticationError,
                               match="refused this cluster's key on its lane"):
                await other.request(server.address, "ping", timeout=10)
        finally:
            other.close()
        assert (await client.request(server.address, "ping", timeout=10))[0] == "pong"
        assert list(server._lanes) == [client._identity]

    _run(tmp_path, body)


def lane_hello(path: str, keys: ClusterKeys, identity: bytes) -> socket.socket:
    """A lane client by hand: connected, its hello sent (a valid proof); the answer is left
    to read."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(lane_setup._proof(keys, path, identity)
                 + struct.pack("<H", len(identity)) + identity)
    return sock


def _raw_lane(path: str, keys: ClusterKeys, identity: bytes) -> socket.socket:
    """A lane client by hand, admitted."""
    sock = lane_hello(path, keys, identity)
    assert sock.recv(1) == b"\x01"  # admitted
    return sock


@pytest.mark.parametrize("garbage", [
    struct.pack("<I", 0),  # a message of no frames
    struct.pack("<I", lane_module.MAX_FRAMES + 1),  # more frames than anyone sends
    struct.pack("<IQ", 1, lane_module.MAX_MESSAGE_BYTES + 1),  # an impossible size
])
def test_a_peer_that_sends_garbage_loses_its_lane_and_nobody_else_does(
        tmp_path: Path, garbage: bytes) -> None:
    async def body(server: Endpoint, client: Endpoint, keys: ClusterKeys, host: str) -> None:
        server.handle("ping", lambda m: m.reply("pong"))
        assert (await client.request(server.address, "ping"))[0] == "pong"
        path = lane_path(server.address)
        assert path is not None
        loop = asyncio.get_running_loop()

        def hostile() -> bytes:
            sock = _raw_lane(path, keys, b"hostile")
            try:
                sock.sendall(garbage)
                return sock.recv(1)  # b"": the server closed the lane
            finally:
                sock.close()

        assert await loop.run_in_executor(None, hostile) == b""
        assert (await client.request(server.address, "ping"))[0] == "pong"
        assert b"hostile" not in server._lanes

    _run(tmp_path, body)


def test_a_tcp_endpoint_has_no_lane_and_its_peers_use_zmq(tmp_path: Path) -> None:
    async def main() -> None:
        server = Endpoint("server", host="127.0.0.1", keys=None, lane=True)
        client = Endpoint("client", host=_private(tmp_path), keys=None)
        try:
            server.handle("ping", lambda m: m.reply("pong"))
            assert (await client.request(server.address, "ping"))[0] == "pong"
            assert not isinstance(client._peers[server.address].connection, LaneConnection)
        finally:
            client.close()
            server.close()

    asyncio.run(main())


class _Noop(aiorl.Worker):
    def noop(self) -> int:
        return os.getpid()


def test_a_groups_calls_to_its_workers_take_their_lanes() -> None:
    with aiorl.Cluster(num_nodes=1, timeout=60) as cluster:
        group = _Noop.create_group().launch(cluster, num_workers=4, name="lanes")
        try:
            pids = group.noop().wait(60)
            assert len(set(pids)) == 4
            endpoint = cluster.runtime.endpoint
            lanes = [p for p in list(endpoint._peers.values())
                     if isinstance(p.connection, LaneConnection)]
            assert len(lanes) == 4, [p.address for p in endpoint._peers.values()]
        finally:
            group.close()


class _Pair(aiorl.Worker):
    """Two ranks on one node: does rank 0 reach rank 1 by lane?"""

    async def ping(self, peer: int) -> tuple[bool, str]:
        from aiorl.runtime.runtime import current_runtime

        await self.send("ping", self.worker_group_name, peer)
        runtime = current_runtime()
        assert runtime is not None
        peers = runtime.endpoint._peers
        return (any(isinstance(p.connection, LaneConnection) for p in peers.values()),
                os.environ.get(lane_setup.LANE_DIR_VAR, ""))

    async def pong(self, peer: int) -> Any:
        return await self.recv(self.worker_group_name, peer)


def test_workers_bound_on_tcp_reach_each_other_by_lane_in_their_agents_directory(
        tmp_path: Path) -> None:
    from tests.system.test_failures import ClusterProcesses

    procs = ClusterProcesses(tmp_path, nodes=1)
    try:
        with aiorl.Cluster(registry=procs.address, num_nodes=1,
                           key_file=procs.key_file) as cluster:
            group = _Pair.create_group().launch(cluster, num_workers=2, name="tcppair")
            try:
                got = group.execute_on(1).pong(0)
                ((by_lane, lane_dir),) = group.execute_on(0).ping(1).wait(60)
                assert got.wait(60) == ["ping"]
                assert by_lane, "rank 0 sent to rank 1 through ZMQ, not its lane"
                assert lane_dir and (os.stat(lane_dir).st_mode & 0o777) == 0o700
                assert any(name.endswith(".lane") for name in os.listdir(lane_dir))
            finally:
                group.close()
    finally:
        procs.close()
    assert not os.path.exists(lane_dir), "the agent left its lane directory behind"


def test_dropping_a_peer_mid_handshake_never_stalls_the_processs_other_links(
        tmp_path: Path) -> None:
    """A peer dropped (`close_sockets`) while its handshake with an endpoint that is closing
    may still be reported: the process's other links keep working. Before the fix, the
    first round stalled libzmq's I/O thread and the control request timed out (a driver
    then lost its registry and heartbeats, and the registry tore its groups down)."""
    host = _private(tmp_path)

    async def main() -> None:
        keys = ClusterKeys.generate("plain")
        control = Endpoint("control", host=host, keys=keys)
        control.handle("ping", lambda m: m.reply("pong"))
        client = Endpoint("client", host=host, keys=keys)
        try:
            for i in range(100):
                target = Endpoint(f"target{i}", host=host, keys=keys)  # ZMQ only: no lane
                target.handle("ping", lambda m: m.reply("pong"))
                for step in range(3):
                    client.request_then(target.address, "ping", None, [],
                                        lambda e, r: None, timeout=1)
                    await asyncio.sleep(0)
                    if step == 1:
                        target.close()
                    dropped = client._peers.pop(target.address, None)
                    if dropped is not None:
                        dropped.close_sockets()
                meta, _ = await client.request(control.address, "ping", timeout=5)
                assert meta == "pong", i
        finally:
            client.close()
            control.close()

    asyncio.run(main())



def _large_has(conn: LaneConnection, nbytes: int) -> bool:
    return conn._large is not None and conn._large.have == nbytes


def test_every_way_a_message_can_arrive_on_the_stream_gives_the_same_messages() -> None:
    """A read may bring one whole one-frame message (dispatched at once), part of one, the
    rest of one, several, or one larger than the read buffer: each is delivered whole, once,
    in order; a handler that raises loses only its own message."""

    def framed(*frames: bytes) -> bytes:
        return struct.pack(f"<I{len(frames)}Q", len(frames), *map(len, frames)) + b"".join(frames)

    split, body, big = framed(b"split"), framed(b"b" * 100), os.urandom(3 * lane_module._READ_CHUNK)
    huge_frame = os.urandom(LARGE_MESSAGE + 12_345)
    huge = framed(b"h" * 10, huge_frame)  # read into memory of its own
    # (what the peer writes, whether the lane must have read it before the next write: for
    # a large message, how much of it by then)
    writes = [
        (framed(b"one"), False),  # one whole one-frame message in one read
        (split[:5], True), (split[5:], False),  # its head split across two reads
        (body[:20], True), (body[20:], False),  # its frame split across two reads
        (framed(b"x", b"y") + framed(b"two") + framed(b"raise") + framed(b"after"), False),
        (framed(big), False),  # larger than the read buffer: grown, then given back
        (framed(b"small again"), False),
        (huge[:1000], 1000),  # a large message's head, then its frames in pieces...
        (huge[1000:200_000], 200_000),
        (huge[200_000:] + framed(b"after huge"), False),  # ...its end and the next message
    ]
    expected = [[b"one"], [b"split"], [b"b" * 100], [b"x", b"y"], [b"two"], [b"after"], [big],
                [b"small again"], [b"h" * 10, huge_frame], [b"after huge"]]

    async def main() -> list[list[Any]]:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)
        got: list[list[Any]] = []

        def on_message(frames: list[Any]) -> None:
            if frames == [b"raise"]:
                raise RuntimeError("a handler's bug")
            got.append(frames)

        async def until(condition: Callable[[], bool]) -> None:
            # A partial read dispatches nothing, so there is no event to wait on: poll.
            async with asyncio.timeout(10):
                while not condition():
                    await asyncio.sleep(0.001)

        conn = LaneConnection(ours, loop, on_message)  # a client: the server admits it first
        try:
            await loop.sock_sendall(theirs, bytes((lane_module.ADMITTED,)))
            for data, read_first in writes:
                await loop.sock_sendall(theirs, data)
                if read_first is True:  # the next part must come in a read of its own
                    await until(lambda: conn._end > conn._start)
                elif read_first:
                    await until(functools.partial(_large_has, conn, read_first))
            await until(lambda: len(got) == len(expected))
            assert len(conn._buf) == lane_module._READ_CHUNK  # the big one's buffer given back
            assert conn._large is None
            assert isinstance(got[-2][1], memoryview)  # the large frame, in place
        finally:
            conn.close()
            theirs.close()
        return got

    assert asyncio.run(main()) == expected
