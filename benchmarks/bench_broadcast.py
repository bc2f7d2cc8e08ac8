"""Broadcast of one 64 MB tensor to 8 workers of one node, against point-to-point sends.

Run: ``python benchmarks/bench_broadcast.py [--reps 5] [--mb 64] [--ranks 8]``. Prints medians
and writes ``benchmarks/results/broadcast.json``.

Nine workers on one node: rank 0 is the source, ranks 1-8 the receivers. For each form the
receivers post their receive first (not timed); rank 0 stamps ``t0`` and starts; each receiver
stamps ``t1`` when its receive completes (``time.perf_counter``: CLOCK_MONOTONIC, comparable
across processes of one host). The time of a form is ``max(t1) - t0``, median of ``reps``.

* ``broadcast``: ``self.broadcast(t, groups=[("bcast", [0..8])])`` (the source writes the bytes
  once into shared memory; every receiver maps them copy-on-write; the broadcast completes when
  every member has them).
* ``one send``: ``send``/``recv`` of the same tensor to rank 1 only (the source copies it into a
  shared segment; the received tensor views it).
* ``8 sends``: rank 0 sends the tensor to each receiver with ``send``; each receives it.
* ``broadcast of an int``: the latency of a small broadcast (two phases: every member
  acknowledges to the source, which then says done to all).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

import aiorl
from aiorl.placement import NodePlacementStrategy

G = "bcast"


class Member(aiorl.Worker):
    def setup(self, mb: int) -> None:
        self.t = torch.ones(mb << 18)  # float32: mb MB

    def _members(self) -> list[tuple[str, list[int]]]:
        return [(G, list(range(self.world_size)))]

    async def broadcast_source(self, small: bool = False) -> float:
        t0 = time.perf_counter()
        await self.broadcast(1 if small else self.t, self._members(), async_op=True)
        return t0

    async def broadcast_receive(self) -> float:
        got = await self.broadcast(None, self._members(), async_op=True)
        t1 = time.perf_counter()
        assert isinstance(got, int) or got.shape == self.t.shape
        return t1

    async def send_to(self, ranks: list[int]) -> float:
        t0 = time.perf_counter()
        works = [self.send(self.t, G, r) for r in ranks]
        for w in works:
            await w
        return t0

    async def receive(self) -> float:
        got = await self.recv(G, 0)
        t1 = time.perf_counter()
        assert got.shape == self.t.shape
        return t1


def measure(g: Any, source: str, source_args: tuple[Any, ...], receivers: list[int],
            receive: str) -> float:
    pending = [getattr(g.execute_on(r), receive)() for r in receivers]
    time.sleep(0.3)  # the receives are posted
    t0: float = getattr(g.execute_on(0), source)(*source_args).wait(120)[0]
    t1: float = max(w.wait(120)[0] for w in pending)
    return t1 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=8, help="receivers")
    args = ap.parse_args()
    n = args.ranks
    receivers = list(range(1, n + 1))
    times: dict[str, list[float]] = {
        "broadcast": [], "one send": [], f"{n} sends": [], "broadcast of an int": []}
    with aiorl.Cluster(num_nodes=1) as cluster:
        g = Member.create_group().launch(
            cluster, name=G, placement_strategy=NodePlacementStrategy([0] * (n + 1))
        )
        g.setup(args.mb).wait(120)
        for rep in range(args.reps + 1):  # the first round warms up (segments, lookups)
            sample = {
                "broadcast": measure(g, "broadcast_source", (), receivers, "broadcast_receive"),
                "one send": measure(g, "send_to", ([1],), [1], "receive"),
                f"{n} sends": measure(g, "send_to", (receivers,), receivers, "receive"),
                "broadcast of an int": measure(g, "broadcast_source", (True,), receivers,
                                               "broadcast_receive"),
            }
            if rep:
                for k, v in sample.items():
                    times[k].append(v)
        g.close()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{args.mb} MB tensor, {n} receivers on one node, {os.cpu_count()} cores, "
          f"median of {args.reps} (ms):")
    for k, v in med.items():
        print(f"  {k:>19}: {v:8.1f}   (runs: {', '.join(f'{x * 1e3:.1f}' for x in times[k])})")
    ratio = med["broadcast"] / med["one send"]
    print(f"  broadcast / one send = {ratio:.2f}  (target <= 2)")
    print(f"  {n} sends / broadcast = {med[f'{n} sends'] / med['broadcast']:.2f}")
    out = os.path.join(os.path.dirname(__file__), "results", "broadcast.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"mb": args.mb, "receivers": n, "reps": args.reps, "median_ms": med,
                   "runs_ms": {k: [x * 1e3 for x in v] for k, v in times.items()},
                   "broadcast_over_one_send": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
