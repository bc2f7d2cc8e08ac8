"""What an endpoint hands its handlers: one received request, one-way message or event, with
the means to answer it (through the endpoint that received it, on the way it came)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from aiorl.errors import to_wire
from aiorl.transport.lane import LaneConnection
from aiorl.transport.wire import Kind

__all__ = ["Incoming"]

# Plain ints on the hot path: comparing IntEnum members costs more than the send itself.
_REQUEST, _REPLY, _ERROR = int(Kind.REQUEST), int(Kind.REPLY), int(Kind.ERROR)


class _Receiver(Protocol):
    """The endpoint that received a message: it sends the answer (`Endpoint._send_router`)."""

    def _send_router(self, identity: bytes, kind: int, request_id: int, op: str, meta: Any,
                     frames: Sequence[Any], lane: LaneConnection | None = None) -> bool: ...


class Incoming:
    """One received request, one-way message or event, with the means to answer it."""

    __slots__ = ("endpoint", "identity", "kind", "request_id", "op", "meta", "frames", "lane",
                 "_answered")

    def __init__(
        self,
        endpoint: _Receiver,
        identity: bytes,
        kind: int,  # a Kind value, as a plain int (see wire.Header)
        request_id: int,
        op: str,
        meta: Any,
        frames: list[Any],
        lane: LaneConnection | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.identity = identity
        self.kind = kind
        self.request_id = request_id
        self.op = op
        self.meta = meta
        self.frames = frames
        #: The lane it came on (None: through the ROUTER): the answer's way back, unless
        #: it broke meanwhile (then the client's lane now, or the ROUTER).
        self.lane = lane
        self._answered = False

    @property
    def expects_reply(self) -> bool:
        return self.kind == _REQUEST

    def reply(self, meta: Any = None, frames: Sequence[Any] = ()) -> None:
        """Answer a request (ignored for one-way messages and after the first answer)."""
        if self.kind != _REQUEST or self._answered:
            return
        self._answered = True
        self.endpoint._send_router(self.identity, _REPLY, self.request_id, self.op, meta, frames,
                                   self.lane)

    def reply_error(self, exc: BaseException, **extra: Any) -> None:
        """Answer a request with an error; ``extra`` lands in the error's meta (e.g. rank)."""
        if self.kind != _REQUEST or self._answered:
            return
        self._answered = True
        self.endpoint._send_router(self.identity, _ERROR, self.request_id, self.op,
                                   to_wire(exc, **extra), (), self.lane)
