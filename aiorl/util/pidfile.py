"""``pid_file``: a daemon writes its pid where its operator asked, and removes it on exit.

A cluster started by hand (docs/deploy.md) is stopped with ``kill -TERM "$(cat FILE)"``:
the pid file names exactly this cluster's daemon, where ``pkill -f aiorl-node`` would stop
every user's agents on the machine. The file is written whole (a temporary file renamed
over it), refused while another live process's pid is in it (two daemons must not share
one file, or stopping one would stop the other), and removed on exit only if it still
holds our pid.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["PidFileError", "pid_file"]


class PidFileError(RuntimeError):
    """The pid file names another process that is running."""


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def _read(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip() or "0") or None
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def pid_file(path: str | None) -> Iterator[None]:
    """Hold ``path`` (None: nothing to do) with this process's pid while the block runs.

    Raises PidFileError when the file holds the pid of another running process.
    """
    if path is None:
        yield
        return
    path = os.path.abspath(os.path.expanduser(path))
    other = _read(path)
    if other is not None and other != os.getpid() and _running(other):
        raise PidFileError(f"{path} holds pid {other}, a process that is running: stop it "
                           "first, or give this one another --pid-file")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, path)
    try:
        yield
    finally:
        if _read(path) == os.getpid():
            with contextlib.suppress(OSError):
                os.unlink(path)
