"""Hierarchical worker names: ``WorkerAddress`` and ``WorkerInfo``.

A worker address is a root group name followed by a rank path, written
``group:rank:subrank``. ``"rollout"`` is the group itself, ``"rollout:3"`` its
fourth rank, ``"rollout:3:0"`` the first child of that rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WorkerAddress", "WorkerInfo"]


@functools.total_ordering
class WorkerAddress:
    """The hierarchical name of a worker: ``root_group_name`` plus a rank path.

    Ordering compares the root name first, then the rank path numerically, so
    ``g:2 < g:10``. Addresses are immutable and hashable.
    """

    __slots__ = ("_root", "_path")

    def __init__(self, root_group_name: str, ranks: int | Sequence[int] = ()) -> None:
        if not isinstance(root_group_name, str) or not root_group_name:
            raise ValueError("a worker group name must be a non-empty string")
        if ":" in root_group_name:
            raise ValueError(
                f"worker group name {root_group_name!r} may not contain ':' "
                "(it separates ranks in a worker address)"
            )
        path = (ranks,) if isinstance(ranks, int) else tuple(ranks)
        for r in path:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise ValueError(f"ranks must be non-negative integers, got {r!r}")
        self._root = root_group_name
        self._path: tuple[int, ...] = path

    @classmethod
    def from_name(cls, name: str) -> WorkerAddress:
        """Parse ``"g:0:1"`` back into an address (root ``g``, path ``[0, 1]``)."""
        root, *ranks = name.split(":")
        try:
            path = [int(r) for r in ranks]
        except ValueError:
            raise ValueError(f"invalid worker address {name!r}: ranks must be integers") from None
        return cls(root, path)

    @property
    def root_group_name(self) -> str:
        return self._root

    @property
    def rank_path(self) -> list[int]:
        return list(self._path)

    @property
    def rank(self) -> int:
        """The last element of the rank path, 0 for a root address."""
        return self._path[-1] if self._path else 0

    def get_name(self) -> str:
        return ":".join([self._root, *map(str, self._path)])

    def get_parent_rank(self) -> int:
        """The rank of the parent (second-to-last path element), 0 if there is none."""
        return self._path[-2] if len(self._path) >= 2 else 0

    def get_parent_address(self) -> WorkerAddress | None:
        if not self._path:
            return None
        return WorkerAddress(self._root, self._path[:-1])

    def get_child_address(self, rank: int) -> WorkerAddress:
        return WorkerAddress(self._root, (*self._path, rank))

    def _key(self) -> tuple[str, tuple[int, ...]]:
        return (self._root, self._path)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkerAddress):
            return NotImplemented
        return self._key() == other._key()

    def __lt__(self, other: WorkerAddress) -> bool:
        if not isinstance(other, WorkerAddress):
            return NotImplemented
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"WorkerAddress({self.get_name()!r})"

    def __str__(self) -> str:
        return self.get_name()

    def __reduce__(self):
        return (WorkerAddress, (self._root, self._path))


@dataclass
class WorkerInfo:
    """What the registry knows about one running worker."""

    address: WorkerAddress
    rank: int
    group_world_size: int
    node_rank: int
    node_ip: str
    endpoint: str
    pid: int = 0
    accelerator_type: str = "cpu"
    available_accelerators: list[int] = field(default_factory=list)
    hardware_ranks: list[int] = field(default_factory=list)
    node_id: str = ""
    hostname: str = ""

    @property
    def name(self) -> str:
        return self.address.get_name()

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly dict (the registry stores and forwards this)."""
        return {
            "address": self.address.get_name(),
            "rank": self.rank,
            "group_world_size": self.group_world_size,
            "node_rank": self.node_rank,
            "node_ip": self.node_ip,
            "endpoint": self.endpoint,
            "pid": self.pid,
            "accelerator_type": self.accelerator_type,
            "available_accelerators": list(self.available_accelerators),
            "hardware_ranks": list(self.hardware_ranks),
            "node_id": self.node_id,
            "hostname": self.hostname,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> WorkerInfo:
        d = dict(d)
        d["address"] = WorkerAddress.from_name(d["address"])
        known = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in d.items() if k in known})
