"""The runtime's building blocks in one process: LoopThread, AsyncWork, promise, waiter."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aiorl.errors import WaitTimeout
from aiorl.runtime import AsyncCollWork, AsyncWork
from aiorl.runtime.loop import LoopThread, loop_thread_of
from aiorl.runtime.promise import is_settled, link_threads, prepare_threads, reject, resolve
from aiorl.runtime.waiter import BlockingWaiter, Job
from aiorl.runtime.work import _WAITER

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def home():
    lt, _ = LoopThread.start("test", lambda lt: None)
    yield lt
    lt.stop(lambda: None)


def test_submissions_from_threads_run_on_the_loop_in_order(home):
    seen: list[tuple[int, bool]] = []
    done = threading.Event()
    for i in range(1000):
        home.submit(lambda i=i: seen.append((i, home.on_loop())))
    home.submit(done.set)
    assert done.wait(5)
    assert [i for i, _ in seen] == list(range(1000))
    assert all(on for _, on in seen)
    assert not home.on_loop()
    assert loop_thread_of(home.loop) is home


def test_run_sync_returns_refuses_on_the_loop_and_times_out(home):
    async def answer() -> int:
        return 42

    assert home.run_sync(answer(), timeout=5) == 42
    with pytest.raises(WaitTimeout):
        home.run_sync(asyncio.sleep(10), timeout=0.05)

    async def nested() -> str:
        with pytest.raises(RuntimeError, match="event loop's thread"):
            home.run_sync(answer())
        return "refused"

    assert home.run_sync(nested(), timeout=5) == "refused"


def test_work_completed_by_promise_is_seen_by_threads_and_coroutines(home):
    work: AsyncWork[int] = home.run_sync(_make(home), timeout=5)
    assert not work.done()
    prepare_threads(work)
    home.submit(link_threads, work)
    home.submit(resolve, work, 7)
    assert work.wait(5) == 7
    assert asyncio.run(_await(work)) == 7  # from a foreign loop
    assert home.run_sync(_await(work), timeout=5) == 7  # on its own loop


def test_reject_and_timeout_cancel_locally(home):
    failed: AsyncWork[int] = home.run_sync(_make(home), timeout=5)
    home.submit(reject, failed, KeyError("gone"))
    with pytest.raises(KeyError):
        failed.wait(5)
    pending: AsyncWork[int] = home.run_sync(_make(home), timeout=5)
    with pytest.raises(WaitTimeout):
        pending.wait(0.05)
    time.sleep(0.05)
    assert home.run_sync(_settled(pending), timeout=5)


def test_then_chains_and_follows_returned_works(home):
    first: AsyncWork[int] = home.run_sync(_make(home), timeout=5)
    inner: AsyncWork[int] = home.run_sync(_make(home), timeout=5)
    last = first.then(lambda v: v + 1).then(lambda v: inner)
    assert first.get_last_work() is last
    home.submit(resolve, first, 1)
    home.submit(resolve, inner, 10)
    assert last.wait(5) == 10


class _FakeTorchWork:
    """The two methods of torch.distributed's Work that the waiter uses (is_completed, wait)."""

    def __init__(self, after_s: float, error: BaseException | None = None) -> None:
        self.due = time.monotonic() + after_s
        self.error = error

    def is_completed(self) -> bool:
        return time.monotonic() >= self.due

    def wait(self) -> bool:
        if self.error is not None:
            raise self.error
        return True


def test_coll_works_share_one_waiter_and_do_not_block_each_other(home):
    before = _WAITER.pending()
    slow = AsyncCollWork(home.loop, [_FakeTorchWork(5.0)], result="slow")
    fast = AsyncCollWork(home.loop, [_FakeTorchWork(0.01)], result="fast")
    broken = AsyncCollWork(home.loop, [_FakeTorchWork(0.0, RuntimeError("nccl error"))])
    assert fast.wait(2) == "fast"  # not stuck behind the slow one
    with pytest.raises(RuntimeError, match="nccl error"):
        broken.wait(2)
    assert not slow.done()
    names = [t.name for t in threading.enumerate()]
    assert names.count("aiorl-waiter") == 1
    slow.cancel()
    # Cancelled: its torch work (due in 5 s) is no longer polled.
    deadline = time.monotonic() + 2
    while _WAITER.pending() > before and time.monotonic() < deadline:
        time.sleep(0.005)
    assert _WAITER.pending() <= before


def test_real_gloo_work_completes_through_the_waiter(home, tmp_path):
    import torch
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(4)
        work = dist.all_reduce(t, async_op=True)
        assert AsyncCollWork(home.loop, [work], result="reduced").wait(10) == "reduced"
    finally:
        dist.destroy_process_group()


def test_waiter_reports_errors_raised_by_ready():
    waiter = BlockingWaiter("test-waiter")
    got: list[BaseException | None] = []
    done = threading.Event()

    def boom() -> bool:
        raise ValueError("poll failed")

    waiter.watch(Job(boom, lambda e: (got.append(e), done.set())))
    assert done.wait(5)
    assert isinstance(got[0], ValueError)
    waiter.close()


async def _make(home: LoopThread) -> AsyncWork[int]:
    return AsyncWork(home.loop)


async def _await(work: AsyncWork[int]) -> int:
    return await work


async def _settled(work: AsyncWork[int]) -> bool:
    return is_settled(work) and work._fut.cancelled()
