"""``PerRank``: a constructor argument with one value per rank.

``Worker.create_group(*args, **kwargs)`` gives every rank the same arguments; Ray users
write ``[P.remote(seed) for seed in seeds]`` to give each actor its own, and the aiorl
spelling that looked the same (``P.create_group(0)``) gave every rank seed 0 in silence.
A ``PerRank`` among the arguments stands for its value at the rank's index: checked
against the group's size when it launches, picked in each worker before ``__init__``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["PerRank", "check_per_rank", "resolve_per_rank"]


class PerRank:
    """One value per rank for an argument of the worker's ``__init__``: rank ``i`` gets
    ``values[i]``. Give it as a positional or keyword argument of
    [`create_group`][aiorl.Worker.create_group] (arguments nested inside others are not
    looked into); the group must have exactly ``len(values)`` ranks, or its launch raises
    ``ValueError``. A restarted rank gets its own value again.

    Args:
        values: The values, in rank order (any iterable; read once).

    Raises:
        ValueError: ``values`` is empty.

    Example:
        ```python
        seeds = [11, 22, 33]
        producers = Producer.create_group(aiorl.PerRank(seeds), lr=1e-3).launch(
            cluster, num_workers=3, name="producer")     # rank i runs Producer(seeds[i], lr=1e-3)
        ```
    """

    __slots__ = ("values",)

    def __init__(self, values: Iterable[Any]) -> None:
        self.values = tuple(values)
        if not self.values:
            raise ValueError("PerRank([]): give one value per rank of the group")

    def __repr__(self) -> str:
        return f"PerRank({list(self.values)!r})"


def _per_rank(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, PerRank]]:
    found = [(f"argument {i}", a) for i, a in enumerate(args) if isinstance(a, PerRank)]
    return found + [(f"{k}=", v) for k, v in kwargs.items() if isinstance(v, PerRank)]


def check_per_rank(cls_name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   world_size: int) -> None:
    """Raise ``ValueError`` when a `PerRank` argument does not have one value per rank."""
    for where, value in _per_rank(args, kwargs):
        if len(value.values) != world_size:
            raise ValueError(
                f"{cls_name}.create_group(...): {where} is a PerRank of {len(value.values)} "
                f"value(s) and the launch places {world_size} rank(s): give one value per rank "
                "(or launch as many ranks as values, num_workers=len(values))")


def resolve_per_rank(args: tuple[Any, ...], kwargs: dict[str, Any], rank: int
                     ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with each `PerRank` replaced by its value for ``rank``."""
    if not _per_rank(args, kwargs):
        return args, kwargs

    def pick(value: Any) -> Any:
        if not isinstance(value, PerRank):
            return value
        if not 0 <= rank < len(value.values):
            raise ValueError(f"rank {rank} has no value in {value!r} (it has one per rank of "
                             "the launch; ranks added later need a group of their own)")
        return value.values[rank]

    return tuple(map(pick, args)), {k: pick(v) for k, v in kwargs.items()}
