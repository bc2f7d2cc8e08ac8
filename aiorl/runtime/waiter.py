"""``BlockingWaiter``: one thread per process for completions the event loop cannot see.

Some completions can only be observed by polling or blocking: ``torch.distributed`` work
objects (NCCL, Gloo), CUDA events, a peer's progress through shared memory. The loop must
never block on them, and a thread per operation (what ``AsyncCollWork`` used before) costs
a thread start per transfer. One daemon thread polls every pending job without blocking,
backing off from 50 µs to 2 ms while nothing completes and sleeping while nothing is
pending, and hands each finished job to its loop.

Polling (``is_completed()``, ``event.query()``) rather than a blocking ``wait()`` per job
keeps jobs independent: a receive that waits for a slow peer never delays the report of a
send that has finished (head-of-line blocking there could deadlock two workers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from aiorl.util.threads import RuntimeThread

__all__ = ["BlockingWaiter", "Job"]

log = logging.getLogger("aiorl.runtime")

_MIN_PAUSE_S = 50e-6
_MAX_PAUSE_S = 2e-3


class Job:
    """One thing to watch: ``ready()`` polls (never blocks); ``report(error)`` runs once after
    it returned True or raised (with the exception, or None)."""

    __slots__ = ("ready", "report")

    def __init__(self, ready: Callable[[], bool], report: Callable[[BaseException | None], None]):
        self.ready = ready
        self.report = report


class BlockingWaiter:
    """The process's waiter thread (started on first use). See the module docstring."""

    def __init__(self, name: str = "aiorl-waiter") -> None:
        self._name = name
        self._jobs: list[Job] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, job: Job) -> None:
        """Start watching ``job`` (from any thread)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the waiter is closed")
            self._jobs.append(job)
            if self._thread is None:
                self._thread = RuntimeThread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._jobs)

    def close(self) -> None:
        """Stop the thread; jobs still pending are dropped (their owners fail them on close)."""
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._cond.notify()

    def _run(self) -> None:
        pause = _MIN_PAUSE_S
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                    pause = _MIN_PAUSE_S
                if self._closed:
                    return
                jobs = list(self._jobs)
            finished: list[tuple[Job, BaseException | None]] = []
            for job in jobs:
                try:
                    if job.ready():
                        finished.append((job, None))
                except BaseException as exc:  # noqa: BLE001 - reported to the job's owner
                    finished.append((job, exc))
            if finished:
                with self._cond:
                    done = {id(job) for job, _ in finished}
                    self._jobs = [j for j in self._jobs if id(j) not in done]
                for job, error in finished:
                    try:
                        job.report(error)
                    except Exception:
                        log.exception("reporting a finished job failed")
                pause = _MIN_PAUSE_S
            else:
                time.sleep(pause)
                pause = min(pause * 2, _MAX_PAUSE_S)

