"""What tracing costs: call latency and in-flight throughput with tracing off and on, one run.

Run: ``python benchmarks/bench_trace.py [--reps 15]``. One embedded cluster, one worker;
tracing is switched in every process between samples (off and on interleaved, so
machine noise hits both alike), exactly as ``aiorl trace start/stop`` does. Prints a table
and writes ``benchmarks/results/trace.json``.

Targets (issue 15): on adds ≤ 2 µs per span and ≤ 5 % throughput loss; off adds nothing
measurable. The no-op cases are the worst case (tracing's fixed cost against the smallest
call); the 200 µs method shows a call that does some work. A traced call records one span in
each process (the caller's call span, the worker's execution), so the cost of a span is what
tracing adds to each process's CPU time per call: read from ``/proc/<pid>/task/*/schedstat``
around the in-flight samples (Linux; the rows are left out elsewhere). The latency rows
cannot show it: their run-to-run noise is ten times larger. The cost of the hooks with
tracing off is one module attribute check each, measured alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import timeit
from collections.abc import Callable

import aiorl
from aiorl.actors.inspection import traced_execution
from aiorl.cluster import doctor
from aiorl.group import calls as group_calls
from aiorl.trace import recorder
from aiorl.transport.endpoint import Incoming

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_calls as calls  # noqa: E402 - the sibling script, importable once on the path

SEQ_CALLS, IN_FLIGHT = calls.SEQ_CALLS, calls.IN_FLIGHT

class Bench(calls.Bench):
    """The call benchmark's worker, plus a method that does some work."""

    def work(self) -> None:
        """A call that does something: ~200 µs of CPU (a small policy step, a reward)."""
        end = time.perf_counter() + 200e-6
        while time.perf_counter() < end:
            pass


def switch(cluster: aiorl.Cluster, on: bool) -> None:
    """Tracing on or off everywhere (as ``aiorl trace start/stop``), buffers emptied."""
    rt = cluster.runtime
    for probe in rt.run_sync(doctor.switch_tracing(rt.endpoint, rt.registry, on)):
        assert probe.reply is not None, probe.error
    rt.run_sync(doctor.pull_trace(rt.endpoint, rt.registry))  # drain, so buffers start empty


def sequential(call: Callable[[], aiorl.AsyncWork[object]]) -> float:
    t = time.perf_counter()
    for _ in range(SEQ_CALLS):
        call().wait()
    return (time.perf_counter() - t) / SEQ_CALLS * 1e6


#: Rounds of IN_FLIGHT calls per in-flight sample: one round of no-op calls lasts 12-35 ms
#: here, too short a sample against this machine's noise.
IN_FLIGHT_ROUNDS = 30


def in_flight(call: Callable[[], aiorl.AsyncWork[object]], rounds: int = IN_FLIGHT_ROUNDS) -> float:
    t = time.perf_counter()
    for _ in range(rounds):
        works = [call() for _ in range(IN_FLIGHT)]
        for w in works:
            w.wait()
    return rounds * IN_FLIGHT / (time.perf_counter() - t)


def hook_check_ns() -> float:
    """What a hook costs with tracing off: one ``if recorder.ON`` (net of the loop)."""
    n = 2_000_000
    check = timeit.timeit("if r.ON: pass", globals={"r": recorder}, number=n)
    empty = timeit.timeit("pass", number=n)
    return max(0.0, (check - empty) / n * 1e9)


def span_ns(kind: str) -> float:
    """One span alone: a pending one (``begin``/``end``: sends, receives, channel and weight
    operations) or a recorded one (``record``: group calls and executions)."""
    was = recorder.ON
    recorder.enable()
    n = 200_000
    t = time.perf_counter()
    if kind == "pending":
        for _ in range(n):
            recorder.Span("send", "send", "bench:0").end()  # as the P2P hooks do
    else:
        for _ in range(n):
            recorder.record("call", "noop", 0, "bench:0", 0, True, None, None, None, True)
    cost = (time.perf_counter() - t) / n * 1e9
    recorder.drain()
    if not was:
        recorder.disable()
    return cost


def call_hook_ns(n: int = 200_000) -> float:
    """The driver's hook alone: what a traced group call's object and answer cost more than an
    untraced one's (``aiorl.group.calls``: the call made, rank 0's request id kept, the answer
    settled and, traced, recorded), on one rank, in a loop on a private event loop."""
    loop = asyncio.new_event_loop()
    shape = group_calls.CallTrace("driver", "bench", (0,), "noop")
    reply: tuple[None, list[bytes]] = (None, [])

    def run(traced: bool) -> float:
        t = time.perf_counter()
        for rid in range(1, n + 1):
            work: aiorl.AsyncWork[list[object]] = aiorl.AsyncWork(loop)
            if traced:  # as CallDispatch.dispatch makes it
                call = group_calls.TracedGroupCall(work, 1)
                call.shape, call.nbytes, call.t0 = shape, 0, recorder.now()
            else:
                call = group_calls.GroupCall(work, 1)
            call.results[0] = rid
            call.settle(0, None, reply)
        return (time.perf_counter() - t) / n * 1e9

    was = recorder.ON
    recorder.enable()
    try:
        costs = [run(True) - run(False) for _ in range(5)]
    finally:
        recorder.drain()
        if not was:
            recorder.disable()
        loop.close()
    return statistics.median(costs)


def execution_hook_ns(me: aiorl.WorkerInfo, n: int = 200_000) -> float:
    """The worker's hook alone: recording an ``async def`` execution's start
    (``aiorl.actors.inspection.traced_execution``) for calls as they arrive."""
    calls = [Incoming(None, b"driver/1/ab", 0, rid, "call", "anoop", [])  # type: ignore[arg-type]
             for rid in range(1, n + 1)]
    was = recorder.ON
    recorder.enable()
    costs = []
    try:
        for _ in range(5):
            t = time.perf_counter()
            for msg in calls:
                traced_execution(sequential, True, msg, me)
            costs.append((time.perf_counter() - t) / n * 1e9)
            recorder.drain()
    finally:
        if not was:
            recorder.disable()
    return statistics.median(costs)


def cpu_ns(pid: int) -> int | None:
    """CPU time a process has used so far (ns, all its threads; Linux), or None."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total


#: The case whose samples also measure each process's CPU time per call.
CPU_CASE = "in flight, async (calls/s)"


def median_interval(changes: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 95 % bootstrap interval of the median change: how far the noise of this run alone
    could move it (on this 2-core VM one repetition's change can be ±30 % for in-flight
    throughput, so a median can only be as sure as this interval says)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(changes, k=len(changes)))
                     for _ in range(resamples))
    return medians[int(resamples * 0.025)], medians[int(resamples * 0.975) - 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    rows: dict[str, dict[str, list[float]]] = {}
    with aiorl.Cluster() as cluster:
        g = Bench.create_group().launch(cluster, name="bench")
        g.noop().wait(60)
        cases: dict[str, Callable[[], float]] = {
            "seq plain method (µs/call)": lambda: sequential(g.noop),
            "seq async method (µs/call)": lambda: sequential(g.anoop),
            "in flight, async (calls/s)": lambda: in_flight(g.anoop),
            "in flight, 200 µs method (calls/s)": lambda: in_flight(g.work, 1),
        }
        me = g.worker_info_list[0]
        processes = {"driver": os.getpid(), "worker": me.pid}
        for fn in cases.values():
            fn()  # warm
        for rep in range(args.reps):
            # Each repetition's two samples run back to back, in turns off-on and on-off,
            # so that a drift within a pair (this VM's speed moves within seconds) is not
            # charged to the same state every time.
            for state in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                switch(cluster, state == "on")
                for name, fn in cases.items():
                    before = {who: cpu_ns(pid) for who, pid in processes.items()}
                    rows.setdefault(name, {}).setdefault(state, []).append(fn())
                    if name != CPU_CASE:
                        continue
                    for who, pid in processes.items():
                        t0, t1 = before[who], cpu_ns(pid)
                        if t0 is not None and t1 is not None:
                            rows.setdefault(f"{who} CPU in flight (µs/call)", {}).setdefault(
                                state, []).append((t1 - t0) / (IN_FLIGHT * IN_FLIGHT_ROUNDS) / 1e3)
        switch(cluster, False)
    result: dict[str, object] = {"reps": args.reps, "cpus": os.cpu_count(),
                                 "python": sys.version.split()[0]}
    print(f"{'case':36} {'off':>10} {'on':>10} {'change':>10}   95 % interval")
    for name, by_state in rows.items():
        off, on = statistics.median(by_state["off"]), statistics.median(by_state["on"])
        # The change is the median of each repetition's own change (its off and on samples
        # ran back to back): this VM's speed drifts by 10-20 % over a run, which a ratio of
        # the two medians would mix in.
        changes = [(b - a) / a * 100
                   for a, b in zip(by_state["off"], by_state["on"], strict=True)]
        change = statistics.median(changes)
        low, high = median_interval(changes)
        result[name] = {"off": off, "on": on, "change_pct": change,
                        "change_pct_95": [low, high], "samples": by_state}
        print(f"{name:36} {off:10.1f} {on:10.1f} {change:+9.1f}%   [{low:+.1f}, {high:+.1f}]")
    for who in ("driver", "worker"):  # one span per call in each process
        c = result.get(f"{who} CPU in flight (µs/call)")
        if isinstance(c, dict):
            per_span = statistics.median(
                b - a for a, b in zip(c["samples"]["off"], c["samples"]["on"], strict=True))
            result[f"added per span, {who} (µs)"] = per_span
            print(f"{f'added per span, {who} (CPU)':36} {per_span:10.2f} µs")
    hooks = {"driver hook per call (traced - not)": call_hook_ns(),
             "worker hook per async call": execution_hook_ns(me)}
    for name, cost in hooks.items():
        result[f"{name} (ns)"] = cost
        print(f"{name:36} {cost:10.0f} ns")
    for kind in ("pending", "recorded"):
        result[f"{kind} span alone (ns)"] = span_ns(kind)
        print(f"{f'one {kind} span alone':36} {result[f'{kind} span alone (ns)']:10.0f} ns")
    result["hook check with tracing off (ns)"] = hook_check_ns()
    # This machine's speed, to scale the figures above: an empty Python function call.
    n = 1_000_000
    result["empty Python call (ns)"] = timeit.timeit(lambda: None, number=n) / n * 1e9
    print(f"{'(an empty Python call here)':36} {result['empty Python call (ns)']:10.1f} ns")
    print(f"{'a hook with tracing off':36} {result['hook check with tracing off (ns)']:10.1f} ns")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "trace.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
