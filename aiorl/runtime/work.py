"""``AsyncWork``: the handle every remote operation returns.

An :class:`AsyncWork` wraps an :class:`asyncio.Future` that lives on the aiorl
runtime loop of this process (the worker's loop, or the driver's I/O thread).
It can be consumed from anywhere:

* ``await work`` / ``await work.async_wait()`` in a coroutine, on the runtime
  loop or on any other loop (the result is handed across threads);
* ``work.wait(timeout)`` from synchronous code on any thread *except* the
  runtime loop's own thread, where blocking would stop the loop that must
  deliver the result (that raises :class:`RuntimeError` instead of hanging);
* ``work.then(fn)`` to chain a callback, giving an :class:`AsyncFuncWork`.

Cancellation: ``wait(timeout)`` that expires cancels the work locally and
raises :class:`TimeoutError`; a task cancelled while it awaits the work
cancels the work too. Local cancellation withdraws what this process waits
for (a pending receive no longer consumes a message; a call's late answer is
dropped); it never interrupts code already running in a remote worker.

Ordering: callbacks added with ``then`` run on the runtime loop, in the order
they were added, after the work completes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["AsyncChannelWork", "AsyncCollWork", "AsyncFuncWork", "AsyncWork"]

T = TypeVar("T")

_running_loop = asyncio._get_running_loop  # C-level and cheap; a public alias raises instead


class AsyncWork(Generic[T]):
    """A result that will exist later. See the module docstring for the rules."""

    __slots__ = ("_loop", "_fut", "_cf", "_cf_lock", "_next")

    def __init__(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[T] | None = None) -> None:
        self._loop = loop
        self._fut: asyncio.Future[T] = fut if fut is not None else loop.create_future()
        self._cf: concurrent.futures.Future[T] | None = None
        self._cf_lock = threading.Lock()
        self._next: AsyncWork[Any] | None = None

    # ---------------------------------------------------------------- construction helpers
    @classmethod
    def completed(cls, loop: asyncio.AbstractEventLoop, value: T) -> AsyncWork[T]:
        work: AsyncWork[T] = cls(loop)
        work._fut.set_result(value)
        return work

    def _on_loop(self) -> bool:
        return _running_loop() is self._loop

    def _call_on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._on_loop():
            fn(*args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    def _set_result(self, value: T) -> None:
        """Complete the work (runtime loop only)."""
        if not self._fut.done():
            self._fut.set_result(value)

    def _set_exception(self, exc: BaseException) -> None:
        """Fail the work (runtime loop only)."""
        if not self._fut.done():
            self._fut.set_exception(exc)

    def _complete_from(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            self._fut.cancel()
        elif fut.exception() is not None:
            self._set_exception(fut.exception())  # type: ignore[arg-type]
        else:
            self._set_result(fut.result())

    def _concurrent(self) -> concurrent.futures.Future[T]:
        """A thread-safe mirror of the result, created once (on first cross-thread use)."""
        with self._cf_lock:
            if self._cf is None:
                cf: concurrent.futures.Future[T] = concurrent.futures.Future()
                self._cf = cf
                self._call_on_loop(self._fut.add_done_callback, lambda f: _mirror(f, cf))
            return self._cf

    # ---------------------------------------------------------------- consuming
    def done(self) -> bool:
        cf = self._cf
        return self._fut.done() or (cf is not None and cf.done())

    def wait(self, timeout: float | None = None) -> T:
        """Block until done and return the result (or raise the work's exception).

        Raises :class:`TimeoutError` after ``timeout`` seconds, cancelling the work.
        Raises :class:`RuntimeError` when called on the runtime loop's thread
        before the work is done (use ``await`` there).
        """
        if self._fut.done():
            return self._fut.result()
        if self._on_loop():
            raise RuntimeError(
                "AsyncWork.wait() was called on the aiorl event loop's thread, where blocking "
                "would stop the loop that delivers the result; use 'await work' in async code"
            )
        cf = self._concurrent()
        try:
            return cf.result(timeout)
        except concurrent.futures.TimeoutError:
            if cf.done():
                raise  # the work's own result is a TimeoutError (on 3.11 the types are one)
            self.cancel()
            raise TimeoutError(f"AsyncWork not done within {timeout} s (cancelled)") from None

    async def async_wait(self) -> T:
        """Wait without blocking the event loop; same as ``await work``."""
        return await self

    def __await__(self) -> Generator[Any, None, T]:
        if self._on_loop():
            return (yield from self._fut.__await__())
        return (yield from asyncio.wrap_future(self._concurrent()).__await__())

    def cancel(self) -> bool:
        """Cancel locally (see the module docstring). False if already done."""
        if self._fut.done():
            return False
        cf = self._cf
        if cf is not None:
            cf.cancel()  # visible to other threads now, before the loop gets to it
        self._call_on_loop(self._fut.cancel)
        return True

    def exception(self) -> BaseException | None:
        return self._fut.exception() if self._fut.done() else None

    # ---------------------------------------------------------------- chaining
    def then(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> AsyncFuncWork[Any]:
        """Run ``fn(result, *args, **kwargs)`` on the runtime loop once this work completes.

        If ``fn`` returns an :class:`AsyncWork`, the returned work completes when
        that one does. An exception here (or in ``fn``) propagates down the chain
        without calling ``fn``.
        """
        nxt: AsyncFuncWork[Any] = AsyncFuncWork(self._loop)
        self._next = nxt

        def run(fut: asyncio.Future[T]) -> None:
            if fut.cancelled():
                nxt._fut.cancel()
                return
            if fut.exception() is not None:
                nxt._set_exception(fut.exception())  # type: ignore[arg-type]
                return
            try:
                value = fn(fut.result(), *args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the chain's consumer
                nxt._set_exception(exc)
                return
            if isinstance(value, AsyncWork):
                nxt._deferred = value
                value._call_on_loop(value._fut.add_done_callback, nxt._complete_threadsafe)
            else:
                nxt._set_result(value)

        self._call_on_loop(self._fut.add_done_callback, run)
        return nxt

    def get_next_work(self) -> AsyncWork[Any] | None:
        """The work created by the latest ``then`` on this one, if any."""
        return self._next

    def get_last_work(self) -> AsyncWork[Any]:
        """Follow ``then`` links to the end of the chain."""
        work: AsyncWork[Any] = self
        while work._next is not None:
            work = work._next
        return work

    def __repr__(self) -> str:
        state = "pending"
        if self._fut.done():
            state = "cancelled" if self._fut.cancelled() else (
                "failed" if self._fut.exception() else "done")
        return f"<{type(self).__name__} {state}>"


class AsyncFuncWork(AsyncWork[T]):
    """The result of ``then``: completes with the callback's value (or the work it returned)."""

    __slots__ = ("_deferred",)

    def __init__(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[T] | None = None) -> None:
        super().__init__(loop, fut)
        self._deferred: AsyncWork[Any] | None = None

    def _complete_threadsafe(self, fut: asyncio.Future[Any]) -> None:
        self._call_on_loop(self._complete_from, fut)


class AsyncCollWork(AsyncWork[T]):
    """Wraps ``torch.distributed`` work objects (and optional CUDA events).

    Completion is observed on a helper thread so that ``async_wait`` never blocks
    the event loop; for CUDA work, the work is done only once its recorded CUDA
    event has completed too. ``result`` is what the work resolves to.
    """

    __slots__ = ()

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        works: Sequence[Any],
        result: Any = None,
        cuda_events: Sequence[Any] = (),
        on_done: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__(loop)

        def watch() -> None:
            try:
                for w in works:
                    w.wait()
                for ev in cuda_events:
                    ev.synchronize()
                value = on_done() if on_done is not None else result
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                loop.call_soon_threadsafe(self._set_exception, exc)
                return
            loop.call_soon_threadsafe(self._set_result, value)

        threading.Thread(target=watch, name="aiorl-coll-wait", daemon=True).start()


class AsyncChannelWork(AsyncWork[T]):
    """An operation on a :class:`~aiorl.Channel` (put, get, get_batch, statistics)."""

    __slots__ = ()


def _mirror(fut: asyncio.Future[Any], cf: concurrent.futures.Future[Any]) -> None:
    if cf.done():
        return
    if fut.cancelled():
        cf.cancel()
        cf.set_running_or_notify_cancel()
    elif fut.exception() is not None:
        cf.set_exception(fut.exception())
    else:
        cf.set_result(fut.result())
