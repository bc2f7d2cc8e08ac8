"""Hierarchical worker names: ``WorkerAddress`` and ``WorkerInfo``.

A worker address is a root group name followed by a rank path, written
``group:rank:subrank``. ``"rollout"`` is the group itself, ``"rollout:3"`` its
fourth rank, ``"rollout:3:0"`` the first child of that rank.

Group names follow one grammar, checked wherever a name enters (``launch``,
``WorkerAddress``, the registry's boundary)::

    name := [A-Za-z0-9_] [A-Za-z0-9_.-]{0,127}      and no ".." anywhere

Why so strict: a name travels into registry patterns (``"*"`` is the
registry's wildcard, ``"@nodes"`` its node feed), file names (a worker's log
is ``<log dir>/<group>_<rank>.log``, so ``/`` and ``..`` would escape the log
directory), process environments and C strings (a NUL byte kills the worker
at start). Everything outside the grammar raises `ValueError` before
any process or registry state is touched.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_NAME_LENGTH", "MAX_RANK_DEPTH", "WorkerAddress", "WorkerInfo", "check_group_name"]

#: The longest group name accepted (a log file name and an environment value carry it).
MAX_NAME_LENGTH = 128
#: The deepest rank path accepted (``group:rank:subrank:...``).
MAX_RANK_DEPTH = 8

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


def check_group_name(name: object) -> str:
    """Return ``name`` if it follows the group-name grammar (module docstring), else raise ValueError.

    The message says which rule was broken, so a user can fix the name at once.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a worker group name must be a non-empty string, got {name!r}")
    if ":" in name:
        raise ValueError(
            f"worker group name {name!r} may not contain ':' (it separates ranks in a worker address)"
        )
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"worker group name {name[:40]!r}... is longer than {MAX_NAME_LENGTH} characters")
    if not _NAME.fullmatch(name) or ".." in name:
        raise ValueError(
            f"invalid worker group name {name!r}: use letters, digits, '_', '.' and '-' "
            "(ASCII), starting with a letter, digit or '_', without '..'"
        )
    return name


@functools.total_ordering
class WorkerAddress:
    """The hierarchical name of a worker: ``root_group_name`` plus a rank path.

    Ordering compares the root name first, then the rank path numerically, so
    ``g:2 < g:10``. Addresses are immutable and hashable.

    Example:
        ```python
        addr = WorkerAddress("rollout", 3)
        addr.get_name()                                   # "rollout:3"
        WorkerAddress.from_name("rollout:3:0").rank_path  # [3, 0]
        addr.get_child_address(0).get_parent_address() == addr   # True
        ```
    """

    __slots__ = ("_root", "_path")

    def __init__(self, root_group_name: str, ranks: int | Sequence[int] = ()) -> None:
        check_group_name(root_group_name)
        path = (ranks,) if isinstance(ranks, int) else tuple(ranks)
        if len(path) > MAX_RANK_DEPTH:
            raise ValueError(f"a rank path has at most {MAX_RANK_DEPTH} levels, got {len(path)}")
        for r in path:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise ValueError(f"ranks must be non-negative integers, got {r!r}")
        self._root = root_group_name
        self._path: tuple[int, ...] = path

    @classmethod
    def from_name(cls, name: str) -> WorkerAddress:
        """Parse ``"g:0:1"`` back into an address (root ``g``, path ``[0, 1]``)."""
        if not isinstance(name, str):
            raise ValueError(f"a worker address must be a string, got {type(name).__name__}")
        root, *ranks = name.split(":")
        # Digits only: int() would also take " 1", "+1" and "1_0", names that differ from ours.
        if not all(r.isascii() and r.isdigit() and len(r) <= 9 for r in ranks):
            raise ValueError(f"invalid worker address {name!r}: ranks must be integers")
        path = [int(r) for r in ranks]
        return cls(root, path)

    @property
    def root_group_name(self) -> str:
        """The group name at the root of the path (``"rollout"``)."""
        return self._root

    @property
    def rank_path(self) -> list[int]:
        """The ranks below the root, outermost first (``[3, 0]`` for ``"rollout:3:0"``)."""
        return list(self._path)

    @property
    def rank(self) -> int:
        """The last element of the rank path, 0 for a root address."""
        return self._path[-1] if self._path else 0

    def get_name(self) -> str:
        """The address as text, ``"root:rank:subrank"`` (the root alone for a group)."""
        return ":".join([self._root, *map(str, self._path)])

    def get_parent_rank(self) -> int:
        """The rank of the parent (second-to-last path element), 0 if there is none."""
        return self._path[-2] if len(self._path) >= 2 else 0

    def get_parent_address(self) -> WorkerAddress | None:
        """The address one level up (``"g:1"`` for ``"g:1:0"``); None for a root."""
        if not self._path:
            return None
        return WorkerAddress(self._root, self._path[:-1])

    def get_child_address(self, rank: int) -> WorkerAddress:
        """The address one level down, at ``rank``."""
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

    def __reduce__(self) -> tuple[type[WorkerAddress], tuple[str, tuple[int, ...]]]:
        return (WorkerAddress, (self._root, self._path))


@dataclass
class WorkerInfo:
    """What the registry knows about one running worker.

    Example:
        ```python
        class Rollout(aiorl.Worker):
            def where(self):
                info = self.worker_info
                return info.name, info.node_rank, info.available_accelerators, info.pid
        ```
    """

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
        """The worker's name, ``"group:rank"``."""
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
        """Inverse of [`to_wire`][aiorl.WorkerInfo.to_wire]."""
        d = dict(d)
        d["address"] = WorkerAddress.from_name(d["address"])
        known = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in d.items() if k in known})
