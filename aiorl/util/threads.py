"""``RuntimeThread``: aiorl's own threads block SIGINT and SIGTERM, so the main thread gets them.

The kernel delivers a signal sent to a process to any one of its threads that does not
block it. CPython runs the handler on the main thread, but only wakes that thread if the
signal landed on it: a main thread waiting on a lock (``work.wait()`` in a driver) would
not see Ctrl-C that landed on one of aiorl's threads until its wait ended by itself (under
load, that was seen to be never). A thread inherits the mask of the thread that starts it,
so `RuntimeThread.start` blocks the two signals in the starting thread for the moment of the
start, and the new thread runs with them blocked from its first instruction: no window.

Threads started by aiorl's threads inherit the block: a driver's loop thread blocks both, so
the pools its loop starts (the default executor, libuv's) block them too. Threads started
elsewhere go through `RuntimeThread`, `RuntimeThreadPool` or `blocked` (pyzmq's ZAP
authenticator, the ZMQ context's I/O threads, which libzmq also blocks itself once running).

Threads that run the user's code (a worker's method thread, mapping and polling threads)
keep the default mask: a process the user's code starts there inherits its mask, and must
get SIGTERM and Ctrl-C as it would anywhere. A worker's main thread runs its event loop,
which hears SIGTERM through the signal wakeup fd whichever thread the kernel picked.
`unblocked` is for aiorl's own process starts from its threads (the mask survives ``exec``).

Threads that libraries start are not aiorl's to mask: numpy's OpenBLAS starts its pool when
numpy is imported, torch its OpenMP pool at the first parallel operation, each with the mask
of the thread that caused it (a driver's main thread, often). aiorl imports its modules on
first use with the two signals blocked (``aiorl.__getattr__``), so a pool started by that
import blocks them; and the main thread's waits in aiorl (`acquire_interruptibly`,
`result_interruptibly`) return to the interpreter every `MAIN_WAIT_SLICE_S`, so a signal
that another thread took still raises there (CPython runs its handler at that point).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

__all__ = [
    "MAIN_WAIT_SLICE_S", "SHIELDED", "RuntimeThread", "RuntimeThreadPool",
    "acquire_interruptibly", "blocked", "result_interruptibly", "unblocked",
]

P = ParamSpec("P")
T = TypeVar("T")

#: The signals aiorl's own threads never take: the user's (Ctrl-C) and the system's stop.
SHIELDED = frozenset({signal.SIGINT, signal.SIGTERM})
#: The longest the main thread blocks in one piece in aiorl's waits: the most a Ctrl-C that
#: another thread took waits before it raises there.
MAIN_WAIT_SLICE_S = 0.1


@contextlib.contextmanager
def blocked() -> Iterator[None]:
    """Block `SHIELDED` in this thread for the block (threads started in it inherit that)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def unblocked() -> Iterator[None]:
    """Unblock `SHIELDED` in this thread for the block: a process started in it (which
    inherits the mask across ``exec``) takes SIGINT and SIGTERM as a program should."""
    old = signal.pthread_sigmask(signal.SIG_UNBLOCK, SHIELDED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class RuntimeThread(threading.Thread):
    """A ``threading.Thread`` that runs with `SHIELDED` blocked (see the module docstring)."""

    def start(self) -> None:
        with blocked():
            super().start()


class RuntimeThreadPool(concurrent.futures.ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` whose threads run with `SHIELDED` blocked.

    Its threads start inside ``submit``, which blocks the two signals around it (an
    ``initializer`` would leave them open for the thread's first instructions)."""

    def submit(self, fn: Callable[P, T], /, *args: P.args,
               **kwargs: P.kwargs) -> concurrent.futures.Future[T]:
        with blocked():
            return super().submit(fn, *args, **kwargs)


def _slice(deadline: float | None) -> float:
    if deadline is None:
        return MAIN_WAIT_SLICE_S
    return min(MAIN_WAIT_SLICE_S, max(deadline - time.monotonic(), 0.0))


def acquire_interruptibly(lock: Any, timeout: float = -1) -> bool:
    """``lock.acquire(True, timeout)`` (``timeout`` < 0: no limit) that, on the main thread,
    returns to the interpreter every `MAIN_WAIT_SLICE_S` (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        return bool(lock.acquire(True, timeout))
    deadline = None if timeout < 0 else time.monotonic() + timeout
    while True:
        if lock.acquire(True, _slice(deadline)):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


def result_interruptibly(fut: concurrent.futures.Future[T], timeout: float | None = None) -> T:
    """``fut.result(timeout)`` that, on the main thread, returns to the interpreter every
    `MAIN_WAIT_SLICE_S` (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        return fut.result(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return fut.result(_slice(deadline))
        except concurrent.futures.TimeoutError:
            if fut.done() or (deadline is not None and time.monotonic() >= deadline):
                raise  # the future's own TimeoutError, or ours at the deadline
