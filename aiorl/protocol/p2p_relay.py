"""Point-to-point messages relayed through node agents: O(N) connections for all-to-all.

A worker sends directly to a bounded number of workers on other nodes
(``AIORL_P2P_DIRECT_PEERS``, `aiorl.p2p.relay`); toward the rest, each p2p control
message (``p2p.data`` or ``p2p.batch``, frames unchanged) goes to its own node agent as
a `RelayedP2P` (worker -> agent -> agent, one-way ``relay_p2p``). The agent of the
destination's node hands it to the worker as a `ViaP2P` (agent -> worker, one-way
``p2p.via``), which the worker's p2p engine serves as the inner message sent by the
original endpoint (``src_identity``: the routing id the receiver would have seen).

Both are lists, not maps: they travel once per relayed message (or batch). ``from_wire``
checks every field; the agents and the engine drop what does not pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only (postponed)

from aiorl.errors import ProtocolError
from aiorl.protocol.fields import MAX_SHORT

__all__ = ["P2P_VIA", "RELAYED_P2P_OPS", "RelayedP2P", "ViaP2P"]

#: The worker op that delivers a relayed message (the p2p engine serves it).
P2P_VIA: Final = "p2p.via"
#: The p2p ops that may be relayed: those that need no answer and no set-up (the wire
#: names of ``aiorl.p2p.proto.OP_DATA`` and ``OP_BATCH``; a test checks they agree).
RELAYED_P2P_OPS: Final = frozenset({"p2p.data", "p2p.batch"})


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
    assert isinstance(op, str)
    return op


def _fields(meta: object, n: int, message: str) -> list[Any]:
    if not isinstance(meta, (list, tuple)) or len(meta) != n:
        raise ProtocolError(f"{message}: expected a list of {n} fields")
    return list(meta)


@dataclass(frozen=True, slots=True)
class RelayedP2P:
    """Worker -> agent -> agent: deliver the p2p message ``op``/``meta`` (and the frames
    that travel with it) to the worker at ``dst_address`` on node ``dst_node``."""

    dst_node: str
    dst_address: str
    src_identity: bytes
    op: str
    meta: list[Any]

    def to_wire(self) -> list[Any]:
        return [self.dst_node, self.dst_address, self.src_identity, self.op, self.meta]

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        m = _fields(meta, 5, "relay_p2p")
        return cls(
            _text(m[0], "relay_p2p", "dst_node"),
            _text(m[1], "relay_p2p", "dst_address"),
            _identity(m[2], "relay_p2p"),
            _inner(m[3], m[4], "relay_p2p"),
            m[4],
        )

    def via(self) -> ViaP2P:
        """What the destination's agent hands the worker."""
        return ViaP2P(self.src_identity, self.op, self.meta)


@dataclass(frozen=True, slots=True)
class ViaP2P:
    """Agent -> worker: the p2p message ``op``/``meta`` that ``src_identity`` sent."""

    src_identity: bytes
    op: str
    meta: list[Any]

    def to_wire(self) -> list[Any]:
        return [self.src_identity, self.op, self.meta]

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        m = _fields(meta, 3, P2P_VIA)
        return cls(_identity(m[0], P2P_VIA), _inner(m[1], m[2], P2P_VIA), m[2])
