"""Answers for a client whose lane broke, held until it reaches the server again.

A client whose lane breaks carries on through the ZMQ link (aiorl.transport.peer), under the
same routing id. Until that link is up, the server's ROUTER does not know the client, and an
answer sent meanwhile would be dropped (``EHOSTUNREACH``): its request would then fail with
ConnectionLostError although the peer answered. So for `HOLD_S` after a client's lane ended,
answers for it that cannot leave are held here; the client's first message on its new link
(it sends `aiorl.transport.wire.RESUME` at once) takes them out, in order.

Bounded: at most `MAX_MESSAGES` answers and `MAX_BYTES` bytes per client, `MAX_CLIENTS`
clients; what does not fit, and what is still here `HOLD_S` after the lane ended (the client
died, or never came back), is dropped with a rate-limited log line, and its requests end on
the client's side (the verdict, or ConnectionLostError).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["HOLD_S", "MAX_BYTES", "MAX_CLIENTS", "MAX_MESSAGES", "ParkedAnswers"]

log = logging.getLogger("aiorl.transport")
_dropped = RateLimitedLog(log)

#: As long as a client waits for answers on a broken connection (`peer.VERDICT_WAIT_S`).
HOLD_S = 5.0
MAX_MESSAGES = 4096
MAX_BYTES = 64 << 20
MAX_CLIENTS = 1024


class _Held:
    __slots__ = ("messages", "nbytes", "timer")

    def __init__(self, timer: asyncio.TimerHandle) -> None:
        self.messages: list[Sequence[Any]] = []
        self.nbytes = 0
        self.timer = timer


class ParkedAnswers:
    """See the module docstring. Loop thread only."""

    __slots__ = ("name", "loop", "hold_s", "clients")

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop, hold_s: float = HOLD_S) -> None:
        self.name = name
        self.loop = loop
        self.hold_s = hold_s
        #: What is held, by client; empty almost always (the server checks it per message).
        self.clients: dict[bytes, _Held] = {}

    def expect(self, identity: bytes) -> None:
        """``identity``'s lane ended: hold what cannot reach it for `hold_s`."""
        if identity in self.clients:
            return
        if len(self.clients) >= MAX_CLIENTS:
            _dropped.warning("parked clients", "%s: %d clients already wait to come back; "
                             "answers for another are not held", self.name, MAX_CLIENTS)
            return
        timer = self.loop.call_later(self.hold_s, self._expire, identity)
        self.clients[identity] = _Held(timer)

    def park(self, identity: bytes, parts: Sequence[Any]) -> bool:
        """Hold ``parts`` (a whole message) for ``identity``; False if it is not expected
        back, or its share is full (the message is then dropped by the caller)."""
        held = self.clients.get(identity)
        if held is None:
            return False
        size = sum(memoryview(p).nbytes for p in parts)
        if len(held.messages) >= MAX_MESSAGES or held.nbytes + size > MAX_BYTES:
            _dropped.warning("parked full", "%s: answers held for a client whose lane broke "
                             "reached their bound (%d messages, %d bytes): dropped one",
                             self.name, MAX_MESSAGES, MAX_BYTES)
            return False
        held.messages.append(parts)
        held.nbytes += size
        return True

    def take(self, identity: bytes) -> list[Sequence[Any]]:
        """What is held for ``identity``, which is back (and is no longer expected)."""
        held = self.clients.pop(identity, None)
        if held is None:
            return []
        held.timer.cancel()
        return held.messages

    def _expire(self, identity: bytes) -> None:
        held = self.clients.pop(identity, None)
        if held is not None and held.messages:
            _dropped.warning("parked expired", "%s: a client whose lane broke did not come "
                             "back within %g s: dropped %d answer(s) held for it", self.name,
                             self.hold_s, len(held.messages))

    def close(self) -> None:
        for held in self.clients.values():
            held.timer.cancel()
        self.clients.clear()
