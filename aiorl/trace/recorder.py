"""The per-process span recorder: a ring buffer of finished spans and a set of open ones.

Hooks in the runtime services read the module-level `ON` once per operation; with
tracing off that check is all they cost. With tracing on, an operation becomes one
`Span` (a slotted object: ~0.5 µs to open and close) that stays in `open_spans`
while it is pending (what ``aiorl doctor`` shows as pending work with its age) and moves to
the ring buffer when it ends. Nothing is sent per span: the buffer is pulled in pages
(`drain_page`) by ``aiorl trace dump`` / ``cluster.trace_dump``, which stream them to the
file (`aiorl.cluster.doctor.dump_trace`).

Flows (the arrows from a send to its receive, from a call to its execution) need no extra
message either. A call's flow is named by its request id, which both ends know (the caller
chose it, the worker reads it in the header). Point-to-point messages have no request id:
both ends count the messages of an ordered pair of processes, and the k-th send from A to B
is the k-th receive of B from A (each pair's messages are delivered in order,
docs/ordering.md), so each end names the flow ``(pair, k)`` on its own.

Times are ``time.perf_counter_ns()`` (CLOCK_MONOTONIC: shared by the processes of one
machine); the merger corrects other machines' clocks (`aiorl.trace.chrome`).
"""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any, ClassVar

__all__ = [
    "ON", "CompactShape", "Span", "append", "begin", "counter", "disable", "drain", "drain_page",
    "enable",
    "enable_from_environment", "error_text", "flow_seq", "mark", "now", "open_spans", "payload_bytes", "recent", "record",
    "set_process_name", "span",
]

#: The switch every hook reads. Off by default; ``AIORL_TRACE=1`` turns it on at start-up.
ON = False
#: The environment variable that turns tracing on in a process and everything it spawns.
ENV = "AIORL_TRACE"
#: Finished spans kept per process (the oldest are dropped first).
DEFAULT_CAPACITY = 200_000

_now = time.perf_counter_ns
#: The recorder's clock (ns), for hooks that time an operation themselves.
now = _now
_ident = threading.get_ident
_running_loop = asyncio._get_running_loop

#: Finished spans: plain tuples laid out as :func:`record` builds them (tuples of atomic
#: values leave the garbage collector's tracking at the first collection that sees them),
#: or compact records (:class:`CompactShape`).
_buffer: deque[tuple[Any, ...] | bytes] = deque(maxlen=DEFAULT_CAPACITY)
#: The buffer's ``append``, for the two hottest hooks (a call's span at its caller and its
#: start at the worker), which build their record inline: a Python-level call with ten
#: arguments costs as much as the rest of the record on a slow core. Rebound with the buffer.
append = _buffer.append
#: Spans begun and not ended: the process's pending operations while tracing is on.
open_spans: set[Span] = set()
_flow_counts: dict[str, int] = {}
_process_name = f"pid{os.getpid()}"


class CompactShape:
    """What the compact records of one caller (or rank list) and method share, for the two
    hottest hooks: a group call's answer at its caller and an ``async def`` execution's
    start at the worker, once per call each.

    Such a hook appends ``shape.layout.pack(shape.key, times, ids...)``: one ``bytes``
    object of int64 fields (the shape's key first) instead of the full record
    (`record` gives the layout). The method, the peer's name, the flow pair and the
    thread live once in the shape. Bytes are never tracked by the garbage collector, where
    a tuple is, until the first collection that sees it: with thousands of records waiting
    for a pull, each young collection walked them all (~0.2 µs per call and process,
    measured with 1,000 calls in flight), and the records were most of what started those
    collections. A record also takes less than half a full one's memory. `expand` makes the
    full record when the buffer is read (`drain`, `recent`). Shapes are kept
    for the life of the process (one per caller or rank list and method: few).
    """

    __slots__ = ("key",)

    #: The record's fields, the key first (a subclass's own layout).
    layout: ClassVar[struct.Struct]

    def __init__(self) -> None:
        with _shapes_lock:
            self.key = len(_shapes)
            _shapes.append(self)

    def expand(self, fields: tuple[int, ...]) -> tuple[Any, ...]:
        """The full record of one compact record's ``fields`` (unpacked with `layout`)."""
        raise NotImplementedError


#: Every CompactShape made in this process, by key.
_shapes: list[CompactShape] = []
_shapes_lock = threading.Lock()
_key_of = struct.Struct("<q").unpack_from


def _full(rec: tuple[Any, ...] | bytes) -> tuple[Any, ...]:
    if isinstance(rec, tuple):
        return rec
    key: int = _key_of(rec)[0]
    shape = _shapes[key]
    return shape.expand(shape.layout.unpack(rec))


class Span:
    """One operation or user region: when, where (thread), with whom, how much, and how it ended.

    ``on_loop`` spans (begun on a running event loop, or completed later by the loop) are
    drawn as async slices, since they interleave with other tasks; the others are nested
    slices of their thread. ``flow_out``/``flow_in`` name the pair-and-sequence that links
    this span to its counterpart in another process.
    """

    __slots__ = ("cat", "name", "t0", "tid", "peer", "nbytes", "flow_out", "flow_in", "tags",
                 "on_loop")

    def __init__(self, cat: str, name: str, peer: str | None = None,
                 tags: dict[str, Any] | None = None) -> None:
        self.cat = cat
        self.name = name
        self.peer = peer
        self.tags = tags
        self.on_loop = _running_loop() is not None
        self.nbytes = 0
        self.flow_out: tuple[str, int] | None = None
        self.flow_in: tuple[str, int] | None = None
        self.tid = _ident()
        self.t0 = _now()
        open_spans.add(self)

    def end(self, ok: bool = True, nbytes: int = 0, error: str | None = None) -> None:
        """Close the span (once; later calls are ignored): it leaves the open spans and its
        record goes to the ring buffer."""
        try:
            open_spans.remove(self)
        except KeyError:
            return
        tid = _ident()
        append((self.cat, self.name, self.t0, _now(), self.tid, tid, self.peer,
                self.nbytes + nbytes, ok, error, self.flow_out, self.flow_in, self.tags,
                self.on_loop))

    def settled(self, fut: asyncio.Future[Any]) -> None:
        """A done-callback: close the span as the operation's future ended."""
        if fut.cancelled():
            self.end(False, error="cancelled")
        elif (exc := fut.exception()) is not None:
            self.end(False, error=error_text(exc))
        else:
            self.end()

    def age_s(self, now_ns: int | None = None) -> float:
        return ((now_ns or _now()) - self.t0) / 1e9

    def to_wire(self) -> tuple[Any, ...]:
        """The record of a span still open (a finished span's record is made by `end`;
        `aiorl.trace.chrome` reads both)."""
        return (self.cat, self.name, self.t0, 0, self.tid, 0, self.peer, self.nbytes, True,
                None, self.flow_out, self.flow_in, self.tags, self.on_loop)


def begin(cat: str, name: str, peer: str | None = None, **tags: Any) -> Span:
    """Open a span for an operation that ends later (``span.end()`` or ``span.settled``).

    Hooks that carry no tags construct `Span` directly: one Python call less, a
    quarter of a pending span's cost."""
    return Span(cat, name, peer, tags or None)


def record(cat: str, name: str, t0: int, peer: str | None, nbytes: int, ok: bool,
           error: str | None, flow_out: tuple[str, int] | None,
           flow_in: tuple[str, int] | None, on_loop: bool) -> None:
    """Record a finished operation begun at ``t0`` (``now()``) without a `Span`:
    for hot operations whose pending state the doctor reads elsewhere (group calls,
    executions), one tuple is all they cost.

    The tuple, which `aiorl.trace.chrome` reads: ``(cat, name, t0, t1, begin thread,
    end thread, peer, nbytes, ok, error, flow_out, flow_in, tags, on_loop)``. The two
    hottest hooks append a compact record instead (`CompactShape`), expanded to
    this layout when the buffer is read.
    """
    tid = _ident()
    _buffer.append((cat, name, t0, _now(), tid, tid, peer, nbytes, ok, error, flow_out, flow_in,
                    None, on_loop))


def error_text(exc: BaseException) -> str:
    """How a span records the error an operation ended with."""
    return f"{type(exc).__name__}: {exc}"[:200]


def flow_seq(pair: str) -> tuple[str, int]:
    """The next flow id of the ordered pair ``pair`` (``"A>B/kind"``), counted on this end."""
    k = _flow_counts.get(pair, 0) + 1
    _flow_counts[pair] = k
    return pair, k


@contextmanager
def span(name: str, **tags: Any) -> Iterator[Span | None]:
    """Record the enclosed block as a span (a no-op yielding None when tracing is off).

    Example:
        ```python
        with aiorl.span("rollout.generate", step=step):
            trajectories = self.generate(prompts)
        ```
    """
    if not ON:
        yield None
        return
    s = Span("user", name, None, tags or None)
    try:
        yield s
    except BaseException as exc:
        s.end(False, error=error_text(exc))
        raise
    s.end()


def mark(name: str, **tags: Any) -> None:
    """Record an instant (a zero-length span) when tracing is on.

    Example:
        ```python
        aiorl.mark("weights.published", version=step)
        ```
    """
    if ON:
        t = _now()
        _buffer.append(("mark", name, t, t, _ident(), 0, None, 0, True, None, None, None,
                        tags or None, False))


def counter(name: str, value: float) -> None:
    """Record a sample of a counter (a queue depth, pending operations) when tracing is on."""
    if ON:
        t = _now()
        _buffer.append(("counter", name, t, t, 0, 0, None, 0, True, None, None, None,
                        {"value": value}, False))


def payload_bytes(frames: Any) -> int:
    """Bytes in a list of frames (bytes, memoryviews, pickle buffers)."""
    total = 0
    for f in frames:
        if f.__class__ is bytes:
            total += len(f)
            continue
        try:
            total += memoryview(f).nbytes
        except TypeError:
            pass
    return total


def set_process_name(name: str) -> None:
    """The name this process's spans carry (its worker name, or the driver's)."""
    global _process_name
    _process_name = name


def enable(capacity: int | None = None) -> None:
    """Turn tracing on in this process (optionally resizing the ring buffer)."""
    global ON, _buffer, append
    if capacity is not None and capacity != _buffer.maxlen:
        _buffer = deque(_buffer, maxlen=capacity)
        append = _buffer.append
    ON = True


def disable() -> None:
    """Turn tracing off; what was recorded stays until drained."""
    global ON
    ON = False


def enable_from_environment() -> bool:
    """Turn tracing on if ``AIORL_TRACE`` is set (read when a process starts); returns ON."""
    if os.environ.get(ENV, "") not in ("", "0"):
        enable()
    return ON


def recent(window_s: float) -> dict[str, list[float]]:
    """Per category, ``[operations, errors, bytes]`` per second over the last ``window_s``
    seconds of finished spans (what live status and metrics show while tracing is on).

    Read from the newest end of the buffer back to the window's start, so recording pays
    nothing for it."""
    since = _now() - int(window_s * 1e9)
    totals: dict[str, list[float]] = {}
    for rec in reversed(_buffer):
        rec = _full(rec)
        if rec[3] < since:
            break
        t = totals.get(rec[0])
        if t is None:
            t = totals[rec[0]] = [0.0, 0.0, 0.0]
        t[0] += 1
        t[1] += not rec[8]
        t[2] += rec[7]
    return {cat: [v / window_s for v in t] for cat, t in totals.items()}


def drain() -> dict[str, Any]:
    """Take every finished span (and copies of the open ones) for a pull.

    The reply carries this process's clock at the time of the pull, so the puller can
    estimate the offset between its clock and ours from the round trip.
    """
    global _buffer, append
    taken, _buffer = _buffer, deque(maxlen=_buffer.maxlen)
    append = _buffer.append
    return {**_header(), "spans": [_full(rec) for rec in taken],
            "full": len(taken) == taken.maxlen}


def _header() -> dict[str, Any]:
    threads = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
    return {"process": _process_name, "pid": os.getpid(), "on": ON,
            "open": [s.to_wire() for s in list(open_spans)], "threads": threads,
            "clock_ns": _now()}


#: The spans a pull in pages took from the buffer and has not fetched yet (`drain_page`).
_taken: deque[tuple[Any, ...] | bytes] = deque()


def drain_page(first: bool, max_spans: int) -> dict[str, Any]:
    """One page of a pull: at most ``max_spans`` of the oldest spans not yet pulled.

    ``first`` starts a pull: it takes every finished span from the buffer (later spans are
    for the next pull) and the answer also carries what `drain` does besides spans (open
    spans, thread names, this process's clock). The answer's ``more`` says whether spans
    remain; the puller asks for the next page until none do. A whole buffer in one answer
    (200,000 spans) costs the puller hundreds of MB per process, decoded at once; a page costs
    it a few MB. Spans left by a pull that stopped midway (its puller
    died) come first in the next one."""
    global _buffer, append, _taken
    out: dict[str, Any] = {}
    if first:
        taken, _buffer = _buffer, deque(maxlen=_buffer.maxlen)
        append = _buffer.append
        out = {**_header(), "full": len(taken) == taken.maxlen}
        if _taken:  # bounded: beyond one buffer's worth, the oldest are dropped
            taken = deque(chain(_taken, taken), maxlen=taken.maxlen)
        _taken = taken
    pop = _taken.popleft
    out["spans"] = [_full(pop()) for _ in range(min(max(max_spans, 0), len(_taken)))]
    out["more"] = bool(_taken)
    return out
