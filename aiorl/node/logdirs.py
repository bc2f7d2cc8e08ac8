"""Where a node agent started without ``--log-dir`` keeps its workers' logs and lanes, and
the cleaning of what ended agents left there.

Each agent gets a private ``<pid>-<random>`` directory under one per-user parent,
``<runtime dir>/aiorl-node-logs-<uid>`` (docs/deploy.md). An agent that stops removes its
lanes; one that was killed (SIGKILL, the OOM killer) removes nothing, so whoever comes next
cleans up after it: a starting agent, and ``aiorl status``. Kept light (no agent, no event
loop) for the command line.
"""

from __future__ import annotations

import os
import shutil

from aiorl.transport import security
from aiorl.util.processes import pid_alive

__all__ = ["KEPT_ENDED_AGENT_LOGS", "agent_logs_parent", "remove_ended_agent_files"]

#: Log directories of ended agents kept for a post-mortem (a killed agent cannot remove its own).
KEPT_ENDED_AGENT_LOGS = 4
#: The subdirectory of an agent's log directory that holds its workers' lane sockets.
LANES = "lanes"


def agent_logs_parent() -> str:
    """The per-user parent of agents' default log directories (it may not exist yet)."""
    return os.path.join(security.runtime_base(), f"aiorl-node-logs-{os.getuid()}")


def remove_ended_agent_files(parent: str | None = None,
                             keep: int = KEPT_ENDED_AGENT_LOGS) -> list[str]:
    """Clean what agents that are gone left under ``parent`` (default `agent_logs_parent`);
    returns the paths removed.

    A directory belongs to an ended agent when the pid its name starts with runs no more. Its
    lane sockets (``lanes/*.lane``) are removed at once: nothing can connect to them again.
    Its worker logs stay for a post-mortem, the newest ``keep`` ended agents' only, so the
    total stays bounded. Directories of live agents are not touched; one that another cleaner
    removes meanwhile is skipped.

    Example:
        ```python
        remove_ended_agent_files()   # what a starting agent and `aiorl status` do
        ```
    """
    parent = parent or agent_logs_parent()
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    removed = []
    ended = []
    for name in names:
        pid = name.split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        path = os.path.join(parent, name)
        try:
            ended.append((os.path.getmtime(path), path))
        except FileNotFoundError:  # another agent starting now removed it first
            continue
        lanes = os.path.join(path, LANES)
        if os.path.isdir(lanes):
            shutil.rmtree(lanes, ignore_errors=True)
            removed.append(lanes)
    for _, path in sorted(ended, reverse=True)[keep:]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
