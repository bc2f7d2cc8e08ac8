"""The control plane at scale: launch to first answer and the fan-out group call, by size.

For each layout (``N`` workers on one node agent, or ``A`` agents x ``N/A`` workers) and
each run, a fresh interpreter starts a fresh embedded cluster, warms every agent's zygote
(one throw-away worker per node, so torch is preloaded as in a running job), then times

* **launch to first answer**: ``launch(num_workers=N)`` until a no-op call to every rank
  has answered (spawn messages, forks, registrations, readiness, the first call);
* **fan-out group call, p50**: the median of ``--calls`` sequential no-op calls to all
  ``N`` ranks (after a few unmeasured ones);
* **driver CPU per call**: the driver process's CPU time (every thread) over those calls,
  divided by their number: the part that grows with the job on the driver, whatever the
  machine (on this VM every worker shares the driver's two cores, so the p50 also pays
  for all of the workers' own wake-ups; docs/scale.md).

The table shows the median over ``--runs`` runs (each a fresh cluster). With ``--baseline
DIR`` the same measurement runs against the tree in ``DIR`` as well (``PYTHONPATH=DIR``,
e.g. ``git archive 4b36fc5 | tar -x -C DIR``), interleaved run by run so that machine noise
hits both alike, and the two are printed side by side with their ratio.

With ``--floor`` the same run also measures the *floor* of the fan-out on this machine:
``benchmarks/_fanout_floor.py``, in a fresh interpreter, forks ``N`` Python processes (after
importing torch, as the zygote does) that each do only the least a call needs (one socket
each, unpack the header, look the method up, call it, send a reply: no authentication,
routing, ordering or error handling), and times a call to all ``N`` the same way. Both of
its modes run, for every distinct ``N`` among the layouts, ``--runs`` times, interleaved
with the other runs: the child runs the method on its method thread (what aiorl does for a
plain ``def`` method, which is what the probe calls) or right on its event loop. Their p50s
are printed below aiorl's in the fan-out table (a layout on ``A`` agents gets the floor of
the same ``N``: the floor has no agents, and it is one machine either way), with a table of
the floor's CPU per worker per call (every thread of every child; the aiorl probe does not
measure its workers' CPU). It answers "how far is aiorl from what this machine allows for
a call that runs on a worker's method thread?"::

    python benchmarks/bench_scale.py --sizes 8,16,64,128,256 --agents 4x64 --runs 3 \\
        [--baseline /tmp/aiorl-main] [--floor] [--json out.json] [--plot scale.png]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
from dataclasses import dataclass

PROBE = textwrap.dedent("""\
    import json, statistics, sys, time
    import aiorl

    nodes, workers, calls = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

    class Probe(aiorl.Worker):
        def noop(self):
            return None

    with aiorl.Cluster(num_nodes=nodes, timeout=120) as cluster:
        warm = Probe.create_group().launch(cluster, num_workers=nodes, name="warm")
        warm.noop().wait(300)  # every zygote has imported torch
        warm.close()
        begin = time.perf_counter()
        group = Probe.create_group().launch(cluster, num_workers=workers, name="probe")
        group.noop().wait(300)
        launch = time.perf_counter() - begin
        for _ in range(max(5, calls // 10)):
            group.noop().wait(60)
        samples = []
        cpu = time.process_time()  # the driver's own CPU, all its threads (ZMQ's included)
        for _ in range(calls):
            t = time.perf_counter()
            group.noop().wait(60)
            samples.append(time.perf_counter() - t)
        cpu = time.process_time() - cpu
        group.close()
    print(json.dumps({"launch_s": launch, "call_p50_ms": statistics.median(samples) * 1e3,
                      "driver_cpu_ms": cpu / calls * 1e3, "source": aiorl.__file__}))
    """)


@dataclass(frozen=True)
class Layout:
    nodes: int
    workers: int

    @property
    def label(self) -> str:
        return f"{self.workers}" if self.nodes == 1 else f"{self.workers} on {self.nodes} agents"


def parse_layouts(sizes: str, agents: str) -> list[Layout]:
    layouts = [Layout(1, int(s)) for s in sizes.split(",") if s.strip()]
    for item in filter(None, (a.strip() for a in agents.split(","))):
        count, _, per_agent = item.partition("x")
        layouts.append(Layout(int(count), int(count) * int(per_agent)))
    return layouts


def run_probe(layout: Layout, calls: int, tree: str | None, timeout: float) -> dict[str, float]:
    """One fresh interpreter and cluster; ``tree`` (a source tree) goes first on its path."""
    env = {k: v for k, v in os.environ.items() if k != "AIORL_REGISTRY"}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", PROBE, str(layout.nodes), str(layout.workers),
                          str(calls)], capture_output=True, text=True, timeout=timeout, env=env,
                         cwd=tree or os.getcwd())
    if out.returncode != 0:
        raise RuntimeError(f"probe {layout} ({tree or 'this tree'}) failed:\n{out.stderr[-3000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    source = str(result.pop("source"))
    if tree is not None and not os.path.realpath(source).startswith(os.path.realpath(tree)):
        raise RuntimeError(f"the baseline run imported aiorl from {source}, not from {tree}")
    return result


FLOOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fanout_floor.py")
FLOOR_MODES = {"thread": "floor, method thread", "loop": "floor, on the loop"}
FLOOR_KEYS = ("call_p50_ms", "worker_cpu_us", "driver_cpu_ms")


def run_floor(mode: str, workers: int, calls: int, timeout: float) -> dict[str, float]:
    """The floor program in a fresh interpreter (it forks ``workers`` children)."""
    out = subprocess.run([sys.executable, FLOOR, "--mode", mode, "--workers", str(workers),
                          "--calls", str(calls), "--warmup", str(max(5, calls // 10)),
                          "--timeout", str(max(10.0, timeout - 30))],
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"floor {mode} x{workers} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {key: float(result[key]) for key in FLOOR_KEYS}


TABLES = (("launch_s", "launch to first answer", "s"),
          ("call_p50_ms", "fan-out group call, p50", "ms"),
          ("driver_cpu_ms", "driver CPU per group call", "ms"))


def plot(samples: dict[str, dict[str, dict[str, list[float]]]], path: str) -> None:
    """A panel per table: each tree's medians by layout, with the range of its runs; the
    fan-out panel also has the floor's, hatched, where the samples hold them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floors = [name for name in samples if name in FLOOR_MODES.values()]
    trees = [name for name in samples if name not in floors]
    layouts = list(samples[trees[0]])
    fig, axes = plt.subplots(1, len(TABLES), figsize=(5 * len(TABLES), 3.4))
    for ax, (key, title, unit) in zip(axes, TABLES, strict=True):
        names = trees + floors if key == "call_p50_ms" else trees
        width = 0.8 / len(names)
        for k, name in enumerate(names):
            values = [samples[name][layout][key] for layout in layouts]
            medians = [statistics.median(v) for v in values]
            spread = [[m - min(v) for m, v in zip(medians, values, strict=True)],
                      [max(v) - m for m, v in zip(medians, values, strict=True)]]
            ax.bar([i + (k - (len(names) - 1) / 2) * width for i in range(len(layouts))],
                   medians, width, yerr=spread, capsize=2, label=name,
                   hatch="//" if name in floors else None)
        ax.set_xticks(range(len(layouts)), [x.replace(" on ", "\non ") for x in layouts],
                      fontsize=8)
        ax.set_title(f"{title} ({unit})", fontsize=10)
        ax.set_xlabel("workers")
        ax.grid(axis="y", alpha=0.3)
        if key == "call_p50_ms":  # the panel with every series
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def floor_label(layout: Layout) -> str:
    """A layout's label in a floor row: starred on agents (the floor of as many workers)."""
    return layout.label + ("*" if layout.nodes > 1 else "")


def floor_footnotes(layouts: list[Layout]) -> None:
    if any(layout.nodes > 1 for layout in layouts):
        print("* the floor of as many workers: the floor has no agents, and it is one machine "
              "either way")


def print_floor_rows(samples: dict[str, dict[str, dict[str, list[float]]]], floors: list[str],
                     layouts: list[Layout], trees: int, baseline: bool) -> None:
    """The fan-out table's floor rows: a block per mode, each p50 under the last tree's
    column (and, beside a baseline, the range of its runs under the range column)."""
    for name in floors:
        print(name)
        for layout in layouts:
            runs = samples[name][layout.label]["call_p50_ms"]
            row = f"{floor_label(layout):>18}{'':>{14 * (trees - 1)}}"
            row += f"{statistics.median(runs):>14.2f}"
            if baseline:
                row += f"{'':>10}{min(runs):>12.2f}-{max(runs):.2f}"
            print(row)
    print("floor: N forked Python processes doing the least a call needs, one socket each "
          "(benchmarks/_fanout_floor.py)")
    floor_footnotes(layouts)


def print_floor_cpu(samples: dict[str, dict[str, dict[str, list[float]]]], floors: list[str],
                    layouts: list[Layout]) -> None:
    """The floor's CPU per worker per call, by mode (the aiorl probe does not measure it)."""
    print("\nCPU per worker per call (µs), floor only: every thread of every child")
    print(f"{'workers':>18}" + "".join(f"{name.removeprefix('floor, '):>16}" for name in floors))
    for layout in layouts:
        print(f"{floor_label(layout):>18}" + "".join(
            f"{statistics.median(samples[name][layout.label]['worker_cpu_us']):>16.1f}"
            for name in floors))
    floor_footnotes(layouts)


def record(samples: dict[str, list[float]], result: dict[str, float]) -> None:
    """Add one run's values to a layout's samples, key by key."""
    for key, value in result.items():
        samples.setdefault(key, []).append(value)


def machine() -> str:
    load = os.getloadavg()
    return (f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"load average {load[0]:.2f} at start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,16,64,128,256",
                        help="worker counts on one node agent (comma-separated)")
    parser.add_argument("--agents", default="4x64",
                        help="AxN layouts: A agents with N workers each (comma-separated; '' none)")
    parser.add_argument("--runs", type=int, default=3, help="fresh clusters per layout and tree")
    parser.add_argument("--calls", type=int, default=100, help="measured group calls per run")
    parser.add_argument("--baseline", default=None,
                        help="a source tree to measure side by side (git archive REV | tar -x -C DIR)")
    parser.add_argument("--floor", action="store_true",
                        help="also measure the floor: N forked processes doing the least a call"
                             " needs (benchmarks/_fanout_floor.py), both modes, every N")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--json", help="also write every sample here")
    parser.add_argument("--plot", help="draw the tables into this PNG file")
    parser.add_argument("--plot-from", help="only draw --plot from a --json file written before")
    args = parser.parse_args()
    if args.plot_from:
        with open(args.plot_from) as f:
            plot(json.load(f)["samples"], args.plot or "scale.png")
        return 0
    layouts = parse_layouts(args.sizes, args.agents)
    trees: dict[str, str | None] = {"this tree": None}
    if args.baseline:
        trees = {"baseline": os.path.abspath(args.baseline), "this tree": None}
    print(machine(), flush=True)
    samples: dict[str, dict[str, dict[str, list[float]]]] = {t: {} for t in trees}
    # The floor's samples by worker count: a layout on A agents shares its N's floor.
    floor: dict[str, dict[int, dict[str, list[float]]]] = {
        name: {} for name in (FLOOR_MODES.values() if args.floor else ())}
    for layout in layouts:
        for run in range(args.runs):
            for tree_name, tree in trees.items():  # interleaved: noise hits both trees alike
                result = run_probe(layout, args.calls, tree, args.timeout)
                record(samples[tree_name].setdefault(layout.label, {}), result)
                print(f"  {layout.label:>18} run {run + 1}/{args.runs} {tree_name:>9}: "
                      f"launch {result['launch_s']:.2f} s, call p50 {result['call_p50_ms']:.2f} ms"
                      f", driver CPU {result['driver_cpu_ms']:.2f} ms/call",
                      file=sys.stderr, flush=True)
            for mode, name in FLOOR_MODES.items() if args.floor else ():
                per = floor[name].setdefault(layout.workers, {})
                if len(per.get("call_p50_ms", ())) > run:
                    continue  # measured with an earlier layout of as many workers
                result = run_floor(mode, layout.workers, args.calls, args.timeout)
                record(per, result)
                print(f"  {layout.workers:>18} run {run + 1}/{args.runs} {name}: call p50 "
                      f"{result['call_p50_ms']:.2f} ms, worker CPU {result['worker_cpu_us']:.1f}"
                      f" us/call, driver CPU {result['driver_cpu_ms']:.2f} ms/call",
                      file=sys.stderr, flush=True)
    for name, by_workers in floor.items():
        samples[name] = {layout.label: by_workers[layout.workers] for layout in layouts}
    print(f"\nmachine: {machine()}; median of {args.runs} runs, {args.calls} calls each")
    for key, title, unit in TABLES:
        print(f"\n{title} ({unit})")
        header = f"{'workers':>18}" + "".join(f"{t:>14}" for t in trees)
        if args.baseline:
            header += f"{'ratio':>10}{'range (this tree)':>22}"
        print(header)
        for layout in layouts:
            values = [statistics.median(samples[t][layout.label][key]) for t in trees]
            row = f"{layout.label:>18}" + "".join(f"{v:>14.2f}" for v in values)
            if args.baseline:
                mine = samples["this tree"][layout.label][key]
                row += f"{values[0] / values[1]:>9.2f}x{min(mine):>12.2f}-{max(mine):.2f}"
            print(row)
        if key == "call_p50_ms" and floor:
            print_floor_rows(samples, list(floor), layouts, len(trees), bool(args.baseline))
    if floor:
        print_floor_cpu(samples, list(floor), layouts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "runs": args.runs, "calls": args.calls,
                       "samples": samples}, f, indent=1)
    if args.plot:
        plot(samples, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
