"""The node agent's half of relayed point-to-point messages (`aiorl.protocol.p2p_relay`).

A worker beyond its direct-connection budget (`aiorl.p2p.relay`) sends its p2p control
messages to its own agent as ``relay_p2p``. The agent forwards each, frames unchanged (no
copy: ZMQ sends the received frames on), either to the destination as ``p2p.via`` (the
destination is on this node) or, as the same ``relay_p2p``, to the agent of the
destination's node, from the registry's node list (watched: pushed on every change).
Forwarding is synchronous and in arrival order, and messages for a node the list does
not show yet wait, in order, behind one look-up: one pair's messages keep their order
(docs/ordering.md). Credits (``p2p.credit``: what a receiver consumed) take the same
way back to the sender.

What an agent holds is bounded by the pairs' flow control, not by this module: a relayed
sender has at most its window (``AIORL_P2P_RELAY_WINDOW``) unconsumed, so an agent holds at
most that much per pair that crosses it, toward a receiver that does not read or a node
that does not drain. The agent counts it (`P2PRelay.held`: bytes forwarded toward each
receiver and not yet granted back) from the envelopes and credits that cross it.

Rules for what cannot be forwarded (nothing here answers, and nothing is opened for it):

* a malformed envelope is dropped (logged at a bounded rate);
* an envelope for a worker of this node that the agent does not know (never started here,
  or exited) is dropped: no connection is made to an address nobody serves;
* an envelope for a node the registry does not list is held (bounded in bytes, one
  look-up at a time for all such nodes) until the list is refreshed, then forwarded or
  dropped;
* a node the registry declares dead (it leaves the watched list, and its agent does not
  answer a ping) has its agent's connection closed at once (`Endpoint.mark_peer_lost`):
  what was queued toward it is freed, and what this agent counted toward its workers is
  forgotten. The senders learn of the death from the registry, as for a direct pair.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from aiorl.errors import ProtocolError
from aiorl.protocol.ops import AgentOp
from aiorl.protocol.p2p_relay import P2P_CREDIT, P2P_VIA, RelayedP2P, envelope_bytes
from aiorl.protocol.registry import NodeInfo
from aiorl.transport.endpoint import Endpoint, Incoming
from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["P2PRelay"]

log = logging.getLogger("aiorl.node")
_warn = RateLimitedLog(log)

#: The agent op as a plain str (an enum member costs msgpack a slow path per message).
_RELAY_P2P: str = AgentOp.RELAY_P2P.value
#: Bytes held, over all nodes, while the node list is looked up for nodes it does not show;
#: beyond, messages are dropped: a registry that does not answer, or envelopes naming
#: nodes that do not exist, must not grow the agent. One relayed window's worth (8 MiB)
#: times a few senders.
MAX_HELD_BYTES = 32 << 20
#: A node that left the registry's list is pinged before its connection is closed: a
#: registry that restarted lists a live node again only once it re-registered. Its agent
#: answers within this, or it is dead (the close frees what was queued toward it).
GONE_PING_S = 0.5


class P2PRelay:
    """Serves ``relay_p2p`` on a node agent's endpoint.

    ``is_local(address)``: whether a worker of this node serves ``address`` now.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        node_id: str,
        list_nodes: Callable[[], Awaitable[Sequence[NodeInfo]]],
        is_local: Callable[[str], bool] = lambda _address: True,
    ) -> None:
        self.endpoint = endpoint
        self.node_id = node_id
        self._list_nodes = list_nodes
        self._is_local = is_local
        #: Node id -> its agent's endpoint, from the registry's node list.
        self._agents: dict[str, str] = {}
        #: Messages for nodes not (yet) in the list, in arrival order, and their bytes.
        self._held: list[tuple[str, Any, list[Any], int]] = []
        self._held_bytes = 0
        self._look_up_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Receiver address -> [its node, bytes forwarded toward it not yet granted back].
        self.held: dict[str, list[Any]] = {}
        #: The sum of `held`'s bytes.
        self.held_total = 0

    # ------------------------------------------------------------------ forwarding
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
        agent = self._agents.get(node)
        if agent is None or self._held:  # not listed, or others wait: keep the order
            self._hold(node, msg.meta, msg.frames)
            return
        self._forward(agent, relayed, msg.meta, msg.frames)

    def _deliver(self, relayed: RelayedP2P, frames: list[Any]) -> None:
        """To the destination worker on this node, as if its sender had sent it."""
        address = relayed.dst_address
        if relayed.op == P2P_CREDIT:
            self._granted(relayed)
        if not self._is_local(address):
            _warn.warning("relay_p2p_unknown", "dropped a relayed p2p message for %s: no worker "
                          "of this node serves that address", address)
            return
        try:
            self.endpoint.send_oneway(address, P2P_VIA, relayed.via().to_wire(), frames)
        except Exception as exc:  # noqa: BLE001 - a worker that is gone: its senders hear from the registry
            _warn.warning("relay_p2p_deliver", "dropped a p2p message for %s: %s", address, exc)
            return
        if relayed.op != P2P_CREDIT:
            self._count(address, relayed.dst_node, envelope_bytes(frames))

    def _forward(self, agent: str, relayed: RelayedP2P, meta: Any, frames: list[Any]) -> None:
        """To the agent of the destination's node, unchanged."""
        try:
            self.endpoint.send_oneway(agent, _RELAY_P2P, meta, frames)
        except Exception as exc:  # noqa: BLE001 - a node that is gone: so are its workers
            _warn.warning("relay_p2p_forward", "dropped a p2p message for node %s: %s",
                          relayed.dst_node, exc)
            return
        if relayed.op == P2P_CREDIT:
            self._granted(relayed)
        else:
            self._count(relayed.dst_address, relayed.dst_node, envelope_bytes(frames))

    # ------------------------------------------------------------------ accounting
    def _count(self, receiver: str, node: str, nbytes: int) -> None:
        entry = self.held.get(receiver)
        if entry is None:
            self.held[receiver] = [node, nbytes]
        else:
            entry[1] += nbytes
        self.held_total += nbytes

    def _granted(self, credit: RelayedP2P) -> None:
        """A receiver's credit crossed this agent: what it consumed is no longer held here."""
        entry = self.held.get(credit.src_address)
        if entry is None:
            return
        nbytes = min(entry[1], credit.meta[1])
        entry[1] -= nbytes
        self.held_total -= nbytes
        if entry[1] == 0:
            del self.held[credit.src_address]

    def forget(self, receivers: Iterable[str]) -> None:
        """These receivers are gone: nothing more is held toward them."""
        for address in receivers:
            entry = self.held.pop(address, None)
            if entry is not None:
                self.held_total -= entry[1]

    # ------------------------------------------------------------------ nodes
    def on_nodes(self, nodes: list[dict[str, Any]]) -> None:
        """The registry's node list changed (watched): forward to the listed agents, and
        close the connection to any that left it and does not answer (dead)."""
        agents = {n["node_id"]: n["endpoint"] for n in nodes
                  if isinstance(n, dict) and isinstance(n.get("node_id"), str)
                  and isinstance(n.get("endpoint"), str)}
        gone = {node: address for node, address in self._agents.items()
                if agents.get(node) != address}
        self._agents = agents
        for node, address in gone.items():
            self._spawn(self._confirm_gone(node, address))
        if self._held and self._look_up_task is None:
            self._release_held()

    async def _confirm_gone(self, node: str, address: str) -> None:
        try:
            await self.endpoint.request(address, AgentOp.PING.value, None, timeout=GONE_PING_S)
        except Exception:  # noqa: BLE001 - no answer: it is dead
            self._node_dead(node, address)

    def _node_dead(self, node: str, address: str) -> None:
        if self._agents.get(node) == address:
            return  # listed again meanwhile (a registry that restarted)
        self.endpoint.mark_peer_lost(address, f"node {node} is dead")
        self.forget([r for r, (n, _b) in self.held.items() if n == node])
        log.info("node %s is dead: closed the relay connection to its agent", node)

    def _hold(self, node: str, meta: Any, frames: list[Any]) -> None:
        nbytes = envelope_bytes(frames)
        if self._held_bytes + nbytes > MAX_HELD_BYTES:
            _warn.warning("relay_p2p_held", "dropped a p2p message for node %s: %d bytes wait "
                          "for nodes the registry does not list", node, self._held_bytes)
            return
        self._held.append((node, meta, frames, nbytes))
        self._held_bytes += nbytes
        if self._look_up_task is None:
            self._look_up_task = self._spawn(self._look_up())

    async def _look_up(self) -> None:
        """Refresh the node list, then forward what waited, in order."""
        try:
            nodes = await self._list_nodes()
        except Exception as exc:  # noqa: BLE001 - what waited is dropped below
            _warn.warning("relay_p2p_nodes", "cannot list the nodes: %s", exc)
        else:
            self._agents.update({n.node_id: n.endpoint for n in nodes})
        finally:
            self._look_up_task = None
        self._release_held(drop_unknown=True)

    def _release_held(self, drop_unknown: bool = False) -> None:
        held, self._held, self._held_bytes = self._held, [], 0
        for i, (node, meta, frames, _nbytes) in enumerate(held):
            agent = self._agents.get(node)
            if agent is None:
                if not drop_unknown:  # keep this and what follows, in order
                    for rest in held[i:]:
                        self._held.append(rest)
                        self._held_bytes += rest[3]
                    return
                _warn.warning("relay_p2p_node", "dropped a p2p message for node %s: not among "
                              "the registry's nodes", node)
                continue
            self._forward(agent, RelayedP2P.from_wire(meta), meta, frames)

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
