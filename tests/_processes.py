"""Process checks shared by the tests that start programs and verify nothing is left running."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable

import psutil

# A process that ends while psutil reads it raises NoSuchProcess, or, in the window between
# psutil finding /proc/<pid> and reading /proc/<pid>/stat, a bare FileNotFoundError.
_GONE_ERRORS = (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError)


def alive(pids: Iterable[int]) -> set[int]:
    """The pids that still run (zombies and processes gone mid-check do not count)."""
    running = set()
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                running.add(p)
        except _GONE_ERRORS:  # gone between the listing and the look
            pass
    return running


def gone_within(pids: Iterable[int], within: float) -> bool:
    """Whether every one of ``pids`` has ended (or is a zombie) within ``within`` seconds."""
    pids = list(pids)
    deadline = time.monotonic() + within
    while alive(pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def wait_listening(address: str, within: float = 60.0) -> None:
    """Until something accepts TCP connections at ``address`` (``tcp://host:port``): a
    registry started as a program listens only once its imports ran, which takes seconds on
    a loaded machine, and a driver gives up on a port that refuses everything for 3 s."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    deadline = time.monotonic() + within
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens at {address} after {within:g} s") from None
            time.sleep(0.05)
