"""``LoopThread``: one event loop and the thread that runs it; the one way across threads.

Every aiorl process has one runtime loop: a worker's main thread, or a driver's private
I/O thread. Code on other threads (a driver's synchronous user code, a worker's method
thread, a waiter thread) reaches the loop only through this class:

* `LoopThread.submit` runs a callback on the loop. Submissions from other threads
  run in the order they were made and are batched: only the first of a burst wakes the
  loop (a wake-up costs tens of microseconds; 1,000 calls in flight would pay it 1,000
  times). On the loop thread, ``submit`` runs the callback at once.
* `LoopThread.run_sync` runs a coroutine on the loop and blocks the calling thread
  for its result; on the loop thread it refuses (blocking there would stop the loop).
* `LoopThread.on_loop` says whether the caller is on the loop thread: a thread-id
  comparison, as cheap as asyncio's private running-loop check.

Once `LoopThread.refuse` has run (the runtime is stopping: its Cluster closed, or its
embedded registry died), ``submit`` and ``run_sync`` from other threads raise the error it
names at once instead of queueing work that no loop will run; a ``run_sync`` still blocked
when the loop stops gets that error too, and a submission that raced with the stop is run
where it can still fail its work (the services are closed by then).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aiorl.errors import ClusterClosedError, WaitTimeout
from aiorl.util.threads import RuntimeThread, result_interruptibly

__all__ = ["LoopThread", "loop_thread_of"]

log = logging.getLogger("aiorl.runtime")
T = TypeVar("T")

# Every LoopThread by its loop, so that an AsyncWork made with a bare loop finds its thread.
_by_loop: dict[asyncio.AbstractEventLoop, LoopThread] = {}


#: The :class:`LoopThread` that runs a loop, if aiorl made or adopted one for it. The
#: dictionary's own ``get``, not a Python function: every AsyncWork asks once.
loop_thread_of: Callable[[asyncio.AbstractEventLoop], LoopThread | None] = _by_loop.get


class LoopThread:
    """An event loop, the id of the thread running it, and a FIFO of cross-thread callbacks."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread_id: int,
                 thread: threading.Thread | None = None) -> None:
        self.loop = loop
        self.thread_id = thread_id
        #: The thread we started, or None when the loop runs on a thread we adopted.
        self.thread = thread
        self._submissions: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque())
        self._wake_pending = False
        #: Set by :meth:`refuse`: makes the error that work offered from now on raises.
        self.refusal: Callable[[], BaseException] | None = None
        #: True once a loop thread we started has left its loop for good.
        self._stopped = False
        #: The futures of ``run_sync`` calls still blocked: failed with the refusal at the end.
        self._blocked: set[concurrent.futures.Future[Any]] = set()
        _by_loop[loop] = self

    # ------------------------------------------------------------------ construction
    @classmethod
    def adopt_running(cls) -> LoopThread:
        """The loop running on this thread (a worker's main loop) as a LoopThread."""
        loop = asyncio.get_running_loop()
        return _by_loop.get(loop) or cls(loop, threading.get_ident())

    @classmethod
    def start(cls, name: str, setup: Callable[[LoopThread], T]) -> tuple[LoopThread, T]:
        """Start a uvloop on a new daemon thread and run ``setup`` there first.

        Returns the loop thread and what ``setup`` returned (or raises what it raised).
        """
        import uvloop

        loop = uvloop.new_event_loop()
        ready: concurrent.futures.Future[tuple[LoopThread, T]] = concurrent.futures.Future()

        def main() -> None:
            asyncio.set_event_loop(loop)
            lt = cls(loop, threading.get_ident(), threading.current_thread())

            def run_setup() -> None:
                try:
                    ready.set_result((lt, setup(lt)))
                except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
                    ready.set_exception(exc)

            loop.call_soon(run_setup)
            try:
                loop.run_forever()
            finally:
                _by_loop.pop(loop, None)
                lt._after_loop()

        RuntimeThread(target=main, name=f"aiorl-io-{name}", daemon=True).start()
        return result_interruptibly(ready, timeout=10)

    # ------------------------------------------------------------------ crossing threads
    def on_loop(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.get_ident() == self.thread_id

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop: now when on the loop thread, else soon, in order.

        Raises the refusal's error (`refuse`) at once from another thread once the
        loop is being stopped for good.
        """
        if threading.get_ident() == self.thread_id:
            fn(*args)
            return
        refusal = self.refusal
        if refusal is not None:
            raise refusal()
        self._submissions.append((fn, args))
        if not self._wake_pending:
            self._wake_pending = True
            try:
                self.loop.call_soon_threadsafe(self._run_submissions)
            except RuntimeError:  # the loop is closed: nothing will run any more
                self._submissions.clear()
        if self._stopped:  # lost a race with the stop: no loop turn will come for it
            self._run_submissions()

    def _run_submissions(self) -> None:
        # Clear the flag before draining: a submission racing with the drain either
        # lands in this drain or schedules a new one; none is stranded.
        self._wake_pending = False
        queue = self._submissions
        while queue:
            fn, args = queue.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("callback submitted to the aiorl loop failed")

    def run_sync(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block this (non-loop) thread for its result.

        Raises [`WaitTimeout`][aiorl.WaitTimeout] (cancelling the coroutine) after ``timeout``
        seconds, and `RuntimeError` on the loop thread itself.
        """
        if self.on_loop():
            coro.close()
            raise RuntimeError("a blocking aiorl call was made on the aiorl event loop's thread; "
                               "use the async form (await) there")
        refusal = self.refusal
        if refusal is not None:
            coro.close()
            raise refusal()
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._blocked.add(fut)
        if self._stopped:  # lost a race with the stop: nothing will run the coroutine
            self._fail_blocked()
        try:
            return result_interruptibly(fut, timeout)  # a Ctrl-C raises within 0.1 s
        except concurrent.futures.TimeoutError:
            if fut.done():
                raise  # the coroutine's own TimeoutError
            fut.cancel()
            raise WaitTimeout(f"operation did not finish within {timeout} s") from None
        finally:
            self._blocked.discard(fut)

    async def run_here(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on this loop from a coroutine running on any loop."""
        if self.on_loop():
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def refuse(self, make_error: Callable[[], BaseException]) -> None:
        """From now on, ``submit`` and ``run_sync`` from other threads raise ``make_error()``
        at once (the first refusal stays: it names why the runtime stopped)."""
        if self.refusal is None:
            self.refusal = make_error

    def _after_loop(self) -> None:
        """The loop thread left its loop for good: run what was submitted too late (the
        closed services fail it) and fail every ``run_sync`` still blocked on it."""
        self._stopped = True
        if self.refusal is None:
            self.refusal = lambda: ClusterClosedError("this process's aiorl runtime has stopped")
        self._run_submissions()
        self._fail_blocked()

    def _fail_blocked(self) -> None:
        refusal = self.refusal
        assert refusal is not None
        for fut in list(self._blocked):
            if not fut.done():
                try:
                    fut.set_exception(refusal())
                except concurrent.futures.InvalidStateError:
                    pass  # it finished meanwhile

    def stop(self, before: Callable[[], None], settle_turns: int = 3) -> None:
        """Run ``before`` on the loop, let its callbacks settle, then stop the loop thread.

        Closing fails pending operations; their callbacks (a group call's collect, a
        work's mirror to a waiting thread) run over the next few loop turns. The loop
        stops only after them, so every waiter hears "closed" and nothing is left with
        an unread exception. Call `refuse` first so that nothing new is accepted.
        """

        def stop_after(turns: int) -> None:
            if turns:
                self.loop.call_soon(stop_after, turns - 1)
            else:
                self.loop.stop()

        def shutdown() -> None:
            try:
                before()
            finally:
                stop_after(settle_turns)

        if self.thread is None:  # an adopted loop: its owner stops it
            before()
            return
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(shutdown)
            self.thread.join(timeout=5)
