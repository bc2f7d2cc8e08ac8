"""Point-to-point messages between workers: the engine, its Senders, Inboxes and payload paths.

Layer ``p2p``: above ``cuda`` and ``runtime``; may import ``cuda``, ``runtime``,
``registry``, ``transport``, ``protocol``, ``names``, ``errors`` and ``util``, never
``actors``, ``group``, ``channels`` or ``cluster``. Only this package touches the payload
paths (``aiorl.transport.shared_memory``, NCCL pairs, CUDA IPC). See ``docs/ordering.md``.
"""

from aiorl.p2p.engine import P2PEngine, P2PStatistics, get_p2p
from aiorl.p2p.inbox import InboxStatistics
from aiorl.p2p.paths.base import PathStatistics
from aiorl.p2p.sender import SenderStatistics

__all__ = [
    "InboxStatistics",
    "P2PEngine",
    "P2PStatistics",
    "PathStatistics",
    "SenderStatistics",
    "get_p2p",
]
