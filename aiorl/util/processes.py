"""Process helpers shared by the node agent and the driver's embedded cluster."""

from __future__ import annotations

import os

__all__ = ["pid_alive", "process_start_time"]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts).

    Example:
        ```python
        pid_alive(os.getpid())   # True
        ```
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux ``/proc``); None when
    it is gone or this cannot be read. With the pid it names one process: a pid reused by a
    later process has another start time.

    Example:
        ```python
        process_start_time(os.getpid()) == process_start_time(os.getpid())   # True
        ```
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        # The command name (field 2) may hold spaces and parentheses: count after its end.
        return int(data[data.rindex(b")") + 2:].split()[19])  # field 22, starttime
    except (OSError, ValueError, IndexError):
        return None
