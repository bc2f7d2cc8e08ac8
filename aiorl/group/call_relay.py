"""Group calls through the node agents: the driver's cost grows with nodes, not workers.

A call to at least `RELAY_MIN_RANKS` ranks on at least two nodes goes out as one
``relay_call`` per node agent (`aiorl.protocol.call_relay`); each agent calls its own ranks and
answers once for all of them (`aiorl.node.call_relay`). The driver sends and reads one message
per node instead of one per rank: at 256 ranks that was ~35 µs of the driver's CPU per
rank (docs/scale.md), and the agents do their part at the same time, each on its own
machine. Smaller calls keep the direct path, where the extra hop costs more than it
saves; so do calls to one node only, where the agent would do the driver's work, one hop
later, instead of beside it (measured: 52 ms instead of 31 ms for 256 ranks on one agent
of a 2-core machine).

What stays as on the direct path: results in rank order; a rank's error keeps its rank
(a `RemoteError` names its worker and rank; the agent forwards it as data); a rank not
ready yet gets its part when it is (a call made before any rank is ready waits for all,
then goes through the agents); a dead rank fails only itself, and a dead node only its
own ranks: its agent's pending answers fail once the registry declares its workers dead
(`RelayPath.node_lost`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

from aiorl.errors import PeerLostError, ProtocolError, from_wire
from aiorl.group.state import GroupState
from aiorl.protocol.call_relay import RelayedAnswers, RelayedCall
from aiorl.protocol.ops import AgentOp

__all__ = ["RELAY_MIN_RANKS", "RelayPath", "settle_relayed"]

#: Calls to fewer ranks than this go to each rank directly (measured in
#: benchmarks/bench_scale.py: below it the agent's hop costs more than it saves).
#: ``AIORL_RELAY_MIN_RANKS`` overrides it (0: never relay), e.g. to compare both paths.
RELAY_MIN_RANKS = int(os.environ.get("AIORL_RELAY_MIN_RANKS", "32") or 0) or 1 << 62
#: Calls that reach fewer nodes than this go to each rank directly (see above).
RELAY_MIN_NODES = 2
#: Rank lists whose split by node is remembered (the views a program calls are few).
_MAX_PLANS = 64
_RELAY_CALL: str = AgentOp.RELAY_CALL.value

#: A rank list split by node: ``(node rank, indices into the rank list)`` per node.
Plan = tuple[tuple[int, tuple[int, ...]], ...]


def settle_relayed(call: Any, indices: Sequence[int], error: BaseException | None,
                   reply: Any) -> None:
    """One node agent's answer to a relayed call: settle each of its ranks, in order, as
    the direct path would have (``call.settle(i, error, reply)``)."""
    settle = call.settle
    if error is None:
        try:
            answers = RelayedAnswers.from_wire(reply[0], len(indices))
        except ProtocolError as exc:
            error = exc
    if error is not None:  # the agent is gone, or answered nonsense: each of its ranks fails
        for i in indices:
            settle(i, error, None)
        return
    frames, pos = reply[1], 0
    counts, errors = answers.frame_counts, answers.errors
    for k, i in enumerate(indices):
        failure = errors.get(k) if errors else None
        if failure is not None:
            settle(i, from_wire(failure), None)
            continue
        n = counts[k]
        settle(i, None, (None, frames[pos:pos + n]))
        pos += n


class _Pending:
    """One node's part of a relayed call until its answer (or its node's loss) settles it,
    whichever comes first: the other is ignored."""

    __slots__ = ("call", "indices", "done")

    def __init__(self, call: Any, indices: list[int]) -> None:
        self.call = call
        self.indices = indices
        self.done = False


class RelayPath:
    """A group's relayed calls: the rank lists split by node, and the agents in use.

    ``group`` is the group's `GroupState` (on the loop, as everything here);
    ``send_direct(call, i, slot, method, frames)`` is its direct send of one rank.
    """

    def __init__(self, group: GroupState, send_direct: Callable[..., Any]) -> None:
        self.group = group
        self.send_direct = send_direct
        self._plans: dict[tuple[int, ...], Plan | None] = {}
        #: node rank -> the parts of relayed calls its agent has not answered yet.
        self._pending: dict[int, set[_Pending]] = {}

    def forget_placement(self) -> None:
        """Ranks moved (a restart elsewhere, new ranks): split rank lists again."""
        self._plans.clear()

    def _plan(self, ranks: tuple[int, ...]) -> Plan | None:
        """``ranks`` split by node; None for the direct path (one node, or a rank whose
        node is not known yet: a call made before the launch planned it)."""
        plan = self._plans.get(ranks, False)
        if plan is not False:
            return plan  # type: ignore[return-value]  # a Plan or None, from the cache
        launches = self.group.launches
        by_node: dict[int, list[int]] = {}
        for i, r in enumerate(ranks):
            launch = launches.get(r)
            if launch is None:  # not planned yet: decide again later, do not remember
                return None
            by_node.setdefault(launch[0], []).append(i)
        made = (tuple((n, tuple(ix)) for n, ix in sorted(by_node.items()))
                if len(by_node) >= RELAY_MIN_NODES else None)
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[ranks] = made
        return made

    def dispatch(self, call: Any, method: str, ranks: tuple[int, ...],
                 frames: list[Any]) -> bool:
        """Send ``call`` through the agents; False when the direct path must take it."""
        group = self.group
        if not group.launched_here:
            return False  # a view attached by name: only the owner knows where ranks run
        if group.launches and self._plan(ranks) is None:
            return False
        states = group.ranks
        waiting = [states[r] for r in ranks
                   if states[r].address is None and states[r].error is None]
        if len(waiting) < len(ranks):
            # Ranks that are ready go now, through their agents; one not ready (restarting,
            # or still starting) gets its part directly once it is: nobody waits for it.
            self._send(call, method, ranks, frames)
            return True
        # No rank ready yet (a call right after the launch, whose placement may not even be
        # planned yet): the call leaves once each has become ready (or failed), so it still
        # goes one message per node, not one per rank.
        left = [len(waiting)]

        def one_settled() -> None:
            left[0] -= 1
            if left[0] == 0:
                self._send(call, method, ranks, frames)

        for st in waiting:
            st.queued.append(one_settled)
        return True

    def _send(self, call: Any, method: str, ranks: tuple[int, ...], frames: list[Any]) -> None:
        plan = self._plan(ranks)
        group = self.group
        states = group.ranks
        nodes = group.nodes()
        send_direct = self.send_direct
        request = group.runtime.endpoint.request_then
        if plan is None:  # one node after all, or not planned: each rank directly
            for i, r in enumerate(ranks):
                st = states[r]
                if st.address is None and st.error is None:
                    st.queued.append(functools.partial(send_direct, call, i, st, method, frames))
                else:
                    send_direct(call, i, st, method, frames)
            return
        for node_rank, indices in plan:
            node = nodes.get(node_rank)
            relayed: list[int] = []
            addresses: list[str] = []
            for i in indices:
                st = states[ranks[i]]
                if st.address is not None and st.error is None and node is not None:
                    relayed.append(i)
                    addresses.append(st.address)
                elif st.address is None and st.error is None:  # gone again: wait for it
                    st.queued.append(functools.partial(send_direct, call, i, st, method, frames))
                else:  # failed (fails at once), or its node left the list (direct to it)
                    send_direct(call, i, st, method, frames)
            if len(relayed) < 2:
                for i in relayed:
                    send_direct(call, i, states[ranks[i]], method, frames)
                continue
            assert node is not None
            wire = RelayedCall(group.name, method, tuple(ranks[i] for i in relayed),
                               tuple(addresses)).to_wire()
            pending = _Pending(call, relayed)
            waiting_here = self._pending.get(node_rank)
            if waiting_here is None:
                waiting_here = self._pending[node_rank] = set()
            waiting_here.add(pending)
            rid = request(node["endpoint"], _RELAY_CALL, wire, frames,
                          functools.partial(self._answered, node_rank, pending))
            if rid:  # sent (no answer can have come yet): each rank's id, as direct calls
                results = call.results
                for i in relayed:
                    results[i] = rid

    def _answered(self, node_rank: int, pending: _Pending, error: BaseException | None,
                  reply: Any) -> None:
        waiting_here = self._pending.get(node_rank)
        if waiting_here is not None:
            waiting_here.discard(pending)
        if not pending.done:
            pending.done = True
            settle_relayed(pending.call, pending.indices, error, reply)

    def rank_died(self, rank: int, error: BaseException) -> None:
        """Rank ``rank`` was reported dead: its part of each relayed call still pending
        fails now, as a direct call to it would. Its agent fails it too once it sees the
        process end, but a worker that died before its agent learnt its endpoint would
        leave the agent waiting. (An answer the rank gave its agent just before it died is
        lost with it: the call fails, as any call does that one of its ranks died in.)"""
        launch = self.group.launches.get(rank)
        for pending in self._pending.get(launch[0], ()) if launch is not None else ():
            if pending.done:
                continue
            ranks = pending.call.ranks
            for i in pending.indices:
                if ranks[i] == rank:
                    pending.call.settle(i, error, None)

    def node_lost(self, rank: int, reason: str) -> None:
        """Rank ``rank`` died with its node (the registry's news): what its agent has not
        answered fails now, each of that node's ranks with ``reason``. The agent's address
        stays usable: a node declared dead while cut off comes back with the same agent."""
        launch = self.group.launches.get(rank)
        lost = self._pending.pop(launch[0], set()) if launch is not None else set()
        for pending in lost:
            if not pending.done:
                pending.done = True
                settle_relayed(pending.call, pending.indices, PeerLostError(reason), None)
