"""Process helpers shared by the node agent and the driver's embedded cluster."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts).

    Example::

        pid_alive(os.getpid())   # True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
