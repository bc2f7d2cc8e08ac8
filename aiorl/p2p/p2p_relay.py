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

Flow control: a relayed pair is credit-based, end to end. The Sender may have at most
``AIORL_P2P_RELAY_WINDOW`` bytes (`relay_window`; each envelope counts its frames plus
`aiorl.protocol.p2p_relay.ENVELOPE_COST`) sent and not yet consumed by the receiver; the
receiver grants them back as its loop reads them (``p2p.credit``, relayed the other way).
A send that finds the window full waits in the Sender's backlog, in order, and completes
later, as a direct pair's does when its socket is full. The window is checked before each
message, whatever its size, so a message larger than the window still goes: a pair has at
most the window plus one message in flight. What the agents hold for a pair is therefore
bounded by the sender, not by how fast the receiver or the agents drain it. The pair also
has a direct pair's receive window (`aiorl.p2p.window`: what the receiver holds that no
receive has taken), its ``p2p.taken`` counts relayed back the same way.

A relayed pair never waits for ever without a death: its receiver grants credit as its loop
reads, whatever its user code does with the messages, so a Sender that waits for credit for
``AIORL_P2P_RELAY_STALL_S`` (`relay_stall_s`) without any coming back has lost an envelope
or a credit on the way; its pair then fails with a `PeerLostError` naming it, not a hang. (A
receiver that holds a gigabyte untaken keeps its senders waiting on the receive window
instead, for as long as it likes: that wait is the user's, and never ends the pair.)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from aiorl.p2p.window import Window
from aiorl.protocol.ops import AgentOp
from aiorl.protocol.p2p_relay import envelope_bytes
from aiorl.util.settings import count_setting

if TYPE_CHECKING:
    from aiorl.transport.endpoint import Endpoint

log = logging.getLogger("aiorl.p2p")

__all__ = ["DEFAULT_DIRECT_PEERS", "DEFAULT_RELAY_STALL_S", "DEFAULT_RELAY_WINDOW", "RelayRoute",
           "direct_peers", "node_agent_endpoint", "relay_stall_s", "relay_window"]

#: Workers on other nodes a process sends to directly before it relays through agents.
DEFAULT_DIRECT_PEERS: Final = 64
#: Bytes a relayed pair may have unconsumed in flight. 8 MiB: a relayed hop round trip is
#: about 0.5 ms on one machine, so 8 MiB keeps the pipe full up to ~16 GB/s, far above what
#: two agents forward (~0.4 GB/s measured); and 8 such pairs stalled toward one receiver hold
#: 64 MiB in an agent, what `aiorl.node.p2p_relay` allows per destination by default.
DEFAULT_RELAY_WINDOW: Final = 8 << 20
#: Seconds a relayed Sender waits for credit, with none coming back, before its pair fails.
#: Credit comes back within milliseconds of a read; a minute leaves room for a receiver
#: whose loop a long garbage collection or a swapping machine holds up.
DEFAULT_RELAY_STALL_S: Final = 60
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


def relay_window(environ: Mapping[str, str] = os.environ) -> int:
    """``AIORL_P2P_RELAY_WINDOW`` (bytes a relayed pair may have unconsumed), else the default.

    Raises ValueError for a value that is not a positive integer: 0 would stop every
    relayed pair, and a typo must not silently lift the bound the agents rely on.
    """
    value = count_setting(environ, "AIORL_P2P_RELAY_WINDOW", DEFAULT_RELAY_WINDOW, "a byte count")
    if value == 0:
        raise ValueError("AIORL_P2P_RELAY_WINDOW must be > 0 bytes (0 would stop every relayed pair)")
    return value


def relay_stall_s(environ: Mapping[str, str] = os.environ) -> int:
    """``AIORL_P2P_RELAY_STALL_S`` (seconds a relayed pair waits for credit before it fails),
    else the default.

    Raises ValueError for a value that is not a positive integer.
    """
    value = count_setting(environ, "AIORL_P2P_RELAY_STALL_S", DEFAULT_RELAY_STALL_S, "seconds")
    if value == 0:
        raise ValueError("AIORL_P2P_RELAY_STALL_S must be > 0 seconds")
    return value


class RelayRoute(Window):
    """How a relayed Sender's control messages leave: wrapped for this node's agent, within
    the pair's credit window (see the module docstring): a `Window` of the bytes sent
    that the receiver has not granted back yet."""

    __slots__ = ("endpoint", "agent", "stall_s", "_head", "_tail")

    def __init__(
        self, endpoint: Endpoint, agent: str, dst_node: str, dst_address: str, identity: bytes,
        src_node: str, window: int, stall_s: float = DEFAULT_RELAY_STALL_S,
    ) -> None:
        super().__init__(window)
        #: Seconds without credit after which the pair fails (`relay_stall_s`).
        self.stall_s = stall_s
        self.endpoint = endpoint
        self.agent = agent  # this worker's node agent: the first hop
        #: The envelope's fixed fields: the destination, and the routing id the receiver
        #: would have seen on a direct connection (its engine compares the pid in it) ...
        self._head = (dst_node, dst_address, identity)
        #: ... and where the receiver's credit comes back to.
        self._tail = (src_node, endpoint.address)

    def send(self, op: str, meta: list[Any], frames: Sequence[Any]) -> None:
        """Send the p2p message ``op``/``meta`` toward the destination (raises what
        ``send_oneway`` raises: the agent is gone, or refuses our key)."""
        self.endpoint.send_oneway(self.agent, _RELAY_P2P, [*self._head, op, meta, *self._tail],
                                  frames)
        self.outstanding += envelope_bytes(frames)


async def node_agent_endpoint(registry: Any, node_id: str | None, who: str) -> str | None:
    """This node's agent endpoint, from the registry's node list; None (said once, as a
    warning naming ``who``) where there is none to relay through: the pair goes direct."""
    if node_id is None:
        return None
    try:
        nodes = await registry.nodes()
    except Exception as exc:  # noqa: BLE001 - the pair goes direct instead
        log.warning("%s: cannot find this node's agent (%r): p2p goes direct", who, exc)
        return None
    agent: str | None = next((n.endpoint for n in nodes if n.node_id == node_id), None)
    if agent is None:
        log.warning("%s: node %s is not in the registry: p2p goes direct", who, node_id)
    return agent
