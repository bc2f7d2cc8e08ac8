"""Process checks shared by the tests that verify nothing is left running."""

from __future__ import annotations

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
