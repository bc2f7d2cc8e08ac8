"""``AsyncWork``: the handle every remote operation returns.

An [`AsyncWork`][aiorl.AsyncWork] wraps an `asyncio.Future` that lives on the aiorl
runtime loop of this process (the worker's loop, or the driver's I/O thread).
It can be consumed from anywhere:

* ``await work`` / ``await work.async_wait()`` in a coroutine, on the runtime
  loop or on any other loop (the result is handed across threads);
* ``work.wait(timeout)`` from synchronous code on any thread *except* the
  runtime loop's own thread, where blocking would stop the loop that must
  deliver the result (that raises `RuntimeError` instead of hanging);
* ``work.then(fn)`` to chain a callback, giving an [`AsyncFuncWork`][aiorl.AsyncFuncWork].

Cancellation: ``wait(timeout)`` that expires cancels the work locally and
raises [`WaitTimeout`][aiorl.WaitTimeout] (a ``TimeoutError``); a task cancelled while it awaits the
work cancels the work too. Local cancellation withdraws what this process waits
for (a pending receive no longer consumes a message; a call's late answer is
dropped); it never interrupts code already running in a remote worker.

Ordering: callbacks added with ``then`` run on the runtime loop, in the order
they were added, after the work completes.

This module is the consumer side. Producers (group calls, P2P, channels) create and
complete works through `aiorl.runtime.promise`.
"""

from __future__ import annotations

import _thread
import asyncio
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from aiorl.errors import ClusterClosedError, WaitTimeout
from aiorl.runtime.loop import LoopThread, loop_thread_of
from aiorl.runtime.waiter import BlockingWaiter, Job
from aiorl.util.threads import acquire_interruptibly

__all__ = ["AsyncChannelWork", "AsyncCollWork", "AsyncFuncWork", "AsyncWork", "UnawaitedWorkError"]

T = TypeVar("T")
V = TypeVar("V")


class TimeoutExplainer(Protocol):
    """What a producer attaches to a work (`aiorl.runtime.promise.explain_timeouts`) so that
    a ``wait(timeout)`` that expires says what was not done, and what goes on without it."""

    def timeout_message(self, timeout: float | None) -> str:
        """The [`WaitTimeout`][aiorl.WaitTimeout]'s message (on the waiting thread)."""

# Creating a work's thread-side signal is rare (a thread waits on it) and must happen once:
# one lock for all works, not a lock per work on the hot path.
_mirror_lock = threading.Lock()
_allocate_lock = _thread.allocate_lock


class UnawaitedWorkError(TypeError):
    """An [`AsyncWork`][aiorl.AsyncWork] met where a value must travel (a result, a send's payload).

    ``work`` is the work that was met: a worker whose method returned it cancels it, as
    nobody can await it any more (docs/failures.md).
    """

    def __init__(self, message: str, work: AsyncWork[Any]) -> None:
        super().__init__(message)
        self.work = work


class AsyncWork(Generic[T]):
    """A result that will exist later. See the module docstring for the rules.

    Example:
        ```python
        work = group.step(batch)              # returns at once
        results = work.wait(timeout=60)       # from synchronous code, or:
        results = await group.step(batch)     # from a coroutine, on any event loop
        group.step(batch).then(print)         # a callback, on the runtime loop
        ```
    """

    __slots__ = ("_loop", "_home", "_fut", "_cf", "_next", "_cancelling", "_about")

    #: Set by a producer that can say more when a wait expires (a group call: the method and
    #: its ranks); left unset otherwise (no store per work): read with ``getattr``.
    _about: TimeoutExplainer

    def __init__(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[T] | None = None) -> None:
        self._loop = loop
        self._home: LoopThread | None = loop_thread_of(loop)
        self._fut: asyncio.Future[T] = fut if fut is not None else loop.create_future()
        #: Held until the work settles: what other threads block on (see :meth:`_thread_signal`).
        self._cf: _thread.LockType | None = None
        self._next: AsyncWork[Any] | None = None
        #: Cancelled from another thread, before the loop got to it: done for every reader now.
        self._cancelling = False

    def _on_loop(self) -> bool:
        home = self._home
        if home is not None:
            return threading.get_ident() == home.thread_id
        try:  # a loop aiorl does not run (tests, foreign code): ask asyncio
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _call_on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        home = self._home
        if home is not None:
            home.submit(fn, *args)
        elif self._on_loop():
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

    def _thread_signal(self) -> _thread.LockType:
        """A lock held until the work settles, for threads to block on; made once.

        A plain lock (one C call to make) rather than a ``concurrent.futures.Future``
        (a condition, an RLock and a dozen Python lines): a driver thread with 1,000 calls in
        flight makes one per call. The loop releases it when the work settles; a waiter
        acquires it and releases it again at once, so every waiting thread gets through.
        """
        lock = self._cf
        if lock is not None:  # prepared by its producer (or made earlier): no lock needed
            return lock
        with _mirror_lock:
            lock = self._cf
            if lock is None:
                lock = _allocate_lock()
                lock.acquire()
                self._cf = lock
                try:
                    self._call_on_loop(self._fut.add_done_callback, self._wake_threads)
                except BaseException:  # the runtime is closed: nothing will release it
                    self._cf = None
                    raise
            return lock

    def _wake_threads(self, _fut: asyncio.Future[T]) -> None:
        """Let blocked threads through, once (runtime loop only).

        The future's done-callback, and called at once by the producers' ``resolve`` and
        ``reject``: a waiting thread then wakes in the loop turn that read the answer, not a
        turn later when asyncio runs done-callbacks. The lock is forgotten as it is
        released, so the later callback finds nothing to do; a thread that asks for a
        signal after that sees the work done first (or gets a fresh lock, released by a
        callback on the done future).
        """
        lock = self._cf
        if lock is not None:
            self._cf = None
            lock.release()

    # ---------------------------------------------------------------- consuming
    def __getattr__(self, name: str) -> Any:
        # Only reached for names the class lacks. Ray's ray.get(ref), concurrent.futures'
        # result(): answered with this class's spelling, not a bare AttributeError.
        if name in ("get", "result"):
            raise AttributeError(
                f"an AsyncWork has no .{name}(): work.wait(timeout) blocks for the result "
                "(Ray's ray.get(ref)); in a coroutine, await work; a call on one rank gives "
                "its value with .wait_one()")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def done(self) -> bool:
        """Whether the work has completed (with a result, an error, or cancelled)."""
        return self._fut.done() or self._cancelling

    def wait(self, timeout: float | None = None) -> T:
        """Block until done and return the result (or raise the work's exception).

        Raises [`WaitTimeout`][aiorl.WaitTimeout] (a ``TimeoutError``) after ``timeout`` seconds,
        cancelling the work.
        Raises `RuntimeError` when called on the runtime loop's thread
        before the work is done (use ``await`` there).
        """
        if self._fut.done():
            return self._fut.result()
        if self._cancelling:
            raise asyncio.CancelledError()
        if self._on_loop():
            raise RuntimeError(
                "AsyncWork.wait() was called on the aiorl event loop's thread, where blocking "
                "would stop the loop that delivers the result; use 'await work' in async code"
            )
        lock = self._thread_signal()
        # In slices on the main thread: a Ctrl-C that another thread took raises here.
        if acquire_interruptibly(lock, -1 if timeout is None else max(timeout, 0.0)):
            lock.release()
            return self._fut.result()
        if self._fut.done():  # settled as the wait expired
            return self._fut.result()
        self.cancel()
        raise WaitTimeout(self._timeout_message(timeout)) from None

    def _timeout_message(self, timeout: float | None) -> str:
        about: TimeoutExplainer | None = getattr(self, "_about", None)
        if about is not None:
            try:
                return about.timeout_message(timeout)
            except Exception:  # noqa: BLE001 - a description must never hide the timeout
                pass
        return f"AsyncWork not done within {timeout} s (cancelled)"

    def wait_one(self: AsyncWork[Sequence[V]], timeout: float | None = None) -> V:
        """[`wait`][aiorl.AsyncWork.wait] for a call on one rank: its one result, not a list.

        A group call's result is a list with one result per rank called, even for a group
        of one (RLinf's semantics); Ray's ``ray.get(actor.f.remote())`` gives the value. This
        gives the value of a call that went to exactly one rank (a group of one, or
        ``group.execute_on(i)``), and refuses any other rather than drop results.

        Args:
            timeout: Seconds to wait, as for ``wait``; ``None`` waits as long as the peer lives.

        Returns:
            The one result.

        Raises:
            ValueError: The call gave no result or several (it went to that many ranks); the
                message says how many. Use ``wait()`` for the list.
            TypeError: The work's result is not a list of per-rank results (not a group call).
            WaitTimeout: Not done within ``timeout`` (the work is cancelled), as for ``wait``.

        Example:
            ```python
            counter = Counter.create_group(10).launch(cluster, num_workers=1)
            counter.incr().wait()          # [11]: one result per rank
            counter.incr().wait_one()      # 12
            squares = [g.execute_on(i).sq(i) for i in range(4)]
            [w.wait_one() for w in squares]   # [0, 1, 4, 9]
            ```
        """
        return _only_result(self.wait(timeout))

    async def async_wait_one(self: AsyncWork[Sequence[V]]) -> V:
        """[`wait_one`][aiorl.AsyncWork.wait_one] for coroutines: the one result of a call on
        one rank (``await actor.f.remote()`` in Ray).

        Returns:
            The one result.

        Raises:
            ValueError: The call gave no result or several; the message says how many.
            TypeError: The work's result is not a list of per-rank results.

        Example:
            ```python
            value = await counter.incr().async_wait_one()          # 11
            squares = await asyncio.gather(
                *(g.execute_on(i).sq(i).async_wait_one() for i in range(4)))   # [0, 1, 4, 9]
            ```
        """
        return _only_result(await self)

    async def async_wait(self) -> T:
        """Wait without blocking the event loop; same as ``await work``."""
        return await self

    def __await__(self) -> Generator[Any, None, T]:
        if self._on_loop():
            return (yield from self._fut.__await__())
        return (yield from self._await_from_other_loop().__await__())

    async def _await_from_other_loop(self) -> T:
        """Await on a loop other than the runtime's: the outcome is relayed to this loop."""
        loop = asyncio.get_running_loop()
        relayed: asyncio.Future[None] = loop.create_future()

        def relay(_fut: asyncio.Future[T]) -> None:  # on the runtime loop
            try:
                loop.call_soon_threadsafe(_set_done, relayed)
            except RuntimeError:
                pass  # the awaiting loop is closed: nobody is left to tell

        self._call_on_loop(self._fut.add_done_callback, relay)
        try:
            await relayed
        except asyncio.CancelledError:
            self.cancel()  # the awaiting task was cancelled: so is the work
            raise
        return self._fut.result()

    def cancel(self) -> bool:
        """Cancel locally (see the module docstring). False if already done."""
        if self._fut.done() or self._cancelling:
            return False
        if not self._on_loop():
            self._cancelling = True  # visible to other threads now, before the loop gets to it
        try:
            self._call_on_loop(self._fut.cancel)
        except ClusterClosedError:
            pass  # the runtime is closed: no loop is left to tell, and nothing waits there
        return True

    def exception(self) -> BaseException | None:
        """The error the work failed with; None while pending or when it succeeded."""
        return self._fut.exception() if self._fut.done() else None

    # ---------------------------------------------------------------- chaining
    def then(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> AsyncFuncWork[Any]:
        """Run ``fn(result, *args, **kwargs)`` on the runtime loop once this work completes.

        If ``fn`` returns an [`AsyncWork`][aiorl.AsyncWork], the returned work completes when
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

    def __reduce__(self) -> Any:
        # A work is a handle on a future in this process: it cannot travel. Met in a
        # return value or a send, it is almost always a missing ``await``.
        raise UnawaitedWorkError(
            f"an {type(self).__name__} cannot be returned from a worker method or sent: it is a "
            "handle on a result in this process; did you forget `await` (or `.wait()`)?", self)

    def __repr__(self) -> str:
        state = "pending"
        if self._fut.done():
            state = "cancelled" if self._fut.cancelled() else (
                "failed" if self._fut.exception() else "done")
        return f"<{type(self).__name__} {state}>"


class AsyncFuncWork(AsyncWork[T]):
    """The result of ``then``: completes with the callback's value (or the work it returned).

    Example:
        ```python
        sizes = group.generate(8).then(lambda results: [len(r) for r in results])
        print(sizes.wait())
        ```
    """

    __slots__ = ()

    def _complete_threadsafe(self, fut: asyncio.Future[Any]) -> None:
        self._call_on_loop(self._complete_from, fut)


class AsyncCollWork(AsyncWork[T]):
    """Wraps ``torch.distributed`` work objects (and optional CUDA events).

    Completion is observed by the process's `BlockingWaiter`
    thread, so that ``async_wait`` never blocks the event loop; for CUDA work, the work is
    done only once its recorded CUDA events have completed too. The work resolves to
    ``on_done()`` when given, else to ``result``; a failed torch work (``wait()`` raises)
    fails it.

    Example:
        ```python
        work = self.broadcast(tensor, groups=[("trainer", [0, 1])], async_op=True)
        tensor = await work                   # an AsyncCollWork where NCCL carries it
        ```
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

        # A work that ended before its torch works did (cancelled, or failed by its owner)
        # stops being polled: a work that never completes must not keep the waiter busy.
        def ready() -> bool:
            if self.done():
                return True
            return all(w.is_completed() for w in works) and all(ev.query() for ev in cuda_events)

        def report(error: BaseException | None) -> None:
            if self.done():
                return  # nothing to tell; a blocking wait() on its works would hang here
            value: Any = None
            if error is None:
                try:
                    for w in works:
                        w.wait()  # completed: returns at once, or raises the work's error
                    value = on_done() if on_done is not None else result
                except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                    error = exc
            if error is not None:
                self._call_on_loop(self._set_exception, error)
            else:
                self._call_on_loop(self._set_result, value)

        _WAITER.watch(Job(ready, report))


#: The process's one waiter thread (started on first use; reports route to each work's loop).
_WAITER = BlockingWaiter()


class AsyncChannelWork(AsyncWork[T]):
    """An operation on a [`Channel`][aiorl.Channel] (put, get, get_batch, statistics).

    Example:
        ```python
        await channel.put(trajectory, weight=len(trajectory))
        batch = await channel.get_batch(4096)
        ```
    """

    __slots__ = ()


def _only_result(results: Sequence[V]) -> V:
    """The one element of a group call's per-rank results (`AsyncWork.wait_one`)."""
    if not isinstance(results, list):
        raise TypeError(
            f"wait_one() is for group calls, whose result is a list with one result per rank; "
            f"this work's result is a {type(results).__name__}: use wait()")
    if len(results) != 1:
        raise ValueError(
            f"wait_one() expects the result of a call on exactly one rank, and this call gave "
            f"{len(results)} results (one per rank called); use wait() for the list, or call "
            "one rank: group.execute_on(rank).method(...)")
    only: V = results[0]
    return only


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
