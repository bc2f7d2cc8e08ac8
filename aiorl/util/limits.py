"""Process limits the services raise when they start (the registry and every node agent).

A service holds a file descriptor per peer connection (ZMQ TCP or Unix sockets), per
worker log and per HTTP client of the metrics port. Most systems start processes with a
soft ``RLIMIT_NOFILE`` of 1,024 while allowing far more (the hard limit, often 524,288):
the soft limit is what runs out first, so a service raises it to the hard limit at start.
Imports nothing from aiorl.
"""

from __future__ import annotations

__all__ = ["raise_open_file_limit"]


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit when allowed; returns the
    ``(soft, hard)`` limits in force afterwards (``(-1, -1)`` where there is no such limit).

    An unlimited hard limit is not copied (some kernels refuse an unlimited soft limit for
    open files): the soft limit then goes as far as the kernel allows (``nr_open``)."""
    try:
        import resource
    except ImportError:  # not a Unix system
        return -1, -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        target = _nr_open(default=soft)
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # not allowed here (a container may cap it): keep what we have
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _nr_open(default: int) -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return default
