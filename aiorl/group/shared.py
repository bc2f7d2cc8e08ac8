"""What every view of one group shares: its state, the parts that act on it, and the news
that moves them.

A `SharedGroup` is the group's `GroupState` (rank slots, readiness, membership epoch,
events) with its calls (`CallDispatch`), its launcher (`Launcher`) and its restarts
(`Restarts`), wired to the registry's news of its workers: a rank ready, a rank whose
``__init__`` raised, a rank dead, the group closed by someone else. It also changes the
membership: ``add_ranks`` and ``remove_ranks`` start a new epoch. Everything here runs on
the runtime loop.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aiorl.errors import ClusterClosedError, PeerLostError, WorkerInitError
from aiorl.group.calls import CallDispatch
from aiorl.group.group_events import EventKind
from aiorl.group.launch import Launcher
from aiorl.group.state import GroupState, RankSlot
from aiorl.group.supervision import Restarts, Supervision
from aiorl.names import WorkerAddress
from aiorl.protocol.registry import DETAIL_FENCED_IN, DETAIL_GROUP_CLOSED, WorkerRecord
from aiorl.registry.client import WorkerEvent
from aiorl.runtime import Session, describe_death

if TYPE_CHECKING:
    from aiorl.placement import Placement

__all__ = ["SharedGroup"]


class SharedGroup(GroupState):
    """One group's state and the parts that act on it, moved by the registry's news (loop only).

    Supervision (docs/failures.md): a rank's death fails what is pending on it
    (``PeerLostError``), then `Restarts` applies the group's `Supervision`. Membership:
    ``add_ranks`` and ``remove_ranks`` change ``members`` and start a new epoch.
    """

    def __init__(self, session: Session, cls: type, name: str, world_size: int,
                 supervision: Supervision | None = None, *, held_weakly: bool = False) -> None:
        super().__init__(session, cls, name, world_size, held_weakly=held_weakly)
        self.calls = CallDispatch(self)
        self.launcher = Launcher(self, self.calls.relay)
        self.restarts = Restarts(self, self.calls, self.launcher, supervision)
        self._watching = False
        #: What the registry client calls with the group's news; ``held_weakly``: it does
        #: not keep the group alive (a handle that arrived, `aiorl.group.arrivals`).
        self.on_news: WorkerEvent = (_weak_news(self) if held_weakly
                                     else self._on_worker_event)

    async def start(self, placements: list[Placement], payload: bytes,
                    extra_env: dict[str, str]) -> None:
        """Launch the group's first ranks; a failure fails their calls with its reason."""
        launcher = self.launcher
        launcher.payload, launcher.extra_env = payload, extra_env
        try:
            launcher.check_descriptors(placements)
            await self.watch()
            await launcher.wait_for_nodes({p.node_rank for p in placements})
            await launcher.plan(placements, len(placements))
            await launcher.spawn([p.rank for p in placements])
        except ClusterClosedError as exc:  # closed while launching: not a failed launch
            self.mark_closed(f"worker group {self.name} can no longer be reached: {exc}")
        except Exception as exc:  # noqa: BLE001 - every rank learns why
            launcher.failed([p.rank for p in placements], exc)

    async def watch(self) -> dict[str, WorkerRecord]:
        """Subscribe to the registry's news of the group's workers (once); returns the
        registry's snapshot of them (empty when already watching)."""
        if self._watching:
            return {}
        self._watching = True
        return await self.runtime.registry.watch(self.name, self.on_news)

    def unwatch(self) -> None:
        """Stop hearing the registry's news of the group (its registry watch goes with the
        last callback on it); nothing to do once the runtime stopped."""
        if self._watching:
            self._watching = False
            if self.runtime.closed_reason is None:
                self.runtime.registry.drop_watch(self.name, self.on_news)

    def mark_closed(self, reason: str, error: BaseException | None = None) -> None:
        """`GroupState.mark_closed`, and the group's registry watch goes: its news can
        change nothing any more."""
        super().mark_closed(reason, error)
        self.unwatch()

    # ------------------------------------------------------------------ registry news
    def _on_worker_event(self, name: str, state: str, info: dict[str, Any],
                         detail: dict[str, Any]) -> None:
        try:
            rank = WorkerAddress.from_name(name).rank
        except ValueError:
            return
        if not 0 <= rank < len(self.ranks) or self.closed:
            return
        st = self.ranks[rank]
        record = self.runtime.registry.known.get(name)
        incarnation = record.incarnation if record is not None else 0
        if incarnation < st.incarnation or not st.member:
            return  # an earlier process of this rank (already replaced), or a removed rank
        st.incarnation = incarnation  # an attached view learns of restarts by the owner
        if state == "ready":
            self._rank_ready(name, rank, st, info["endpoint"])
        elif state == "failed":
            self._rank_failed(name, rank, st, detail)
        elif state == "dead" and detail.get(DETAIL_GROUP_CLOSED):
            # Closed by someone else (a channel's destroy, another driver, the owner's
            # end): the group is over, not a rank to restart or to report as dead.
            self.session.groups.pop(self.name, None)  # nothing to restore later
            self.mark_closed(f"worker group {self.name} is over: {detail.get('reason')}")
        elif state == "dead" and st.error is None:
            self._rank_dead(name, rank, st, detail)

    def _rank_ready(self, name: str, rank: int, st: RankSlot, endpoint: str) -> None:
        if st.address is not None and st.address != endpoint:
            # A newer process of this rank, and we never heard the old one die (it died
            # while the registry was down): its pending calls fail instead of waiting.
            self.runtime.endpoint.mark_peer_lost(
                st.address, f"worker {name} was replaced by incarnation {st.incarnation}")
        st.address = endpoint
        st.error = None
        if st.restarting:
            st.restarting = False
            st.streak = 0
            self.restarts.restarted(rank, st)
        queued, st.queued = st.queued, []
        for fn in queued:
            fn()

    def _rank_failed(self, name: str, rank: int, st: RankSlot, detail: dict[str, Any]) -> None:
        """The rank's ``__init__`` raised: it is not restarted (it would fail again)."""
        error = WorkerInitError(
            name, rank, str(detail.get("type", "Exception")), str(detail.get("message", "")),
            str(detail.get("traceback", "")), None)
        st.restarting = False
        st.fail(error)
        self.emit(EventKind.GAVE_UP, rank, f"its __init__ raised: {error}")
        if self.restarts.policy.fate == "group":
            self.restarts.tear_down(rank, str(error))

    def _rank_dead(self, name: str, rank: int, st: RankSlot, detail: dict[str, Any]) -> None:
        reason = describe_death(name, detail)
        if st.address is None:
            st.fail(WorkerInitError(name, rank, "WorkerDied", reason, "", None))
        else:
            self.runtime.endpoint.mark_peer_lost(st.address, reason)
            st.fail(PeerLostError(reason))
        st.address = None
        st.restarting = False
        if DETAIL_FENCED_IN in detail:  # its node left the cluster, with its agent
            self.calls.relay.node_lost(rank, reason)
        else:
            self.calls.relay.rank_died(rank, PeerLostError(reason))
        # A lost node's workers stop themselves only after this (its agent's fence).
        self.restarts.on_death(rank, st, reason, _seconds(detail.get(DETAIL_FENCED_IN)))

    # ------------------------------------------------------------------ membership
    def _require_launches(self, what: str) -> None:
        if not self.launches:
            raise RuntimeError(f"{what} of group {self.name}: only the process that launched "
                               "the group can change its membership")

    async def add_ranks(self, placements: list[Placement]) -> tuple[int, ...]:
        """Start new ranks (``placements`` numbered 0..n-1) after the highest rank so far;
        returns the new ranks. A new epoch begins once the registry knows the new size."""
        self._require_launches("add_ranks")
        if self.closed:
            raise PeerLostError(f"worker group {self.name} is closed")
        base = len(self.ranks)
        placements = [dataclasses.replace(p, rank=base + p.rank) for p in placements]
        new = tuple(p.rank for p in placements)
        bound = base + len(new)
        spec = self.session.groups.get(self.name)
        if spec is None:
            raise RuntimeError(f"group {self.name} is not one this session launched")
        await self.runtime.registry.create_group(
            dataclasses.replace(spec, world_size=bound, restore=True))
        self.session.groups[self.name] = dataclasses.replace(spec, world_size=bound)
        self.world_size = bound
        self.ranks.extend(RankSlot() for _ in new)
        self.members += new
        self.new_epoch()
        for r in new:
            self.emit(EventKind.ADDED, r, f"placed on node {placements[r - base].node_rank}")
        try:
            await self.launcher.plan(placements, len(self.members))
            await self.launcher.spawn(new)
        except Exception as exc:  # noqa: BLE001 - the new ranks' calls learn why
            self.launcher.failed(new, exc)
        return new

    def remove_ranks(self, ranks: Sequence[int]) -> None:
        """Stop ``ranks`` and start a new epoch without them; what is pending on them fails
        with PeerLostError (calls of earlier epochs that name them, too)."""
        self._require_launches("remove_ranks")
        unknown = [r for r in ranks if r not in self.members]
        if unknown:
            raise IndexError(f"ranks {unknown} are not members of group {self.name} "
                             f"(members: {list(self.members)})")
        gone = set(ranks)
        self.members = tuple(r for r in self.members if r not in gone)
        self.new_epoch()
        for r in ranks:
            st = self.ranks[r]
            reason = f"worker {self.name}:{r} was removed from its group (epoch {self.epoch})"
            st.member = False
            st.restarting = False
            if st.address is not None:
                self.runtime.endpoint.mark_peer_lost(st.address, reason)
            st.fail(PeerLostError(reason))
            self.calls.forget(r)
            self.emit(EventKind.REMOVED, r, reason)
        self.launcher.kill_ranks(list(ranks))


def _weak_news(group: SharedGroup) -> WorkerEvent:
    """``group._on_worker_event`` without a strong reference to ``group``."""
    ref = weakref.WeakMethod(group._on_worker_event)

    def on_news(name: str, state: str, info: dict[str, Any], detail: dict[str, Any]) -> None:
        handler = ref()
        if handler is not None:
            handler(name, state, info, detail)

    return on_news


def _seconds(value: Any) -> float:
    """A duration from a registry detail map (0 when absent or not a number)."""
    return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0
