"""Pure units: names, the wire format, serialization, AsyncWork, and the public surface."""

from __future__ import annotations

import asyncio
import threading

import msgpack
import numpy as np
import pytest
import torch
import zmq

import aiorl
from aiorl.runtime.work import AsyncWork
from aiorl.transport import serialization, wire
from aiorl.transport.endpoint import Endpoint

pytestmark = pytest.mark.timeout(60)


def test_error_tree():
    for name in ["RemoteError", "PeerLostError", "WorkerInitError", "PlacementError", "QueueFull",
                 "QueueEmpty", "RegistryUnavailable", "AuthenticationError", "ProtocolError"]:
        assert issubclass(getattr(aiorl, name), aiorl.AiorlError)
    assert issubclass(aiorl.PlacementError, ValueError)
    assert issubclass(aiorl.WorkerInitError, aiorl.RemoteError)


def test_worker_address():
    a = aiorl.WorkerAddress("g", [0, 1])
    assert a.get_name() == "g:0:1" and a.rank == 1 and a.rank_path == [0, 1]
    assert aiorl.WorkerAddress.from_name("g:0:1") == a
    assert aiorl.WorkerAddress("g").get_name() == "g" and aiorl.WorkerAddress("g").rank == 0
    assert a.get_parent_address() == aiorl.WorkerAddress("g", [0])
    assert aiorl.WorkerAddress("g").get_parent_address() is None
    assert a.get_child_address(3).get_name() == "g:0:1:3"
    assert aiorl.WorkerAddress("g", 2) < aiorl.WorkerAddress("g", 10)
    assert len({aiorl.WorkerAddress("g", 1), aiorl.WorkerAddress.from_name("g:1")}) == 1
    for bad in ["", "a:b"]:
        with pytest.raises(ValueError):
            aiorl.WorkerAddress(bad)
    with pytest.raises(ValueError):
        aiorl.WorkerAddress.from_name("g:x")


@pytest.mark.parametrize("frame", [
    b"", b"\xff\xff", msgpack.packb([1, 2]), msgpack.packb({"a": 1}),
    msgpack.packb([99, 1, 0, "op", None]), msgpack.packb([1, 42, 0, "op", None]),
    msgpack.packb([1, 1, "x", "op", None]), msgpack.packb([1, 1, 0, 7, None]),
])
def test_malformed_headers_raise_protocol_error(frame):
    with pytest.raises(aiorl.ProtocolError):
        wire.decode_header(frame)


def test_header_round_trip():
    h = wire.decode_header(wire.encode_header(wire.Kind.REQUEST, 7, "call", {"x": [1, 2]}))
    assert (h.kind, h.request_id, h.op, h.meta) == (wire.Kind.REQUEST, 7, "call", {"x": [1, 2]})


def test_serialization_zero_copy_tensors_and_fallback():
    big = torch.arange(1 << 16, dtype=torch.float32)
    obj = {"t": big, "small": torch.ones(3, dtype=torch.bfloat16), "f": lambda x: x * 2}
    frames = serialization.dumps(obj)
    assert len(frames) == 2  # the large tensor travels out of band, the small one inline
    back = serialization.loads([bytes(f) for f in frames])
    assert torch.equal(back["t"], big) and back["small"].dtype == torch.bfloat16
    assert back["f"](2) == 4
    with pytest.raises(serialization.SerializationError, match="lock"):
        serialization.dumps(threading.Lock())


def test_endpoint_survives_garbage_and_serves_afterwards():
    async def main():
        server = Endpoint("server", keys=None)
        server.handle("echo", lambda m: m.reply(m.meta))
        client = Endpoint("client", keys=None)
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(server.address)
        for junk in ([b"\x00"], [b"not msgpack", b"x"], [msgpack.packb([1, 1, 5, "nope", None])],
                     [msgpack.packb([1, 9, 5, "echo", None])], [b""] * 5):
            raw.send_multipart(junk)
        with pytest.raises(aiorl.ProtocolError, match="does not serve"):
            await client.request(server.address, "missing", timeout=5)
        meta, _ = await client.request(server.address, "echo", {"ok": 1}, timeout=5)
        assert meta == {"ok": 1}
        raw.close(0)
        client.close()
        server.close()

    asyncio.run(main())


def test_pack_round_trip_and_what_is_not_packed():
    frames = [wire.encode_header(wire.Kind.REQUEST, 1, "echo", None), b"a" * 10,
              memoryview(b"bc"), np.arange(4, dtype=np.float32), bytearray(b"")]
    head, body = wire.pack(frames)
    header = wire.decode_header(head)
    assert header.kind == wire.Kind.PACKED
    assert wire.unpack(header.meta, [body]) == [bytes(memoryview(f).cast("B")) for f in frames]
    assert wire.pack([b"x", b"y" * wire.PACK_MAX_FRAME_BYTES, b"z"]) is None  # zero-copy frame
    assert wire.pack([b"x" * 60_000] * 20) is None  # too many bytes to copy into one frame
    assert wire.pack([b"x", np.zeros((4, 4))[:, 0], b"z"]) is None  # not contiguous
    for lengths, payload in (([1, 2], [b"abcd"]), ([1, -1], [b""]), ("x", [b""]), ([1], [b"a", b"b"])):
        with pytest.raises(aiorl.ProtocolError, match="PACKED"):
            wire.unpack(lengths, payload)


def test_endpoint_serves_packed_messages_and_drops_malformed_ones():
    async def main():
        server = Endpoint("server", keys=None)
        server.handle("echo", lambda m: m.reply(m.meta, m.frames))
        client = Endpoint("client", keys=None)
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(server.address)
        request = [wire.encode_header(wire.Kind.REQUEST, 5, "echo", "hi"), b"1", b"22", b"333"]
        packed = wire.pack(request)
        assert packed is not None
        raw.send_multipart([wire.encode_header(wire.Kind.PACKED, 0, "", [1, 1]), b"abc"])
        raw.send_multipart([wire.encode_header(wire.Kind.PACKED, 0, "", [len(packed[0]),
                                                                         len(packed[1])]),
                            packed[0] + packed[1]])  # PACKED inside PACKED: dropped
        raw.send_multipart(packed)
        assert await asyncio.get_running_loop().run_in_executor(None, raw.poll, 5000)
        reply = raw.recv_multipart()
        header = wire.decode_header(reply[0])
        if header.kind == wire.Kind.PACKED:  # the answer has 4 frames: it comes back packed
            reply = wire.unpack(header.meta, reply[1:])
            header = wire.decode_header(reply[0])
        assert (header.kind, header.request_id, header.meta) == (wire.Kind.REPLY, 5, "hi")
        assert reply[1:] == [b"1", b"22", b"333"]
        assert not raw.poll(200)  # the malformed ones got no answer
        meta, frames = await client.request(server.address, "echo", "ok", [b"x", b"y", b"z"],
                                            timeout=5)
        assert (meta, [bytes(f) for f in frames]) == ("ok", [b"x", b"y", b"z"])
        raw.close(0)
        client.close()
        server.close()

    asyncio.run(main())


def test_async_work_chain_and_thread_wait():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        first: AsyncWork[int] = AsyncWork(loop)
        inner: AsyncWork[int] = AsyncWork(loop)
        chained = first.then(lambda v: inner).then(lambda v, k: v * k, 10)
        loop.call_soon_threadsafe(first._set_result, 1)
        assert not chained.done()
        loop.call_soon_threadsafe(inner._set_result, 4)
        assert chained.wait(5) == 40
        assert first.get_last_work() is chained
        failing: AsyncWork[int] = AsyncWork(loop)
        after = failing.then(lambda v: v + 1)
        loop.call_soon_threadsafe(failing._set_exception, KeyError("x"))
        with pytest.raises(KeyError):
            after.wait(5)
        never: AsyncWork[int] = AsyncWork(loop)
        with pytest.raises(TimeoutError):
            never.wait(0.05)
        assert never.done()

        async def on_loop():
            w: AsyncWork[int] = AsyncWork(loop)
            with pytest.raises(RuntimeError, match="event loop"):
                w.wait()
            loop.call_soon(w._set_result, 3)
            return await w

        assert asyncio.run_coroutine_threadsafe(on_loop(), loop).result(5) == 3
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()


def test_no_lost_wakeups_when_sender_closes_right_after_sending():
    """The ZMQ FD is edge-triggered: messages queued behind one wake-up must all be drained."""

    async def main() -> None:
        server = Endpoint("sink", keys=None)
        got: list[int] = []
        done = asyncio.Event()

        def on_msg(m) -> None:
            got.append(m.meta)
            if len(got) == 3000:
                done.set()

        server.handle("push", on_msg)
        ctx = zmq.Context.instance()
        for burst in range(3):
            raw = ctx.socket(zmq.DEALER)
            raw.linger = 5000  # deliver everything, then vanish
            raw.connect(server.address)
            for i in range(1000):
                raw.send_multipart([wire.encode_header(wire.Kind.ONEWAY, 0, "push", burst * 1000 + i)])
            raw.close()
        await asyncio.wait_for(done.wait(), 10)
        assert sorted(got) == list(range(3000))  # every message arrived
        for burst in range(3):  # and each sender's messages in the order sent
            mine = [g for g in got if g // 1000 == burst]
            assert mine == sorted(mine)
        server.close()

    asyncio.run(main())


def test_messages_sent_in_one_turn_are_batched_in_order():
    async def main() -> None:
        server = Endpoint("batched", keys=None)
        got: list[int] = []
        server.handle("push", lambda m: got.append(m.meta))
        server.handle("echo", lambda m: m.reply(m.meta))
        client = Endpoint("burst", keys=None)
        await client.request(server.address, "echo", 0, timeout=5)  # connected
        for i in range(2000):  # one loop turn: the first goes at once, the rest in one batch
            client.send_oneway(server.address, "push", i)
        replies = await asyncio.gather(*(client.request(server.address, "echo", i) for i in range(500)))
        assert [meta for meta, _ in replies] == list(range(500))
        assert got == list(range(2000))
        # A batch whose counts do not match its frames is dropped; the server keeps serving.
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(server.address)
        raw.send_multipart([wire.encode_header(wire.Kind.BATCH, 0, "", [2, 5]), b"x"])
        raw.close(1000)
        assert (await client.request(server.address, "echo", "ok", timeout=5))[0] == "ok"
        client.close()
        server.close()

    asyncio.run(main())
