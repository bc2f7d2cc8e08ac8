"""Reading the one-way broadcast messages a worker receives.

A one-way message has nobody to answer, so a malformed one (its ``from_wire`` raised
[`ProtocolError`][aiorl.ProtocolError]) is dropped here, with a warning that names it and why.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, TypeVar

from aiorl.errors import ProtocolError
from aiorl.transport.endpoint import Incoming

__all__ = ["read_oneway"]

log = logging.getLogger("aiorl.collective")

_M = TypeVar("_M", covariant=True)


class _Readable(Protocol[_M]):
    def from_wire(self, meta: Any) -> _M: ...


def read_oneway(kind: _Readable[_M], msg: Incoming, reader: str) -> _M | None:
    """``msg``'s meta as message type ``kind``, or None (logged for worker ``reader``)."""
    try:
        return kind.from_wire(msg.meta)
    except ProtocolError as exc:
        log.warning("%s: dropped a malformed %s message: %s", reader, msg.op, exc)
        return None
