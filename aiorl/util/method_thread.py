"""``MethodThread``: one thread that runs jobs in the order they were given, cheaply.

A worker runs its plain (non-``async``) methods on one thread beside its event loop, in
arrival order, so that a method may block (on ``recv().wait()``, on a GPU) while the loop
keeps serving. ``concurrent.futures.ThreadPoolExecutor(1)`` does that, but each ``submit``
builds a ``Future`` and a work item and juggles a Python-level semaphore: ~10 µs of the
~25 µs a no-op call costs the worker in CPU. Here a job is one tuple put on a C-level
``SimpleQueue``; the thread blocks on that queue while idle.

``run`` is fire-and-forget (the job answers its caller itself); ``submit`` keeps the
`concurrent.futures.Executor` contract for the few callers that want a future
(``loop.run_in_executor``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["MethodThread"]

log = logging.getLogger("aiorl.util")
T = TypeVar("T")

#: Put on the queue by :meth:`MethodThread.shutdown`: the thread ends when it reaches it.
_STOP = None
#: A job: the function, its arguments, and the future of a ``submit`` (None for ``run``).
_Job = tuple[Callable[..., Any], tuple[Any, ...], "concurrent.futures.Future[Any] | None"]


class MethodThread(concurrent.futures.Executor):
    """One daemon thread running ``run``/``submit`` jobs in order (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the thread after the jobs before it; its errors are logged."""
        if self._closed:
            raise RuntimeError("cannot run a job on a method thread that was shut down")
        self._jobs.put((fn, args, None))

    def submit(self, fn: Callable[..., T], /, *args: Any,
               **kwargs: Any) -> concurrent.futures.Future[T]:
        """`run`, with a future of ``fn``'s result (the Executor contract)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the future's reader
                future.set_exception(exc)

        if self._closed:
            raise RuntimeError("cannot submit a job to a method thread that was shut down")
        self._jobs.put((job, (), future))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking jobs; the thread ends after those already given, or, with
        ``cancel_futures``, after the one running (the others are dropped, and the futures
        of dropped ``submit`` jobs cancelled). ``wait`` joins the thread."""
        if not self._closed:
            self._closed = True
            while cancel_futures:
                try:
                    dropped = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if dropped is not None and dropped[2] is not None:
                    dropped[2].cancel()
            self._jobs.put(_STOP)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _main(self) -> None:
        get = self._jobs.get
        while (job := get()) is not _STOP:
            fn, args, _ = job
            try:
                fn(*args)
            except Exception:
                log.exception("a job on the method thread failed")
            del job, fn, args  # release the arguments now, not when the next job arrives
