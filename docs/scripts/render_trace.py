"""Draw a Chrome/Perfetto trace (what ``aiorl trace dump`` writes) as a timeline image.

For documentation and bug reports where ui.perfetto.dev cannot be opened or screenshotted:
the image is laid out the way Perfetto shows the same file, but drawn here, by matplotlib,
from the JSON alone.

* one block of tracks per process, in the order the trace's ``process_sort_index`` gives (aiorl
  sorts by node, worker group and rank, the driver first), headed by its name; a band on the
  left groups the processes of one node, and the shading alternates per worker group;
* a track per thread with slices (``X`` events, nested by depth), a track per name of async
  slices (``b``/``e`` pairs, concurrent ones stacked in lanes, as Perfetto merges async tracks
  of one name), a track per counter (``C`` events, drawn as a step area);
* slices as bars coloured by name and labelled where they are wide enough; instants as ticks;
* flows (``s`` -> ``f``) as arrows between the slices they bind to. A flow end binds to a slice
  of its process that contains its time: the one whose ``peer`` argument names the process at
  the other end first, then one of its own thread, then the one with an edge nearest the time,
  then the innermost. (aiorl marks an async slice's flow end with a zero-length thread slice,
  an anchor; anchors are not drawn, the async slice they stand for is.)

Run: ``python docs/scripts/render_trace.py trace.json -o trace.png`` (``--start``/``--end`` in
ms from the trace's first event crop it; ``.svg`` output works too). Needs matplotlib
(``pip install -e ".[docs]"``).
"""

from __future__ import annotations

import argparse
import json
import re
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Flow", "Process", "Slice", "Timeline", "Track", "load", "main", "render"]

#: Zero-length thread slices aiorl adds to carry an async slice's flow (``"send ->"``).
ANCHOR = re.compile(r"^-> .+|.+ ->$")
#: Times closer than this (µs) count as the same instant when binding flows.
TOLERANCE_US = 1.0
#: Perfetto-like slice colours (material 600-700 shades), picked by a hash of the name.
PALETTE = (
    "#1e88e5", "#43a047", "#fb8c00", "#8e24aa", "#00897b", "#e53935", "#3949ab", "#7cb342",
    "#6d4c41", "#d81b60", "#00acc1", "#5e35b1", "#c0ca33", "#f4511e", "#546e7a", "#fdd835",
)  # fmt: skip


@dataclass
class Slice:
    """One drawn slice: a thread slice, an async slice or an instant (``end == start``)."""

    name: str
    start: float  # µs, as in the trace
    end: float
    tid: int  # the thread it ran on (async slices: where they began)
    args: dict[str, Any] = field(default_factory=dict)
    lane: int = 0  # depth inside its track: nesting (threads) or lane (async)
    track: Track | None = None

    @property
    def peer(self) -> str:
        return str(self.args.get("peer", ""))


@dataclass
class Track:
    """One row of the timeline (several sub-rows: ``lanes``)."""

    label: str
    kind: str  # "thread", "async" or "counter"
    slices: list[Slice] = field(default_factory=list)
    samples: list[tuple[float, float]] = field(default_factory=list)  # counters: (ts, value)
    lanes: int = 1


@dataclass
class Process:
    """One process's block of tracks."""

    pid: int
    name: str
    sort_index: int
    tracks: list[Track] = field(default_factory=list)

    @property
    def node(self) -> str:
        """``node0`` for a worker, ``driver`` for a driver (its name is ``driver@host``)."""
        first = self.name.split()[0]
        return first if " " in self.name else first.split("@")[0]

    @property
    def group(self) -> str:
        """The worker group (``rollout`` of ``node0 rollout:3``), or the process name."""
        return self.name.split()[-1].rsplit(":", 1)[0]

    @property
    def short_name(self) -> str:
        """How a peer names this process in slice arguments (``rollout:3``, ``driver``)."""
        return self.name.split()[-1].split("@")[0]


@dataclass
class Flow:
    """An arrow: from ``source`` at ``start`` to ``target`` at ``end`` (µs)."""

    source: Slice
    target: Slice
    start: float
    end: float


@dataclass
class Timeline:
    """A parsed trace: processes with their tracks, and the flows between slices."""

    processes: list[Process]
    flows: list[Flow]
    t0: float  # µs: the earliest event, time zero of the drawing
    t1: float

    def ms(self, us: float) -> float:
        """A trace time (µs) as drawn: ms since the first event."""
        return (us - self.t0) / 1000.0

    def slices(self) -> Iterable[Slice]:
        for p in self.processes:
            for t in p.tracks:
                yield from t.slices


def load(trace: Mapping[str, Any]) -> Timeline:
    """Parse a Chrome trace (``{"traceEvents": [...]}``) into tracks, slices and flows."""
    events: list[dict[str, Any]] = list(trace["traceEvents"])
    names: dict[int, str] = {}
    order: dict[int, int] = {}
    threads: dict[tuple[int, int], str] = {}
    for e in events:
        if e.get("ph") != "M":
            continue
        pid, args = int(e["pid"]), e.get("args", {})
        if e["name"] == "process_name":
            names[pid] = str(args["name"])
        elif e["name"] == "process_sort_index":
            order[pid] = int(args["sort_index"])
        elif e["name"] == "thread_name":
            threads[pid, int(e["tid"])] = str(args["name"])

    thread_slices: dict[tuple[int, int], list[Slice]] = defaultdict(list)
    async_slices: dict[tuple[int, str], list[Slice]] = defaultdict(list)
    counters: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    begun: dict[tuple[int, str, Any], Slice] = {}
    flow_ends: dict[Any, dict[str, tuple[int, int, float]]] = defaultdict(dict)
    by_pid: dict[int, list[Slice]] = defaultdict(list)
    times: list[float] = []
    for e in events:
        ph = e.get("ph")
        if ph == "M":
            continue
        pid, ts = int(e["pid"]), float(e["ts"])
        times.append(ts)
        if ph == "X":
            dur = float(e.get("dur", 0.0))
            times.append(ts + dur)
            if dur == 0 and ANCHOR.match(e["name"]):
                continue
            s = Slice(e["name"], ts, ts + dur, int(e["tid"]), dict(e.get("args") or {}))
            thread_slices[pid, int(e["tid"])].append(s)
        elif ph == "i":
            s = Slice(e["name"], ts, ts, int(e["tid"]), dict(e.get("args") or {}))
            thread_slices[pid, int(e["tid"])].append(s)
        elif ph == "b":
            s = Slice(e["name"], ts, ts, int(e["tid"]), dict(e.get("args") or {}))
            begun[pid, e.get("cat", ""), e["id"]] = s
        elif ph == "e" and (pid, e.get("cat", ""), e["id"]) in begun:
            s = begun.pop((pid, e.get("cat", ""), e["id"]))
            s.end = max(ts, s.start)
            async_slices[pid, s.name].append(s)
        elif ph == "C":
            for key, value in (e.get("args") or {}).items():
                label = e["name"] if key == e["name"] else f"{e['name']} {key}"
                counters[pid, label].append((ts, float(value)))
        elif ph in ("s", "f"):
            flow_ends[e["id"]][ph] = (pid, int(e["tid"]), ts)

    processes: dict[int, Process] = {}
    for pid in sorted(
        names.keys() | {k[0] for k in (*thread_slices, *async_slices, *counters)},
        key=lambda p: (order.get(p, len(order)), p),
    ):
        processes[pid] = Process(pid, names.get(pid, f"pid {pid}"), order.get(pid, len(order)))
    for (pid, tid), slices in sorted(thread_slices.items()):
        track = Track(threads.get((pid, tid), f"thread {tid}"), "thread", slices)
        track.lanes = _nest(slices)
        processes[pid].tracks.append(track)
    for (pid, name), slices in sorted(async_slices.items()):
        track = Track(name, "async", slices)
        track.lanes = _pack(slices)
        processes[pid].tracks.append(track)
    for (pid, name), samples in sorted(counters.items()):
        processes[pid].tracks.append(Track(name, "counter", samples=sorted(samples)))
    for p in processes.values():
        for t in p.tracks:
            for s in t.slices:
                s.track = t
                by_pid[p.pid].append(s)

    flows = []
    for ends in flow_ends.values():
        if "s" not in ends or "f" not in ends:
            continue  # one end fell out of a ring buffer, or was not traced
        (spid, stid, sts), (fpid, ftid, fts) = ends["s"], ends["f"]
        if spid not in processes or fpid not in processes:
            continue
        source = _bind(by_pid[spid], stid, sts, processes[fpid].short_name)
        target = _bind(by_pid[fpid], ftid, fts, processes[spid].short_name)
        if source is not None and target is not None:
            flows.append(Flow(source, target, sts, fts))
    t0, t1 = (min(times), max(times)) if times else (0.0, 1.0)
    return Timeline(list(processes.values()), flows, t0, t1)


def _nest(slices: list[Slice]) -> int:
    """Give each thread slice its nesting depth (its lane); returns the depth count."""
    slices.sort(key=lambda s: (s.start, -(s.end - s.start)))
    stack: list[Slice] = []
    deepest = 0
    for s in slices:
        while stack and stack[-1].end <= s.start:
            stack.pop()
        s.lane = len(stack)
        deepest = max(deepest, s.lane)
        if s.end > s.start:
            stack.append(s)
    return deepest + 1


def _pack(slices: list[Slice]) -> int:
    """Lay overlapping async slices into lanes (first lane free at the start); lane count."""
    slices.sort(key=lambda s: (s.start, s.end))
    lane_ends: list[float] = []
    for s in slices:
        for lane, end in enumerate(lane_ends):
            if end <= s.start:
                s.lane, lane_ends[lane] = lane, s.end
                break
        else:
            s.lane = len(lane_ends)
            lane_ends.append(s.end)
    return max(len(lane_ends), 1)


def _bind(slices: Sequence[Slice], tid: int, ts: float, other_end: str) -> Slice | None:
    """The slice of a process that a flow end at ``(tid, ts)`` belongs to (module docstring)."""
    around = [
        s
        for s in slices
        if s.start - TOLERANCE_US <= ts <= s.end + TOLERANCE_US and s.end > s.start
    ]
    if not around:
        return None
    return min(
        around,
        key=lambda s: (
            s.peer != other_end,
            s.tid != tid,
            min(abs(ts - s.start), abs(ts - s.end)),
            s.end - s.start,
        ),
    )


def _colour(name: str) -> str:
    return PALETTE[zlib.crc32(name.encode()) % len(PALETTE)]


# ----------------------------------------------------------------------------- drawing
LANE_IN = 0.19  # height of one lane, inches
COUNTER_IN = 0.3  # height of a counter track
HEADER_IN = 0.24  # a process's name row
LABELS = 0.2  # fraction of the figure's width: the track names, on the left
TIMELINE = 1 - LABELS - 0.01  # fraction of the figure's width: the time axis


@dataclass
class Row:
    """Where a process header (``track`` None) or a track is drawn: inches from the top."""

    top: float
    height: float
    process: Process
    track: Track | None

    def lane_middle(self, lane: int) -> float:
        lane_h = self.height / (self.track.lanes if self.track else 1)
        return self.top + (lane + 0.5) * lane_h


def _layout(timeline: Timeline) -> tuple[list[Row], float]:
    """A header per process, then its tracks; returns the rows and the total height."""
    rows, y = [], 0.0
    for p in timeline.processes:
        rows.append(Row(y, HEADER_IN, p, None))
        y += HEADER_IN
        for t in p.tracks:
            height = COUNTER_IN if t.kind == "counter" else LANE_IN * t.lanes
            rows.append(Row(y, height, p, t))
            y += height + 0.04
        y += 0.06
    return rows, y


def render(
    timeline: Timeline,
    output: str | Path,
    title: str = "",
    width_in: float = 16.0,
    start_ms: float | None = None,
    end_ms: float | None = None,
    dpi: int = 100,
) -> None:
    """Draw ``timeline`` into ``output`` (PNG or SVG, by its suffix); ``start_ms`` and
    ``end_ms`` (from the first event) crop it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, total_in = _layout(timeline)
    fig_h = total_in + 0.9
    fig = plt.figure(figsize=(width_in, fig_h), dpi=dpi)
    ax = fig.add_axes((LABELS, 0.15 / fig_h, TIMELINE, total_in / fig_h))
    x0 = start_ms if start_ms is not None else 0.0
    x1 = end_ms if end_ms is not None else timeline.ms(timeline.t1)
    ax.set_xlim(x0, x1)
    ax.set_ylim(total_in, 0)
    ax.set_yticks([])
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.set_xlabel("time (ms)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for spine in ("right", "bottom", "left"):
        ax.spines[spine].set_visible(False)
    _draw_groups(ax, rows, timeline.processes)
    px_per_ms = TIMELINE * width_in * dpi / max(x1 - x0, 1e-6)
    for row in rows:
        _draw_row(ax, row, timeline, px_per_ms)
    _draw_flows(ax, rows, timeline)
    if title:
        fig.suptitle(title, x=0.01, y=1 - 0.08 / fig_h, ha="left", va="top", fontsize=10)
    if str(output).endswith(".png"):
        fig.savefig(output, dpi=dpi, pil_kwargs={"optimize": True})
    else:
        fig.savefig(output, dpi=dpi)
    plt.close(fig)


def _draw_groups(ax: Any, rows: Sequence[Row], processes: Sequence[Process]) -> None:
    """Shading that alternates per worker group, and a named band per node on the left."""
    from matplotlib.patches import Rectangle

    extent: dict[int, tuple[float, float]] = {}
    for row in rows:
        top, bottom = extent.get(row.process.pid, (row.top, row.top))
        extent[row.process.pid] = (min(top, row.top), max(bottom, row.top + row.height))
    groups: dict[tuple[str, str], tuple[float, float]] = {}
    nodes: dict[str, tuple[float, float]] = {}
    for p in processes:
        groups[p.node, p.group] = _union(groups.get((p.node, p.group)), extent[p.pid])
        nodes[p.node] = _union(nodes.get(p.node), extent[p.pid])
    across = ax.get_yaxis_transform()  # x in fractions of the timeline's width, y in inches
    for i, (top, bottom) in enumerate(groups.values()):
        shade = "#f3f6fa" if i % 2 else "#ffffff"
        ax.add_patch(
            Rectangle(
                (0, top), 1, bottom - top, transform=across, color=shade, zorder=0, linewidth=0
            )
        )
    column = -LABELS / TIMELINE  # where the label column begins
    for i, (node, (top, bottom)) in enumerate(nodes.items()):
        ax.add_patch(
            Rectangle(
                (column, top + 0.02),
                0.014,
                bottom - top - 0.06,
                transform=across,
                clip_on=False,
                color=PALETTE[i * 5 % len(PALETTE)],
                alpha=0.6,
            )
        )
        ax.text(
            column + 0.007,
            (top + bottom) / 2,
            node,
            transform=across,
            rotation=90,
            ha="center",
            va="center",
            fontsize=7,
            color="white",
            fontweight="bold",
        )


def _union(a: tuple[float, float] | None, b: tuple[float, float]) -> tuple[float, float]:
    return b if a is None else (min(a[0], b[0]), max(a[1], b[1]))


def _draw_row(ax: Any, row: Row, timeline: Timeline, px_per_ms: float) -> None:
    """A process's name, or a track: its name on the left, its slices or counter."""
    from matplotlib.patches import Rectangle

    across = ax.get_yaxis_transform()
    t = row.track
    if t is None:
        ax.text(
            -LABELS / TIMELINE + 0.02,
            row.top + HEADER_IN * 0.62,
            row.process.name,
            transform=across,
            ha="left",
            va="center",
            fontsize=8.5,
            fontweight="bold",
        )
        ax.axhline(row.top, color="#c8ccd2", linewidth=0.6, zorder=1)
        return
    ax.text(
        -0.005,
        row.top + row.height / 2,
        t.label,
        transform=across,
        ha="right",
        va="center",
        fontsize=7,
        color="#333333",
    )
    if t.kind == "counter":
        _draw_counter(ax, row, timeline)
        return
    x0, x1 = ax.get_xlim()
    lane_h = row.height / t.lanes
    for s in t.slices:
        a, b = timeline.ms(s.start), timeline.ms(s.end)
        if b < x0 or a > x1:
            continue
        y = row.lane_middle(s.lane)
        if b == a:  # an instant
            ax.plot([a], [y], marker="v", markersize=4, color=_colour(s.name), zorder=3)
            continue
        bar = Rectangle(
            (a, y - lane_h / 2 + 0.015),
            max(b - a, 0.5 / px_per_ms),
            lane_h - 0.03,
            facecolor=_colour(s.name),
            edgecolor="none",
            zorder=2,
        )
        ax.add_patch(bar)
        room = (min(b, x1) - max(a, x0)) * px_per_ms  # pixels of the bar in view
        for text in (f"{s.name} ({s.peer})" if s.peer else s.name, s.name):
            if room > 5.2 * len(text) + 6:  # about 5.2 px a character at 6.5 pt
                label = ax.text(
                    max(a, x0) + 3 / px_per_ms,
                    y,
                    text,
                    fontsize=6.5,
                    color="white",
                    va="center",
                    ha="left",
                    zorder=4,
                )
                label.set_clip_path(bar)  # never past the bar's end
                break


def _draw_counter(ax: Any, row: Row, timeline: Timeline) -> None:
    """A counter as Perfetto draws it: a step area scaled to its track, its maximum noted."""
    assert row.track is not None
    samples = row.track.samples
    x0, x1 = ax.get_xlim()
    peak = max((v for _, v in samples), default=0.0)
    base = row.top + row.height - 0.02
    scale = (row.height - 0.06) / (peak or 1.0)
    xs = [timeline.ms(ts) for ts, _ in samples] + [x1]
    ys = [base - v * scale for _, v in samples]
    ys.append(ys[-1] if ys else base)
    colour = _colour(row.track.label)
    ax.fill_between(xs, ys, base, step="post", color=colour, alpha=0.35, linewidth=0, zorder=2)
    ax.step(xs, ys, where="post", color=colour, linewidth=0.8, zorder=3)
    ax.text(
        x0,
        row.top + 0.02,
        f" max {peak:g}",
        fontsize=6,
        va="top",
        ha="left",
        color="#555555",
        zorder=4,
    )


def _draw_flows(ax: Any, rows: Sequence[Row], timeline: Timeline) -> None:
    """Each flow as an arrow from its source slice to its target slice."""
    from matplotlib.patches import FancyArrowPatch

    row_of = {id(row.track): row for row in rows if row.track is not None}
    x0, x1 = ax.get_xlim()

    def where(s: Slice, us: float) -> tuple[float, float]:
        return timeline.ms(us), row_of[id(s.track)].lane_middle(s.lane)

    for f in timeline.flows:
        (a, ya), (b, yb) = where(f.source, f.start), where(f.target, f.end)
        if max(a, b) < x0 or min(a, b) > x1:
            continue
        ax.add_patch(
            FancyArrowPatch(
                (a, ya),
                (b, yb),
                arrowstyle="-|>",
                mutation_scale=9,
                color="#263238",
                linewidth=0.7,
                alpha=0.75,
                zorder=5,
                shrinkA=0,
                shrinkB=0,
            )
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a trace written by `aiorl trace dump` (JSON)")
    parser.add_argument("-o", "--output", required=True, help="the image to write (.png/.svg)")
    parser.add_argument("--title", default="")
    parser.add_argument("--width", type=float, default=16.0, help="inches (100 px each)")
    parser.add_argument("--start", type=float, help="ms from the first event")
    parser.add_argument("--end", type=float, help="ms from the first event")
    args = parser.parse_args(argv)
    timeline = load(json.loads(Path(args.trace).read_text()))
    render(timeline, args.output, args.title, args.width, args.start, args.end)
    tracks = sum(len(p.tracks) for p in timeline.processes)
    print(
        f"wrote {args.output}: {len(timeline.processes)} processes, {tracks} tracks, "
        f"{sum(1 for _ in timeline.slices())} slices, {len(timeline.flows)} flows"
    )


if __name__ == "__main__":
    main()
