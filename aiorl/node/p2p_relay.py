"""The node agent's half of relayed point-to-point messages (`aiorl.protocol.p2p_relay`).

A worker beyond its direct-connection budget (`aiorl.p2p.relay`) sends its p2p control
messages to its own agent as ``relay_p2p``. The agent forwards each, frames unchanged (no
copy: ZMQ sends the received frames on), either to the destination as ``p2p.via`` (the
destination is on this node) or, as the same ``relay_p2p``, to the agent of the
destination's node, found in the registry's node list (cached; looked up again on a
miss). Forwarding is synchronous and in arrival order, and messages for a node whose
agent is being looked up wait, in order, behind that look-up: one pair's messages keep
their order (docs/ordering.md).

Nothing here answers: a message that cannot be forwarded (a malformed one, a node or
worker that is gone) is dropped and logged at a bounded rate. The sender learns of a dead
destination from the registry, as for a direct connection; the agent of a worker that
exited has marked its endpoint lost (`aiorl.node.relay.CallRelay.worker_exited`), so
nothing queues toward it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiorl.errors import ProtocolError
from aiorl.protocol.ops import AgentOp
from aiorl.protocol.p2p_relay import P2P_VIA, RelayedP2P
from aiorl.protocol.registry import NodeInfo
from aiorl.transport.endpoint import Endpoint, Incoming
from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["P2PRelay"]

log = logging.getLogger("aiorl.node")
_warn = RateLimitedLog(log)

#: The agent op as a plain str (an enum member costs msgpack a slow path per message).
_RELAY_P2P: str = AgentOp.RELAY_P2P.value
#: Messages held for one node while its agent is looked up; beyond, they are dropped (a
#: registry that does not answer must not grow the agent without bound).
MAX_HELD_PER_NODE = 100_000


class P2PRelay:
    """Serves ``relay_p2p`` on a node agent's endpoint."""

    def __init__(
        self,
        endpoint: Endpoint,
        node_id: str,
        list_nodes: Callable[[], Awaitable[Sequence[NodeInfo]]],
    ) -> None:
        self.endpoint = endpoint
        self.node_id = node_id
        self._list_nodes = list_nodes
        #: Node id -> its agent's endpoint, from the registry's node list.
        self._agents: dict[str, str] = {}
        #: Messages for a node whose agent is being looked up, in arrival order.
        self._held: dict[str, list[tuple[Any, list[Any]]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def on_relay_p2p(self, msg: Incoming) -> None:
        try:
            relayed = RelayedP2P.from_wire(msg.meta)
        except ProtocolError as exc:
            _warn.warning("relay_p2p", "dropped a malformed relay_p2p: %s", exc)
            return
        node = relayed.dst_node
        if node == self.node_id:
            self._deliver(relayed, msg.frames)
            return
        held = self._held.get(node)
        if held is not None:  # behind the look-up of that node's agent: keep the order
            if len(held) < MAX_HELD_PER_NODE:
                held.append((msg.meta, msg.frames))
            else:
                _warn.warning("relay_p2p_held", "dropped a p2p message for node %s: "
                              "%d wait for its agent's look-up", node, len(held))
            return
        agent = self._agents.get(node)
        if agent is None:
            self._held[node] = [(msg.meta, msg.frames)]
            task = asyncio.get_running_loop().create_task(self._look_up(node))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._forward(agent, node, msg.meta, msg.frames)

    def _deliver(self, relayed: RelayedP2P, frames: list[Any]) -> None:
        """To the destination worker on this node, as if its sender had sent it."""
        try:
            self.endpoint.send_oneway(relayed.dst_address, P2P_VIA, relayed.via().to_wire(), frames)
        except Exception as exc:  # noqa: BLE001 - a worker that is gone: its senders hear from the registry
            _warn.warning("relay_p2p_deliver", "dropped a p2p message for %s: %s",
                          relayed.dst_address, exc)

    def _forward(self, agent: str, node: str, meta: Any, frames: list[Any]) -> None:
        """To the agent of ``node``, unchanged."""
        try:
            self.endpoint.send_oneway(agent, _RELAY_P2P, meta, frames)
        except Exception as exc:  # noqa: BLE001 - a node that is gone: so are its workers
            _warn.warning("relay_p2p_forward", "dropped a p2p message for node %s: %s", node, exc)

    async def _look_up(self, node: str) -> None:
        """Refresh the node list, then forward what waited for ``node``'s agent, in order."""
        try:
            nodes = await self._list_nodes()
        except Exception as exc:  # noqa: BLE001 - what waited is dropped below
            _warn.warning("relay_p2p_nodes", "cannot list the nodes: %s", exc)
        else:
            self._agents = {n.node_id: n.endpoint for n in nodes}
        held = self._held.pop(node, [])
        agent = self._agents.get(node)
        if agent is None:
            if held:
                _warn.warning("relay_p2p_node", "dropped %d p2p message(s) for node %s: "
                              "not among the registry's nodes", len(held), node)
            return
        for meta, frames in held:
            self._forward(agent, node, meta, frames)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
