"""Point-to-point messages relayed through node agents: O(N) connections for all-to-all.

A worker sends directly to a bounded number of workers on other nodes
(``AIORL_P2P_DIRECT_PEERS``, `aiorl.p2p.p2p_relay`); toward the rest, each p2p control
message (``p2p.data`` or ``p2p.batch``, frames unchanged) goes to its own node agent as
a `RelayedP2P` (worker -> agent -> agent, one-way ``relay_p2p``). The agent of the
destination's node hands it to the worker as a `ViaP2P` (agent -> worker, one-way
``p2p.via``), which the worker's p2p engine serves as the inner message sent by the
original endpoint (``src_identity``: the routing id the receiver would have seen).

Flow control: a relayed pair has two windows, and each has its word relayed back the
other way. Each envelope names its source (``src_node``, ``src_address``); the receiving
worker, as it reads relayed messages, sends the bytes it consumed back to their sender as
``p2p.credit`` (meta ``[bytes]``): the sender keeps at most its credit window
(`aiorl.p2p.p2p_relay.relay_window`) unconsumed, and both agents count what crosses them
toward each receiver from the envelopes and the credits (`aiorl.node.p2p_relay`). As
receives take the messages, it sends how many as ``p2p.taken`` (meta ``[src, count]``, a
`aiorl.protocol.p2p.Taken`), the pair's receive window (`aiorl.p2p.window`), as a direct
pair's receiver does over its connection; the agents pass it on without counting it.
An agent that cannot hand a message to its receiver (no worker of its node serves the
address) sends its sender ``p2p.undelivered`` (meta ``[reason]``) the same way back: the pair
fails with that reason rather than lose the message in silence.
`envelope_bytes` is what both ends count for an envelope: its frames plus a fixed cost, so
that a flood of empty messages is bounded too.

Both are lists, not maps: they travel once per relayed message (or batch). ``from_wire``
checks every field; the agents and the engine drop what does not pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only (postponed)

from aiorl.errors import ProtocolError
from aiorl.protocol.fields import MAX_SHORT
from aiorl.protocol.ops import P2POp
from aiorl.protocol.p2p import Taken

__all__ = ["BACK_OPS", "ENVELOPE_COST", "P2P_CREDIT", "P2P_TAKEN", "P2P_UNDELIVERED", "P2P_VIA",
           "RELAYED_P2P_OPS", "RelayedP2P", "ViaP2P", "envelope_bytes"]

#: The worker op that delivers a relayed message (the p2p engine serves it), as a plain str
#: (an enum member costs msgpack a slow path per message).
P2P_VIA: Final = P2POp.VIA.value
#: Receiver -> sender, relayed: ``[bytes]`` the receiver (``src_address``) consumed: its grant.
P2P_CREDIT: Final = P2POp.CREDIT.value
#: Receiver -> sender, relayed: ``[src, count]``, messages its receives took (a `Taken`).
P2P_TAKEN: Final = P2POp.TAKEN.value
#: Agent -> sender, relayed: ``[reason]``, a message of the pair was not delivered.
P2P_UNDELIVERED: Final = P2POp.UNDELIVERED.value
#: The ops that flow back, receiver -> sender: they carry no message, and the agents never
#: count them as held for the worker they go to.
BACK_OPS: Final = frozenset({P2P_CREDIT, P2P_TAKEN, P2P_UNDELIVERED})
#: The p2p ops that may be relayed: those that need no answer and no set-up, and the
#: windows' words that flow back.
RELAYED_P2P_OPS: Final = frozenset({P2POp.DATA.value, P2POp.BATCH.value, *BACK_OPS})
#: What an envelope costs beyond its frames' bytes in the credit count (its header, and
#: the agent's bookkeeping): a stream of tiny messages is bounded as bytes are.
ENVELOPE_COST: Final = 256
#: The largest grant one credit carries (a sender's window is far below).
_MAX_CREDIT = 1 << 50
#: The longest reason a ``p2p.undelivered`` carries.
_MAX_REASON = 1024


def envelope_bytes(frames: Sequence[Any]) -> int:
    """What a relayed envelope with ``frames`` counts against its pair's credit."""
    n = ENVELOPE_COST
    for f in frames:  # bytes, or a zmq.Frame: len is bytes (as the frames path assumes too)
        n += f.nbytes if type(f) is memoryview else len(f)
    return n


def _text(value: object, message: str, field: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_SHORT:
        raise ProtocolError(f"{message}.{field}: expected a non-empty string of at most "
                            f"{MAX_SHORT} characters, got {type(value).__name__}")
    return value


def _identity(value: object, message: str) -> bytes:
    if not isinstance(value, bytes) or not value or len(value) > MAX_SHORT:
        raise ProtocolError(f"{message}.src_identity: expected a routing id (bytes), "
                            f"got {type(value).__name__}")
    return value


def _inner(op: object, meta: object, message: str) -> str:
    if op not in RELAYED_P2P_OPS:
        raise ProtocolError(f"{message}.op: {op!r} may not be relayed")
    if not isinstance(meta, list):
        raise ProtocolError(f"{message}.meta: expected a list, got {type(meta).__name__}")
    if op == P2P_CREDIT and not (
        len(meta) == 1 and type(meta[0]) is int and 0 < meta[0] <= _MAX_CREDIT
    ):
        raise ProtocolError(f"{message}.meta: a {P2P_CREDIT} is [bytes > 0]")
    if op == P2P_TAKEN:
        Taken.from_wire(meta)  # raises ProtocolError for a malformed count
    if op == P2P_UNDELIVERED and not (
        len(meta) == 1 and isinstance(meta[0], str) and len(meta[0]) <= _MAX_REASON
    ):
        raise ProtocolError(f"{message}.meta: a {P2P_UNDELIVERED} is [reason, at most "
                            f"{_MAX_REASON} characters]")
    assert isinstance(op, str)
    return op


def _fields(meta: object, n: int, message: str) -> list[Any]:
    if not isinstance(meta, (list, tuple)) or len(meta) != n:
        raise ProtocolError(f"{message}: expected a list of {n} fields")
    return list(meta)


@dataclass(frozen=True, slots=True)
class RelayedP2P:
    """Worker -> agent -> agent: deliver the p2p message ``op``/``meta`` (and the frames
    that travel with it) to the worker at ``dst_address`` on node ``dst_node``, from the
    worker at ``src_address`` on ``src_node`` (where its credit goes back)."""

    dst_node: str
    dst_address: str
    src_identity: bytes
    op: str
    meta: list[Any]
    src_node: str
    src_address: str

    def to_wire(self) -> list[Any]:
        return [self.dst_node, self.dst_address, self.src_identity, self.op, self.meta,
                self.src_node, self.src_address]

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        m = _fields(meta, 7, "relay_p2p")
        return cls(
            _text(m[0], "relay_p2p", "dst_node"),
            _text(m[1], "relay_p2p", "dst_address"),
            _identity(m[2], "relay_p2p"),
            _inner(m[3], m[4], "relay_p2p"),
            m[4],
            _text(m[5], "relay_p2p", "src_node"),
            _text(m[6], "relay_p2p", "src_address"),
        )

    def via(self) -> ViaP2P:
        """What the destination's agent hands the worker."""
        return ViaP2P(self.src_identity, self.op, self.meta, self.src_node, self.src_address)


@dataclass(frozen=True, slots=True)
class ViaP2P:
    """Agent -> worker: the p2p message ``op``/``meta`` that ``src_identity`` sent from
    ``src_address`` on ``src_node`` (where the receiver's credit goes)."""

    src_identity: bytes
    op: str
    meta: list[Any]
    src_node: str
    src_address: str

    def to_wire(self) -> list[Any]:
        return [self.src_identity, self.op, self.meta, self.src_node, self.src_address]

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        m = _fields(meta, 5, P2P_VIA)
        return cls(_identity(m[0], P2P_VIA), _inner(m[1], m[2], P2P_VIA), m[2],
                   _text(m[3], P2P_VIA, "src_node"), _text(m[4], P2P_VIA, "src_address"))
