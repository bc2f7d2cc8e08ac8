"""What a broadcast is before any byte moves: its members, its source, its relay tree.

Pure functions, no processes: `plan_broadcast` checks a ``Worker.broadcast`` call's
arguments the way RLinf does (same exception types, same messages) and names the member set;
`relay_tree` decides who sends to whom so that every node receives the payload once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiorl.names import WorkerAddress

__all__ = ["BroadcastPlan", "RelayTree", "expand_groups", "plan_broadcast", "relay_tree"]


@dataclass(frozen=True)
class BroadcastPlan:
    """One broadcast call as every member sees it (identical arguments give identical plans)."""

    members: tuple[str, ...]  # worker names, in the order the ``groups`` argument lists them
    src: str  # the member whose object everyone gets
    me: str  # the calling member
    set_id: str  # names the member *set* (order-free): broadcasts over it are numbered in it


@dataclass(frozen=True)
class RelayTree:
    """Who the source sends to. Members on the source's node read one shared segment; each
    other node gets the payload once, at its relay, which fans it out on its node."""

    local: tuple[str, ...]  # members on the source's node, the source excluded
    relays: dict[str, tuple[str, ...]]  # relay -> the other members of its node


def expand_groups(groups: Any) -> list[WorkerAddress]:
    """The worker addresses ``groups`` names, in order, validated as RLinf validates them."""
    if groups is None:
        raise ValueError("groups must be provided with explicit ranks.")
    if not isinstance(groups, list):
        raise TypeError("groups must be a list of (group_name, rank) tuples.")
    if len(groups) == 0:
        raise ValueError("groups must contain at least one entry.")
    addresses: list[WorkerAddress] = []
    for entry in groups:
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise TypeError("Each groups entry must be a (group_name, ranks) tuple.")
        group_name, ranks = entry
        if not isinstance(group_name, str):
            raise TypeError(f"group_name must be a string. But got {type(group_name)}.")
        if isinstance(ranks, list):
            if len(ranks) == 0:
                raise ValueError("ranks list must not be empty.")
            for rank in ranks:
                if not isinstance(rank, (int, tuple)):
                    raise TypeError(f"All ranks must be integers or tuples. But got {type(rank)}.")
            addresses.extend(WorkerAddress(group_name, rank) for rank in ranks)
        elif isinstance(ranks, (int, tuple)):
            addresses.append(WorkerAddress(group_name, ranks))
        else:
            raise TypeError(
                "ranks must be an int, tuple, list[int], list[tuple[int]]. "
                f"But got {type(ranks)}."
            )
    return addresses


def _source(src: Any) -> WorkerAddress:
    if not isinstance(src, (tuple, list)) or len(src) != 2:
        raise TypeError(f"src must be a (group_name, rank) tuple. But got {src!r}.")
    group_name, ranks = src
    if not isinstance(group_name, str):
        raise TypeError(f"src_group_name must be a string. But got {type(group_name)}.")
    if not isinstance(ranks, (int, tuple)):
        raise TypeError(f"src_ranks must be an int or tuple. But got {type(ranks)}.")
    return WorkerAddress(group_name, ranks)


def plan_broadcast(groups: Any, src: Any, me: WorkerAddress) -> BroadcastPlan:
    """Validate a broadcast's arguments on member ``me``; raises ValueError / TypeError."""
    addresses = expand_groups(groups)
    names = [a.get_name() for a in addresses]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"Worker {name} appears more than once in the broadcast group.")
        seen.add(name)
    if me not in addresses:
        raise ValueError(f"Worker {me.get_name()} is not part of the broadcast group.")
    source = addresses[0] if src is None else _source(src)
    if source not in addresses:
        raise ValueError(f"src {source.get_name()} is not part of the broadcast group.")
    ordered = "\0".join(a.get_name() for a in sorted(addresses))
    set_id = hashlib.blake2b(ordered.encode(), digest_size=10).hexdigest()
    return BroadcastPlan(tuple(names), source.get_name(), me.get_name(), set_id)


def relay_tree(src: str, members: Sequence[str], node_of: Mapping[str, str | None]) -> RelayTree:
    """The source's fan-out: its node's members directly, one relay per other node.

    The relay of a node is its lowest-ranked member (address order), so every source picks
    the same one. A member of unknown node (None) is a node of its own.
    """
    home = node_of.get(src)
    local: list[str] = []
    by_node: dict[str, list[str]] = {}
    for name in sorted(members, key=WorkerAddress.from_name):
        if name == src:
            continue
        node = node_of.get(name)
        if home is not None and node == home:
            local.append(name)
        else:
            by_node.setdefault(node if node is not None else f"?{name}", []).append(name)
    relays = {group[0]: tuple(group[1:]) for group in by_node.values()}
    return RelayTree(tuple(local), relays)
