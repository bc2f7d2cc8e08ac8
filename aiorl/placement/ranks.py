"""Rank strings: ``"0-3,5,7-8"``, ``"all"`` and plain integers.

The same small grammar names node ranks (``node_groups[].node_ranks``), resource
ranks and process ranks (placement strings), so it lives in one place::

    rank_list = item ("," item)*
    item      = INT | INT "-" INT          (a-b is inclusive, a <= b)
    INT       = [0-9]+
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from aiorl.errors import PlacementError

__all__ = ["format_ranks", "parse_range", "parse_rank_config", "rank_out_of_range_message"]

# Only plain decimal digits: "-1" or "+2" are not ranks, and "1e3" is not an integer.
_RANGE_RE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_range(token: str, *, what: str = "rank") -> tuple[int, int]:
    """Parse one ``a-b`` (inclusive) or ``a`` token into ``(first, last)``.

    Args:
        token: the text of one comma-free item.
        what: the kind of rank, used in error messages (``"resource rank"``...).

    Raises:
        PlacementError: ``token`` is not ``INT`` or ``INT-INT``, or ``a > b``. The
            message quotes ``token``; callers add the surrounding context.
    """
    match = _RANGE_RE.match(token)
    if match is None:
        raise PlacementError(
            f"{token!r} is not a valid {what} range: write a single integer such as '3' "
            "or an inclusive range such as '0-7'"
        )
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if first > last:
        raise PlacementError(
            f"{token!r} is a reversed {what} range: the first rank must not exceed the last"
        )
    return first, last


def _available_list(available: Sequence[int] | int | None) -> list[int] | None:
    if available is None:
        return None
    if isinstance(available, bool):  # bool is an int subclass; True is never meant as "1"
        raise TypeError("available must be an int or a list of ints, not a bool")
    if isinstance(available, int):
        if available < 0:
            raise PlacementError(f"available rank count must be >= 0, got {available}")
        return list(range(available))
    return sorted(int(r) for r in available)


def parse_rank_config(
    text: str | int | Sequence[int | str],
    available: Sequence[int] | int | None = None,
    rank_type: str | None = None,
) -> list[int]:
    """Parse a rank string into a sorted list of unique ranks.

    Args:
        text: ``"0-3,5,7-8"`` (inclusive ranges and single integers, comma-joined,
            spaces allowed around items), ``"all"`` (every rank in ``available``), a
            non-negative ``int`` (one rank), or a list of ints / rank strings (their
            union, e.g. a YAML list ``[0, 1, "4-5"]``).
        available: the ranks that exist, as a list or as a count ``n`` meaning
            ``0..n-1``. Required for ``"all"``; when given, every parsed rank must be
            in it.
        rank_type: what the ranks count (``"node"``...). When given, a malformed
            item is reported in RLinf's words first (``Invalid rank format TEXT for
            node, expected format: "a,b,c-d" or "all"``), then aiorl's explanation.

    Returns:
        The ranks in ascending order.

    Raises:
        PlacementError: empty text or item, malformed or reversed range, a rank
            given twice, ``"all"`` without ``available``, or a rank not in
            ``available``. The message quotes the offending text.
    """
    avail = _available_list(available)
    ranks: list[int]
    if isinstance(text, bool):
        raise PlacementError(f"{text!r} is not a rank: use an integer or a rank string")
    if isinstance(text, int):
        if text < 0:
            raise PlacementError(f"rank {text} is negative: ranks start at 0")
        ranks = [text]
    elif isinstance(text, str):
        stripped = text.strip()
        if not stripped:
            raise PlacementError("empty rank string: give ranks such as '0-3,5' or 'all'")
        if stripped.lower() == "all":
            if avail is None:
                raise PlacementError(
                    "'all' needs to know which ranks are available, and none were given"
                )
            return list(avail)
        ranks = []
        for item in stripped.split(","):
            if not item.strip():
                raise PlacementError(
                    f"rank string {text!r} has an empty item: remove the stray comma"
                )
            try:
                first, last = parse_range(item.strip())
            except PlacementError as exc:
                if rank_type is None or _RANGE_RE.match(item) is not None:
                    raise  # no rank type to name, or a reversed range: not RLinf's case
                raise PlacementError(
                    f'Invalid rank format {text} for {rank_type}, expected format: '
                    f'"a,b,c-d" or "all"; {exc}'
                ) from None
            ranks.extend(range(first, last + 1))
    elif isinstance(text, Sequence):
        if len(text) == 0:
            raise PlacementError("empty rank list: give at least one rank")
        ranks = []
        for element in text:
            ranks.extend(parse_rank_config(element, rank_type=rank_type))
    else:
        raise PlacementError(
            f"{text!r} is not a rank string: use an integer, a string such as '0-3,5', or a list"
        )
    seen: set[int] = set()
    for r in ranks:
        if r in seen:
            raise PlacementError(f"rank {r} appears more than once in {text!r}")
        seen.add(r)
    if avail is not None:
        allowed = set(avail)
        for r in ranks:
            if r not in allowed:
                raise PlacementError(
                    f"rank {r} in {text!r} is out of range: available ranks are "
                    f"{format_ranks(avail) or 'none'}"
                )
    return sorted(ranks)


def rank_out_of_range_message(
    text: str | int | Sequence[int | str], available: Sequence[int], rank_type: str
) -> str | None:
    """RLinf's message for the first item of ``text`` outside ``available`` (checked
    as RLinf does: each item's start, then its end, against the lowest and highest
    available rank), or None when every item is within. ``text`` must parse."""
    avail = sorted(available)
    if isinstance(text, (str, int)):
        items = [i.strip() for i in str(text).split(",") if i.strip()]
    else:
        items = [str(element).strip() for element in text]
    for item in items:
        if item.lower() == "all":
            continue
        first, last = parse_range(item)
        for name, rank in (("Start", first), ("End", last)):
            if not avail or not avail[0] <= rank <= avail[-1]:
                return (
                    f'{name} rank {rank} in rank config string "{text}" must be within the '
                    f"available {rank_type} ranks {avail}."
                )
    return None


def format_ranks(ranks: Iterable[int]) -> str:
    """Write ranks compactly, the inverse of
    [`parse_rank_config`][aiorl.placement.parse_rank_config].

    Consecutive runs collapse into ``a-b``: ``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``.
    The input order is kept (runs are only merged when ascending by one), so an
    unsorted list round-trips as written. An empty input gives ``""``.
    """
    parts: list[str] = []
    run_start: int | None = None
    prev: int | None = None
    for r in ranks:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if run_start is not None and prev is not None:
            parts.append(str(run_start) if run_start == prev else f"{run_start}-{prev}")
        run_start = prev = r
    if run_start is not None and prev is not None:
        parts.append(str(run_start) if run_start == prev else f"{run_start}-{prev}")
    return ",".join(parts)
