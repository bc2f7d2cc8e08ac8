"""A group call relayed through node agents: one message per node instead of one per rank.

A driver with a large group sends a `RelayedCall` (driver -> agent, msgpack, checked by
``from_wire``) to each node agent that hosts ranks of the call: the method, the ranks on
that node and each rank's endpoint; the call's pickled arguments travel as its frames,
unchanged. The agent sends the ordinary worker ``call`` to each of those ranks and answers
once with `RelayedAnswers`: for each rank, in the request's order, how many of the reply's
frames are its result (0: ``None``), or the error it answered with (`aiorl.errors.to_wire`
data: a [`RemoteError`][aiorl.RemoteError] keeps its worker and rank).

The endpoints come from the driver, which learned them from the registry. A worker tells
its agent where it is before it tells the registry, but on another connection, so the
agent checks them against its own table (`aiorl.node.call_relay`) without relying on it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only (postponed)

from aiorl.protocol.fields import MAX_SHORT, Fields

__all__ = ["RelayedAnswers", "RelayedCall"]

_MAX_RANK = 1 << 20


@dataclass(frozen=True, slots=True)
class RelayedCall:
    """Call ``method`` on ``ranks`` of ``group`` (reached at ``endpoints``, one per rank)."""

    group: str
    method: str
    ranks: tuple[int, ...]
    endpoints: tuple[str, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"group": self.group, "method": self.method, "ranks": list(self.ranks),
                "endpoints": list(self.endpoints)}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "relayed_call")
        ranks = f.int_list("ranks", hi=_MAX_RANK)
        endpoints = f.text_list("endpoints", max_len=MAX_SHORT)
        if len(endpoints) != len(ranks):
            raise f.error("endpoints", f"{len(endpoints)} endpoints for {len(ranks)} ranks")
        return cls(f.group_name("group"), f.text("method", max_len=MAX_SHORT), ranks, endpoints)

    @property
    def names(self) -> tuple[str, ...]:
        """The workers' names, in the request's order."""
        return tuple(f"{self.group}:{r}" for r in self.ranks)


@dataclass(frozen=True, slots=True)
class RelayedAnswers:
    """Each relayed rank's answer, in the request's order: ``frame_counts[i]`` frames of
    the reply are rank ``i``'s result, unless ``errors`` holds ``i`` (then 0)."""

    frame_counts: tuple[int, ...]
    errors: dict[int, dict[str, Any]] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"counts": list(self.frame_counts)}
        if self.errors:  # the common case carries no map at all
            wire["errors"] = [[i, e] for i, e in self.errors.items()]
        return wire

    @classmethod
    def from_wire(cls, meta: Any, expected: int) -> Self:
        """Checked against the ``expected`` number of ranks the request named."""
        f = Fields(meta, "relayed_answers")
        counts = f.int_list("counts", hi=1 << 20)
        if len(counts) != expected:
            raise f.error("counts", f"{len(counts)} answers for {expected} ranks")
        errors: dict[int, dict[str, Any]] = {}
        for entry in f.items("errors", ()):
            if (not isinstance(entry, (list, tuple)) or len(entry) != 2
                    or not isinstance(entry[0], int) or not 0 <= entry[0] < expected
                    or not isinstance(entry[1], dict)):
                raise f.error("errors", "expected [rank index, error map] pairs")
            errors[entry[0]] = entry[1]
        return cls(counts, errors)
