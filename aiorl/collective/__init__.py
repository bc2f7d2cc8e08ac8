"""Collectives over worker groups: broadcast (RLinf's ``Worker.broadcast``).

Sits above ``group`` and ``p2p`` (it moves bytes with the P2P codec and shared memory) and
below ``weights`` and ``actors``. See ``docs/broadcast.md``.
"""

from aiorl.collective.broadcast import Broadcaster, BroadcastStatistics, get_broadcaster
from aiorl.collective.broadcast_plan import BroadcastPlan, RelayTree, plan_broadcast, relay_tree

__all__ = [
    "BroadcastPlan",
    "BroadcastStatistics",
    "Broadcaster",
    "RelayTree",
    "get_broadcaster",
    "plan_broadcast",
    "relay_tree",
]
