"""The producer side of :class:`~aiorl.AsyncWork`: creating and completing works.

Consumers (user code) hold an ``AsyncWork`` and only read it: ``await``, ``wait``,
``then``, ``cancel``. The services that produce results (group calls, P2P, channels)
complete works only through these functions, on the runtime loop. Keeping completion in
one module gives one place to attach tracing and the doctor's view of pending work; an
import-linter contract lets only the runtime's service layers import it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, TypeVar

from aiorl.runtime.work import AsyncWork, _mirror_lock, mirror_to

__all__ = ["is_settled", "link_threads", "reject", "resolve", "settle_from"]

T = TypeVar("T")


def resolve(work: AsyncWork[T], value: T) -> None:
    """Complete ``work`` with ``value`` (runtime loop only; no-op if already done)."""
    fut = work._fut
    if not fut.done():
        fut.set_result(value)


def reject(work: AsyncWork[Any], exc: BaseException) -> None:
    """Fail ``work`` with ``exc`` (runtime loop only; no-op if already done)."""
    fut = work._fut
    if not fut.done():
        fut.set_exception(exc)


def settle_from(work: AsyncWork[Any], fut: asyncio.Future[Any]) -> None:
    """Complete ``work`` as ``fut`` completed: result, exception or cancellation."""
    if fut.cancelled():
        work._fut.cancel()
    elif (exc := fut.exception()) is not None:
        reject(work, exc)
    else:
        resolve(work, fut.result())


def is_settled(work: AsyncWork[Any]) -> bool:
    """Whether ``work`` has its outcome on the loop side (what producers check)."""
    return work._fut.done()


def link_threads(work: AsyncWork[T]) -> concurrent.futures.Future[T]:
    """Create ``work``'s thread-safe mirror now, on the loop.

    A producer that knows a thread will wait (the work was created off the loop) links
    it while it is on the loop anyway, so ``wait()`` needs no extra loop wake-up.
    """
    with _mirror_lock:
        cf = work._cf
        if cf is None:
            cf = work._cf = concurrent.futures.Future()
            work._fut.add_done_callback(lambda f: mirror_to(f, cf))
    return cf
