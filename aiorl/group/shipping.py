"""Shipping a driver's packed working directory to a node agent before a spawn there.

The offer goes first without the archive (a node that has the digest cached answers at once,
so a second job, a restart or a second group sends a few bytes), then, only if the node lacks
it, with the archive (protocol/working_dir.py).
"""

from __future__ import annotations

from typing import Any

from aiorl.protocol.ops import AgentOp
from aiorl.protocol.working_dir import WorkingDirOffer, WorkingDirReply
from aiorl.runtime.working_dir import PackedDir
from aiorl.transport.endpoint import Endpoint

__all__ = ["SHIP_TIMEOUT_S", "ship_working_dir"]

#: How long a node may take to receive and unpack an archive (up to the size limit).
SHIP_TIMEOUT_S = 120.0
#: How long a node may take to say whether it has a digest.
ASK_TIMEOUT_S = 10.0


async def ship_working_dir(endpoint: Endpoint, node: dict[str, Any], packed: PackedDir) -> None:
    """Make sure ``node``'s agent holds ``packed``; raises what the agent answered (a
    refused archive, a timeout) so that the launch fails with it."""
    offer = WorkingDirOffer(packed.digest, len(packed.data), packed.size).to_wire()
    reply, _ = await endpoint.request(node["endpoint"], AgentOp.WORKING_DIR, offer,
                                      timeout=ASK_TIMEOUT_S)
    if WorkingDirReply.from_wire(reply).cached:
        return
    reply, _ = await endpoint.request(node["endpoint"], AgentOp.WORKING_DIR, offer,
                                      [packed.data], timeout=SHIP_TIMEOUT_S)
    if not WorkingDirReply.from_wire(reply).cached:
        raise RuntimeError(f"node {node.get('node_rank')} did not take working directory "
                           f"{packed.source}")
