"""The node agent's half of a relayed group call (`aiorl.protocol.call_relay`).

A driver calling a large group sends one ``relay_call`` per node instead of one ``call``
per rank; the agent sends each of its ranks the ordinary worker ``call`` and answers the
driver once, when every one of them has answered. The driver's cost of a call then grows
with the number of nodes, not of workers (docs/scale.md).

A rank's process that ends while its call is pending fails that rank only: the agent sees
the exit (`CallRelay.worker_exited`) and fails what is pending on the worker's endpoint,
so the driver's answer comes without waiting for the registry's news.

A rank that no worker of this node serves (no such worker here, it exited, or the endpoint
is not the one it reported) fails at once with `PeerLostError`: no connection is opened to
an address nobody serves (it would never answer, and never close), and the call's frames
are not kept for it. A rank whose worker is starting and has not told the agent where it
listens yet (a worker tells its agent before the registry, but on another connection) waits
for that report, up to ``HOLD_FOR_READY_S``: then it is called if the endpoint is that
worker's, and fails with `PeerLostError` otherwise, or if the report does not come in time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from aiorl.errors import PeerLostError, ProtocolError, to_wire
from aiorl.node.node_workers import HOLD_FOR_READY_S
from aiorl.protocol.call_relay import RelayedAnswers, RelayedCall
from aiorl.protocol.ops import WorkerOp
from aiorl.transport.endpoint import Endpoint, Incoming
from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["CallRelay"]

log = logging.getLogger("aiorl.node")
_warn = RateLimitedLog(log)

#: The worker call op as a plain str (an enum member costs a look-up per rank).
_CALL: str = WorkerOp.CALL.value


class _Gathered:
    """One relayed call's answers, in the request's order, until the last rank answered."""

    __slots__ = ("msg", "frames", "errors", "remaining")

    def __init__(self, msg: Incoming, n: int) -> None:
        self.msg = msg
        self.frames: list[list[Any]] = [[] for _ in range(n)]
        self.errors: dict[int, dict[str, Any]] = {}
        self.remaining = n

    def settle(self, i: int, error: BaseException | None, reply: Any) -> None:
        if error is not None:
            self.errors[i] = to_wire(error)
        else:
            self.frames[i] = reply[1]
        self.remaining -= 1
        if self.remaining == 0:
            counts = tuple(0 if i in self.errors else len(f) for i, f in enumerate(self.frames))
            flat = [frame for frames in self.frames for frame in frames]
            try:
                self.msg.reply(RelayedAnswers(counts, self.errors).to_wire(), flat)
            except Exception as exc:  # noqa: BLE001 - e.g. many long tracebacks past the
                # header's cap: the driver must still hear, and each of these ranks fails
                self.msg.reply_error(exc)


class CallRelay:
    """Serves ``relay_call`` on a node agent's endpoint."""

    def __init__(self, endpoint: Endpoint,
                 serves: Callable[[str, str], bool | None] = lambda _n, _e: None) -> None:
        self.endpoint = endpoint
        #: serves(name, endpoint): True / False / None (cannot tell yet), from the agent.
        self._serves = serves
        #: Relayed calls served so far (the agent trims its memory once this stops moving).
        self.moved = 0
        #: The endpoint each worker name was last called at: where an exit fails its calls.
        self._endpoints: dict[str, str] = {}
        #: Ranks whose worker is starting (cannot tell yet), by worker name: (the call's
        #: answers, the rank's index, endpoint, method, frames), and the time limit.
        self._waiting: dict[str, tuple[list[tuple[_Gathered, int, str, Any, list[Any]]],
                                       asyncio.TimerHandle]] = {}

    def on_relay_call(self, msg: Incoming) -> None:
        try:
            call = RelayedCall.from_wire(msg.meta)
        except ProtocolError as exc:
            _warn.warning("relay_call", "refused a malformed relay_call: %s", exc)
            msg.reply_error(exc)
            return
        self.moved += 1
        gathered = _Gathered(msg, len(call.ranks))
        request = self.endpoint.request_then
        frames = msg.frames
        serves = self._serves
        for i, (name, endpoint) in enumerate(zip(call.names, call.endpoints, strict=True)):
            served = serves(name, endpoint)
            if served is None:
                self._wait_for_ready(name, (gathered, i, endpoint, call.method, frames))
                continue
            if not served:
                gathered.settle(i, _not_served(name, endpoint), None)
                continue
            self._endpoints[name] = endpoint
            request(endpoint, _CALL, call.method, frames, functools.partial(gathered.settle, i))

    def _wait_for_ready(self, name: str, rank: tuple[_Gathered, int, str, Any, list[Any]]) -> None:
        waiting = self._waiting.get(name)
        if waiting is None:
            timer = asyncio.get_running_loop().call_later(HOLD_FOR_READY_S, self._settle_waiting,
                                                          name, True)
            waiting = self._waiting[name] = ([], timer)
        waiting[0].append(rank)

    def _settle_waiting(self, name: str, expired: bool) -> None:
        """Call, or fail, the ranks that waited for worker ``name`` to say where it listens."""
        waiting = self._waiting.pop(name, None)
        if waiting is None:
            return
        ranks, timer = waiting
        timer.cancel()
        for gathered, i, endpoint, method, frames in ranks:
            served = self._serves(name, endpoint)
            if served:
                self._endpoints[name] = endpoint
                self.endpoint.request_then(endpoint, _CALL, method, frames,
                                           functools.partial(gathered.settle, i))
            elif served is None and expired:
                gathered.settle(i, PeerLostError(
                    f"worker {name} of this node did not say where it listens within "
                    f"{HOLD_FOR_READY_S:g} s of a call relayed to {endpoint}"), None)
            elif served is None:
                self._wait_for_ready(name, (gathered, i, endpoint, method, frames))
            else:
                gathered.settle(i, _not_served(name, endpoint), None)

    def worker_ready(self, name: str) -> None:
        """Worker ``name`` of this node said where it listens: calls that waited go on."""
        if name in self._waiting:
            self._settle_waiting(name, False)

    def worker_exited(self, name: str, endpoint: str | None, reason: str) -> None:
        """Worker ``name`` (at ``endpoint``, None if it never said where) ended: what is
        pending on it fails now, and calls relayed to it later fail at once, naming why."""
        for address in {self._endpoints.pop(name, None), endpoint}:
            if address is not None:
                self.endpoint.mark_peer_lost(address, reason)
        if name in self._waiting:
            self._settle_waiting(name, False)

    def close(self) -> None:
        """The agent is stopping: nothing waits any more."""
        for _ranks, timer in self._waiting.values():
            timer.cancel()
        self._waiting.clear()


def _not_served(name: str, endpoint: str) -> PeerLostError:
    return PeerLostError(f"no worker {name} of this node serves {endpoint} (it is not running "
                         "here, or it exited)")
