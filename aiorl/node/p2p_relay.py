"""The node agent's half of relayed point-to-point messages (`aiorl.protocol.p2p_relay`).

A worker beyond its direct-connection budget (`aiorl.p2p.p2p_relay`) sends its p2p control
messages to its own agent as ``relay_p2p``. The agent forwards each, frames unchanged (no
copy: ZMQ sends the received frames on), either to the destination as ``p2p.via`` (the
destination is on this node) or, as the same ``relay_p2p``, to the agent of the
destination's node, from the registry's node list (watched: pushed on every change).
Forwarding is synchronous and in arrival order, and messages for a node the list does
not show yet wait, in order, behind one look-up: one pair's messages keep their order
(docs/ordering.md). Credits (``p2p.credit``: bytes a receiver consumed) and counts of
messages taken (``p2p.taken``: the pair's receive window) take the same way back to the
sender; only credits are counted (below), and only they are ever kept back.

**Bounds.** Every relayed pair is credit-based (`aiorl.p2p.p2p_relay`): its sender has at most
its window unconsumed. The agent counts, from the envelopes and credits that cross it,
what it forwarded toward each receiver that the receiver has not consumed (`held`, per
pair): an upper bound on what it holds for that receiver. While that count is over
``AIORL_NODE_RELAY_DEST_BYTES`` for a receiver, or over ``AIORL_NODE_RELAY_BYTES`` in all
(`RelayBounds`), the credits that cross the agent toward the senders are kept back
(one count per pair) and passed on, oldest first, as the receivers consume: the senders
wait, and the agent never adds to what it holds past its bounds beyond the credit the
senders already had (one window per pair, at most).

**Rules for what cannot be forwarded** (nothing here answers, and nothing is opened):

* a malformed envelope is dropped (logged at a bounded rate);
* an envelope for a worker of this node that the agent does not know is held, in order
  behind any other held for that address, while a worker of this node is starting (its
  ready message may come after a peer's first message: they travel on other connections),
  up to ``HOLD_FOR_READY_S`` and ``MAX_HELD_FOR_READY_BYTES`` in all, and handed over when
  that address says it is ready. Otherwise (nobody starting, held too long, no room) it
  is dropped, its bytes are granted back to its sender (the agents between count them no
  longer), and its sender is told ``p2p.undelivered``: the pair fails with a
  `PeerLostError` naming why, never in silence. No connection is made to an address
  nobody serves;
* a credit or a count taken for a sender of this node that exited is dropped and counted
  (a sender's last credits often come back after its end); one for an address the agent
  never knew is held the same way while a worker is starting, else dropped and counted in
  a warning. A message for a receiver that exited fails its pair at once, as above, without
  a warning (its senders learn of the death from the registry too);
* an envelope for a node the registry does not list is held (bounded in bytes, one
  look-up at a time for all such nodes) until the list is refreshed, then forwarded or
  dropped;
* a worker of this node that exits: what was counted toward it is granted back to its
  senders, and credits kept back for it go on, so the agents between stop counting it;
* a node the registry declares dead (it leaves the watched list, and its agent does not
  answer a ping) has its agent's connection closed at once (`Endpoint.mark_peer_lost`):
  what was queued toward it is freed, and what was counted or kept back for its workers
  is forgotten. The senders learn of the death from the registry, as for a direct pair.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiorl.errors import ProtocolError
from aiorl.node.node_workers import HOLD_FOR_READY_S
from aiorl.protocol.ops import AgentOp
from aiorl.protocol.p2p_relay import (
    BACK_OPS,
    P2P_CREDIT,
    P2P_UNDELIVERED,
    P2P_VIA,
    RelayedP2P,
    envelope_bytes,
)
from aiorl.protocol.registry import NodeInfo
from aiorl.transport.endpoint import Endpoint, Incoming
from aiorl.util.ratelimit import RateLimitedLog
from aiorl.util.settings import count_setting

__all__ = ["DEFAULT_DEST_BYTES", "DEFAULT_TOTAL_BYTES", "P2PRelay", "RelayBounds"]

log = logging.getLogger("aiorl.node")
_warn = RateLimitedLog(log)

#: The agent op as a plain str (an enum member costs msgpack a slow path per message).
_RELAY_P2P: str = AgentOp.RELAY_P2P.value
#: Per receiver: 64 MiB, eight relayed windows (8 MiB each) in flight toward one worker.
#: One sender streams at full speed within its own window; eight senders toward a worker
#: that does not read leave at most this in the agent.
DEFAULT_DEST_BYTES = 64 << 20
#: In all: 256 MiB, so that an agent next to its workers stays far below a node's memory
#: while four receivers' worth of relayed traffic is in flight through it.
DEFAULT_TOTAL_BYTES = 256 << 20
#: Bytes held, over all nodes, while the node list is looked up for nodes it does not show;
#: beyond, messages are dropped: a registry that does not answer, or envelopes naming
#: nodes that do not exist, must not grow the agent.
MAX_UNLISTED_BYTES = 32 << 20
#: A node that left the registry's list is pinged before its connection is closed: a
#: registry that restarted lists a live node again only once it re-registered. Its agent
#: answers within this, or it is dead (the close frees what was queued toward it).
GONE_PING_S = 0.5
#: Bytes held, over all such addresses, while they wait for a worker's ready message.
MAX_HELD_FOR_READY_BYTES = 32 << 20


@dataclass(frozen=True)
class RelayBounds:
    """What an agent lets itself hold for relayed pairs (see the module docstring)."""

    dest_bytes: int = DEFAULT_DEST_BYTES
    total_bytes: int = DEFAULT_TOTAL_BYTES

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> RelayBounds:
        """``AIORL_NODE_RELAY_DEST_BYTES`` and ``AIORL_NODE_RELAY_BYTES``, else the defaults.

        Raises ValueError naming the variable for a value that is not a positive integer:
        a typo must not lift the bound an agent relies on (or stop every relayed pair).
        """
        values = []
        for name, default in (("AIORL_NODE_RELAY_DEST_BYTES", DEFAULT_DEST_BYTES),
                              ("AIORL_NODE_RELAY_BYTES", DEFAULT_TOTAL_BYTES)):
            value = count_setting(environ, name, default, "a byte count")
            if value == 0:
                raise ValueError(f"{name} must be > 0 bytes (0 would stop every relayed pair)")
            values.append(value)
        return cls(values[0], values[1])


class _Receiver:
    """What one receiver has crossing this agent: per sender (node, address), bytes
    forwarded toward it and not yet consumed."""

    __slots__ = ("node", "total", "pairs")

    def __init__(self, node: str) -> None:
        self.node = node
        self.total = 0
        self.pairs: dict[tuple[str, str], int] = {}


class _Held:
    """Messages for one address no worker of this node serves yet, in arrival order."""

    __slots__ = ("messages", "timer")

    def __init__(self, timer: asyncio.TimerHandle) -> None:
        self.messages: list[tuple[RelayedP2P, list[Any], int]] = []
        self.timer = timer


class P2PRelay:
    """Serves ``relay_p2p`` on a node agent's endpoint.

    ``is_local(address)``: whether a worker of this node serves ``address`` now;
    ``starting()``: whether a worker of this node is starting (has not said where it
    listens yet); ``exited(address)``: whether a worker of this node that served
    ``address`` exited. The agent calls `worker_ready` when one says where it listens.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        node_id: str,
        list_nodes: Callable[[], Awaitable[Sequence[NodeInfo]]],
        is_local: Callable[[str], bool] = lambda _address: True,
        bounds: RelayBounds | None = None,
        starting: Callable[[], bool] = lambda: False,
        exited: Callable[[str], bool] = lambda _address: False,
    ) -> None:
        self.endpoint = endpoint
        self.node_id = node_id
        self._list_nodes = list_nodes
        self._is_local = is_local
        self._starting = starting
        self._exited = exited
        #: Address -> what waits for a worker of this node to say it serves it.
        self._held_for_ready: dict[str, _Held] = {}
        self._held_for_ready_bytes = 0
        #: Messages this agent could not hand to a worker of its node (their senders were
        #: told), and credits or counts for senders it did not know (dropped).
        self.undelivered = 0
        self.stray_back = 0
        self.bounds = bounds or RelayBounds.from_environment()
        #: Node id -> its agent's endpoint, from the registry's node list.
        self._agents: dict[str, str] = {}
        #: Messages for nodes not (yet) in the list, in arrival order, and their bytes.
        self._unlisted: list[tuple[str, Any, list[Any], int]] = []
        self._unlisted_bytes = 0
        self._look_up_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Receiver address -> what crosses this agent toward it, not consumed yet.
        self.held: dict[str, _Receiver] = {}
        #: The sum over `held`.
        self.held_total = 0
        #: Envelopes handled so far (the agent trims its memory once this stops moving).
        self.moved = 0
        #: Credits kept back while over a bound, oldest first: (receiver address, sender
        #: node, sender address) -> [the credit's envelope, bytes]; one entry per pair.
        self.kept: dict[tuple[str, str, str], list[Any]] = {}

    # ------------------------------------------------------------------ forwarding
    def on_relay_p2p(self, msg: Incoming) -> None:
        self.moved += 1
        try:
            relayed = RelayedP2P.from_wire(msg.meta)
        except ProtocolError as exc:
            _warn.warning("relay_p2p", "dropped a malformed relay_p2p: %s", exc)
            return
        if relayed.op == P2P_CREDIT:
            self._on_credit(relayed)
            return
        if relayed.op in BACK_OPS:  # a count of messages taken: nothing held, nothing kept
            self._pass_back(relayed)
            return
        node = relayed.dst_node
        if node == self.node_id:
            self._deliver(relayed, msg.frames)
            return
        agent = self._agents.get(node)
        if agent is None or self._unlisted:  # not listed, or others wait: keep the order
            self._hold_unlisted(node, msg.meta, msg.frames)
            return
        self._forward(agent, relayed, msg.meta, msg.frames)

    def _deliver(self, relayed: RelayedP2P, frames: list[Any]) -> None:
        """To the destination worker on this node, as if its sender had sent it."""
        address = relayed.dst_address
        nbytes = envelope_bytes(frames)
        if address in self._held_for_ready or not self._is_local(address):
            if self._exited(address):
                self._undeliverable(relayed, nbytes, "its receiver exited")
            elif not self._hold_for_ready(relayed, frames, nbytes):
                self._undeliverable(relayed, nbytes, "no worker of that node serves the "
                                    "address (it exited, or never started)")
            return
        try:
            self.endpoint.send_oneway(address, P2P_VIA, relayed.via().to_wire(), frames)
        except Exception as exc:  # noqa: BLE001 - a worker that is gone
            self._undeliverable(relayed, nbytes, f"its node agent could not pass it on: {exc}")
            return
        self._count(relayed, nbytes)

    def _undeliverable(self, relayed: RelayedP2P, nbytes: int, why: str) -> None:
        """``relayed`` cannot reach its receiver: its bytes go back to its sender's window,
        and its sender is told, so the pair fails instead of waiting for an answer."""
        self.undelivered += 1
        if self._exited(relayed.dst_address):  # a receiver's death: its senders learn it
            log.debug("a relayed p2p message from %s to %s: %s; its sender is told",
                      relayed.src_address, relayed.dst_address, why)
        else:
            _warn.warning("relay_p2p_undelivered", "could not deliver a relayed p2p message "
                          "from %s to %s: %s; its sender is told", relayed.src_address,
                          relayed.dst_address, why)
        self._bounce(relayed, nbytes)
        reason = (f"a message to {relayed.dst_address} was not delivered by the node agent of "
                  f"node {self.node_id}: {why}")[:1024]
        self._pass_back(RelayedP2P(relayed.src_node, relayed.src_address, self.endpoint.identity,
                                   P2P_UNDELIVERED, [reason], self.node_id, relayed.dst_address))

    # ------------------------------------------------------------------ workers starting
    def _hold_for_ready(self, relayed: RelayedP2P, frames: list[Any], nbytes: int) -> bool:
        """Keep ``relayed`` for its address while a worker of this node is starting; False:
        nothing is starting, or the bound is reached (the caller drops it)."""
        address = relayed.dst_address
        held = self._held_for_ready.get(address)
        if self._held_for_ready_bytes + nbytes > MAX_HELD_FOR_READY_BYTES:
            self._release_held(address, False)  # in order: what waited before it goes first
            return False
        if held is None:
            if not self._starting():
                return False
            timer = asyncio.get_running_loop().call_later(
                HOLD_FOR_READY_S, self._release_held, address, False)
            held = self._held_for_ready[address] = _Held(timer)
        held.messages.append((relayed, frames, nbytes))
        self._held_for_ready_bytes += nbytes
        return True

    def worker_ready(self, address: str) -> None:
        """A worker of this node said it serves ``address``: what waited for it goes on."""
        if address in self._held_for_ready:
            self._release_held(address, True)

    def _release_held(self, address: str, ready: bool) -> None:
        held = self._held_for_ready.pop(address, None)
        if held is None:
            return
        held.timer.cancel()
        for relayed, frames, nbytes in held.messages:
            self._held_for_ready_bytes -= nbytes
            if relayed.op in BACK_OPS:
                if ready:
                    self._pass_back(relayed)
                else:
                    self.stray_back += 1
                    _warn.warning("relay_p2p_stray", "dropped a %s for %s: no worker of this "
                                  "node served that address within %g s", relayed.op, address,
                                  HOLD_FOR_READY_S)
            elif ready:
                self._deliver(relayed, frames)
            else:
                self._undeliverable(relayed, nbytes, "no worker of that node served the address "
                                    f"within {HOLD_FOR_READY_S:g} s")

    def _forward(self, agent: str, relayed: RelayedP2P, meta: Any, frames: list[Any]) -> None:
        """To the agent of the destination's node, unchanged."""
        try:
            self.endpoint.send_oneway(agent, _RELAY_P2P, meta, frames)
        except Exception as exc:  # noqa: BLE001 - a node that is gone: so are its workers
            _warn.warning("relay_p2p_forward", "dropped a p2p message for node %s: %s",
                          relayed.dst_node, exc)
            return
        if relayed.op not in BACK_OPS:
            self._count(relayed, envelope_bytes(frames))

    # ------------------------------------------------------------------ credit
    def _on_credit(self, credit: RelayedP2P) -> None:
        """A receiver (``src_*``) consumed bytes its sender (``dst_*``) sent: they no longer
        cross this agent. The credit goes on toward the sender unless this agent is over a
        bound, in which case it waits here (counted into the pair's one entry)."""
        receiver = credit.src_address
        self._uncount(receiver, (credit.dst_node, credit.dst_address), credit.meta[0])
        if self.kept or self._over(receiver):
            key = (receiver, credit.dst_node, credit.dst_address)
            kept = self.kept.get(key)
            if kept is None:
                self.kept[key] = [credit, credit.meta[0]]
            else:
                kept[1] += credit.meta[0]
        else:
            self._pass_credit(credit, credit.meta[0])
        if self.kept:
            self._release_kept()

    def _over(self, receiver: str) -> bool:
        entry = self.held.get(receiver)
        return (self.held_total >= self.bounds.total_bytes
                or (entry is not None and entry.total >= self.bounds.dest_bytes))

    def _release_kept(self) -> None:
        """Pass on kept credits, oldest first, for receivers no longer over their bound
        (all wait while the total is over)."""
        for key in list(self.kept):
            if self.held_total >= self.bounds.total_bytes:
                return
            if self._over(key[0]):
                continue
            credit, nbytes = self.kept.pop(key)
            self._pass_credit(credit, nbytes)

    def _pass_credit(self, credit: RelayedP2P, nbytes: int) -> None:
        if nbytes != credit.meta[0]:
            credit = RelayedP2P(credit.dst_node, credit.dst_address, credit.src_identity,
                                P2P_CREDIT, [nbytes], credit.src_node, credit.src_address)
        self._pass_back(credit)

    def _pass_back(self, back: RelayedP2P) -> None:
        """``back`` (a credit, or a count of messages taken) on toward its sender."""
        node = back.dst_node
        if node == self.node_id:
            address = back.dst_address
            if address in self._held_for_ready or not self._is_local(address):
                if self._exited(address):  # the last credits of a sender that ended: expected
                    self.stray_back += 1
                elif not self._hold_for_ready(back, [], 0):
                    self.stray_back += 1
                    _warn.warning("relay_p2p_stray", "dropped a %s for %s: no worker of this "
                                  "node serves that address", back.op, address)
                return
            try:
                self.endpoint.send_oneway(address, P2P_VIA, back.via().to_wire())
            except Exception as exc:  # noqa: BLE001 - a worker that is gone
                self.stray_back += 1
                _warn.warning("relay_p2p_deliver", "dropped a %s for %s: %s", back.op,
                              address, exc)
            return
        agent = self._agents.get(node)
        if agent is None:  # a node that joined a moment ago: the look-up finds it, or drops it
            self._hold_unlisted(node, back.to_wire(), [])
            return
        self._forward(agent, back, back.to_wire(), [])

    def _bounce(self, data: RelayedP2P, nbytes: int) -> None:
        """Grant ``data``'s bytes back to its sender, as if its receiver had consumed them:
        it was dropped, and the agents it crossed must stop counting it."""
        credit = RelayedP2P(data.src_node, data.src_address, self.endpoint.identity, P2P_CREDIT,
                            [nbytes], data.dst_node, data.dst_address)
        self._on_credit(credit)

    # ------------------------------------------------------------------ accounting
    def _count(self, data: RelayedP2P, nbytes: int) -> None:
        receiver = self.held.get(data.dst_address)
        if receiver is None:
            receiver = self.held[data.dst_address] = _Receiver(data.dst_node)
        pair = (data.src_node, data.src_address)
        receiver.pairs[pair] = receiver.pairs.get(pair, 0) + nbytes
        receiver.total += nbytes
        self.held_total += nbytes

    def _uncount(self, address: str, pair: tuple[str, str], nbytes: int) -> None:
        receiver = self.held.get(address)
        if receiver is None:
            return
        held = receiver.pairs.get(pair)
        if held is None:
            return
        nbytes = min(held, nbytes)
        if held == nbytes:
            del receiver.pairs[pair]
        else:
            receiver.pairs[pair] = held - nbytes
        receiver.total -= nbytes
        self.held_total -= nbytes
        if not receiver.pairs:
            del self.held[address]

    def worker_exited(self, address: str) -> None:
        """A worker of this node exited: what was counted toward it is granted back to its
        senders, and credits kept back for it go on now, so that the agents between stop
        counting bytes it will never consume."""
        for key in [k for k in self.kept if k[0] == address]:
            credit, nbytes = self.kept.pop(key)
            self._pass_credit(credit, nbytes)
        receiver = self.held.pop(address, None)
        if receiver is not None:
            self.held_total -= receiver.total
            for (node, sender), nbytes in receiver.pairs.items():
                self._pass_credit(RelayedP2P(node, sender, self.endpoint.identity, P2P_CREDIT,
                                             [nbytes], self.node_id, address), nbytes)
        if self.kept:
            self._release_kept()

    def forget(self, receivers: Iterable[str]) -> None:
        """These receivers are gone: nothing more is counted or kept for them."""
        gone = set(receivers)
        for address in gone:
            receiver = self.held.pop(address, None)
            if receiver is not None:
                self.held_total -= receiver.total
        for key in [k for k in self.kept if k[0] in gone]:
            del self.kept[key]
        if self.kept:
            self._release_kept()

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

    async def _confirm_gone(self, node: str, address: str) -> None:
        try:
            await self.endpoint.request(address, AgentOp.PING.value, None, timeout=GONE_PING_S)
        except Exception:  # noqa: BLE001 - no answer: it is dead
            self._node_dead(node, address)

    def _node_dead(self, node: str, address: str) -> None:
        if self._agents.get(node) == address:
            return  # listed again meanwhile (a registry that restarted)
        self.endpoint.mark_peer_lost(address, f"node {node} is dead")
        self.forget([r for r, entry in self.held.items() if entry.node == node])
        for key in [k for k, (credit, _n) in self.kept.items() if credit.dst_node == node]:
            del self.kept[key]  # toward senders of that node
        log.info("node %s is dead: closed the relay connection to its agent", node)

    def _hold_unlisted(self, node: str, meta: Any, frames: list[Any]) -> None:
        nbytes = envelope_bytes(frames)
        if self._unlisted_bytes + nbytes > MAX_UNLISTED_BYTES:
            _warn.warning("relay_p2p_held", "dropped a p2p message for node %s: %d bytes wait "
                          "for nodes the registry does not list", node, self._unlisted_bytes)
            return
        self._unlisted.append((node, meta, frames, nbytes))
        self._unlisted_bytes += nbytes
        if self._look_up_task is None:
            self._look_up_task = self._spawn(self._look_up())

    async def _look_up(self) -> None:
        """Refresh the node list, then forward what waited, in order (or drop it)."""
        try:
            nodes = await self._list_nodes()
        except Exception as exc:  # noqa: BLE001 - what waited is dropped below
            _warn.warning("relay_p2p_nodes", "cannot list the nodes: %s", exc)
        else:
            self._agents.update({n.node_id: n.endpoint for n in nodes})
        finally:
            self._look_up_task = None
        waited, self._unlisted, self._unlisted_bytes = self._unlisted, [], 0
        for node, meta, frames, _nbytes in waited:
            agent = self._agents.get(node)
            if agent is None:
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
        for held in self._held_for_ready.values():
            held.timer.cancel()
        self._held_for_ready.clear()
        self._held_for_ready_bytes = 0
