"""What a timed-out wait on a group call says (docs/cancellation.md).

``group.f().wait(timeout)`` that expires cancels the call *here*; the worker is never
interrupted. What then goes on in the worker depends on the method, and the
[`WaitTimeout`][aiorl.WaitTimeout] says it, as the driver knows it:

* the worker class, the method, and which of the ranks it went to had not answered;
* an ``async def`` method keeps running on the worker's event loop, and its answer is dropped;
* a plain method cannot be interrupted at all: it keeps the rank's one method thread busy
  until it returns, and later plain calls to that rank queue behind it. A rank remembers the
  earliest such call that timed out and has not answered there, so a later call that times
  out behind it names it (``incr()`` waits behind ``forever()``);
* a rank not ready yet (starting, restarting) has not been sent the call: it is sent once
  the process is ready.

Only the timeout path runs this; a call pays for it with the few fields ``GroupCall`` keeps
(its group, method and ranks, and a bit per rank that has answered).
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["describe_timeout"]

#: Ranks named in a message before it says "and N more".
_MAX_NAMED = 8


def describe_timeout(call: Any, timeout: float | None) -> str:
    """The message of the [`WaitTimeout`][aiorl.WaitTimeout] of a wait on ``call`` (a
    ``GroupCall``) that expired; remembers it, on each rank that has not answered, as what
    that rank's method thread is busy with when it is a plain call.

    Args:
        call: The group call: ``group`` (its `GroupState`), ``method``, ``ranks``,
            ``answered`` (bit ``i`` set once rank ``i`` answered) and ``results`` (the request
            id of each rank that has not answered).
        timeout: The wait's timeout, in seconds.

    Returns:
        One paragraph: what was not done, where, and what goes on in the worker.
    """
    group, method, ranks = call.group, call.method, call.ranks
    name = f"{method}()"
    pending = _pending(call) or list(range(len(ranks)))  # all answered as it expired: rare
    late = [ranks[i] for i in pending]
    where = (f"rank {ranks[0]}" if len(ranks) == 1 else
             f"{_rank_word(late)} {_ranks(late)}, of the {len(ranks)} ranks it went to")
    parts = [f"{group.cls.__name__}.{name} on group {group.name!r} not done within {timeout} s "
             f"by {where} (cancelled here; cancellation is local, docs/cancellation.md)."]
    states = group.ranks
    starting = [ranks[i] for i in pending
                if states[ranks[i]].address is None and states[ranks[i]].error is None]
    if starting:
        parts.append(f"{_rank_word(starting).capitalize()} {_ranks(starting)} "
                     f"{'is' if len(starting) == 1 else 'are'} not ready yet "
                     f"(starting or restarting): {name} waits there for the process, and is "
                     "sent once it is ready.")
    if inspect.iscoroutinefunction(getattr(group.cls, method, None)):
        parts.append(f"{name} is an async method: it keeps running on the worker's event "
                     "loop until it returns, and its answer is dropped.")
        return " ".join(parts)
    behind: dict[str, list[int]] = {}
    for i in pending:
        earlier = _stalled_before(call, i)
        if earlier is not None:
            behind.setdefault(earlier.method, []).append(ranks[i])
    waiting = {r for rs in behind.values() for r in rs}
    busy = [r for r in late if r not in waiting and r not in starting]
    if busy:
        threads = (f"{_rank_word(busy)} {_ranks(busy)}'s method thread" if len(busy) == 1
                   else f"the method threads of ranks {_ranks(busy)}")
        parts.append(
            f"{name} is a plain (non-async) method, which cannot be interrupted: it keeps "
            f"running in the worker, {threads} {'is' if len(busy) == 1 else 'are'} still busy "
            f"with {name}, and later plain calls to {'that rank' if len(busy) == 1 else 'those ranks'} "
            "queue behind it until it returns (async methods still run).")
    for earlier_method, rs in behind.items():
        one = len(rs) == 1
        parts.append(
            f"{name} is a plain (non-async) method, and a rank runs plain calls one at a time, "
            f"in order: {_rank_word(rs)} {_ranks(rs)}'s method thread{'' if one else 's'} "
            f"{'is' if one else 'are'} still busy with {earlier_method}(), an earlier call "
            f"that timed out and has not returned, and {name} waits behind it. Neither can "
            f"be interrupted: each runs to its end in the worker, and later plain calls to "
            f"{'that rank' if one else 'those ranks'} queue behind them (async methods still run).")
    if starting and not busy and not behind:
        parts.append(f"{name} is a plain (non-async) method: once it runs, nothing "
                     "interrupts it, and later plain calls to the rank queue behind it.")
    _remember(call, pending)
    return " ".join(parts)


def _pending(call: Any) -> list[int]:
    """The indices (in ``call.ranks``) of the ranks that have not answered ``call``."""
    answered = call.answered
    return [i for i in range(len(call.ranks)) if not answered >> i & 1]


def _stalled_before(call: Any, i: int) -> Any:
    """The earlier timed-out plain call that rank ``call.ranks[i]`` has not answered, which
    ``call`` (sent after it) waits behind there; None if there is none."""
    rank = call.ranks[i]
    earlier = call.group.ranks[rank].stalled
    if earlier is None or earlier is call:
        return None
    j = _index(earlier, rank)
    if j is None or earlier.answered >> j & 1 or not _request_id(earlier, j) < _request_id(call, i):
        return None
    return earlier


def _remember(call: Any, pending: list[int]) -> None:
    """Note a plain call that a wait gave up on as what the method thread of each rank that
    has not answered it is busy with, unless that rank is known to be busy with an earlier one."""
    states = call.group.ranks
    for i in pending:
        state = states[call.ranks[i]]
        earlier = state.stalled
        if earlier is not None and earlier is not call:
            j = _index(earlier, call.ranks[i])
            if j is not None and not earlier.answered >> j & 1 and not (
                    _request_id(call, i) < _request_id(earlier, j)):
                continue  # that rank's thread is busy with the earlier one
        state.stalled = call


def _index(call: Any, rank: int) -> int | None:
    try:
        return int(call.ranks.index(rank))
    except ValueError:
        return None


def _request_id(call: Any, i: int) -> float:
    """The request id of rank ``i``'s part of ``call`` while it has not answered (ids grow with
    each request: an earlier call's are smaller); infinity while it is not sent yet."""
    rid = call.results[i]
    return rid if type(rid) is int and rid > 0 else float("inf")


def _rank_word(ranks: list[int]) -> str:
    return "rank" if len(ranks) == 1 else "ranks"


def _ranks(ranks: Any) -> str:
    named = ", ".join(str(r) for r in list(ranks)[:_MAX_NAMED])
    more = len(ranks) - _MAX_NAMED
    return named + (f" and {more} more" if more > 0 else "")
