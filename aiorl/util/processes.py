"""Process helpers shared by the node agent and the driver's embedded cluster."""

from __future__ import annotations

import os
import sys

__all__ = ["pid_alive", "process_start_time", "python_module_command"]

# Run by an interpreter that may not take -P: drop the working-directory entry "-c" put
# first on sys.path, then run the module as "python -m" would. The "-m MODULE" that follows
# it on the command line keeps the command readable in ps and to tools that look for it.
_RUN_MODULE_SAFELY = (
    "import runpy, sys; del sys.path[0]; module = sys.argv[2]; del sys.argv[1:3]; "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


def python_module_command(module: str, *args: str, interpreter: str | None = None) -> list[str]:
    """The command line that runs ``python -m module args...`` without putting the working
    directory first on ``sys.path``.

    ``python -m`` puts the directory it starts in ahead of everything, before it imports the
    module's package. An aiorl process starts in the driver's working directory: a folder
    named ``aiorl`` there (the clone's parent directory, or any empty ``aiorl/``) became the
    ``aiorl`` package, an empty namespace whose submodules an editable install's finder
    still supplied, and a worker class failed with "module 'aiorl' has no attribute
    'Worker'". ``-P`` (Python 3.11+) leaves that entry out; an interpreter that may be
    older runs the module through ``-c`` code that removes it first. The directory stays
    importable, last (`aiorl.node.zygote.working_directory_last`).

    Example:
        ```python
        python_module_command("aiorl.node.agent", "--help")
        # [sys.executable, "-P", "-m", "aiorl.node.agent", "--help"]
        ```
    """
    python = interpreter or sys.executable
    ours = os.path.realpath(python) == os.path.realpath(sys.executable)
    if ours and sys.version_info >= (3, 11):
        return [python, "-P", "-m", module, *args]
    return [python, "-c", _RUN_MODULE_SAFELY, "-m", module, *args]


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
