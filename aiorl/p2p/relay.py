"""Routes through node agents, for destinations beyond the direct-connection budget.

A direct connection per destination makes an all-to-all among N workers hold N^2
connections. A process therefore sends directly to at most ``AIORL_P2P_DIRECT_PEERS``
(`direct_peers`) workers on other nodes; toward later ones its Senders are *relayed*:
each control message goes, wrapped as a `aiorl.protocol.p2p_relay.RelayedP2P`, to this
worker's node agent, which forwards it to the destination node's agent, which hands it to
the destination as ``p2p.via`` (`aiorl.node.p2p_relay`). Each process then holds its
budget of direct connections plus one to its agent, and each agent one per local worker
and one per other node: O(N) in all.

Same-node destinations are always direct (lanes are cheap, and a node has few workers).
A Sender picks its route once, when it resolves the destination, and keeps it: every hop
is one FIFO connection and agents forward synchronously in arrival order, so one pair's
messages stay in order (docs/ordering.md). A relayed Sender uses only the payload paths
that need no set-up question and send nothing back (`RELAYED_PATHS`): frames, and CUDA
tensors staged through pinned host memory at any size.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from aiorl.protocol.ops import AgentOp
from aiorl.util.environment import count_setting

if TYPE_CHECKING:
    from aiorl.transport.endpoint import Endpoint

__all__ = ["DEFAULT_DIRECT_PEERS", "RelayRoute", "direct_peers"]

#: Workers on other nodes a process sends to directly before it relays through agents.
DEFAULT_DIRECT_PEERS: Final = 64
#: The agent op as a plain str (an enum member costs msgpack a slow path per message).
_RELAY_P2P: Final = AgentOp.RELAY_P2P.value


def direct_peers(environ: Mapping[str, str] = os.environ) -> int:
    """``AIORL_P2P_DIRECT_PEERS`` (destinations on other nodes; 0 relays them all), else
    the default.

    Raises ValueError for a value that is not a non-negative integer: a typo must not
    silently open a connection to every peer (or relay every message).
    """
    return count_setting(environ, "AIORL_P2P_DIRECT_PEERS", DEFAULT_DIRECT_PEERS,
                         "a number of peers")


class RelayRoute:
    """How a relayed Sender's control messages leave: wrapped for this node's agent."""

    __slots__ = ("endpoint", "agent", "_head")

    def __init__(
        self, endpoint: Endpoint, agent: str, dst_node: str, dst_address: str, identity: bytes
    ) -> None:
        self.endpoint = endpoint
        self.agent = agent  # this worker's node agent: the first hop
        #: The envelope's fixed fields: the destination, and the routing id the receiver
        #: would have seen on a direct connection (its engine compares the pid in it).
        self._head = (dst_node, dst_address, identity)

    def send(self, op: str, meta: list[Any], frames: Sequence[Any]) -> None:
        """Send the p2p message ``op``/``meta`` toward the destination (raises what
        ``send_oneway`` raises: the agent is gone, or refuses our key)."""
        self.endpoint.send_oneway(self.agent, _RELAY_P2P, [*self._head, op, meta], frames)
