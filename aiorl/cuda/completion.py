"""When GPU work is done, told to the event loop: loop futures for CUDA events and NCCL works.

A copy's event is waited for by an `EventWaiter` (`aiorl.cuda.events`). NCCL transfers,
whose events may depend on what the peer does next, are polled with their works' status by
the runtime's waiter thread instead (`gpu_done`), so a failure NCCL reports fails the
transfer at once. Either way the loop is woken once, with `settle_future`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from aiorl.errors import PeerLostError
from aiorl.runtime.waiter import BlockingWaiter, Job

__all__ = ["GpuHost", "after_work_thread", "gpu_done", "settle_future", "work_results"]


class GpuHost(Protocol):
    """What the GPU helpers use of the engine or broadcaster they serve."""

    loop: asyncio.AbstractEventLoop
    waiter: BlockingWaiter

    def call_soon_threadsafe(self, fn: Callable[..., object], *args: Any) -> None: ...


def work_results(works: Sequence[Any]) -> list[Any]:
    """The result futures of NCCL ``works`` (``Work.get_future_result``: completed by
    ProcessGroupNCCL's watchdog with a ``WorkResult``), where this torch has them."""
    results = []
    for w in works:
        get = getattr(w, "get_future_result", None)
        if get is not None:
            results.append(get())
    return results


def _work_error(results: Sequence[Any], pg: Any) -> str | None:
    """Why NCCL works failed (None: nothing says they did). With asynchronous error
    handling off, a timed-out work is reported through its result future and a remote or
    communicator error through the group's error state, never by its CUDA event; the
    deprecated ``Work.exception``/``is_success`` are not used (WorkNCCL does not
    implement them)."""
    for r in results:
        if r.done():
            value = int(r.value())
            if value != 0:  # WorkResult.SUCCESS
                return f"NCCL work result {value} (1: timeout, 2: communicator error)"
    get_error = getattr(pg, "get_error", None)
    if get_error is not None:
        try:
            err = get_error()
        except Exception:  # noqa: BLE001 - an older torch: the results are what we have
            return None
        if getattr(err, "name", "SUCCESS") != "SUCCESS":
            return f"NCCL reported {err.name}"
    return None


def gpu_done(
    host: GpuHost, event: Any, works: Sequence[Any] = (), pg: Any = None, keep: object = None
) -> asyncio.Future[None]:
    """A loop future done once ``event`` (recorded after the transfer on its side stream)
    completed, failed as soon as NCCL reports ``works`` failed; polled by the runtime's one
    waiter thread. ``keep`` stays referenced until then (the tensors)."""
    fut: asyncio.Future[None] = host.loop.create_future()
    results = work_results(works)

    def ready() -> bool:
        if results or pg is not None:
            why = _work_error(results, pg)
            if why is not None:
                raise PeerLostError(f"NCCL transfer failed: {why}")
        return bool(event.query())

    def report(error: BaseException | None) -> None:  # waiter thread
        host.call_soon_threadsafe(settle_future, fut, error, keep)

    host.waiter.watch(Job(ready, report))
    return fut


def after_work_thread(
    host: GpuHost,
    issued: concurrent.futures.Future[Any],
    then: Callable[[Any], asyncio.Future[None]],
) -> asyncio.Future[None]:
    """A loop future for work-thread work: ``issued`` (work thread) yields a value,
    ``then(value)`` (loop) returns the future of its GPU completion; failures and
    cancellation propagate."""
    fut: asyncio.Future[None] = host.loop.create_future()

    def on_loop(cf: concurrent.futures.Future[Any]) -> None:
        if fut.done():
            return
        if cf.cancelled():
            settle_future(fut, PeerLostError("the CUDA transfer was abandoned"), None)
            return
        exc = cf.exception()
        if exc is not None:
            settle_future(fut, exc, None)
            return
        try:
            inner = then(cf.result())
        except BaseException as exc:  # noqa: BLE001 - the transfer fails, not the loop
            settle_future(fut, exc, None)
            return
        inner.add_done_callback(lambda f: _chain(f, fut))

    issued.add_done_callback(lambda cf: host.call_soon_threadsafe(on_loop, cf))
    return fut


def _chain(src: asyncio.Future[None], dst: asyncio.Future[None]) -> None:
    if dst.done():
        return
    if src.cancelled():
        dst.set_exception(PeerLostError("the CUDA transfer was abandoned"))
    elif src.exception() is not None:
        dst.set_exception(src.exception())  # type: ignore[arg-type]
    else:
        dst.set_result(None)


def settle_future(fut: asyncio.Future[None], error: BaseException | None,
                  keep: object = None) -> None:
    """Complete ``fut`` unless it is done (``keep``, e.g. the tensors a transfer reads, stays
    referenced until then)."""
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
