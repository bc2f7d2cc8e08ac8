"""Issue 26's CUDA point-to-point pieces that run on the CPU.

* `EventWaiter` (the completion thread that replaced sleep-and-back-off polling for copies):
  in order, ``synchronize()`` only when ``query()`` says not done, errors reported, a closed
  waiter reports at once, and an idle waiter costs no CPU. Stand-in events with the CUDA
  event interface (``query``/``synchronize``): a CUDA event cannot exist without a GPU.
* `CudaWorkThread.issue`: the work thread issues, its waiter waits, the loop is told once;
  failures and a closed work thread fail the future.
* the inline road for small CUDA tensors: the size decision and ``AIORL_CUDA_INLINE_BYTES``;
  a Sender holds a staged message (and every later one) until its copy is done, then sends
  it first; the receiving half puts the bytes straight into a CPU ``recv_tensor`` buffer and
  refuses, in a process without CUDA, to build CUDA tensors.
* CUDA IPC bookkeeping: a dropped share is released only once the receives naming it are
  done; the ``/dev/shm/torch_<pid>_*`` reference-counter files of our exports are unlinked.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from aiorl.cuda.events import CudaThreadClosed, EventWaiter
from aiorl.cuda.work_thread import CudaWorkThread
from aiorl.errors import ProtocolError
from aiorl.p2p.message import InMessage, OutMessage, PostedRecv, Staged, encode_object
from aiorl.p2p.paths import cuda_host, cuda_ipc
from aiorl.p2p.paths.cuda_host import HostRecv, inline_limit, wants_inline
from aiorl.p2p.paths.cuda_ipc import IpcRecv
from aiorl.p2p.sender import Sender
from aiorl.protocol.ops import P2POp
from aiorl.protocol.p2p import HOST, K_CUDA, IpcDrop
from aiorl.runtime import AsyncWork
from aiorl.transport.serialization import CudaUnavailableError

pytestmark = pytest.mark.timeout(30)


class StandInEvent:
    """The interface of a CUDA event the waiter uses: ``query`` never blocks,
    ``synchronize`` blocks until the "GPU" got there (``fire``)."""

    def __init__(self, done: bool = False, error: BaseException | None = None) -> None:
        self._done = threading.Event()
        if done:
            self._done.set()
        self.error = error
        self.synchronized = 0

    def fire(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self.synchronized += 1
        if self.error is not None:
            raise self.error
        assert self._done.wait(10), "synchronize() never returned"


# ----------------------------------------------------------------------------- EventWaiter
def test_event_waiter_reports_in_order_and_waits_only_when_needed() -> None:
    waiter = EventWaiter("test-waiter")
    reports: list[tuple[str, BaseException | None]] = []
    all_done = threading.Event()
    first, second = StandInEvent(), StandInEvent(done=True)
    failing = StandInEvent(error=RuntimeError("device lost"))

    def report(name: str, last: bool = False) -> Any:
        def fn(error: BaseException | None) -> None:
            reports.append((name, error))
            if last:
                all_done.set()

        return fn

    waiter.watch(first, report("first"))
    waiter.watch(second, report("second"))
    waiter.watch(failing, report("failing", last=True))
    time.sleep(0.1)
    assert reports == []  # the first is not done: nothing reported, nothing skipped ahead
    first.fire()
    assert all_done.wait(5)
    assert [name for name, _ in reports] == ["first", "second", "failing"]
    assert reports[0][1] is None and reports[1][1] is None
    assert isinstance(reports[2][1], RuntimeError)
    assert first.synchronized == 1  # it was not done when looked at: waited for
    assert second.synchronized == 0  # done already: query() was enough
    waiter.close()


def test_a_closed_event_waiter_reports_at_once() -> None:
    waiter = EventWaiter("test-closed")
    waiter.close()
    got: list[BaseException | None] = []
    waiter.watch(StandInEvent(), got.append)
    assert len(got) == 1 and isinstance(got[0], CudaThreadClosed)


def test_an_idle_event_waiter_uses_no_cpu() -> None:
    waiter = EventWaiter("test-idle")
    done = threading.Event()
    waiter.watch(StandInEvent(done=True), lambda _e: done.set())
    assert done.wait(5)
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(0.5)
    used = (time.process_time() - c0) / (time.perf_counter() - t0)
    assert used < 0.01, f"an idle waiter used {used:.1%} of a core"
    waiter.close()


# ----------------------------------------------------------------------------- CudaWorkThread.issue
class LoopHost:
    """What `CudaWorkThread.issue` uses of an engine: its loop and a thread-safe call."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiter = None

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)


def test_work_thread_issue_settles_once_the_event_is_done() -> None:
    async def main() -> None:
        host = LoopHost(asyncio.get_running_loop())
        work_thread = CudaWorkThread("test-issue")
        ev = StandInEvent()
        kept: list[Any] = []
        ran_on: list[str] = []

        def issue(x: int) -> tuple[Any, Any]:
            ran_on.append(threading.current_thread().name)
            kept.append(x)
            return ev, kept

        fut = work_thread.issue(host, issue, 7)
        await asyncio.sleep(0.1)
        assert not fut.done() and kept == [7] and ran_on == ["test-issue"]
        ev.fire()
        await asyncio.wait_for(fut, 5)

        def broken() -> tuple[Any, Any]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")

        with pytest.raises(torch.cuda.OutOfMemoryError):
            await asyncio.wait_for(work_thread.issue(host, broken), 5)
        work_thread.close()
        with pytest.raises(CudaThreadClosed):
            await asyncio.wait_for(work_thread.issue(host, issue, 8), 5)

    asyncio.run(main())


# ----------------------------------------------------------------------------- inline road
def test_inline_limit_reads_the_environment() -> None:
    assert inline_limit({}) == 64 * 1024
    assert inline_limit({"AIORL_CUDA_INLINE_BYTES": "0"}) == 0
    assert inline_limit({"AIORL_CUDA_INLINE_BYTES": " 4096 "}) == 4096
    for bad in ("64KB", "-1"):
        with pytest.raises(ValueError, match="AIORL_CUDA_INLINE_BYTES"):
            inline_limit({"AIORL_CUDA_INLINE_BYTES": bad})


def _with_cuda_list(*tensors: torch.Tensor) -> OutMessage:
    """A message whose ``cuda`` list holds ``tensors`` (CPU stand-ins: only sizes count)."""
    return OutMessage(K_CUDA, ["float32", [1], False], None, [], list(tensors))


def test_inline_decision_counts_every_tensor_of_the_message() -> None:
    limit = 1024
    assert wants_inline(_with_cuda_list(torch.zeros(256)), limit)  # exactly 1 KiB
    assert not wants_inline(_with_cuda_list(torch.zeros(257)), limit)
    assert not wants_inline(_with_cuda_list(torch.zeros(200), torch.zeros(100)), limit)
    assert wants_inline(_with_cuda_list(torch.zeros(100), torch.zeros(100)), limit)
    assert not wants_inline(_with_cuda_list(torch.zeros(0)), limit)  # all empty: NOTHING
    assert not wants_inline(_with_cuda_list(torch.zeros(1)), 0)  # the road turned off
    assert not wants_inline(encode_object(3), limit)  # no CUDA tensor at all


class StubEndpoint:
    def __init__(self) -> None:
        self.address = "tcp://me"
        self.sent: list[tuple[str, Any, list[Any]]] = []

    def send_oneway(self, peer: str, op: str, meta: Any = None, frames: Any = ()) -> None:
        self.sent.append((op, meta, list(frames)))

    def is_lost(self, address: str) -> bool:
        return False


class StubEngine(LoopHost):
    """The engine as a Sender and its paths see it, recording what is sent."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.endpoint = StubEndpoint()
        self.name = "src:0"
        self.pid = os.getpid()
        self.node_id = None
        self.closed = False

    def on_loop(self) -> bool:
        return True

    def spawn(self, coro: Any) -> None:
        self.loop.create_task(coro)


def test_a_staged_message_and_every_later_send_wait_for_its_copy() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        engine = StubEngine(loop)
        sender = Sender(engine, "dst:0")  # type: ignore[arg-type]
        sender.on_resolved("tcp://dst", same_node=False)
        copied = StandInEvent()
        staged_msg = _with_cuda_list(torch.zeros(2))
        pinned = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], dtype=torch.uint8)
        staged_msg.staged = Staged(pinned, [copied], [])
        first: AsyncWork[None] = AsyncWork(loop)
        second: AsyncWork[None] = AsyncWork(loop)
        sender.submit(staged_msg, first)
        sender.submit(encode_object("after"), second)  # small: would go at once otherwise
        await asyncio.sleep(0.1)
        assert engine.endpoint.sent == [] and not first.done() and not second.done()
        copied.fire()
        await asyncio.wait_for(first, 5)
        await asyncio.wait_for(second, 5)
        (op1, meta1, frames1), (_op2, _meta2, frames2) = engine.endpoint.sent
        assert op1 == P2POp.DATA and meta1[4] == [HOST, [["float32", [2]]]]
        assert bytes(frames1[-1]) == bytes(range(1, 9))  # the staged bytes, as one frame
        assert b"after" in bytes(frames2[-1])  # then the later send, in order

    asyncio.run(main())


class RecvHost(LoopHost):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.endpoint = StubEndpoint()
        self.name = "me:0"


def test_a_small_cuda_message_lands_in_a_cpu_buffer_without_the_gpu() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        path = HostRecv(RecvHost(loop), "src:0")  # type: ignore[arg-type]
        buf = torch.zeros(4, dtype=torch.float32)
        want = torch.tensor([1.0, -2.0, 3.5, 8.0])
        posted = PostedRecv(AsyncWork(loop), buf, None)
        msg = InMessage(K_CUDA, ["float32", [4], False])
        frame = want.numpy().tobytes()
        path.accept(msg, [HOST, [["float32", [4]]]], [frame], 0, posted)
        assert msg.direct is buf and msg.cuda_fut is None
        assert torch.equal(buf, want)
        with pytest.raises(ProtocolError, match="lost its CUDA payload frame"):
            path.accept(InMessage(K_CUDA, None), [HOST, [["float32", [4]]]], [frame[:8]], 0,
                        None)

    asyncio.run(main())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a process without CUDA")
def test_a_process_without_cuda_refuses_a_small_cuda_message() -> None:
    async def main() -> None:
        path = HostRecv(RecvHost(asyncio.get_running_loop()), "src:0")  # type: ignore[arg-type]
        msg = InMessage(K_CUDA, ["float32", [2], False])
        with pytest.raises(CudaUnavailableError, match="without CUDA"):
            path.accept(msg, [HOST, [["float32", [2]]]], [bytes(8)], 0, None)

    asyncio.run(main())


# ----------------------------------------------------------------------------- IPC bookkeeping
class _Job:
    """What `IpcRecv._copied` reads of a receive (its parts, token, sender, future)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, share_ids: list[int]) -> None:
        self.parts = [[i, None, 0, 4] for i in share_ids]
        self.token = 1
        self.address = "tcp://src"
        self.nbytes = 4 * len(share_ids)
        self.fut: asyncio.Future[None] = loop.create_future()


def test_a_dropped_share_is_released_only_after_the_receives_naming_it() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        host = RecvHost(loop)
        path = IpcRecv(host, "src:0")  # type: ignore[arg-type]
        path.work_thread = CudaWorkThread("test-ipc")  # where mappings are released
        five, six = torch.zeros(1), torch.zeros(1)  # stand-ins for mapped storages
        path.shares = {5: five, 6: six}
        path._uses = {5: 2}  # two accepted receives read share 5; none reads share 6
        path.window.in_flight = 8
        path.on_control(IpcDrop("src:0", [6]))
        assert 6 not in path.shares  # nobody reads it: released now
        path.on_control(IpcDrop("src:0", [5]))
        assert path.shares == {5: five}  # still read by two receives
        done: asyncio.Future[None] = loop.create_future()
        done.set_result(None)
        path._copied(done, _Job(loop, [5]))  # type: ignore[arg-type]
        assert 5 in path.shares
        path._copied(done, _Job(loop, [5]))  # type: ignore[arg-type]
        assert path.shares == {} and path._uses == {}
        assert [m[0] for m in host.endpoint.sent] == ["p2p.done", "p2p.done"]
        path.close()

    asyncio.run(main())


@pytest.fixture
def shm_dir(tmp_path: Any) -> Iterator[str]:
    yield str(tmp_path)
    cuda_ipc._REF_COUNTER_FILES.clear()


def test_ref_counter_files_of_our_exports_are_unlinked_and_only_those(shm_dir: str) -> None:
    pid = os.getpid()
    ours, other, gone = f"torch_{pid}_123_0", f"torch_{pid + 1}_9_0", f"torch_{pid}_5_1"
    for name in (ours, other):
        open(os.path.join(shm_dir, name), "wb").close()
    cuda_ipc.note_ref_counter_file(f"/{ours}".encode())
    cuda_ipc.note_ref_counter_file(f"/{other}".encode())  # another process's: not ours
    cuda_ipc.note_ref_counter_file(f"/{gone}".encode())  # torch unlinked it already
    cuda_ipc.note_ref_counter_file(f"/torch_{pid}_1/../../etc".encode())  # not a plain name
    assert cuda_ipc.release_ref_counter_files(shm_dir) == [os.path.join(shm_dir, ours)]
    assert sorted(os.listdir(shm_dir)) == [other]
    assert cuda_ipc.release_ref_counter_files(shm_dir) == []  # forgotten once released


def test_the_inline_limit_is_a_named_constant() -> None:
    assert cuda_host.CUDA_INLINE_BYTES == inline_limit()


class _CountingEvent:
    """A CUDA event's ``query()`` where no GPU exists: done after ``after`` queries, or
    raising ``error`` (the polling itself is what is tested, not the GPU)."""

    def __init__(self, after: int | None, error: BaseException | None = None) -> None:
        self.after, self.error, self.queries = after, error, 0

    def query(self) -> bool:
        self.queries += 1
        if self.error is not None:
            raise self.error
        return self.after is not None and self.queries > self.after


def test_done_within_polls_briefly_and_never_longer_than_asked() -> None:
    from aiorl.cuda.events import done_within

    soon = [_CountingEvent(3), _CountingEvent(0)]
    assert done_within(soon, 1.0)
    assert soon[0].queries == 4  # polled until done, then no more
    never = _CountingEvent(None)
    t0 = time.perf_counter()
    assert not done_within([never], 0.002)
    assert 0.002 <= time.perf_counter() - t0 < 0.5 and never.queries > 1
    assert not done_within([_CountingEvent(None)], 0.0)  # no spin: one look
    # A query that raises is left to the waiter thread, whose synchronize() reports it.
    assert not done_within([_CountingEvent(0, RuntimeError("CUDA error"))], 1.0)
