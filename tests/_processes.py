"""Process checks shared by the tests that verify nothing is left running."""

from __future__ import annotations

from collections.abc import Iterable

import psutil


def alive(pids: Iterable[int]) -> set[int]:
    """The pids that still run (zombies and processes gone mid-check do not count)."""
    running = set()
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                running.add(p)
        except psutil.NoSuchProcess:  # gone between the listing and the look
            pass
    return running
