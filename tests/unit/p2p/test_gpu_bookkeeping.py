"""The pure bookkeeping behind the CUDA paths, run on the CPU (issue 13).

* item 2 and 8: :class:`PairOrder` — two sides of one NCCL communicator, both directions,
  refusals; both processes must issue the same operations in the same order, and a refused
  message must never be issued (no mis-pairing, no sender stuck in set-up);
* item 9: :class:`ByteWindow` — in-flight bytes per pair are bounded;
* item 5: :class:`ShareCache` — one IPC export per live storage, bounded per receiver;
* item 13: CUDA placeholders keep ``Parameter``/``requires_grad``; a CPU-only process
  refuses a CUDA tensor with a clear error;
* the work thread (one daemon thread, in order, closable) and the completion poller (one waiter
  thread; a failed NCCL work fails the transfer, its CUDA event alone does not count).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import deque
from typing import Any

import pytest
import torch

from aiorl.cuda.bulk_copy import FLAT_ALIGN, FlatLayout, copy_grouped, copy_many, dtype_groups
from aiorl.cuda.byte_window import ByteWindow
from aiorl.cuda.completion import gpu_done
from aiorl.cuda.tensors import reinterpret
from aiorl.cuda.work_thread import CudaWorkThread
from aiorl.errors import PeerLostError, ProtocolError
from aiorl.p2p.paths.cuda_ipc import ShareCache
from aiorl.p2p.paths.nccl import PACK_ALIGN, PACK_MAX, pack_layout
from aiorl.p2p.paths.nccl_order import Do, PairOrder, Step, is_leader
from aiorl.runtime.waiter import BlockingWaiter
from aiorl.transport import serialization
from aiorl.util import cuda_device

pytestmark = pytest.mark.timeout(30)


# ----------------------------------------------------------------------------- PairOrder
class Side:
    """One process of a pair: its PairOrder, its issue log, its outgoing wire."""

    def __init__(self, name: str, peer: str) -> None:
        self.name = name
        self.order = PairOrder(is_leader(name, peer))
        self.issued: list[tuple[str, str, int]] = []  # (op, sender, token) in issue order
        self.failed: dict[int, str] = {}
        self.wire: deque[tuple[str, int, str]] = deque()  # in order, like one connection
        self.arrived: deque[int] = deque()  # peer's data messages waiting to be allocated
        self.next_token = 1

    def send(self) -> int:
        token, self.next_token = self.next_token, self.next_token + 1
        self.order.announced(token)
        self.wire.append(("data", token, ""))
        return token

    def run(self, steps: list[Step], peer: Side, mine: bool) -> None:
        """Carry out steps; ``mine``: they are about our own send (else a receive)."""
        for step in steps:
            if step.do is Do.ISSUE_SEND:
                self.issued.append(("send", self.name, step.token))
            elif step.do is Do.ISSUE_RECV:
                self.issued.append(("recv", peer.name, step.token))
            elif step.do is Do.TELL_GO:
                self.wire.append(("go-recv" if mine else "go-send", step.token, ""))
            elif step.do is Do.TELL_READY:
                self.wire.append(("ready", step.token, ""))
            elif step.do is Do.TELL_REFUSE:
                self.wire.append(("refuse", step.token, step.reason))
            elif step.do is Do.FAIL_SEND:
                self.failed[step.token] = step.reason

    def deliver(self, peer: Side) -> None:
        """The peer's next wire message reaches us."""
        kind, token, reason = peer.wire.popleft()
        if kind == "data":
            self.arrived.append(token)
        elif kind == "ready":
            self.run(self.order.on_ready(token), peer, mine=True)
        elif kind == "go-send":
            self.run(self.order.on_go_send(token), peer, mine=True)
        elif kind == "go-recv":
            self.run(self.order.on_go_recv(token), peer, mine=False)
        elif kind == "refuse":
            self.run(self.order.on_refused(token, reason), peer, mine=True)

    def allocate(self, peer: Side, ok: bool) -> int:
        token = self.arrived.popleft()
        if ok:
            self.run(self.order.allocated(token), peer, mine=False)
        else:
            self.run(self.order.allocation_failed(token, "CUDA out of memory"), peer, mine=False)
        return token


def as_pairs(side: Side) -> list[tuple[str, int]]:
    """A side's issue log as (sender of the transfer, token): what NCCL pairs up."""
    return [(who if op == "recv" else side.name, token) for op, who, token in side.issued]


@pytest.mark.parametrize("seed", range(40))
def test_both_sides_issue_the_same_operations_in_the_same_order(seed: int) -> None:
    rng = random.Random(seed)
    a, b = Side("actor:0", "rollout:0"), Side("rollout:0", "actor:0")
    refused: dict[str, set[int]] = {"actor:0": set(), "rollout:0": set()}
    sent = {"actor:0": 0, "rollout:0": 0}
    for _ in range(400):
        me, peer = (a, b) if rng.random() < 0.5 else (b, a)
        choice = rng.random()
        if choice < 0.25 and sent[me.name] < 30:
            me.send()
            sent[me.name] += 1
        elif choice < 0.6 and peer.wire:
            me.deliver(peer)
        elif me.arrived:
            ok = rng.random() > 0.2
            token = me.allocate(peer, ok)
            if not ok:
                refused[peer.name].add(token)
    while a.wire or b.wire or a.arrived or b.arrived:  # drain, allocating what remains
        for me, peer in ((a, b), (b, a)):
            while peer.wire:
                me.deliver(peer)
            while me.arrived:
                me.allocate(peer, True)
    assert as_pairs(a) == as_pairs(b)  # one order, both processes
    for side in (a, b):
        assert sorted(side.failed) == sorted(refused[side.name])
        issued_own = {t for op, _, t in side.issued if op == "send"}
        assert not issued_own & refused[side.name]  # a refused message is never issued
        assert len(issued_own) + len(side.failed) == sent[side.name]


def _simulated_pair(seed: int) -> tuple[Side, Side]:
    """Two sides after a random run of sends, deliveries and refusals, drained."""
    rng = random.Random(seed)
    a, b = Side("actor:0", "rollout:0"), Side("rollout:0", "actor:0")
    for _ in range(300):
        me, peer = (a, b) if rng.random() < 0.5 else (b, a)
        choice = rng.random()
        if choice < 0.25 and me.next_token <= 25:
            me.send()
        elif choice < 0.6 and peer.wire:
            me.deliver(peer)
        elif me.arrived:
            me.allocate(peer, rng.random() > 0.2)
    while a.wire or b.wire or a.arrived or b.arrived:
        for me, peer in ((a, b), (b, a)):
            while peer.wire:
                me.deliver(peer)
            while me.arrived:
                me.allocate(peer, True)
    return a, b


def test_a_refused_first_message_leaves_nothing_issued_and_the_pair_goes_on() -> None:
    leader, follower = Side("a:0", "b:0"), Side("b:0", "a:0")
    assert leader.order.leader and not follower.order.leader
    leader.send()
    follower.deliver(leader)
    follower.allocate(leader, ok=False)  # the first message: OOM at the receiver
    leader.deliver(follower)
    assert leader.failed == {1: "CUDA out of memory"}
    assert leader.issued == follower.issued == []  # nobody waits in communicator set-up
    leader.send()
    follower.deliver(leader)
    follower.allocate(leader, ok=True)
    leader.deliver(follower)  # ready -> the leader issues and tells go
    follower.deliver(leader)
    assert leader.issued == [("send", "a:0", 2)]
    assert follower.issued == [("recv", "a:0", 2)]


def test_out_of_protocol_messages_are_rejected() -> None:
    order = PairOrder(leader=True)
    with pytest.raises(ProtocolError):
        order.on_ready(7)  # never announced
    with pytest.raises(ProtocolError):
        order.on_go_send(1)  # the leader is never told to send
    follower = PairOrder(leader=False)
    with pytest.raises(ProtocolError):
        follower.on_ready(1)
    follower.announced(1)
    with pytest.raises(ProtocolError):
        follower.announced(1)
    with pytest.raises(ValueError):
        is_leader("x:0", "x:0")


# ----------------------------------------------------------------------------- ByteWindow
def test_byte_window_bounds_in_flight_bytes_in_arrival_order() -> None:
    window = ByteWindow(limit=100)
    assert window.offer("a", 60)
    assert not window.offer("b", 50)  # would exceed: waits
    assert not window.offer("c", 10)  # FIFO: does not overtake b
    assert window.in_flight == 60
    assert window.release(60) == ["b", "c"]
    assert window.in_flight == 60
    assert window.release(50) == []
    assert window.release(10) == []
    assert window.in_flight == 0


def test_byte_window_lets_an_oversized_message_through_alone() -> None:
    window = ByteWindow(limit=100)
    assert window.offer("small", 10)
    assert not window.offer("huge", 1000)
    assert window.release(10) == ["huge"]  # alone: it cannot wait for ever
    assert not window.offer("next", 1)
    assert window.release(1000) == ["next"]
    with pytest.raises(ProtocolError):
        window.release(5)  # more than in flight
    assert window.clear() == []
    with pytest.raises(ValueError):
        ByteWindow(0)


def test_a_fast_producer_never_has_more_than_the_window_in_flight() -> None:
    window = ByteWindow(limit=1 << 20)
    started: list[int] = []
    peak = 0
    for i in range(1000):
        if window.offer(i, 300_000):
            started.append(i)
        peak = max(peak, window.in_flight)
        if i % 3 == 2 and started:
            started.extend(window.release(300_000))
            started.pop(0)
    assert peak <= 1 << 20


# ----------------------------------------------------------------------------- ShareCache
class Ref:
    def __init__(self) -> None:
        self.dead = False


def test_share_cache_exports_each_live_storage_once_and_stays_bounded() -> None:
    cache = ShareCache(limit=4)
    refs = {k: Ref() for k in range(10)}
    exports: list[int] = []

    def export(key: int) -> Any:
        exports.append(key)
        return refs[key], ("args", key)

    def alive(ref: Ref) -> bool:
        return not ref.dead

    share, args, dropped = cache.lookup(0, alive, lambda: export(0))
    assert args == ("args", 0) and dropped == []
    for _ in range(5000):  # the same live tensor, again and again: no new export
        again, args, dropped = cache.lookup(0, alive, lambda: export(0))
        assert (again, args, dropped) == (share, None, [])
    assert exports == [0]
    for k in range(1, 6):
        cache.lookup(k, alive, lambda k=k: export(k))
        cache.trim(alive, 1)
    assert len(cache) == 4  # bounded: the least recently used were dropped
    refs[5].dead = True
    new_share, args, dropped = cache.lookup(5, alive, lambda: export(5))
    assert args is not None and dropped  # a dead storage's share is dropped, re-exported
    assert len(cache) <= 4
    cache.forget(new_share)  # its send never left: the next send exports again
    again, args, _ = cache.lookup(5, alive, lambda: export(5))
    assert args is not None and again != new_share


def test_share_cache_keeps_every_share_of_one_message_and_trims_after_it() -> None:
    """A message of more storages than the bound keeps them all (none drops another of the
    same message); the next message's trim goes back to the bound, dead shares first."""
    cache = ShareCache(limit=4)
    refs = {k: Ref() for k in range(20)}
    ids = [cache.lookup(k, lambda r: not r.dead, lambda k=k: (refs[k], k)) for k in range(10)]
    assert all(dropped == [] for _, _, dropped in ids) and len(cache) == 10
    assert cache.trim(lambda r: not r.dead, 10) == [] and len(cache) == 10
    for k in range(10):  # the same message again: nothing exported, nothing dropped
        assert cache.lookup(k, lambda r: not r.dead, lambda: None)[1:] == (None, [])
    refs[9].dead = True
    dropped = cache.trim(lambda r: not r.dead, 1)
    assert ids[9][0] in dropped and len(dropped) == 6 and len(cache) == 4
    assert {i for i, _, _ in ids[5:9]} == {cache.lookup(k, lambda r: True, lambda: None)[0]
                                           for k in range(5, 9)}


@pytest.mark.parametrize("strided_dst", [False, True])
def test_flat_layout_and_grouped_copies_keep_every_value(strided_dst: bool) -> None:
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16, torch.int8]
    srcs = [(torch.arange(1 + k * 7 % 61) % 5).to(dtypes[k % len(dtypes)]) for k in range(200)]
    srcs.append(torch.tensor(3.5, dtype=torch.float64))  # 0-d
    srcs.append(torch.empty(0, 3))
    layout = FlatLayout([(t.dtype, tuple(t.shape)) for t in srcs])
    block, dsts = layout.allocate("cpu")
    assert [(t.dtype, t.shape) for t in dsts] == [(t.dtype, t.shape) for t in srcs]
    base = block.data_ptr()
    for idx in layout.groups:  # each dtype's run: end to end, from an aligned offset
        starts = [dsts[i].data_ptr() - base for i in idx if dsts[i].numel()]
        assert not starts or starts[0] % FLAT_ALIGN == 0
        assert starts == sorted(starts)
    assert block.numel() < sum(t.numel() * t.element_size() for t in srcs) + 8 * FLAT_ALIGN
    if strided_dst:
        srcs.append(torch.arange(12.0).reshape(3, 4))
        dsts.append(torch.zeros(4, 3).t())
    copy_many(dsts, srcs)
    assert all(torch.equal(a, b) for a, b in zip(dsts, srcs, strict=True))
    again = [torch.zeros_like(t) for t in srcs]
    copy_grouped(again, srcs, dtype_groups([t.dtype for t in again]))
    assert all(torch.equal(a, b) for a, b in zip(again, srcs, strict=True))
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        copy_many([torch.zeros(3), torch.zeros(3)], [torch.zeros(3)])


# ----------------------------------------------------------------------------- packing
def test_pack_layout_aligns_and_only_packs_several_small_tensors() -> None:
    assert pack_layout([100]) is None
    assert pack_layout([PACK_MAX, 1]) is None
    offsets, size = pack_layout([3, 17, 8]) or ([], 0)
    assert offsets == [0, PACK_ALIGN, 3 * PACK_ALIGN]
    assert all(o % PACK_ALIGN == 0 for o in offsets) and size >= 3 + 17 + 8


def test_reinterpret_covers_bool_complex_and_zero_sized() -> None:
    for like in (
        torch.zeros(3, dtype=torch.bool),
        torch.zeros(2, 2, dtype=torch.complex64),
        torch.zeros(0, 4),
        torch.zeros((), dtype=torch.float64),
    ):
        raw = torch.zeros(like.numel() * like.element_size(), dtype=torch.uint8)
        out = reinterpret(raw, like)
        assert out.dtype == like.dtype and out.shape == like.shape


# ----------------------------------------------------------------------------- serialization
def test_cuda_placeholders_keep_parameters_and_requires_grad() -> None:
    landed = [torch.ones(3), torch.ones(2)]  # stand-ins for received CUDA tensors
    serialization._tls.cuda_in = landed
    try:
        param = serialization._cuda_placeholder(0, True, True)
        grad = serialization._cuda_placeholder(1, True, False)
        plain = serialization._cuda_placeholder(1)
    finally:
        serialization._tls.cuda_in = ()
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad
    assert grad.requires_grad and not isinstance(grad, torch.nn.Parameter)
    assert plain is landed[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a process without CUDA")
def test_a_cpu_only_process_refuses_a_cuda_tensor_clearly() -> None:
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    with pytest.raises(serialization.CudaUnavailableError, match="no CUDA device"):
        serialization._rebuild_cuda_tensor(torch.float32, (4,), False, data, False, "cuda:1")


def test_selected_device_order() -> None:
    try:
        assert cuda_device.selected_device() in (0, cuda_device._noted)
        cuda_device.select_device(3)
        assert cuda_device.selected_device() == 3
        with pytest.raises(ValueError):
            cuda_device.select_device(-1)
    finally:
        cuda_device.select_device(None)
    if not torch.cuda.is_available():
        assert cuda_device.note_thread_device() is None  # never initialises CUDA itself


# ----------------------------------------------------------------------------- work thread, poller
def test_work_thread_runs_in_order_on_one_daemon_thread_and_closes() -> None:
    work_thread = CudaWorkThread("test-work-thread")
    seen: list[int] = []
    gate = threading.Event()
    futs = [work_thread.run(lambda i=i: (gate.wait(5), seen.append(i))) for i in range(5)]
    assert work_thread._thread is not None and work_thread._thread.daemon
    gate.set()
    for f in futs:
        f.result(5)
    assert seen == [0, 1, 2, 3, 4]
    gate.clear()
    started = threading.Event()
    blocker = work_thread.run(lambda: (started.set(), gate.wait(5)))
    queued = work_thread.run(seen.append, 99)
    assert started.wait(5)
    work_thread.close()
    gate.set()
    blocker.result(5)
    with pytest.raises(PeerLostError):
        queued.result(5)
    with pytest.raises(PeerLostError):
        work_thread.run(seen.append, 100).result(1)
    assert 99 not in seen


class FakeEvent:
    """A CUDA event stand-in (no GPU here): ``query`` turns true after a while."""

    def __init__(self, after_s: float) -> None:
        self.at = time.monotonic() + after_s

    def query(self) -> bool:
        return time.monotonic() >= self.at


class FakeResult:
    """``Work.get_future_result()`` stand-in: done with a ``WorkResult`` value."""

    def __init__(self, value: int | None) -> None:
        self._value = value

    def done(self) -> bool:
        return self._value is not None

    def value(self) -> int:
        assert self._value is not None
        return self._value


class FakeWork:
    def __init__(self, result: int | None) -> None:
        self.result = FakeResult(result)

    def get_future_result(self) -> FakeResult:
        return self.result


class Host:
    def __init__(self, loop: asyncio.AbstractEventLoop, waiter: BlockingWaiter) -> None:
        self.loop = loop
        self.waiter = waiter

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)


def test_completion_checks_the_works_status_not_only_the_event() -> None:
    async def main() -> None:
        waiter = BlockingWaiter("test-waiter")
        host = Host(asyncio.get_running_loop(), waiter)
        try:
            ok = gpu_done(host, FakeEvent(0.05), [FakeWork(0)])
            pending = gpu_done(host, FakeEvent(0.05), [FakeWork(None)])  # watchdog not yet
            # A timed-out work: its event never completes, its result says TIMEOUT (1).
            failed = gpu_done(host, FakeEvent(3600), [FakeWork(1)])
            many = [gpu_done(host, FakeEvent(0.01)) for _ in range(200)]
            await asyncio.wait_for(ok, 5)
            await asyncio.wait_for(pending, 5)
            with pytest.raises(PeerLostError, match="timeout"):
                await asyncio.wait_for(failed, 5)
            await asyncio.wait_for(asyncio.gather(*many), 5)
            # One poller thread for all of them, not a thread per transfer.
            assert [t.name for t in threading.enumerate()].count("test-waiter") == 1
        finally:
            waiter.close()

    asyncio.run(main())
