"""`CudaWorkThread`: a daemon thread and one side stream per device, on which CUDA work is
issued in order.

* **Side streams only.** Transfers run on a work thread's own stream per device, after
  waiting for the caller's events; nothing waits on, or makes wait, a default stream.
* **No thread per transfer.** One work thread serves one peer (or one broadcast
  communicator, or all of a process's delivery copies); its `EventWaiter` reports the
  events it records, in record order, and the loop is woken once per transfer
  (`CudaWorkThread.issue`).

Importable without CUDA: nothing here touches torch until work is issued.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from aiorl.cuda.completion import GpuHost, settle_future
from aiorl.cuda.events import WORK_THREAD_SPIN_S, CudaThreadClosed, EventWaiter, done_within
from aiorl.cuda.untyped_torch import untyped
from aiorl.util.threads import RuntimeThread

__all__ = ["CudaWorkThread"]

T = TypeVar("T")


class CudaWorkThread:
    """One daemon thread and one side stream per device, on which CUDA work is issued in order.

    A daemon thread (not an executor's): a work thread stuck in a CUDA or NCCL call behind a
    dead peer must not keep the process from exiting. `close` cancels what has not started.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False
        self._jobs: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._waiter: EventWaiter | None = None

    @property
    def waiter(self) -> EventWaiter:
        """The work thread's own `EventWaiter` (started on first use): its events complete in
        the order the work thread records them."""
        waiter = self._waiter
        if waiter is None:
            with self._lock:
                if self._waiter is None:
                    self._waiter = EventWaiter(f"{self.name}-done")
                waiter = self._waiter
        return waiter

    def issue(
        self, host: GpuHost, fn: Callable[..., tuple[Any, Any]], *args: Any
    ) -> asyncio.Future[None]:
        """Run ``fn(*args)`` on the work thread (it issues GPU work and returns ``(event, keep)``,
        the event recorded after that work); a loop future done once the event completed.

        One hop to the work thread, one to its waiter, one back to the loop: the loop is
        woken once per transfer. ``keep`` (what the GPU reads or writes) stays referenced
        until then; ``fn`` raising fails the future. Loop thread.
        """
        fut: asyncio.Future[None] = host.loop.create_future()

        def on_work_thread() -> None:
            try:
                event, keep = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - the transfer fails, not the thread
                host.call_soon_threadsafe(settle_future, fut, exc, None)
                return
            if done_within((event,), WORK_THREAD_SPIN_S):  # done by now: skip the waiter's hop
                host.call_soon_threadsafe(settle_future, fut, None, keep)
                return
            self.waiter.watch(
                event, lambda error: host.call_soon_threadsafe(settle_future, fut, error, keep)
            )

        cf = self.run(on_work_thread)
        cf.add_done_callback(lambda cf: _issue_refused(host, fut, cf))
        return fut

    def run(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` on the work thread, after everything submitted before it."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self.closed:
                fut.set_exception(CudaThreadClosed(f"CUDA work thread {self.name} is closed"))
                return fut
            if self._thread is None:
                self._thread = RuntimeThread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put((fut, fn, args))
        return fut

    def stream(self, device: int) -> Any:
        """The work thread's own stream on ``device`` (work thread only)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = untyped("torch.cuda").Stream(device)
        return stream

    def existing_stream(self, device: int) -> Any | None:
        """The work thread's stream on ``device`` if it made one (any thread; never creates)."""
        return self._streams.get(device)

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            if self.closed:
                fut.set_exception(CudaThreadClosed(f"CUDA work thread {self.name} is closed"))
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - reported through the future
                fut.set_exception(exc)

    def close(self) -> None:
        """Refuse new work and fail what has not started (what runs keeps running)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            pending = []
            while True:
                try:
                    item = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    pending.append(item[0])
            self._jobs.put(None)
        for fut in pending:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(CudaThreadClosed(f"CUDA work thread {self.name} is closed"))
        if self._waiter is not None:
            self._waiter.close()


def _issue_refused(
    host: GpuHost, fut: asyncio.Future[None], cf: concurrent.futures.Future[Any]
) -> None:
    """A job of `CudaWorkThread.issue` that never ran (the work thread closed): fail its future."""
    if cf.cancelled():
        closed = CudaThreadClosed("the CUDA work thread closed")
        host.call_soon_threadsafe(settle_future, fut, closed, None)
        return
    exc = cf.exception()
    if exc is not None:
        host.call_soon_threadsafe(settle_future, fut, exc, None)
