"""``return_large_buffers_to_os``: large allocations of a relaying process get their own mappings.

glibc serves an allocation from 128 KiB up with its own ``mmap``, returned to the system
the moment it is freed, but raises that threshold to the size of every such block freed
(up to 32 MiB): after the first 1 MiB message, a process's later 1 MiB buffers come from
the heap, and freed ones stay in its resident memory for as long as something live sits
above them. A node agent forwards other processes' frames: its memory must follow what
it holds, or a burst it has long forwarded looks (and is, to the machine) like a leak.
Setting the threshold explicitly turns the adjustment off. Imports nothing from aiorl.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["LARGE_BUFFER_BYTES", "return_large_buffers_to_os"]

#: Allocations from this size up are mapped on their own (glibc's default threshold).
LARGE_BUFFER_BYTES = 128 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def return_large_buffers_to_os(threshold: int = LARGE_BUFFER_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` for this process; False where the C
    library is not glibc (nothing is changed there)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
