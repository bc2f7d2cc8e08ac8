"""Who issues which NCCL operation when, on the one communicator of an unordered pair.

Both directions of a pair share one communicator, so both processes must issue its
point-to-point operations in one agreed order (NCCL pairs them in issue order; two
processes issuing in different orders deadlock or mis-pair). And no operation may be
issued before the receiver holds the memory to land it in: a receiver that cannot
allocate (OOM, an unknown dtype, no CUDA) must be able to refuse one message without
shifting every later pairing or leaving its sender blocked in communicator set-up.

The rules, with the *leader* the pair member whose name sorts first:

* A transfer starts when its control message arrives; the receiver allocates (within its
  in-flight byte window) before anything is issued.
* **Leader receives:** once allocated, the leader issues its receive and tells the
  sender ``GO``; the sender issues its send when ``GO`` arrives.
* **Follower receives:** once allocated, it tells the leader ``READY``; the leader
  issues its send and tells the follower ``GO``; the follower issues its receive when
  ``GO`` arrives.
* A receiver that cannot allocate answers ``REFUSE``: nothing is issued by anyone for
  that message; the send fails with the receiver's reason, and the pair goes on.

So the leader issues every operation of the pair, in its own order, at the moment it
sends the ``GO`` that tells the follower; the follower issues only on ``GO``, which it
receives in the order they were sent (one connection). Both sequences are the same.

Pure bookkeeping (no CUDA, no I/O): `PairOrder` turns events into
`Step`\\ s that `aiorl.p2p.paths.nccl` carries out; tests drive two of them
against each other.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from aiorl.errors import ProtocolError

__all__ = ["Do", "PairOrder", "Step", "is_leader"]


class Do(Enum):
    ISSUE_SEND = "issue_send"  # put the send of ``token`` on the pair's work thread now
    ISSUE_RECV = "issue_recv"  # put the receive of ``token`` on the pair's work thread now
    TELL_GO = "tell_go"  # tell the peer: issue your side of ``token`` now
    TELL_READY = "tell_ready"  # tell the (leader) sender: my memory for ``token`` is ready
    TELL_REFUSE = "tell_refuse"  # tell the sender: ``token`` will never be received
    FAIL_SEND = "fail_send"  # our send of ``token`` fails with ``reason``


class Step(NamedTuple):
    do: Do
    token: int
    reason: str = ""


def is_leader(me: str, peer: str) -> bool:
    """Whether ``me`` orders the pair's operations (the name that sorts first)."""
    if me == peer:
        raise ValueError("a pair needs two distinct members")
    return me < peer


class PairOrder:
    """One side of a pair's ordering (loop thread). Tokens are the sender's, per direction."""

    __slots__ = ("leader", "sending", "receiving")

    def __init__(self, leader: bool) -> None:
        self.leader = leader
        self.sending: set[int] = set()  # our sends announced, not issued yet
        self.receiving: set[int] = set()  # receives allocated, not issued yet (follower)

    # ------------------------------------------------------------------ as the sender
    def announced(self, token: int) -> None:
        """Our control message for send ``token`` left; it waits for the receiver."""
        if token in self.sending:
            raise ProtocolError(f"NCCL send token {token} announced twice")
        self.sending.add(token)

    def on_ready(self, token: int) -> list[Step]:
        """Leader: the follower allocated for our send ``token``."""
        if not self.leader:
            raise ProtocolError("READY reached the follower of an NCCL pair")
        self._take(self.sending, token, "READY")
        return [Step(Do.ISSUE_SEND, token), Step(Do.TELL_GO, token)]

    def on_go_send(self, token: int) -> list[Step]:
        """Follower: the leader received-issued ``token``; our send goes now."""
        if self.leader:
            raise ProtocolError("GO for a send reached the leader of an NCCL pair")
        self._take(self.sending, token, "GO")
        return [Step(Do.ISSUE_SEND, token)]

    def on_refused(self, token: int, reason: str) -> list[Step]:
        """The receiver could not take send ``token``: it fails; nothing was issued."""
        self._take(self.sending, token, "REFUSE")
        return [Step(Do.FAIL_SEND, token, reason)]

    # ------------------------------------------------------------------ as the receiver
    def allocated(self, token: int) -> list[Step]:
        """Our memory for the peer's ``token`` is ready."""
        if self.leader:
            return [Step(Do.ISSUE_RECV, token), Step(Do.TELL_GO, token)]
        if token in self.receiving:
            raise ProtocolError(f"NCCL receive token {token} allocated twice")
        self.receiving.add(token)
        return [Step(Do.TELL_READY, token)]

    def allocation_failed(self, token: int, reason: str) -> list[Step]:
        """We cannot land the peer's ``token``: refuse it (the pair goes on)."""
        return [Step(Do.TELL_REFUSE, token, reason)]

    def on_go_recv(self, token: int) -> list[Step]:
        """Follower: the leader issued its send of ``token``; our receive goes now."""
        if self.leader:
            raise ProtocolError("GO for a receive reached the leader of an NCCL pair")
        self._take(self.receiving, token, "GO")
        return [Step(Do.ISSUE_RECV, token)]

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _take(pending: set[int], token: int, what: str) -> None:
        try:
            pending.remove(token)
        except KeyError:
            raise ProtocolError(f"{what} for NCCL token {token}, which is not waiting") from None

    def clear(self) -> tuple[set[int], set[int]]:
        """Forget everything (the pair is gone): the sends and receives still waiting."""
        sending, receiving = self.sending, self.receiving
        self.sending, self.receiving = set(), set()
        return sending, receiving
