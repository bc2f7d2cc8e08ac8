"""What a group does when a rank dies: the policy, and the mechanics that apply it.

`Supervision` is the policy given to ``launch(restart=..., max_restarts=...,
backoff=..., fate=..., on_restart=...)``; `Restarts` applies it on the runtime loop when
the registry reports a rank dead: nothing more, a new process for the rank after a backoff
(same name and rank, the next incarnation; calls made meanwhile wait for it), or, with
``fate="group"``, the end (or a restart) of every rank. What the driver hears of it is a
[`GroupEvent`][aiorl.GroupEvent] (`aiorl.group.group_events`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiorl.errors import PeerLostError
from aiorl.group.calls import CallDispatch
from aiorl.group.group_events import EventKind, GroupEvent
from aiorl.group.launch import Launcher
from aiorl.group.state import GroupState, RankSlot

__all__ = ["Restarts", "Supervision"]

log = logging.getLogger("aiorl.group")

#: The longest pause between two restarts of one rank, however many failed before.
MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class Supervision:
    """A group's failure policy (docs/failures.md, "Supervision").

    * ``restart``: ``"never"`` (a dead rank stays dead; its calls fail) or
      ``"on_failure"`` (a rank whose process dies is started again under the same
      name and rank, with the next incarnation; a rank whose ``__init__`` raised is
      not: that would fail again).
    * ``max_restarts``: restarts allowed per rank (per group with ``fate="group"``);
      then the rank gives up and its calls fail with the last death's error.
    * ``backoff``: seconds before a rank's restart, doubling with each further restart
      before it is ready again (at most 30 s); a rank that came up starts over.
    * ``fate``: ``"rank"`` (one rank's death fails only what involves it) or
      ``"group"`` (any death stops every rank: SPMD ranks bound by one communicator;
      with ``restart="on_failure"`` the whole group is started again).
    * ``on_restart``: called on the driver's runtime loop as
      ``on_restart(view, event)`` once a restarted rank is ready, before the calls
      that waited for it are sent: what it calls through ``view`` (that rank alone)
      reaches the new process first. It must not block.
    """

    restart: str = "never"
    max_restarts: int = 3
    backoff: float = 0.5
    fate: str = "rank"
    on_restart: Callable[[Any, GroupEvent], None] | None = None

    def __post_init__(self) -> None:
        if self.restart not in ("never", "on_failure"):
            raise ValueError(f"restart must be 'never' or 'on_failure', got {self.restart!r}")
        if self.fate not in ("rank", "group"):
            raise ValueError(f"fate must be 'rank' or 'group', got {self.fate!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or (
                self.max_restarts < 0):
            raise ValueError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if not self.backoff >= 0:
            raise ValueError(f"backoff must be a number of seconds >= 0, got {self.backoff!r}")
        if self.on_restart is not None and not callable(self.on_restart):
            raise TypeError("on_restart must be a callable(view, event)")

    @property
    def restarts(self) -> bool:
        return self.restart == "on_failure"

    def delay(self, failed_in_a_row: int) -> float:
        """Seconds to wait before a restart that follows ``failed_in_a_row`` restarts that
        did not bring the rank up."""
        return float(min(self.backoff * 2.0 ** failed_in_a_row, MAX_BACKOFF_S))


class Restarts:
    """Applies a group's `Supervision` to the deaths of its ranks (loop only).

    A rank's death has already failed what was pending on it (``PeerLostError``) when
    `on_death` runs. Events whose incarnation is older than the rank's current one are news
    of a process already replaced, and never reach here.
    """

    def __init__(self, group: GroupState, calls: CallDispatch, launcher: Launcher,
                 policy: Supervision | None = None) -> None:
        self.group = group
        self.calls = calls
        self.launcher = launcher
        self.policy = policy if policy is not None else Supervision()
        self._group_restarts = 0

    def on_death(self, rank: int, st: RankSlot, reason: str, not_before: float = 0.0) -> None:
        """Apply the supervision policy to a rank whose process ended (errors already set);
        a restart waits at least ``not_before`` seconds."""
        self.group.emit(EventKind.DIED, rank, reason)
        sup = self.policy
        if sup.fate == "group":
            if sup.restarts and self._group_restarts < sup.max_restarts:
                self._group_restarts += 1
                self._restart_group(rank, reason, not_before)
            else:
                self.tear_down(rank, reason)
        elif not sup.restarts:
            return
        elif st.restarts >= sup.max_restarts:
            self.group.emit(EventKind.GAVE_UP, rank,
                            f"restarted {st.restarts} time(s) already (max_restarts="
                            f"{sup.max_restarts}); its calls fail with the last death's error")
        else:
            self._schedule([rank], max(sup.delay(st.streak), not_before), reason)

    def _schedule(self, ranks: Sequence[int], delay: float, reason: str) -> None:
        """Each rank becomes its next incarnation: later calls wait for it (queued), and in
        ``delay`` seconds its process is started again."""
        group = self.group
        for r in ranks:
            st = group.ranks[r]
            st.incarnation += 1
            st.restarts += 1
            st.streak += 1
            st.restarting = True
            st.error = None
            st.address = None
            group.emit(EventKind.RESTARTING, r, f"in {delay:.2f} s, after: {reason}")
        task = group.runtime.loop.create_task(
            self._respawn({r: group.ranks[r].incarnation for r in ranks}, delay, reason))
        group.tasks.add(task)
        task.add_done_callback(group.tasks.discard)

    async def _respawn(self, incarnations: dict[int, int], delay: float, reason: str) -> None:
        await asyncio.sleep(delay)
        group = self.group
        ranks = [r for r, inc in incarnations.items()
                 if not group.closed and group.ranks[r].member
                 and group.ranks[r].incarnation == inc and group.ranks[r].restarting]
        if not ranks:
            return
        try:
            self._relocate(ranks)
            await self.launcher.spawn(ranks)
        except Exception as exc:  # noqa: BLE001 - the restart itself failed: a death of its own
            self.launcher.kill_ranks(ranks)  # whatever the agent may still start for this attempt
            self._respawn_failed(ranks, incarnations,
                                 f"restarting it failed: {type(exc).__name__}: {exc} "
                                 f"(after: {reason})")

    def _respawn_failed(self, ranks: list[int], incarnations: dict[int, int], why: str) -> None:
        """Starting ``ranks`` again failed: a death of its own, under the same policy."""
        group = self.group
        for r in ranks:
            st = group.ranks[r]
            if st.incarnation != incarnations[r] or not st.restarting:
                continue  # it came up after all, or was replaced again meanwhile
            st.restarting = False
            st.fail(PeerLostError(f"worker {group.name}:{r} {why}"))
            if self.policy.fate == "rank":
                self.on_death(r, st, why)
        if self.policy.fate == "group":
            self.on_death(ranks[0], group.ranks[ranks[0]], why)

    def _relocate(self, ranks: Sequence[int]) -> None:
        """A rank whose node is gone restarts on the live node holding the fewest of this
        group's ranks, if it needs no accelerator (one that does waits for its node)."""
        group = self.group
        nodes = group.nodes()
        if not nodes:
            raise RuntimeError("no node agent is alive")
        load = {n: 0 for n in nodes}
        for r in group.members:
            node_rank = group.launches.get(r, (-1, None))[0]
            if node_rank in load:
                load[node_rank] += 1
        for r in ranks:
            node_rank, launch = group.launches[r]
            if node_rank in nodes or launch.visible_accelerators:
                continue
            target = min(load, key=lambda n: (load[n], n))
            load[target] += 1
            log.warning("node %d of %s:%d is gone: restarting it on node %d", node_rank,
                        group.name, r, target)
            group.launches[r] = (target, dataclasses.replace(
                launch, env={**launch.env, "NODE_RANK": str(target)}))
            self.calls.relay.forget_placement()

    def restarted(self, rank: int, st: RankSlot) -> None:
        """A restarted rank is ready: tell the driver, let its hook speak first, then send
        the replayed calls (``configure`` with its last arguments), then what waited."""
        assert st.address is not None
        group = self.group
        event = group.emit(EventKind.RESTARTED, rank, f"ready at {st.address}")
        self.calls.replay(rank, st.address)
        hook = self.policy.on_restart
        if hook is not None:
            try:
                hook(group.view_of((rank,)) if group.view_of else None, event)
            except Exception:
                log.exception("on_restart hook of group %s failed for rank %d", group.name, rank)

    def _restart_group(self, rank: int, reason: str, not_before: float) -> None:
        """``fate="group"`` with restarts: stop every rank, then start all of them again."""
        group = self.group
        why = f"group {group.name} restarts (fate='group') because rank {rank} died: {reason}"
        self._fail_all(why)
        self.launcher.kill_ranks([r for r in group.members if r != rank])
        delay = max(self.policy.delay(self._group_restarts - 1), not_before)
        self._schedule(group.members, delay, why)

    def tear_down(self, rank: int, reason: str) -> None:
        """``fate="group"``: one rank died, so no rank may go on; stop them all now."""
        group = self.group
        why = f"group {group.name} was torn down (fate='group') because rank {rank} died: {reason}"
        self._fail_all(why)
        group.emit(EventKind.TORN_DOWN, None, why)
        group.closed = True
        group.runtime.loop.create_task(group.close())

    def _fail_all(self, why: str) -> None:
        group = self.group
        for r in group.members:
            st = group.ranks[r]
            if st.address is not None:
                group.runtime.endpoint.mark_peer_lost(st.address, why)
                st.address = None
            if st.error is None:
                st.fail(PeerLostError(why))
