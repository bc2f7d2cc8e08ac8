"""``TokenTable``: numbered operations waiting for an answer.

Every place that sends something and waits for a reply (endpoint requests, channel
operations, P2P acknowledgements, agent spawns) keeps the same table: a fresh token per
operation, the pending value by token, and a sweep that fails everything owed by a peer
that is gone. One type for all of them, so the doctor can list what each one waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["TokenTable"]

V = TypeVar("V")


class TokenTable(Generic[V]):
    """Pending values by token; tokens count up from 1 and are never reused."""

    __slots__ = ("_next", "_pending")

    def __init__(self) -> None:
        self._next = 0
        self._pending: dict[int, V] = {}

    def issue(self, value: V) -> int:
        """Store ``value`` under a new token and return the token."""
        self._next += 1
        token = self._next
        self._pending[token] = value
        return token

    def next_token(self) -> int:
        """A new token with nothing stored (for one-way operations that still need an id)."""
        self._next += 1
        return self._next

    def pop(self, token: int) -> V | None:
        """Remove and return the value of ``token`` (None if answered or withdrawn already)."""
        return self._pending.pop(token, None)

    def get(self, token: int) -> V | None:
        return self._pending.get(token)

    def __contains__(self, token: object) -> bool:
        return token in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._pending))

    def values(self) -> list[V]:
        """A snapshot of the pending values, oldest first."""
        return list(self._pending.values())

    def take_where(self, owed: Callable[[V], bool]) -> list[V]:
        """Remove and return every pending value for which ``owed(value)`` is true, oldest first
        (what a lost peer owed)."""
        taken = [(t, v) for t, v in self._pending.items() if owed(v)]
        for t, _ in taken:
            del self._pending[t]
        return [v for _, v in taken]

    def take_all(self) -> list[V]:
        """Remove and return every pending value, oldest first (on close)."""
        values = list(self._pending.values())
        self._pending.clear()
        return values
