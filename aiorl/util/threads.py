"""``RuntimeThread``: aiorl's own threads block SIGINT and SIGTERM, so the main thread gets them.

The kernel delivers a signal sent to a process to any one of its threads that does not
block it. CPython runs the handler on the main thread, but only wakes that thread if the
signal landed on it: a main thread waiting on a lock (``work.wait()`` in a driver) would
not see Ctrl-C that landed on one of aiorl's threads until its wait ended by itself (under
load, that was seen to be never). A thread inherits the mask of the thread that starts it,
so `RuntimeThread.start` blocks the two signals in the starting thread for the moment of the
start, and the new thread runs with them blocked from its first instruction: no window.

Threads that run the user's code (a worker's method thread, mapping and polling threads)
keep the default mask: a process the user's code starts there inherits its mask, and must
get SIGTERM and Ctrl-C as it would anywhere. `unblocked` is for aiorl's own process starts
from its threads (the mask survives ``exec``).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["SHIELDED", "RuntimeThread", "block_in_this_thread", "blocked", "unblocked"]

#: The signals aiorl's own threads never take: the user's (Ctrl-C) and the system's stop.
SHIELDED = frozenset({signal.SIGINT, signal.SIGTERM})


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


def block_in_this_thread() -> None:
    """Block `SHIELDED` in the calling thread for good (an executor's ``initializer``)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)


class RuntimeThread(threading.Thread):
    """A ``threading.Thread`` that runs with `SHIELDED` blocked (see the module docstring)."""

    def start(self) -> None:
        with blocked():
            super().start()
