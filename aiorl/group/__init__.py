"""Worker groups: launch a worker class on many processes and fan calls out to them.

Layer: above ``runtime``; beside ``p2p``; below ``channels`` and ``actors``.
"""

from aiorl.group.group import WorkerGroup, WorkerGroupBuilder
from aiorl.group.per_rank import PerRank

__all__ = ["PerRank", "WorkerGroup", "WorkerGroupBuilder"]
