"""Terminal output of ``aiorl demo``: a live view while it runs and a summary at the end.

Two renderers share one `Snapshot` model, built by the driver a few times per
second from the workers' stats:

* `LiveDisplay` (stdout is a terminal): redraws a block of lines in place with
  plain ANSI escapes (cursor up, erase line), no extra dependency;
* `LineDisplay` (stdout is a pipe or a file): one plain line per training step,
  from the step records of trainer rank 0, so logs and tests see every step.

Rates (items/s, MB/s) are computed over a sliding window of recent snapshots.
"""

from __future__ import annotations

import shutil
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TextIO

__all__ = ["LineDisplay", "LiveDisplay", "Snapshot", "WorkerRow", "make_display",
           "summary_text"]

_MB = 1e6
_RATE_WINDOW_S = 2.0


@dataclass
class WorkerRow:
    """One worker's line in the live view and in the summary table."""

    name: str
    node: int | str
    role: str
    state: str
    activity: str
    version: int
    items: int
    env_steps: int
    nbytes: int
    extra: str = ""


@dataclass
class Snapshot:
    """The job's progress at one moment, as the driver sees it."""

    elapsed: float
    steps: int
    target: int
    version: int
    produced_items: int
    produced_bytes: int
    consumed_items: int
    consumed_bytes: int
    weights_bytes: int
    queue_items: int
    queue_weight: float
    last_step: dict[str, Any] | None
    workers: list[WorkerRow] = field(default_factory=list)


class _Rates:
    """Per-second rates of cumulative counters over the last ``_RATE_WINDOW_S`` seconds."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, tuple[int, ...]]] = deque()

    def update(self, t: float, values: tuple[int, ...]) -> tuple[float, ...]:
        self._samples.append((t, values))
        while len(self._samples) > 2 and t - self._samples[1][0] >= _RATE_WINDOW_S:
            self._samples.popleft()
        t0, v0 = self._samples[0]
        span = t - t0
        if span <= 0:
            return tuple(0.0 for _ in values)
        return tuple((v - w) / span for v, w in zip(values, v0, strict=True))


def _fmt_mb(nbytes: float) -> str:
    return f"{nbytes / _MB:.2f}"


def _step_line(rec: dict[str, Any], target: int, rates: tuple[float, ...], snap: Snapshot) -> str:
    return (f"step {rec['step']:>{len(str(target))}}/{target}  "
            f"t={rec['time']:6.2f}s  loss {rec['loss']:+.4f}  "
            f"ep.len {rec['mean_length']:6.1f}  "
            f"batch {rec['trajectories']} traj/{rec['env_steps']} steps  "
            f"staleness {rec['staleness']:.2f}  "
            f"{rates[1]:7.1f} traj/s  {rates[3] / _MB:6.3f} MB/s  "
            f"queue {snap.queue_items}")


class LineDisplay:
    """One line per training step (for pipes, files and tests)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._rates = _Rates()

    def message(self, text: str) -> None:
        print(text, file=self._out, flush=True)

    def update(self, snap: Snapshot, new_steps: list[dict[str, Any]]) -> None:
        rates = self._rates.update(snap.elapsed, _counters(snap))
        for rec in new_steps:
            print(_step_line(rec, snap.target, rates, snap), file=self._out)
        if new_steps:
            self._out.flush()

    def close(self) -> None:
        self._out.flush()


class LiveDisplay:
    """A block of lines redrawn in place (ANSI), a few times per second."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._rates = _Rates()
        self._drawn = 0  # lines of the block currently on screen
        self._cursor_hidden = False

    def message(self, text: str) -> None:
        self._erase()
        print(text, file=self._out, flush=True)

    def update(self, snap: Snapshot, new_steps: list[dict[str, Any]]) -> None:
        rates = self._rates.update(snap.elapsed, _counters(snap))
        # A line wider than the terminal would wrap and break the cursor-up arithmetic.
        width = max(20, shutil.get_terminal_size().columns - 1)
        lines = [line[:width] for line in _live_lines(snap, rates)]
        if not self._cursor_hidden:
            self._out.write("\x1b[?25l")
            self._cursor_hidden = True
        buf = []
        if self._drawn:
            buf.append(f"\x1b[{self._drawn}F")  # to the first line of the block
        for line in lines:
            buf.append(f"\x1b[2K{line}\n")
        if self._drawn > len(lines):
            buf.append("\x1b[J")  # a shorter block than last time: clear the rest
        self._out.write("".join(buf))
        self._out.flush()
        self._drawn = len(lines)

    def _erase(self) -> None:
        if self._drawn:
            self._out.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0

    def close(self) -> None:
        # The last frame stays on screen; the cursor comes back.
        if self._cursor_hidden:
            self._out.write("\x1b[?25h")
            self._cursor_hidden = False
        self._out.flush()


def make_display(out: TextIO | None = None) -> LineDisplay | LiveDisplay:
    """A live view on a terminal, one line per step otherwise."""
    out = out or sys.stdout
    isatty = getattr(out, "isatty", lambda: False)
    return LiveDisplay(out) if isatty() else LineDisplay(out)


def _counters(snap: Snapshot) -> tuple[int, ...]:
    return (snap.steps, snap.produced_items, snap.consumed_items, snap.produced_bytes,
            snap.consumed_bytes, snap.weights_bytes)


def _bar(done: int, total: int, width: int = 20) -> str:
    frac = min(1.0, done / total) if total else 0.0
    full = int(frac * width)
    return "[" + "#" * full + "." * (width - full) + "]"


def _live_lines(snap: Snapshot, rates: tuple[float, ...]) -> list[str]:
    steps_s, prod_s, cons_s, prod_bs, cons_bs, w_bs = rates
    last = snap.last_step
    learn = (f"loss {last['loss']:+.4f}  mean episode length {last['mean_length']:.1f}  "
             f"staleness {last['staleness']:.2f} versions" if last else "waiting for step 1")
    lines = [
        f"aiorl demo {snap.elapsed:6.1f} s  step {snap.steps}/{snap.target} "
        f"{_bar(snap.steps, snap.target)} {steps_s:5.1f} steps/s  weights v{snap.version}",
        f"  learning  {learn}",
        f"  rollouts  produced {snap.produced_items} traj  {prod_s:6.1f} traj/s  "
        f"{prod_bs / _MB:6.3f} MB/s into the channel",
        f"  trainers  trained on {snap.consumed_items} traj  {cons_s:6.1f} traj/s  "
        f"{cons_bs / _MB:6.3f} MB/s out of the channel",
        f"  channel   {snap.queue_items} trajectories waiting ({snap.queue_weight:.0f} env steps)"
        f"  weights published {w_bs / _MB:.3f} MB/s (aiorl.weights)",
        "",
    ]
    table = _table(["worker", "node", "state", "doing", "weights", "items", "env steps", "MB"],
                   [[w.name, w.node, w.state, w.activity, f"v{w.version}", w.items, w.env_steps,
                     _fmt_mb(w.nbytes)] for w in snap.workers])
    lines += table.splitlines()
    return lines


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    from aiorl.util.text import format_table

    return format_table(headers, rows)


def summary_text(snap: Snapshot, *, wall_s: float, train_s: float, first_length: float | None,
                 stopped_early: str | None, rollout_totals: dict[str, Any]) -> str:
    """The final report: totals, learning progress and a per-worker table."""
    span = train_s if train_s > 0 else float("nan")
    lines = ["", "aiorl demo summary", "=================="]
    pairs: list[tuple[str, str]] = [
        ("steps done", f"{snap.steps}/{snap.target}"
         + (f" (stopped early: {stopped_early})" if stopped_early else "")),
        ("final weight version", str(snap.version)),
        ("wall time", f"{wall_s:.1f} s (training {train_s:.1f} s)"),
        ("trajectories", f"produced {snap.produced_items}, trained on {snap.consumed_items}, "
                         f"left in the channel {snap.queue_items}, "
                         f"dropped at exit {rollout_totals.get('dropped', 0)}"),
        ("env steps", f"produced {rollout_totals.get('env_steps', 0)}, "
                      f"trained on {sum(w.env_steps for w in snap.workers if w.role == 'trainer')}"),
        ("throughput", f"{snap.consumed_items / span:.1f} traj/s trained, "
                       f"{snap.consumed_bytes / _MB / span:.3f} MB/s out of the channel, "
                       f"{snap.produced_bytes / _MB / span:.3f} MB/s into it"),
        ("weights published", f"{snap.weights_bytes / _MB:.2f} MB "
                              f"({snap.weights_bytes / _MB / span:.3f} MB/s, written once by "
                              "trainer:0, pulled by every worker)"),
        ("backpressure", f"rollouts waited {rollout_totals.get('put_wait_s', 0.0):.2f} s "
                         "in total for room in the channel"),
    ]
    if snap.last_step is not None and first_length is not None:
        pairs.append(("mean episode length", f"{first_length:.1f} at step 1 -> "
                      f"{snap.last_step['mean_length']:.1f} at step {snap.last_step['step']}"))
    width = max(len(k) for k, _ in pairs)
    lines += [f"{k.ljust(width)}  {v}" for k, v in pairs]
    lines.append("")
    lines.append(_table(
        ["worker", "node", "role", "items", "env steps", "MB", "weights", "notes"],
        [[w.name, w.node, w.role, w.items, w.env_steps, _fmt_mb(w.nbytes), f"v{w.version}",
          w.extra] for w in snap.workers]))
    return "\n".join(lines)
