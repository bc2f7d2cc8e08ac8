"""The producer side of [`AsyncWork`][aiorl.AsyncWork]: creating and completing works.

Consumers (user code) hold an ``AsyncWork`` and only read it: ``await``, ``wait``,
``then``, ``cancel``. The services that produce results (group calls, P2P, channels)
complete works only through these functions, on the runtime loop. Keeping completion in
one module gives one place to attach tracing and the doctor's view of pending work; an
import-linter contract lets only the runtime's service layers import it.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from aiorl.runtime.work import AsyncWork, TimeoutExplainer, _allocate_lock
from aiorl.trace.recorder import Span

__all__ = [
    "explain_timeouts", "is_settled", "link_threads", "prepare_threads", "reject", "resolve",
    "settle_from", "trace_until_settled",
]

T = TypeVar("T")


def resolve(work: AsyncWork[T], value: T) -> None:
    """Complete ``work`` with ``value`` (runtime loop only; no-op if already done)."""
    fut = work._fut
    if not fut.done():
        fut.set_result(value)
        if work._cf is not None:
            work._wake_threads(fut)


def reject(work: AsyncWork[Any], exc: BaseException) -> None:
    """Fail ``work`` with ``exc`` (runtime loop only; no-op if already done)."""
    fut = work._fut
    if not fut.done():
        fut.set_exception(exc)
        if work._cf is not None:
            work._wake_threads(fut)


def settle_from(work: AsyncWork[Any], fut: asyncio.Future[Any]) -> None:
    """Complete ``work`` as ``fut`` completed: result, exception or cancellation."""
    if fut.cancelled():
        work._fut.cancel()
    elif (exc := fut.exception()) is not None:
        reject(work, exc)
    else:
        resolve(work, fut.result())


def explain_timeouts(work: AsyncWork[Any], about: TimeoutExplainer) -> None:
    """Let ``about`` word the [`WaitTimeout`][aiorl.WaitTimeout] of a ``wait(timeout)`` on
    ``work`` that expires (what was not done, and what goes on regardless); any thread."""
    work._about = about


def is_settled(work: AsyncWork[Any]) -> bool:
    """Whether ``work`` has its outcome on the loop side (what producers check)."""
    return work._fut.done()


def prepare_threads(work: AsyncWork[T]) -> None:
    """Give ``work`` its thread-side signal before it is shared (on the creating thread).

    A producer that creates a work off the loop (a thread will most likely wait on it)
    prepares it, then has the loop `link_threads`: ``wait()`` then needs neither an
    extra loop wake-up nor the mirror lock (no contention with the loop thread).
    """
    if work._cf is None:
        lock = _allocate_lock()
        lock.acquire()
        work._cf = lock


def link_threads(work: AsyncWork[T]) -> None:
    """On the loop: connect a work prepared with `prepare_threads` to its signal."""
    assert work._cf is not None, "link_threads() needs a work prepared with prepare_threads()"
    work._fut.add_done_callback(work._wake_threads)


def trace_until_settled(work: AsyncWork[Any], span: Span) -> None:
    """Close ``span`` when ``work`` settles (tracing on only; any thread).

    The span stays among the process's open spans meanwhile: what ``aiorl doctor`` lists
    as this process's pending operations, with their age and peer.
    """
    work._call_on_loop(work._fut.add_done_callback, span.settled)
