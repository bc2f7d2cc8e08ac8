"""CUDA events: recorded on the caller's streams, waited for by streams, and waited for by a
thread that does nothing else.

* **Device per tensor.** Events are recorded on each tensor's own device and on the caller's
  current stream *of that device* (`record_events`): what the caller had queued for them.
* **No spinning, no polling for copies.** A copy's completion is one blocking-sync CUDA event
  (`blocking_event`), polled briefly where a small copy is likely done already
  (`done_within`), else waited for by an `EventWaiter`, whose thread sleeps in the driver.

Importable without CUDA: torch is imported inside the functions that need it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from aiorl.cuda.untyped_torch import untyped
from aiorl.errors import PeerLostError
from aiorl.util.threads import RuntimeThread

__all__ = [
    "LOOP_SPIN_S",
    "WORK_THREAD_SPIN_S",
    "CudaThreadClosed",
    "EventWaiter",
    "blocking_event",
    "done_within",
    "record_events",
    "wait_events",
]

log = logging.getLogger("aiorl.cuda")


def record_events(tensors: Iterable[Any]) -> dict[int, Any]:
    """One CUDA event per device of ``tensors``, recorded on the calling thread's current
    stream *of that device*: what the caller had queued for them at call time."""
    import torch

    events: dict[int, Any] = {}
    for t in tensors:
        index = t.device.index
        if index is None or index in events:
            continue
        ev = untyped("torch.cuda").Event()
        ev.record(torch.cuda.current_stream(index))
        events[index] = ev
    return events


def wait_events(stream: Any, events: Mapping[int, Any] | None) -> None:
    """Make ``stream`` wait for every event of ``events`` (CUDA lets a stream wait for an
    event of another device)."""
    if events:
        for ev in events.values():
            stream.wait_event(ev)


def blocking_event() -> Any:
    """A CUDA event whose ``synchronize()`` puts the waiting thread to sleep until the GPU
    gets there (``cudaEventBlockingSync``) instead of spinning a core: what an
    `EventWaiter` waits for."""
    return untyped("torch.cuda").Event(blocking=True)


#: How long a thread may poll a just-recorded event (``query()``, ~0.3 us) before it hands
#: the event to a waiter thread. A small copy is done within a few microseconds, and a
#: hand-off to a thread and back to the loop costs far more than the poll: tens of
#: microseconds for a hand-off or a blocking system call on the GPU machines measured
#: (`benchmarks/profile_gpu_messages.py` prints them; docs/gpu.md). The loop polls at most `LOOP_SPIN_S`
#: (it serves everyone else meanwhile); a `CudaWorkThread`, which serves only its transfers,
#: `WORK_THREAD_SPIN_S`. ``AIORL_CUDA_LOOP_SPIN_US`` and ``AIORL_CUDA_LANE_SPIN_US`` override
#: them, in microseconds.
LOOP_SPIN_S = float(os.environ.get("AIORL_CUDA_LOOP_SPIN_US", "30")) * 1e-6
WORK_THREAD_SPIN_S = float(os.environ.get("AIORL_CUDA_LANE_SPIN_US", "150")) * 1e-6


def done_within(events: Sequence[Any], seconds: float) -> bool:
    """Whether every one of ``events`` completes within ``seconds`` of polling (never blocks
    longer; an event that raises is left to the waiter, which reports the error)."""
    deadline = time.perf_counter() + seconds
    try:
        while True:
            if all(ev.query() for ev in events):
                return True
            if time.perf_counter() >= deadline:
                return False
    except Exception:  # noqa: BLE001 - the waiter's synchronize() reports it
        return False


class CudaThreadClosed(PeerLostError):
    """Work handed to a CUDA work thread or event waiter that was closed (its peer was lost or
    its owner closed)."""


class EventWaiter:
    """One daemon thread that waits for CUDA events, one after the other, and reports each.

    ``watch(event, report)`` hands it an event (anything with ``query()`` and a blocking
    ``synchronize()``); the thread calls ``report(None)`` once the event completed, or
    ``report(error)``. It waits with ``synchronize()`` (the GIL released; with a
    `blocking_event` the thread sleeps in the driver), so a transfer's completion costs
    one wake-up, not a poll with back-off, and an idle waiter costs no CPU (it sleeps on
    its queue). ``query()`` first: an event already done costs no driver wait.

    In order, on purpose: a work thread records its events on one stream per device, in the
    order it hands them here, and a stream completes them in that order, so waiting for
    the first never delays the report of a later one. Only events whose work depends on
    nothing this process has yet to do may be watched (a copy after an event the peer
    already recorded); an NCCL transfer waits for its peer and is polled instead
    (`gpu_done`).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False
        self._jobs: queue.SimpleQueue[
            tuple[Any, Callable[[BaseException | None], None]] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, event: Any, report: Callable[[BaseException | None], None]) -> None:
        """Report ``event``'s completion (any thread); a closed waiter reports at once."""
        with self._lock:
            closed = self.closed
            if not closed:
                if self._thread is None:
                    self._thread = RuntimeThread(
                        target=self._run, name=self.name, daemon=True
                    )
                    self._thread.start()
                self._jobs.put((event, report))
        if closed:
            report(CudaThreadClosed(f"CUDA event waiter {self.name} is closed"))

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            event, report = item
            error: BaseException | None = None
            try:
                if not event.query():
                    event.synchronize()
            except BaseException as exc:  # noqa: BLE001 - reported to the event's owner
                error = exc
            try:
                report(error)
            except Exception:
                log.exception("reporting a CUDA event's completion failed")

    def close(self) -> None:
        """Stop once the events handed over so far are reported (they are finite GPU work)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._jobs.put(None)
