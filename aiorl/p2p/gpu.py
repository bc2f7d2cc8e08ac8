"""GPU machinery shared by the CUDA payload paths and the CUDA part of broadcasts.

Importable without CUDA (torch is imported inside functions; nothing here runs unless a
CUDA tensor is sent, received or broadcast). docs/gpu.md states the rules it implements:

* **Device per tensor.** Events are recorded on each tensor's own device and on the
  caller's current stream *of that device* (`record_events`); received tensors land
  on the process's selected device (`aiorl.util.cuda_device`), whatever thread runs.
* **Side streams only.** Transfers run on a `CudaLane`'s own stream per device,
  after waiting for the caller's events; nothing waits on, or makes wait, a default
  stream. Buffers allocated for a receive are allocated on the lane's stream and marked
  used by the device's default stream (``record_stream``), so freeing them later cannot
  hand their memory to a transfer while user kernels still read it.
* **No thread per transfer, no spinning, no polling for copies.** A copy's completion is
  one blocking-sync CUDA event (`blocking_event`) waited for by a thread that does nothing
  else (`EventWaiter`, one per lane, in record order), which then wakes the loop once
  (`CudaLane.landed`). NCCL transfers, whose events may depend on what the peer does
  next, are polled with their works' status by the runtime's waiter thread (`gpu_done`).
* **NCCL that reports instead of killing.** `new_nccl_group` creates aiorl's
  communicators with `NCCL_SETTINGS` in force, non-blocking initialisation (so an
  abort interrupts a set-up whose peer died) and aborts them off the event loop
  (`abort_in_background`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import functools
import importlib
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from aiorl.errors import PeerLostError, ProtocolError
from aiorl.runtime.waiter import BlockingWaiter, Job
from aiorl.util.cuda_device import selected_device

__all__ = [
    "NCCL_SETTINGS",
    "ByteWindow",
    "CudaLane",
    "EventWaiter",
    "GpuHost",
    "abort_in_background",
    "allocate",
    "blocking_event",
    "cuda_needs_init",
    "device_uuid",
    "flat_u8",
    "gpu_done",
    "host_identity",
    "local_cuda_info",
    "new_nccl_group",
    "record_events",
    "reinterpret",
    "settle_future",
    "untyped",
    "wait_events",
]

log = logging.getLogger("aiorl.p2p")

T = TypeVar("T")

#: Bytes of CUDA payload a receiver lets land at once from one sender (allocations
#: included); further messages wait, unallocated, until earlier ones complete.
#: ``AIORL_P2P_CUDA_INFLIGHT_MB`` overrides it.
CUDA_INFLIGHT_BYTES = int(os.environ.get("AIORL_P2P_CUDA_INFLIGHT_MB", "1024")) << 20

#: What aiorl's NCCL communicators are created under (set only while one is created, so a
#: user's own process groups keep the user's settings):
#:
#: * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: a watchdog timeout or a remote error marks the
#:   work failed; it does not tear the process down (aiorl reports ``PeerLostError``).
#: * ``TORCH_NCCL_BLOCKING_WAIT=0``: ``Work.wait`` only orders streams (aiorl never blocks
#:   a thread on NCCL; it polls).
#: * ``TORCH_NCCL_ENABLE_MONITORING=0``: no heartbeat monitor that SIGABRTs a process whose
#:   watchdog is stuck behind a dead peer.
#: * ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``: no flight-recorder dump (and its wait) on a timeout.
NCCL_SETTINGS: Mapping[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}

_env_lock = threading.Lock()


class GpuHost(Protocol):
    """What the GPU helpers use of the engine or broadcaster they serve."""

    loop: asyncio.AbstractEventLoop
    waiter: BlockingWaiter

    def call_soon_threadsafe(self, fn: Callable[..., object], *args: Any) -> None: ...


def untyped(module: str) -> Any:
    """A torch module as ``Any``: torch's stubs leave ``Event``, ``Stream``, ``TCPStore``
    and the IPC reductions untyped or unexported."""
    return importlib.import_module(module)


# ----------------------------------------------------------------------------- identity
@functools.cache
def device_uuid(index: int) -> str:
    """A node-unique identifier of local CUDA device ``index`` (its UUID, else PCI address)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return "pci:{}:{}:{}".format(
        getattr(props, "pci_domain_id", "?"),
        getattr(props, "pci_bus_id", "?"),
        getattr(props, "pci_device_id", "?"),
    )


@functools.cache
def host_identity() -> str:
    """This machine (hostname and boot id): two node agents on one host share it, so their
    workers may still exchange CUDA IPC handles."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def cuda_needs_init() -> bool:
    """Whether describing this process's GPUs would initialise CUDA here (its first use),
    which must then happen off the event loop."""
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    return bool(torch.cuda.is_available()) and not torch.cuda.is_initialized()


def local_cuda_info() -> dict[str, Any]:
    """What a receiver tells a sender: its machine, selected device and every device's UUID."""
    import torch

    if not torch.cuda.is_available():
        return {"host": host_identity(), "current": -1, "uuids": []}
    return {
        "host": host_identity(),
        "current": selected_device(),
        "uuids": [device_uuid(i) for i in range(torch.cuda.device_count())],
    }


# ----------------------------------------------------------------------------- tensors
def reinterpret(src: Any, like: Any) -> Any:
    """``src``'s bytes seen with ``like``'s dtype and shape (same byte count, both contiguous)."""
    if src.dtype == like.dtype:
        return src.reshape(like.shape)
    return flat_u8(src).view(like.dtype).reshape(like.shape)


def flat_u8(t: Any) -> Any:
    """A contiguous tensor's bytes as a flat uint8 tensor (transfers then only match bytes)."""
    import torch

    flat = t.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


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


def allocate(specs: Sequence[tuple[Any, Sequence[int]]], device: int, stream: Any) -> list[Any]:
    """Fresh tensors for ``specs`` on ``device``, allocated on ``stream`` (a lane's side
    stream: the block is not reused while that stream may still write it) and marked used
    by the device's default stream, where user code most likely reads them (so freeing one
    does not hand its memory to the next transfer while a kernel still reads it)."""
    import torch

    out = []
    with torch.cuda.device(device), torch.cuda.stream(stream):
        default = torch.cuda.default_stream(device)
        for dtype, shape in specs:
            t = torch.empty(shape, dtype=dtype, device=device)
            if t.numel():
                t.record_stream(default)
            out.append(t)
    return out


def blocking_event() -> Any:
    """A CUDA event whose ``synchronize()`` puts the waiting thread to sleep until the GPU
    gets there (``cudaEventBlockingSync``) instead of spinning a core: what an
    `EventWaiter` waits for."""
    return untyped("torch.cuda").Event(blocking=True)


#: How long a thread may poll a just-recorded event (``query()``, ~0.3 us) before it hands
#: the event to a waiter thread. A small copy is done within a few microseconds, and a
#: hand-off to a thread and back to the loop costs far more than the poll: on an H100 machine
#: a thread hand-off measured 19 us and every blocking system call ~50 us
#: (`benchmarks/profile_gpu_messages.py`, docs/gpu.md). The loop polls at most `LOOP_SPIN_S` (it serves
#: everyone else meanwhile); a lane thread, which serves only its transfers, `LANE_SPIN_S`.
LOOP_SPIN_S = float(os.environ.get("AIORL_CUDA_LOOP_SPIN_US", "30")) * 1e-6
LANE_SPIN_S = float(os.environ.get("AIORL_CUDA_LANE_SPIN_US", "150")) * 1e-6


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


# ----------------------------------------------------------------------------- lanes
class LaneClosed(PeerLostError):
    """Work submitted to a lane that was closed (its peer was lost or the engine closed)."""


class EventWaiter:
    """One daemon thread that waits for CUDA events, one after the other, and reports each.

    ``watch(event, report)`` hands it an event (anything with ``query()`` and a blocking
    ``synchronize()``); the thread calls ``report(None)`` once the event completed, or
    ``report(error)``. It waits with ``synchronize()`` (the GIL released; with a
    `blocking_event` the thread sleeps in the driver), so a transfer's completion costs
    one wake-up, not a poll with back-off, and an idle waiter costs no CPU (it sleeps on
    its queue). ``query()`` first: an event already done costs no driver wait.

    In order, on purpose: a lane records its events on one stream per device, in the
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
                    self._thread = threading.Thread(
                        target=self._run, name=self.name, daemon=True
                    )
                    self._thread.start()
                self._jobs.put((event, report))
        if closed:
            report(LaneClosed(f"CUDA event waiter {self.name} is closed"))

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


class CudaLane:
    """One daemon thread and one side stream per device, on which CUDA work is issued in order.

    A daemon thread (not an executor's): a lane stuck in a CUDA or NCCL call behind a dead
    peer must not keep the process from exiting. `close` cancels what has not started.
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
        """The lane's own `EventWaiter` (started on first use): its events complete in the
        order the lane records them."""
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
        """Run ``fn(*args)`` on the lane (it issues GPU work and returns ``(event, keep)``,
        the event recorded after that work); a loop future done once the event completed.

        One hop to the lane, one to the lane's waiter, one back to the loop: the loop is
        woken once per transfer. ``keep`` (what the GPU reads or writes) stays referenced
        until then; ``fn`` raising fails the future. Loop thread.
        """
        fut: asyncio.Future[None] = host.loop.create_future()

        def on_lane() -> None:
            try:
                event, keep = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - the transfer fails, not the lane
                host.call_soon_threadsafe(settle_future, fut, exc, None)
                return
            if done_within((event,), LANE_SPIN_S):  # a copy done by now: skip the waiter's hop
                host.call_soon_threadsafe(settle_future, fut, None, keep)
                return
            self.waiter.watch(
                event, lambda error: host.call_soon_threadsafe(settle_future, fut, error, keep)
            )

        cf = self.run(on_lane)
        cf.add_done_callback(lambda cf: _lane_refused(host, fut, cf))
        return fut

    def run(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` on the lane's thread, after everything submitted before it."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self.closed:
                fut.set_exception(LaneClosed(f"CUDA lane {self.name} is closed"))
                return fut
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put((fut, fn, args))
        return fut

    def stream(self, device: int) -> Any:
        """The lane's own stream on ``device`` (lane thread only)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = untyped("torch.cuda").Stream(device)
        return stream

    def existing_stream(self, device: int) -> Any | None:
        """The lane's stream on ``device`` if the lane made one (any thread; never creates)."""
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
                fut.set_exception(LaneClosed(f"CUDA lane {self.name} is closed"))
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
                fut.set_exception(LaneClosed(f"CUDA lane {self.name} is closed"))
        if self._waiter is not None:
            self._waiter.close()


def _lane_refused(
    host: GpuHost, fut: asyncio.Future[None], cf: concurrent.futures.Future[Any]
) -> None:
    """A lane job of `CudaLane.issue` that never ran (the lane closed): fail its future."""
    if cf.cancelled():
        host.call_soon_threadsafe(settle_future, fut, LaneClosed("the CUDA lane closed"), None)
        return
    exc = cf.exception()
    if exc is not None:
        host.call_soon_threadsafe(settle_future, fut, exc, None)


# ----------------------------------------------------------------------------- completion
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


def after_lane(
    host: GpuHost,
    issued: concurrent.futures.Future[Any],
    then: Callable[[Any], asyncio.Future[None]],
) -> asyncio.Future[None]:
    """A loop future for lane work: ``issued`` (lane) yields a value, ``then(value)`` (loop)
    returns the future of its GPU completion; failures and cancellation propagate."""
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


# ----------------------------------------------------------------------------- NCCL
def new_nccl_group(store: Any, rank: int, size: int, device: int, timeout_s: float) -> Any:
    """An NCCL process group (the backend object) for aiorl's own use.

    Created with `NCCL_SETTINGS` in force, connected eagerly (one communicator for
    all of the group's operations, point-to-point included) and, where this torch has it,
    with a non-blocking communicator configuration: its initialisation does not block a
    thread in NCCL, so `abort_in_background` can end a set-up whose peer died.
    """
    dist = untyped("torch.distributed")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    config = getattr(opts, "config", None)
    if config is not None and hasattr(config, "blocking"):
        config.blocking = 0
    with _env_lock:
        saved = {k: os.environ.get(k) for k in NCCL_SETTINGS}
        os.environ.update(NCCL_SETTINGS)
        try:
            torch = untyped("torch")
            torch.cuda.set_device(device)
            pg = dist.ProcessGroupNCCL(store, rank, size, opts)
            # Eager: one communicator for every operation of the group (point-to-point
            # included), set up now, in the background where non-blocking.
            pg.eager_connect_single_device(torch.device("cuda", device))
            return pg
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def abort_in_background(pg: Any, what: str, keep: object = None) -> None:
    """Abort NCCL group ``pg`` on a short-lived daemon thread: ``ncclCommAbort`` may take a
    while, and the event loop (or a lane stuck behind the dead peer) must not wait for it.
    ``keep`` (buffers NCCL kernels may still touch) stays alive until the abort returned."""
    if pg is None:
        return

    def abort(_keep_alive: object) -> None:
        for name in ("abort", "shutdown"):
            fn = getattr(pg, name, None)
            if fn is not None:
                try:
                    fn()
                    return
                except Exception:  # noqa: BLE001 - best effort: the process may be exiting
                    log.debug("NCCL %s of %s failed", name, what, exc_info=True)

    threading.Thread(
        target=abort, args=(keep,), name=f"aiorl-nccl-abort-{what}", daemon=True
    ).start()


# ----------------------------------------------------------------------------- flow control
class ByteWindow:
    """Receive-side backpressure for one sender: at most ``limit`` bytes land at once.

    ``offer(item, nbytes)`` returns True when ``item`` may start now (allocate and land);
    otherwise it waits, in arrival order, and a later `release` hands it back. A
    message larger than the whole window starts alone, once nothing else is in flight,
    so it cannot wait for ever. Pure bookkeeping (no CUDA): unit-tested on its own.
    """

    __slots__ = ("limit", "in_flight", "waiting")

    def __init__(self, limit: int = CUDA_INFLIGHT_BYTES) -> None:
        if limit <= 0:
            raise ValueError("the in-flight byte limit must be positive")
        self.limit = limit
        self.in_flight = 0
        self.waiting: deque[tuple[Any, int]] = deque()

    def _fits(self, nbytes: int) -> bool:
        return self.in_flight == 0 or self.in_flight + nbytes <= self.limit

    def offer(self, item: Any, nbytes: int) -> bool:
        """Start ``item`` now (True, its bytes are counted) or queue it (False)."""
        if not self.waiting and self._fits(nbytes):
            self.in_flight += nbytes
            return True
        self.waiting.append((item, nbytes))
        return False

    def release(self, nbytes: int) -> list[Any]:
        """``nbytes`` landed (or failed): the waiting items that may start now, in order."""
        self.in_flight -= nbytes
        if self.in_flight < 0:
            raise ProtocolError("released more CUDA bytes than were in flight")
        started = []
        while self.waiting and self._fits(self.waiting[0][1]):
            item, n = self.waiting.popleft()
            self.in_flight += n
            started.append(item)
        return started

    def clear(self) -> list[Any]:
        """Forget everything (the pair is gone): the items that never started."""
        waiting = [item for item, _ in self.waiting]
        self.waiting.clear()
        self.in_flight = 0
        return waiting
