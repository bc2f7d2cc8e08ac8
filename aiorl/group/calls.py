"""Group calls on the driver: one call on some ranks, its per-rank answers gathered into the
work's result list, and how it reaches each rank.

`CallDispatch` sends a call to each rank of a view directly, or, for a large call on
several nodes, through the node agents (`aiorl.group.call_relay`); a rank not ready yet
(starting, restarting) gets its part once it is. Methods a worker class names in
`REPLAY_ATTRIBUTE` keep each rank's last call, which a restarted rank receives again before
any other. Everything here runs on the runtime loop.
"""

from __future__ import annotations

import functools
import logging
import struct
import threading
from collections.abc import Sequence
from typing import Any

from aiorl.errors import ClusterClosedError, PeerLostError
from aiorl.group import call_relay as _relay
from aiorl.group.state import GroupState, RankSlot, fresh
from aiorl.group.timeouts import describe_timeout
from aiorl.protocol.ops import WorkerOp
from aiorl.runtime import AsyncWork
from aiorl.runtime.promise import explain_timeouts, is_settled, link_threads, reject, resolve
from aiorl.trace import recorder as _trace
from aiorl.transport import serialization

__all__ = ["REPLAY_ATTRIBUTE", "CallDispatch", "CallTrace", "GroupCall", "TracedGroupCall"]

log = logging.getLogger("aiorl.group")

#: A worker class attribute naming methods whose last call a restarted rank receives again,
#: before any other call (``PollingWorker`` names ``configure``).
REPLAY_ATTRIBUTE = "_aiorl_replay_on_restart"

#: The call op as a plain str: an enum member costs ~0.2 µs to look up on the hot path.
_CALL: str = WorkerOp.CALL.value
_now = _trace.now  # the recorder's clock (a constant: bound once)


class GroupCall:
    """One call on some ranks: the per-rank answers, gathered into the work's result list.

    Until rank ``i`` answers, ``results[i]`` holds the id of its request (set as it is
    sent): a traced call names its flow by it, with no list of its own to allocate.
    ``remaining`` counts the ranks that have not answered and ``answered`` has bit ``i`` set
    once rank ``i`` has, late answers (after the work was cancelled or failed) included: what
    a timed-out wait's message reports (`describe_timeout`), with the group, method and ranks
    that `CallDispatch.dispatch` sets.
    """

    __slots__ = ("work", "results", "remaining", "answered", "group", "method", "ranks")

    work: AsyncWork[list[Any]] | None
    group: GroupState
    method: str
    ranks: tuple[int, ...]

    def __init__(self, work: AsyncWork[list[Any]], n: int) -> None:
        self.work = work
        self.results: list[Any] = [None] * n
        self.remaining = n
        self.answered = 0

    def timeout_message(self, timeout: float | None) -> str:
        """What a ``wait(timeout)`` on the call that expired says (`describe_timeout`)."""
        return describe_timeout(self, timeout)

    def settle(self, i: int, error: BaseException | None, reply: Any) -> None:
        """Rank ``i`` answered (an endpoint settle): the first error fails the call.

        The call lets go of its work once the work settles here (or, cancelled, once every
        rank has answered): the work refers to the call (`explain_timeouts`), and a cycle
        would leave both to the garbage collector instead of reference counting.
        """
        work = self.work
        self.answered |= 1 << i
        if work is None or is_settled(work):
            self.remaining -= 1  # a late answer: the rank is no longer busy with the call
            if self.remaining <= 0:
                self.work = None
            return
        if error is None:
            payload = reply[1]
            try:
                self.results[i] = serialization.loads(payload) if payload else None
            except Exception as exc:  # noqa: BLE001 - an unreadable result fails the call
                error = exc
        if error is not None:
            self.remaining -= 1
            self.work = None
            reject(work, error)
            return
        self.remaining -= 1
        if self.remaining == 0:
            self.work = None
            resolve(work, self.results)


class TracedGroupCall(GroupCall):
    """A group call that records a span per rank as each answers (only while tracing is on).

    Kept to a few stores and one buffer record per rank (tracing a no-op call must cost a
    few percent of it): what a rank's record needs besides the times is made
    once per rank list and method (`CallTrace`), and the record is a compact one
    packed inline (`CompactShape`). The flow from the call to
    its execution is named by the request's id, which the worker reads from the message
    header: neither end counts messages for it.
    """

    __slots__ = ("shape", "t0", "nbytes")

    # No __init__ of its own (a Python call less per call): CallDispatch.dispatch makes it
    # with the base's and sets the three fields.
    shape: CallTrace
    t0: int
    nbytes: int

    def settle(self, i: int, error: BaseException | None, reply: Any) -> None:
        # results[i] is still rank i's request id (None if it failed before it was sent).
        if error is None:
            frames = reply[1]
            _trace.append(_pack_call(self.shape.key, self.t0, _now(), i, self.results[i],
                                     (self.nbytes + _trace.payload_bytes(frames)) if frames
                                     else self.nbytes))
        else:
            _trace.append(self.shape.record(self.t0, _now(), i, self.results[i], self.nbytes,
                                            _trace.error_text(error)))
        GroupCall.settle(self, i, error, reply)


class CallTrace(_trace.CompactShape):
    """What a traced call's records share, made once per rank list and method: the method,
    the workers' names, the flow pair of our calls to each, and the loop thread (where
    calls are sent and settled)."""

    __slots__ = ("method", "n", "peers", "pairs", "tid")

    #: ``(key, t0, t1, rank index, request id, bytes)``
    layout = struct.Struct("<qqqqqq")

    def __init__(self, me: str, group: str, ranks: Sequence[int], method: str) -> None:
        super().__init__()
        self.method = method
        self.n = len(ranks)
        self.peers = [f"{group}:{r}" for r in ranks]
        self.pairs = [f"{me}>{group}:{r}/call" for r in ranks]
        self.tid = threading.get_ident()

    def expand(self, fields: tuple[int, ...]) -> tuple[Any, ...]:
        _, t0, t1, i, rid, nbytes = fields
        return self.record(t0, t1, i, rid, nbytes, None)

    def record(self, t0: int, t1: int, i: int, rid: int | None, nbytes: int,
               error: str | None) -> tuple[Any, ...]:
        """The full record of rank ``i``'s answer (an error's is appended as is: rare)."""
        tid = self.tid
        return ("call", self.method, t0, t1, tid, tid, self.peers[i], nbytes, error is None,
                error, (self.pairs[i], rid) if rid else None, None, None, True)


_pack_call = CallTrace.layout.pack


class CallDispatch:
    """Sends a group's calls to its ranks and gathers their answers (loop only)."""

    def __init__(self, group: GroupState) -> None:
        self.group = group
        #: Methods whose last call each rank replays after a restart (``configure``).
        self.replayed: frozenset[str] = frozenset(getattr(group.cls, REPLAY_ATTRIBUTE, ()))
        self._last_calls: dict[int, dict[str, list[Any]]] = {}
        #: Tracing: what a traced call's records share, by method and rank list.
        self._traces: dict[str, dict[tuple[int, ...], CallTrace]] = {}
        #: Large calls go through the node agents, one message per node (group/call_relay.py).
        self.relay = _relay.RelayPath(group, self.send)

    def dispatch(self, work: AsyncWork[list[Any]], method: str, ranks: tuple[int, ...],
                 frames: list[Any], off_loop: bool) -> None:
        if off_loop:
            link_threads(work)  # link now, on the loop, so wait() needs no extra wake-up
        group = self.group
        if group.closed:
            stopped = group.runtime.closed_reason
            reject(work, ClusterClosedError(stopped) if stopped is not None
                   else fresh(group.end_error) if group.end_error is not None
                   else PeerLostError(f"worker group {group.name} is closed"))
            return
        if not ranks:
            resolve(work, [])
            return
        call = self._traced(work, method, ranks, frames) if _trace.ON else GroupCall(
            work, len(ranks))
        call.group, call.method, call.ranks = group, method, ranks
        explain_timeouts(work, call)
        # A traced call keeps the direct path: its spans are per rank, sent and answered here.
        if len(ranks) >= _relay.RELAY_MIN_RANKS and not _trace.ON and self.relay.dispatch(
                call, method, ranks, frames):
            return
        send = self.send
        slots = group.ranks
        for i, r in enumerate(ranks):
            slot = slots[r]
            if slot.error is not None or slot.address is not None:
                send(call, i, slot, method, frames)
            else:
                slot.queued.append(functools.partial(send, call, i, slot, method, frames))

    def _traced(self, work: AsyncWork[list[Any]], method: str, ranks: tuple[int, ...],
                frames: list[Any]) -> TracedGroupCall:
        """A call that records a span per rank, with the shape its rank list and method share."""
        shapes = self._traces.get(method)
        if shapes is None:
            shapes = self._traces[method] = {}
        shape = shapes.get(ranks)
        if shape is None:
            shape = shapes[ranks] = CallTrace(self.group.runtime.name, self.group.name, ranks,
                                              method)
        traced = TracedGroupCall(work, shape.n)
        traced.shape = shape
        traced.nbytes = _trace.payload_bytes(frames) if frames else 0
        traced.t0 = _now()
        return traced

    def dispatch_remembered(self, work: AsyncWork[list[Any]], method: str, ranks: tuple[int, ...],
                            frames: list[Any], off_loop: bool) -> None:
        """`dispatch` of a method in `replayed`: each rank keeps the call's
        arguments, sent again to its next incarnation before anything else."""
        for r in ranks:
            self._last_calls.setdefault(r, {})[method] = frames
        self.dispatch(work, method, ranks, frames, off_loop)

    def send(self, call: GroupCall, i: int, slot: RankSlot, method: str,
             frames: list[Any]) -> int:
        """Send rank ``i``'s request; its request id (0 when it failed at once), kept in
        ``call.results[i]`` until the rank answers (a traced call names its flow by it)."""
        if slot.error is not None:
            call.settle(i, fresh(slot.error), None)
            return 0
        assert slot.address is not None
        rid = call.results[i] = self.group.runtime.endpoint.request_then(
            slot.address, _CALL, method, frames, functools.partial(call.settle, i))
        return rid

    def replay(self, rank: int, address: str) -> None:
        """Send a restarted rank, at ``address``, the last call of each replayed method."""
        for method, frames in self._last_calls.get(rank, {}).items():
            self.group.runtime.endpoint.request_then(
                address, _CALL, method, frames,
                functools.partial(self._replay_answered, rank, method))

    def _replay_answered(self, rank: int, method: str, error: BaseException | None,
                         _reply: Any) -> None:
        if error is not None:
            log.error("replaying %s on restarted %s:%d failed: %s", method, self.group.name,
                      rank, error)

    def forget(self, rank: int) -> None:
        """The rank left the group: its last calls are not replayed anywhere."""
        self._last_calls.pop(rank, None)
