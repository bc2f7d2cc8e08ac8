"""Every kind of thread aiorl starts blocks SIGINT and SIGTERM from its first instruction, and
the thread that starts it keeps its own mask (`aiorl.util.threads`); the threads that run the
user's code keep the default. Masks are read inside each thread (what the kernel checks when
it picks the thread a signal sent to the process lands on)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from aiorl.util.threads import SHIELDED, RuntimeThread, RuntimeThreadPool, blocked, unblocked

pytestmark = pytest.mark.timeout(30)


def _mask() -> set[int]:
    return {int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])}


def _shielded(mask: set[int]) -> bool:
    return {int(s) for s in SHIELDED} <= mask


def _kernel_mask(tid: int) -> int:
    """The SigBlk bits of thread ``tid`` of this process."""
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("SigBlk:"):
                return int(line.split()[1], 16)
    raise AssertionError(f"no SigBlk for thread {tid}")


SHIELDED_BITS = sum(1 << (int(s) - 1) for s in SHIELDED)


@pytest.fixture(autouse=True)
def _starter_mask_unchanged() -> Iterator[None]:
    """Each test starts threads from a thread that takes both signals, and leaves it so."""
    before = _mask()
    assert not before & {int(s) for s in SHIELDED}, "pytest's thread blocks them already"
    yield
    assert _mask() == before, "starting an aiorl thread changed the starting thread's mask"


def _seen_on(start: Callable[[Callable[[], None]], None]) -> set[int]:
    """The mask ``start`` gives the thread on which it runs the function it is handed."""
    seen: concurrent.futures.Future[set[int]] = concurrent.futures.Future()
    start(lambda: seen.set_result(_mask()))
    return seen.result(timeout=10)


def test_a_runtime_thread_blocks_both_and_so_do_the_threads_it_starts() -> None:
    nested: concurrent.futures.Future[set[int]] = concurrent.futures.Future()

    def run() -> None:  # a loop thread's default executor and libuv's pool are started so
        t = threading.Thread(target=lambda: nested.set_result(_mask()))
        t.start()
        t.join()

    t = RuntimeThread(target=run, name="aiorl-test")
    t.start()
    t.join(10)
    assert _shielded(nested.result(timeout=10))
    assert _shielded(_seen_on(lambda fn: RuntimeThread(target=fn, daemon=True).start()))


def test_a_runtime_thread_pool_blocks_both() -> None:
    pool = RuntimeThreadPool(2, thread_name_prefix="aiorl-test")
    try:
        masks = [pool.submit(_mask).result(10) for _ in range(4)]
    finally:
        pool.shutdown()
    assert all(_shielded(m) for m in masks)


def test_blocked_and_unblocked_restore_the_mask_they_found() -> None:
    with blocked():
        assert _shielded(_mask())
        with unblocked():
            assert not _mask() & {int(s) for s in SHIELDED}
        assert _shielded(_mask())


def test_the_loop_thread_and_what_its_loop_starts_block_both() -> None:
    from aiorl.runtime.loop import LoopThread

    async def in_the_default_executor() -> set[int]:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, _mask)
        finally:
            await loop.shutdown_default_executor()

    lt, mask = LoopThread.start("signals-test", lambda lt: _mask())
    try:
        assert _shielded(mask)
        assert _shielded(lt.run_sync(in_the_default_executor(), timeout=10))
    finally:
        lt.stop(lambda: None)
        lt.loop.close()


def test_the_blocking_waiter_blocks_both() -> None:
    from aiorl.runtime.waiter import BlockingWaiter, Job

    waiter = BlockingWaiter("aiorl-waiter-test")
    try:
        seen: concurrent.futures.Future[set[int]] = concurrent.futures.Future()
        waiter.watch(Job(lambda: True, lambda error: seen.set_result(_mask())))
        assert _shielded(seen.result(timeout=10))
    finally:
        waiter.close()


def test_a_socket_thread_blocks_both() -> None:
    from aiorl.transport.socket_thread import SocketThread

    seen: concurrent.futures.Future[set[int]] = concurrent.futures.Future()

    class Probe(SocketThread):
        def _run(self) -> None:
            seen.set_result(_mask())

    probe = Probe("probe", "test", "ipc:///nowhere", None)
    probe.start()
    try:
        assert _shielded(seen.result(timeout=10))
    finally:
        probe.stop()


def test_the_cuda_threads_block_both() -> None:
    from aiorl.cuda.events import EventWaiter
    from aiorl.cuda.nccl import abort_in_background
    from aiorl.cuda.work_thread import CudaWorkThread

    work = CudaWorkThread("aiorl-cuda-test")
    try:
        assert _shielded(work.run(_mask).result(timeout=10))
    finally:
        work.close()

    class Done:
        def query(self) -> bool:
            return True

    events = EventWaiter("aiorl-events-test")
    try:
        assert _shielded(_seen_on(lambda fn: events.watch(Done(), lambda error: fn())))
    finally:
        events.close()

    class Group:
        def __init__(self, fn: Callable[[], None]) -> None:
            self.abort = fn

    assert _shielded(_seen_on(lambda fn: abort_in_background(Group(fn), "test")))


def test_zmq_threads_and_the_zap_authenticator_block_both() -> None:
    from aiorl.transport import security, sockets

    before_tids = set(os.listdir("/proc/self/task"))
    fresh = sockets._new_context()  # what get_context makes: it starts libzmq's threads
    try:
        # Read at once: blocked from their start, not only once libzmq blocked them itself
        # (it names them then too, so the names may not be there yet).
        zmq_threads = [int(t) for t in set(os.listdir("/proc/self/task")) - before_tids]
        assert len(zmq_threads) == 2  # the I/O thread and the reaper
        assert all(_kernel_mask(t) & SHIELDED_BITS == SHIELDED_BITS for t in zmq_threads)
    finally:
        fresh.term()

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    before = {t.ident for t in threading.enumerate()}
    try:
        security.enable_server(sock, security.ClusterKeys.generate())
        zap = [t for t in threading.enumerate() if t.ident not in before]
        assert zap, "enable_server started no authenticator thread"
        for t in zap:
            assert t.native_id is not None
            assert _kernel_mask(t.native_id) & SHIELDED_BITS == SHIELDED_BITS, t.name
    finally:
        sock.close(0)
        _, auth = security._authenticators.pop(id(ctx))
        auth.stop()
        ctx.term()


def test_threads_that_run_the_users_code_keep_the_default() -> None:
    """A process the user's code starts inherits the mask of its thread: it must take SIGTERM."""
    from aiorl.util.method_thread import MethodThread

    method = MethodThread("aiorl-method-test")
    try:
        assert not method.submit(_mask).result(10) & {int(s) for s in SHIELDED}
    finally:
        method.shutdown()


async def test_a_worker_loops_signal_handler_runs_whichever_thread_takes_the_signal() -> None:
    """Why a worker's method thread may keep the default: its main thread runs the loop,
    which hears SIGTERM through the signal wakeup fd even when another thread took it."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    loop = asyncio.get_running_loop()
    heard = asyncio.Event()
    done = threading.Event()
    taker = threading.Thread(target=done.wait, args=(10,), daemon=True)  # takes SIGUSR2
    loop.add_signal_handler(signal.SIGUSR2, heard.set)
    taker.start()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})  # so the kernel picks
    try:                                                              # another thread
        os.kill(os.getpid(), signal.SIGUSR2)
        await asyncio.wait_for(heard.wait(), 10)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        done.set()
        loop.remove_signal_handler(signal.SIGUSR2)


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("wait", ["lock", "future"])
def test_the_main_threads_waits_raise_for_a_signal_another_thread_took(wait: str) -> None:
    """A library's thread (numpy's OpenBLAS pool) takes SIGINT now and then: CPython then
    runs the handler on the main thread, but only once that thread runs Python code again.
    aiorl's waits on the main thread return to it every slice, so the handler's exception
    comes out of the wait at once, not when the wait ends."""
    from aiorl.util.threads import MAIN_WAIT_SLICE_S, acquire_interruptibly, result_interruptibly

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread")
    main_tid = threading.get_native_id()
    done = threading.Event()
    taker = threading.Thread(target=done.wait, args=(10,), daemon=True)  # takes SIGUSR2
    taker.start()

    def send_once_main_waits() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # until the main thread sleeps in its lock wait
            with open(f"/proc/self/task/{main_tid}/wchan") as f:
                if "futex" in f.read():
                    break
        os.kill(os.getpid(), signal.SIGUSR2)

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR2, interrupt)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})  # the kernel picks taker
    lock = threading.Lock()
    lock.acquire()
    started = time.monotonic()
    try:
        threading.Thread(target=send_once_main_waits, daemon=True).start()
        with pytest.raises(_Interrupted):
            if wait == "lock":
                acquire_interruptibly(lock, 20)
            else:
                result_interruptibly(concurrent.futures.Future(), 20)
        assert time.monotonic() - started < 5 + 10 * MAIN_WAIT_SLICE_S
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        signal.signal(signal.SIGUSR2, previous)
        done.set()


def test_waits_off_the_main_thread_and_past_their_deadline_end_as_before() -> None:
    from aiorl.util.threads import acquire_interruptibly, result_interruptibly

    lock = threading.Lock()
    lock.acquire()
    assert acquire_interruptibly(lock, 0.25) is False
    fut: concurrent.futures.Future[int] = concurrent.futures.Future()
    with pytest.raises(concurrent.futures.TimeoutError):  # TimeoutError itself from 3.11 on
        result_interruptibly(fut, 0.25)
    fut.set_exception(TimeoutError("its own"))
    with pytest.raises(TimeoutError, match="its own"):
        result_interruptibly(fut, 5)
    pool = RuntimeThreadPool(1)
    try:
        assert pool.submit(acquire_interruptibly, lock, 0.05).result(10) is False
        lock.release()
        assert pool.submit(acquire_interruptibly, lock, 5).result(10) is True
    finally:
        pool.shutdown()
