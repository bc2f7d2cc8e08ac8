"""What a member keeps of its broadcasts: one `MemberSet` per member set, one `Round` per
broadcast (one number of one set), and which failures mean a member is gone.

Plain state, no behaviour of its own: the broadcaster (``aiorl.collective.broadcast``) drives
it, and its helpers (the relay tree's sender, the member watch) read it.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from aiorl.errors import PeerLostError

if TYPE_CHECKING:
    from aiorl.collective.broadcast_plan import BroadcastPlan
    from aiorl.p2p.message import InMessage, OutMessage
    from aiorl.protocol.broadcast import BroadcastData
    from aiorl.runtime import AsyncWork

__all__ = ["MemberSet", "Round", "member_gone"]


class Round:
    """One broadcast (one number of one member set) as this member sees it."""

    __slots__ = ("seq", "plan", "work", "obj", "out", "inc", "sender", "src_address", "waiting",
                 "error", "value", "acked", "final", "since")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.plan: BroadcastPlan | None = None  # set when this member called
        self.work: AsyncWork[Any] | None = None
        self.obj: Any = None  # the source's object (what the source's broadcast returns)
        self.out: OutMessage | None = None  # the source's encoded object (kept until done)
        self.inc: InMessage | None = None  # a receiver's landed message
        self.sender: str | None = None  # the source a landed message names
        self.src_address: str | None = None
        self.waiting: set[str] = set()  # source: members that have not acknowledged yet
        self.error: str | None = None  # why this member (or, at the source, some member) failed
        self.value: Any = None
        self.acked = False
        self.final: str | None = None  # the source's verdict, when it failed before we called
        self.since = 0.0  # when this member called (time.time()), for ``aiorl doctor``


class MemberSet:
    """The broadcasts over one member set, as this member sees them."""

    __slots__ = ("set_id", "members", "calls", "rounds", "steps", "next_step", "pumping", "lost")

    def __init__(self, set_id: str) -> None:
        self.set_id = set_id
        self.members: tuple[str, ...] = ()  # known once this member called
        self.calls = 0  # broadcasts this member called over the set
        self.rounds: dict[int, Round] = {}
        # Work to do in number order: the source's sends, or a receiver's landing (with the
        # message it lands, whose segment goes back if the step never runs).
        self.steps: dict[int, tuple[Coroutine[Any, Any, None], BroadcastData | None]] = {}
        self.next_step = 0
        self.pumping = False
        self.lost: PeerLostError | LookupError | None = None

    def round(self, seq: int) -> Round:
        rnd = self.rounds.get(seq)
        if rnd is None:
            rnd = self.rounds[seq] = Round(seq)
        return rnd


def member_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says a member is dead (`PeerLostError`) or never existed (a lookup
    error from the registry), rather than a bug: an ``IndexError`` or ``KeyError`` is a
    ``LookupError`` too, and taken for a missing member it would hide where it was raised
    behind a bare "LookupError: list index out of range"."""
    if isinstance(exc, PeerLostError):
        return True
    return isinstance(exc, LookupError) and not isinstance(exc, (IndexError, KeyError))
