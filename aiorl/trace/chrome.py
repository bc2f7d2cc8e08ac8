"""Merge the span buffers pulled from every process into one Chrome/Perfetto trace.

The output is the Chrome trace-event JSON (``{"traceEvents": [...]}``) that ui.perfetto.dev
and chrome://tracing open as is:

* one process track per aiorl process, named ``node<N> <group>:<rank>`` and sorted by node,
  group and rank (the driver first), with its threads named;
* blocking regions (a plain method's execution, a user span on a thread) as nested slices
  of their thread; operations that interleave on an event loop (calls in flight, sends,
  receives, channel operations, ``async def`` executions) as async slices;
* flow arrows from each call to its execution and from each send to its receive;
* counters (queue depths, pending operations) as counter tracks.

`merge` builds the trace in memory (small traces, tests); `TraceWriter` writes the same
trace event by event to a file, which is how ``aiorl trace dump`` and ``cluster.trace_dump``
write it: they pull each process's spans in pages and hold one page at a time
(`aiorl.cluster.doctor.dump_trace`).

Clocks: a pull records when it left and came back (the puller's clock) and the clock the
process read while answering; NTP-style, the process's offset is its clock minus the
midpoint of the round trip, known within half the round trip. Processes on the puller's
machine share its monotonic clock (offset 0); each other machine gets the offset of its
pull with the shortest round trip.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

__all__ = [
    "PulledBuffer", "TraceWriter", "estimate_offset", "merge", "node_offsets", "open_spans",
    "ordered", "process_events", "span_events",
]


@dataclass
class PulledBuffer:
    """One process's drained buffer (``recorder.drain()``) and where and when it was pulled."""

    dump: dict[str, Any]
    node: str = "?"  # a node label: its rank, or the host name of a driver
    group: str = ""
    rank: int = -1
    sent_ns: int = 0  # the puller's clock when the pull left ...
    received_ns: int = 0  # ... and when its answer came back
    local: bool = True  # on the puller's machine: same monotonic clock
    offset_ns: int = 0  # filled by node_offsets(): subtract from this process's times
    extra: dict[str, Any] = field(default_factory=dict)


def estimate_offset(sent_ns: int, received_ns: int, remote_ns: int) -> tuple[int, int]:
    """(offset, error bound) of a remote clock read between ``sent_ns`` and ``received_ns``."""
    midpoint = (sent_ns + received_ns) // 2
    return remote_ns - midpoint, max(0, (received_ns - sent_ns) // 2)


def node_offsets(buffers: Sequence[PulledBuffer]) -> dict[str, tuple[int, int]]:
    """Fill each buffer's ``offset_ns``; returns ``node -> (offset, error bound)``."""
    best: dict[str, tuple[int, int]] = {}
    for b in buffers:
        if b.local or not b.received_ns:
            continue
        offset, error = estimate_offset(b.sent_ns, b.received_ns, int(b.dump["clock_ns"]))
        if b.node not in best or error < best[b.node][1]:
            best[b.node] = (offset, error)
    for b in buffers:
        b.offset_ns = 0 if b.local else best.get(b.node, (0, 0))[0]
    return best


def _flow_id(flow: Sequence[Any]) -> int:
    pair, seq = flow
    return (zlib.crc32(str(pair).encode()) << 20) | (int(seq) & 0xFFFFF)


def _track_name(b: PulledBuffer) -> str:
    """``node0 rollout:3`` for a worker, ``driver@host`` for a driver (known by host)."""
    name = str(b.dump.get("process", "?"))
    if b.node in ("", "?"):
        return name
    return f"node{b.node} {name}" if b.group else f"{name}@{b.node}"


def ordered(buffers: Sequence[PulledBuffer]) -> list[PulledBuffer]:
    """``buffers`` in track order: the driver first, then by node, group and rank."""
    return sorted(buffers, key=lambda b: (b.group != "", b.node, b.group, b.rank))


def process_events(index: int, b: PulledBuffer) -> list[dict[str, Any]]:
    """The metadata events of the ``index``-th process track: its name, place, threads."""
    pid = int(b.dump.get("pid", index))
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": _track_name(b)}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": index}},
    ]
    for tid, tname in (b.dump.get("threads") or {}).items():
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": int(tid),
                       "args": {"name": tname}})
    return events


def open_spans(dump: dict[str, Any]) -> list[list[Any]]:
    """The spans still open when ``dump`` was pulled, drawn up to the pull."""
    now = int(dump.get("clock_ns", 0))
    spans = []
    for raw in dump.get("open") or ():
        pending = list(raw)
        pending[3] = now
        pending[9] = "pending when the trace was pulled"
        spans.append(pending)
    return spans


def merge(buffers: Sequence[PulledBuffer]) -> dict[str, Any]:
    """The Chrome trace of ``buffers`` (clock offsets estimated and corrected)."""
    node_offsets(buffers)
    events: list[dict[str, Any]] = []
    for index, b in enumerate(ordered(buffers)):
        pid = int(b.dump.get("pid", index))
        events.extend(process_events(index, b))
        spans = [*(b.dump.get("spans") or ()), *open_spans(b.dump)]
        events.extend(span_events(pid, spans, b.offset_ns))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "aiorl", "processes": len(buffers)}}


class TraceWriter:
    """Write the trace `merge` returns to ``out``, a page of events at a time.

    ``{"traceEvents": [`` first, each `write` appends its events, `close` ends the list and
    adds what `merge` puts after it. The writer holds nothing between calls, so a trace of
    any size costs the memory of one page."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._empty = True
        self.events = 0
        self.spans = 0  # slices: what `aiorl trace dump` reports
        out.write('{"traceEvents": [')

    def write(self, events: Iterable[dict[str, Any]]) -> None:
        dumps = json.dumps
        texts = []
        for e in events:
            texts.append(dumps(e))
            self.spans += e["ph"] in ("X", "b")
        if texts:
            self._out.write(("" if self._empty else ", ") + ", ".join(texts))
            self._empty = False
            self.events += len(texts)

    def close(self, processes: int) -> None:
        other = json.dumps({"producer": "aiorl", "processes": processes})
        self._out.write(f'], "displayTimeUnit": "ms", "otherData": {other}}}')


def span_events(pid: int, spans: Iterable[Sequence[Any]], offset_ns: int,
                first: int = 0) -> list[dict[str, Any]]:
    """The events of ``spans`` of process ``pid``; ``first`` is the index of the first of
    them among the process's spans (pages of one pull continue the count: async ids)."""
    out: list[dict[str, Any]] = []
    for n, (cat, name, t0, t1, tid, end_tid, peer, nbytes, ok, error, flow_out, flow_in, tags,
            on_loop) in enumerate(spans, first):
        ts = (t0 - offset_ns) / 1000.0
        end_ts = (t1 - offset_ns) / 1000.0
        args: dict[str, Any] = dict(tags or {})
        if peer:
            args["peer"] = peer
        if nbytes:
            args["bytes"] = nbytes
        if not ok:
            args["error"] = error or "failed"
        if cat == "counter":
            out.append({"ph": "C", "name": name, "pid": pid, "ts": ts,
                        "args": {name: (tags or {}).get("value", 0)}})
            continue
        if cat == "mark":
            out.append({"ph": "i", "s": "t", "name": name, "cat": cat, "pid": pid, "tid": tid,
                        "ts": ts, "args": args})
            continue
        if on_loop:
            ident = (pid << 24) | n  # unique across processes (async ids are global)
            out.append({"ph": "b", "name": name, "cat": cat, "id": ident, "pid": pid,
                        "tid": tid, "ts": ts, "args": args})
            out.append({"ph": "e", "name": name, "cat": cat, "id": ident, "pid": pid,
                        "tid": end_tid or tid, "ts": max(end_ts, ts)})
        else:
            out.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts,
                        "dur": max(end_ts - ts, 0.0), "args": args})
        if flow_out:
            if on_loop:  # flows bind to thread slices: a zero-length anchor where it left
                out.append({"ph": "X", "name": f"{name} ->", "cat": cat, "pid": pid,
                            "tid": tid, "ts": ts, "dur": 0})
            out.append({"ph": "s", "name": "flow", "cat": "flow", "id": _flow_id(flow_out),
                        "pid": pid, "tid": tid, "ts": ts})
        if flow_in:
            # A receive's message arrives when it completes; an execution's when it starts.
            at_end = cat == "recv"
            at_ts, at_tid = (end_ts, end_tid or tid) if at_end else (ts, tid)
            # Perfetto binds a flow's end to a slice open on its thread at that time; a
            # thread slice is closed at its own end (and a receive may end on another
            # thread): a zero-length anchor there, as for async slices.
            if on_loop or at_end:
                out.append({"ph": "X", "name": f"-> {name}", "cat": cat, "pid": pid,
                            "tid": at_tid, "ts": at_ts, "dur": 0})
            out.append({"ph": "f", "bp": "e", "name": "flow", "cat": "flow", "id": _flow_id(flow_in), "pid": pid, "tid": at_tid,
                        "ts": at_ts})
    return out
