"""Registry replies too large for a message header travel as a frame of their own.

A message's header (its op and msgpack meta) is capped at 1 MiB (`aiorl.transport.wire`):
a peer reads it before it knows who sent it, so it must stay small. A ``status`` reply
holds every worker's record (~250 bytes each) and a ``watch`` or ``lookup_group`` reply
every record of a group, so past ~4,000 workers they outgrew the cap and the caller's
endpoint dropped the reply: ``aiorl status`` and a watch of a large group waited until
their timeout (found by benchmarks/bench_registry_scale.py). Such a reply now goes as a
small header, ``{FRAMED_REPLY: size}``, and the msgpack of the reply in one frame; the
client reads it back (`unframe`) and checks it with the same ``from_wire``. Replies that
fit are sent as before, so small clusters and raw clients see no change.
"""

from __future__ import annotations

from typing import Any

import msgpack

from aiorl.errors import ProtocolError
from aiorl.protocol.ops import RegistryOp
from aiorl.transport.wire import MAX_HEADER_BYTES

__all__ = ["FRAMED_REPLY", "INLINE_REPLY_BYTES", "MAY_BE_LARGE", "frame", "unframe"]

#: The header key that says the reply is in the first frame (its value: the frame's size).
FRAMED_REPLY = "framed_reply"
#: Replies up to this size stay in the header: all that fit (the cap less room for the
#: header's other fields), so every client that worked before still reads them inline.
INLINE_REPLY_BYTES = MAX_HEADER_BYTES - 16 * 1024
#: Replies that grow with the number of workers; the others are small by construction.
MAY_BE_LARGE = frozenset({RegistryOp.STATUS, RegistryOp.WATCH, RegistryOp.LOOKUP_GROUP})
#: What one framed reply may hold (a bound for what a client unpacks).
_MAX_FRAMED_BYTES = 1 << 30

_packb = msgpack.Packer(use_bin_type=True).pack


def frame(wire: Any) -> tuple[Any, list[bytes]]:
    """``(meta, frames)`` to reply with: ``wire`` itself when it fits a header, else the
    framed form."""
    packed = _packb(wire)
    if len(packed) <= INLINE_REPLY_BYTES:
        return wire, []
    return {FRAMED_REPLY: len(packed)}, [packed]


def unframe(meta: Any, frames: list[Any]) -> Any:
    """The reply's meta, read back from its frame when the registry framed it."""
    if not (isinstance(meta, dict) and FRAMED_REPLY in meta):
        return meta
    if not frames or len(frames[0]) > _MAX_FRAMED_BYTES:
        raise ProtocolError("a framed registry reply without its frame, or too large")
    try:
        return msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # noqa: BLE001 - garbage from the wire is a protocol error
        raise ProtocolError(f"unreadable framed registry reply: {exc}") from None
