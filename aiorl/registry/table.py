"""The registry's worker table, indexed by root group.

A watch of a group or a worker, a group's lookup, its creation (which drops its old
tombstones) and its tear-down each used to scan every worker the registry knows: at
10,000 workers, each of the hundreds of watches a launch makes cost ~2 ms of the
registry's loop, so launches slowed with the size of the whole cluster rather than of
the group (docs/scale.md). The index keeps each of them proportional to the group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from aiorl.protocol.registry import root_of

__all__ = ["WorkerTable"]

_W = TypeVar("_W")


class WorkerTable(dict[str, _W], Generic[_W]):
    """``name -> entry``, with each root group's entries kept beside (`members`).

    Every change goes through ``table[name] = entry``, ``del table[name]`` or
    ``table.pop(name)``, which keep the index; the other mutators are not used by the
    registry and are refused, so the index cannot silently drift."""

    __slots__ = ("_by_root",)

    def __init__(self) -> None:
        super().__init__()
        self._by_root: dict[str, dict[str, _W]] = {}

    def __setitem__(self, name: str, entry: _W) -> None:
        super().__setitem__(name, entry)
        root = root_of(name)
        members = self._by_root.get(root)
        if members is None:
            members = self._by_root[root] = {}
        members[name] = entry

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        self._forget(name)

    def pop(self, name: str, *default: _W) -> _W:  # type: ignore[override]
        if name not in self:
            if default:
                return default[0]
            raise KeyError(name)
        entry = super().pop(name)
        self._forget(name)
        return entry

    def _forget(self, name: str) -> None:
        root = root_of(name)
        members = self._by_root.get(root)
        if members is not None:
            members.pop(name, None)
            if not members:
                del self._by_root[root]

    def of_group(self, root: str) -> dict[str, _W]:
        """The entries of root group ``root`` (a live view: copy it to change the table)."""
        return self._by_root.get(root, {})

    def members(self, pattern: str, wildcard: str) -> Iterable[tuple[str, _W]]:
        """The entries a watch of ``pattern`` covers: all for ``wildcard``, else the worker
        named ``pattern`` and the workers of the group ``pattern``."""
        if pattern == wildcard:
            return list(self.items())
        found = list(self._by_root.get(pattern, {}).items())
        entry = self.get(pattern)
        if entry is not None and root_of(pattern) != pattern:
            found.append((pattern, entry))
        return found

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("WorkerTable changes only by item assignment, del and pop")

    update = setdefault = popitem = clear = __ior__ = _refuse  # type: ignore[assignment]
