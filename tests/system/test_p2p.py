"""Worker-to-worker send/recv and send_tensor/recv_tensor between real worker processes.

One embedded two-node cluster for the module: ranks 0 and 1 of each group share
node 0 (shared-memory path for bulk bytes), rank 2 is on node 1 (ZMQ frames).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

import aiorl
from aiorl.placement import NodePlacementStrategy

pytestmark = pytest.mark.timeout(90)

G = "p2p"
SAME, CROSS = 1, 2  # peers of rank 0: on its node, on the other node


# ----------------------------------------------------------------------------- payloads
@dataclass
class Batch:
    obs: torch.Tensor
    actions: list[torch.Tensor]
    info: dict[str, Any] = field(default_factory=dict)


class Holder:
    """Holds a lock: neither pickle nor cloudpickle can serialize it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fn = lambda x: x


class BadReduce:
    def __reduce__(self) -> Any:
        raise RuntimeError("BadReduce refuses to be pickled")


def make(kind: str) -> Any:
    """The payload named ``kind``; the receiver rebuilds the same one to compare."""
    g = torch.Generator().manual_seed(zlib.crc32(kind.encode()))
    return {
        "int": lambda: 42,
        "str": lambda: "hello",
        "nested": lambda: {"a": [1, 2, (3, "x")], "b": None, "c": {"d": 1.5}},
        "tensor": lambda: torch.arange(10, dtype=torch.float32),
        "tensor_big": lambda: torch.randn(2_000_000, generator=g, dtype=torch.float64),  # 16 MB
        "tensor_1mb": lambda: torch.randn(1 << 18, generator=g),
        "bf16": lambda: torch.full((1000,), 3.0, dtype=torch.bfloat16),
        "bool": lambda: torch.tensor([True, False, True]),
        "empty": lambda: torch.empty(0, 3),
        "scalar": lambda: torch.tensor(3.5),
        "int64_2d": lambda: torch.arange(600_000, dtype=torch.int64).reshape(1000, 600),
        "grad": lambda: torch.ones(3, requires_grad=True),
        "param": lambda: torch.nn.Parameter(torch.ones(2)),
        "list": lambda: [torch.ones(5), torch.zeros(300_000), torch.arange(7), "tag"],
        "tuple": lambda: (torch.ones(2), torch.full((100_000,), 2.0)),
        "dict": lambda: {
            "z": torch.ones(3),
            "a": torch.randn(200_000, generator=g),
            "m": torch.arange(4),
        },
        "dataclass": lambda: Batch(
            torch.randn(64, 128, generator=g), [torch.ones(2), torch.zeros(70_000)], {"step": 3}
        ),
        "numpy": lambda: np.arange(100_000),
        "bytes": lambda: b"x" * 500_000,
        "lambda": lambda: lambda x: x + 1,
    }[kind]()


KINDS = [
    "int",
    "str",
    "nested",
    "tensor",
    "tensor_big",
    "tensor_1mb",
    "bf16",
    "bool",
    "empty",
    "scalar",
    "int64_2d",
    "grad",
    "param",
    "list",
    "tuple",
    "dict",
    "dataclass",
    "numpy",
    "bytes",
    "lambda",
]
TENSOR_KINDS = ["tensor", "tensor_big", "tensor_1mb", "bf16", "bool", "empty", "scalar", "int64_2d"]


def same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.device.type == b.device.type
            and a.requires_grad == b.requires_grad
            and torch.equal(a.detach(), b.detach())
        )
    if isinstance(b, dict):
        return isinstance(a, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(b, Batch):
        return (
            isinstance(a, Batch)
            and same(a.obs, b.obs)
            and same(a.actions, b.actions)
            and a.info == b.info
        )
    if isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and np.array_equal(a, b) and a.dtype == b.dtype
    if callable(b):
        return callable(a) and a(1) == b(1)
    return a == b


def seq_size(i: int) -> int:
    """Message i of the interleaving test: mostly small, every 97th over the shm threshold."""
    return 300_000 if i % 97 == 5 else (i % 7 + 1) * 10


# ----------------------------------------------------------------------------- worker
class P(aiorl.Worker):
    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return self.worker_info.node_id

    async def send_all(self, dst: int, kinds: list[str]) -> int:
        for k in kinds:
            await self.send(make(k), self.worker_group_name, dst)
        return len(kinds)

    def send_all_sync(self, dst: int, kinds: list[str]) -> int:
        works = [self.send(make(k), self.worker_group_name, dst) for k in kinds]
        for w in works:
            w.wait(30)
        return len(kinds)

    async def recv_all(self, src: int, kinds: list[str]) -> list[str]:
        bad = []
        for k in kinds:
            got = await self.recv(self.worker_group_name, src)
            if not same(got, make(k)):
                bad.append(k)
        return bad

    def recv_all_sync(self, src: int, kinds: list[str]) -> list[str]:
        works = [self.recv(self.worker_group_name, src) for _ in kinds]
        return [k for k, w in zip(kinds, works, strict=True) if not same(w.wait(30), make(k))]

    async def send_tensors(self, dst: int, kinds: list[str]) -> int:
        for k in kinds:
            await self.send_tensor(make(k), self.worker_group_name, dst)
        return len(kinds)

    def send_tensors_sync(self, dst: int, kinds: list[str]) -> int:
        for k in kinds:
            self.send_tensor(make(k), self.worker_group_name, dst).wait(30)
        return len(kinds)

    async def recv_tensors(self, src: int, kinds: list[str]) -> list[str]:
        bad = []
        for k in kinds:
            want = make(k)
            buf = torch.empty_like(want)
            got = await self.recv_tensor(buf, self.worker_group_name, src)
            if got is not buf or not torch.equal(buf, want):
                bad.append(k)
        return bad

    def recv_tensors_sync(self, src: int, kinds: list[str]) -> list[str]:
        bufs = [torch.empty_like(make(k)) for k in kinds]
        works = [self.recv_tensor(b, self.worker_group_name, src) for b in bufs]
        return [
            k
            for k, b, w in zip(kinds, bufs, works, strict=True)
            if w.wait(30) is not b or not torch.equal(b, make(k))
        ]

    async def exchange(self, n: int) -> int:
        """Send n mixed messages to the other of ranks 0/1 while receiving its n; check order."""
        peer, g = 1 - self.rank, self.worker_group_name
        sends = []
        for i in range(n):
            t = torch.full((seq_size(i),), float(i))
            if i % 3 == 0:
                sends.append(self.send_tensor(t, g, peer))
            else:
                sends.append(self.send({"i": i, "t": t, "from": self.rank}, g, peer))
            if i % 50 == 0:
                await asyncio.sleep(0)  # let the peer's messages in meanwhile
        checked = 0
        for start in range(0, n, 100):
            # Post a batch of receives before awaiting: some arrive before, some after.
            batch = []
            for i in range(start, min(n, start + 100)):
                if i % 3 == 0:
                    buf = torch.empty(seq_size(i))
                    batch.append((i, buf, self.recv_tensor(buf, g, peer)))
                else:
                    batch.append((i, None, self.recv(g, peer)))
            for i, buf, w in batch:
                got = await w
                if buf is not None:
                    assert got is buf and bool((buf == i).all()), f"tensor message {i} out of order"
                else:
                    assert got["i"] == i and got["from"] == peer, (
                        f"message {i} out of order: {got['i']}"
                    )
                    assert got["t"].shape == (seq_size(i),) and bool((got["t"] == i).all())
                checked += 1
        for w in sends:
            await w
        return checked

    async def recv_one(self, src: int) -> Any:
        return await self.recv(self.worker_group_name, src)

    async def recv_expect_loss(self, src: int) -> tuple[str, str]:
        try:
            got = await self.recv(self.worker_group_name, src)
            return "received", repr(got)
        except Exception as exc:  # noqa: BLE001 - the test inspects the type
            return type(exc).__name__, str(exc)

    async def after_loss(self, peer: int) -> list[str]:
        out = []
        for op in (
            lambda: self.send(1, self.worker_group_name, peer),
            lambda: self.recv(self.worker_group_name, peer),
            lambda: self.send_tensor(torch.ones(1 << 20), self.worker_group_name, peer),
        ):
            try:
                await asyncio.wait_for(op().async_wait(), 5)
                out.append("ok")
            except Exception as exc:  # noqa: BLE001
                out.append(type(exc).__name__)
        return out

    def bad_sends(self, dst: int) -> dict[str, Any]:
        g = self.worker_group_name
        nc = torch.ones(4, 6).t()
        cases = {
            "send": lambda: self.send(nc, g, dst),
            "send_tensor": lambda: self.send_tensor(nc, g, dst),
            "nested": lambda: self.send({"ok": torch.ones(2), "bad": [nc]}, g, dst),
            "lock": lambda: self.send(Holder(), g, dst),
            "reduce": lambda: self.send(BadReduce(), g, dst),
        }
        out: dict[str, Any] = {}
        for name, fn in cases.items():
            try:
                fn()
                out[name] = None
            except Exception as exc:  # noqa: BLE001
                out[name] = [
                    type(exc).__name__,
                    isinstance(exc, ValueError),
                    isinstance(exc, TypeError),
                    str(exc),
                ]
        self.send("after", g, dst).wait(30)  # nothing of the above went out
        return out

    async def recv_tensor_mismatch(self, src: int) -> str:
        try:
            await self.recv_tensor(torch.empty(3), self.worker_group_name, src)
            return "no error"
        except ValueError as exc:
            return str(exc)

    def recv_times_out(self, src: int) -> str:
        try:
            return repr(self.recv(self.worker_group_name, src).wait(0.3))
        except TimeoutError:
            return "timeout"  # wait() cancelled the receive

    async def lockstep_send(self, dst: int, n: int) -> int:
        for i in range(n):
            await self.send(torch.full((1 << 20,), float(i)), self.worker_group_name, dst)  # 4 MB
            assert await self.recv(self.worker_group_name, dst) == i
        return n

    async def lockstep_recv(self, src: int, n: int) -> int:
        for i in range(n):
            self._kept = await self.recv(self.worker_group_name, src)
            assert bool((self._kept == i).all())
            await asyncio.sleep(0.01)  # let the previous message's segment go back first
            await self.send(i, self.worker_group_name, src)
        return n

    def drop_kept(self) -> None:
        del self._kept

    async def p2p_stats(self) -> Any:
        import gc

        from aiorl.p2p import get_p2p

        gc.collect()
        await asyncio.sleep(0.2)  # acks of released segments travel back
        return get_p2p(self._runtime).statistics()


# ----------------------------------------------------------------------------- fixtures
def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.fixture(scope="module")
def cluster2():
    before = _shm_entries()
    with aiorl.Cluster(num_nodes=2) as c:
        yield c
    leaked = {n for n in _shm_entries() - before if "aiorl" in n or "p2p" in n}
    assert not leaked, f"shared memory left behind: {leaked}"


@pytest.fixture(scope="module")
def group(cluster2):
    g = P.create_group().launch(
        cluster2, name=G, placement_strategy=NodePlacementStrategy([0, 0, 1])
    )
    nodes = g.node().wait(60)
    assert nodes[0] == nodes[1] != nodes[2]
    _LIVE_GROUPS.append(g)
    yield g
    _LIVE_GROUPS.remove(g)
    g.close()


def on(g: Any, rank: int) -> Any:
    return g.execute_on(rank)


_LIVE_GROUPS: list[Any] = []


@pytest.fixture(autouse=True)
def _p2p_state_on_failure(request: Any):
    """After a failed test, print every live group's p2p state (what waits for what)."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        for g in _LIVE_GROUPS:
            for rank in range(3):
                try:
                    print(f"p2p state of rank {rank}:", g.execute_on(rank).p2p_stats().wait(5))
                except Exception as exc:  # noqa: BLE001 - diagnostics only
                    print(f"p2p state of rank {rank}: unavailable ({exc!r})")


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("peer", [SAME, CROSS], ids=["same_node", "cross_node"])
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_every_payload_kind_recv_posted_first(group: Any, peer: int, mode: str) -> None:
    recv = (
        on(group, peer).recv_all(0, KINDS)
        if mode == "async"
        else on(group, peer).recv_all_sync(0, KINDS)
    )
    time.sleep(0.2)  # the receives are posted before anything is sent
    send = (
        on(group, 0).send_all(peer, KINDS)
        if mode == "async"
        else on(group, 0).send_all_sync(peer, KINDS)
    )
    assert send.wait(60) == [len(KINDS)]
    assert recv.wait(60) == [[]]


@pytest.mark.parametrize("peer", [SAME, CROSS], ids=["same_node", "cross_node"])
def test_every_payload_kind_sent_first(group: Any, peer: int) -> None:
    # The sender finishes before the receiver asks: messages wait at the receiver.
    assert on(group, 0).send_all(peer, KINDS).wait(60) == [len(KINDS)]
    assert on(group, peer).recv_all_sync(0, KINDS).wait(60) == [[]]
    # And the other direction, from the cross-node rank back to rank 0.
    assert on(group, peer).send_all_sync(0, KINDS[:8]).wait(60) == [8]
    assert on(group, 0).recv_all(peer, KINDS[:8]).wait(60) == [[]]


@pytest.mark.parametrize("peer", [SAME, CROSS], ids=["same_node", "cross_node"])
def test_send_tensor_into_preallocated_buffers(group: Any, peer: int) -> None:
    recv = on(group, peer).recv_tensors(0, TENSOR_KINDS)
    time.sleep(0.1)
    assert on(group, 0).send_tensors_sync(peer, TENSOR_KINDS).wait(60) == [len(TENSOR_KINDS)]
    assert recv.wait(60) == [[]]
    # Sent first, received from a synchronous method.
    assert on(group, 0).send_tensors(peer, TENSOR_KINDS).wait(60) == [len(TENSOR_KINDS)]
    assert on(group, peer).recv_tensors_sync(0, TENSOR_KINDS).wait(60) == [[]]


def test_recv_of_send_tensor_and_recv_tensor_of_send(group: Any) -> None:
    # Never meant to be mixed, but the ordering is shared and the data stays right.
    assert on(group, 0).send_tensors(SAME, ["tensor", "tensor_big"]).wait(30) == [2]
    assert on(group, SAME).recv_all(0, ["tensor", "tensor_big"]).wait(30) == [[]]
    assert on(group, 0).send_all(SAME, ["tensor_1mb"]).wait(30) == [1]
    assert on(group, SAME).recv_tensors(0, ["tensor_1mb"]).wait(30) == [[]]


def test_recv_tensor_size_mismatch_is_an_error(group: Any) -> None:
    on(group, 0).send_tensors(SAME, ["tensor"]).wait(30)
    msg = on(group, SAME).recv_tensor_mismatch(0).wait(30)[0]
    assert "12 bytes" in msg and "40" in msg
    assert on(group, 0).send_all(SAME, ["int"]).wait(30) == [1]  # the pair still works
    assert on(group, SAME).recv_all(0, ["int"]).wait(30) == [[]]


def test_cancelled_recv_does_not_consume(group: Any) -> None:
    assert on(group, SAME).recv_times_out(0).wait(30) == ["timeout"]
    on(group, 0).send_all(SAME, ["str", "int"]).wait(30)
    assert on(group, SAME).recv_all(0, ["str", "int"]).wait(30) == [[]]


def test_thousand_interleaved_both_directions(group: Any) -> None:
    t = time.monotonic()
    assert group.execute_on(0, 1).exchange(1000).wait(60) == [1000, 1000]
    assert time.monotonic() - t < 30


def test_errors_at_the_sender(group: Any) -> None:
    res = on(group, 0).bad_sends(SAME).wait(30)[0]
    for case in ("send", "send_tensor", "nested"):
        name, is_value, _, text = res[case]
        assert is_value and "contiguous" in text, res[case]
    for case, type_name in (("lock", "Holder"), ("reduce", "BadReduce")):
        name, _, is_type, text = res[case]
        assert is_type and type_name in text, res[case]
    assert on(group, SAME).recv_one(0).wait(30) == ["after"]  # nothing else went out
    on(group, 0).send_all(SAME, ["nested"]).wait(30)
    assert on(group, SAME).recv_all(0, ["nested"]).wait(30) == [[]]


def test_segments_are_reused_and_returned(cluster2: Any) -> None:
    g = P.create_group().launch(
        cluster2, name="p2pseg", placement_strategy=NodePlacementStrategy([0, 0])
    )
    try:
        recv = g.execute_on(1).lockstep_recv(0, 20)
        assert g.execute_on(0).lockstep_send(1, 20).wait(60) == [20]
        assert recv.wait(60) == [20]
        dest = g.execute_on(0).p2p_stats().wait(30)[0].senders["p2pseg:1"]
        assert dest.same_node is True and dest.usable("shm") is True
        assert dest.usable("cma") is None  # never asked: no send_tensor went out
        shm = dest.paths["shm"]
        assert 1 <= shm.resources <= 3, shm  # reused, not one per message
        # The receiver still holds the last tensor it got (a view of the segment) ...
        assert shm.in_use == 1, shm
        # ... and once it lets go, the segment goes back to the sender.
        g.execute_on(1).drop_kept().wait(30)
        shm = g.execute_on(0).p2p_stats().wait(30)[0].senders["p2pseg:1"].paths["shm"]
        assert shm.in_use == 0, shm
    finally:
        g.close()


def test_send_tensor_is_pulled_with_one_copy_on_one_node(group: Any) -> None:
    # After the tests above, rank 0 has sent big send_tensor payloads to both peers.
    dests = on(group, 0).p2p_stats().wait(30)[0].senders
    assert dests[f"{G}:{SAME}"].usable("cma") in (True, False)  # probed (False: ptrace barred)
    assert dests[f"{G}:{CROSS}"].usable("cma") is None  # never on another node


def test_other_node_uses_no_shared_memory(group: Any) -> None:
    on(group, 0).send_all(CROSS, ["tensor_big"]).wait(30)
    assert on(group, CROSS).recv_all(0, ["tensor_big"]).wait(30) == [[]]
    dest = on(group, 0).p2p_stats().wait(30)[0].senders[f"{G}:{CROSS}"]
    assert dest.same_node is False and "shm" not in dest.paths and "cma" not in dest.paths


def test_segment_pool_limit_and_reuse() -> None:
    from aiorl.transport import shared_memory

    pool = shared_memory.SegmentPool(max_bytes=6 << 20)
    a, ev = pool.acquire(3 << 20)  # 4 MiB class
    assert a.size == 4 << 20 and ev == []
    b, _ = pool.acquire(100)  # 1 MiB class
    with pytest.raises(shared_memory.PoolFull):
        pool.acquire(2 << 20)  # 4 + 1 + 2 > 6 and nothing is free
    pool.release(b.seg_id)
    c, ev = pool.acquire(1000)
    assert c is b and ev == []  # reused
    pool.release(c.seg_id)
    d, ev = pool.acquire(2 << 20)  # makes room by closing the free 1 MiB segment
    assert ev == [b.seg_id] and pool.total_bytes == 6 << 20
    pool.release(a.seg_id)
    pool.release(d.seg_id)
    assert pool.busy == 0
    pool.close()


def test_peer_killed_during_pending_recv(cluster2: Any) -> None:
    g = P.create_group().launch(
        cluster2, name="p2pkill", placement_strategy=NodePlacementStrategy([0, 0])
    )
    try:
        victim = g.execute_on(1).pid().wait(60)[0]
        g.execute_on(0).pid().wait(60)
        pending = g.execute_on(0).recv_expect_loss(1)
        time.sleep(0.5)  # the receive is posted and waiting
        t = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        name, text = pending.wait(10)[0]
        assert name == "PeerLostError", (name, text)
        assert time.monotonic() - t <= 5.0
        assert g.execute_on(0).after_loss(1).wait(30)[0] == ["PeerLostError"] * 3
    finally:
        g.close()
