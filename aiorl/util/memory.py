"""``trim_memory``: give the system back what a process's allocator keeps after a burst.

A node agent forwards other processes' frames (relayed p2p, relayed calls). glibc serves a
block from 128 KiB up with its own mapping, returned the moment it is freed, but raises that
threshold to the size of every such block freed (up to 32 MiB): after the first 1 MiB
message, an agent's 1 MiB buffers come from its heaps, and freed ones stay resident while
anything live sits above them. A burst the agent has long forwarded would look (and be, to
the machine) like a leak. ``malloc_trim`` returns the free pages of every heap (from their
middle too) in about 2 µs on an agent's heap. The agent calls it once its relays have been
quiet for a moment: trimming between messages made each one fault its pages in again, and
fixing the threshold (``mallopt``) made every relayed 1 MiB frame a fresh mapping with its
page faults; both measured slower. Imports nothing from aiorl.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

__all__ = ["trim_memory"]


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl and others: nothing to call
        return None
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def trim_memory() -> bool:
    """Return the allocator's free pages to the system; whether any were (False where the
    C library has no ``malloc_trim``)."""
    return _TRIM is not None and bool(_TRIM(0))
