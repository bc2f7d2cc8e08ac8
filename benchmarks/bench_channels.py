"""Channel throughput: aiorl ``Channel`` against ``ray.util.queue.Queue``, side by side.

Run::

    python benchmarks/bench_channels.py            # full run, prints a table
    python benchmarks/bench_channels.py --quick    # fewer items, for a smoke check

Scenarios, each with producers and consumers in separate worker processes and
the queue in its own process (the channel worker / Ray's queue actor):

* small items (a ``(rank, i)`` tuple), 1 -> 1 and 4 -> 4, in items/s;
* 1 MiB float32 CPU tensors, 1 -> 1 and 4 -> 4, in MB/s (10^6 bytes);
* sequential put/get streaming 1 -> 1: small items, the producer awaiting each
  ``put`` and the consumer each ``get`` in turn (no window in user code).

aiorl producers keep up to ``window`` puts in flight (a put completes when its
item is accepted, at once while the producer holds credits for small items). aiorl consumers are measured two ways:
``get_batch`` (one request at a time, for 64 small items or 8 tensors) and ``get``
with up to 256 gets in flight. The channel's maxsize is 64 for tensors (unbounded
for small items). Every aiorl worker runs with the process tuning of
``aiorl.actors.worker_process.tune_process`` (``gc.freeze()``, glibc ``mallopt``).
Ray is driven the way its API offers: one
``put``/``get`` call per item from actor processes. Every consumer takes exactly
its share of the items, so a run ends when the last item is consumed; the time is
the driver's wall clock from starting the consumers and producers to the end
(medians of ``--repeats``). Ray gets 100x fewer items (it is ~100x slower).

Results are printed as a table and saved to ``benchmarks/results/channels.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import deque
from typing import Any

import aiorl
from aiorl.channels import Channel

MB = 1_000_000
TENSOR_ELEMS = 256 * 1024  # float32: 1 MiB


def _payload(kind: str) -> Any:
    import torch

    return torch.ones(TENSOR_ELEMS, dtype=torch.float32) if kind == "tensor" else None


# ---------------------------------------------------------------------- aiorl side
class AiorlProducer(aiorl.Worker):
    async def produce_sequentially(self, ch: Channel, n: int) -> None:
        """One ``await ch.put(x)`` after the other: the plain streaming loop."""
        for i in range(n):
            await ch.put((self.rank, i), weight=1)

    async def produce(self, ch: Channel, n: int, kind: str, window: int) -> None:
        tensor = _payload(kind)  # one tensor, put repeatedly: it is never modified
        pending: list[Any] = []
        half = window // 2
        for i in range(n):
            pending.append(ch.put(tensor if kind == "tensor" else (self.rank, i), weight=1))
            if len(pending) >= window:
                await pending[half]  # puts of one process are acknowledged in order
                pending = pending[half + 1:]
        for w in pending:
            await w


class AiorlConsumer(aiorl.Worker):
    async def consume(self, ch: Channel, n: int, mode: str, batch: int) -> int:
        got = 0
        if mode == "sequential":
            for _ in range(n):
                await ch.get()
            return n
        if mode == "get_batch":
            while got < n:
                got += len(await ch.get_batch(min(batch, n - got)))  # weight 1 each: exact
            return got
        window = 256
        pending = deque(ch.get() for _ in range(min(window, n)))
        issued = len(pending)
        while pending:
            await pending.popleft()  # answers arrive in batches: most are done already
            got += 1
            if issued < n:
                pending.append(ch.get())
                issued += 1
        return got


def run_aiorl(cluster: aiorl.Cluster, kind: str, mode: str, nprod: int, ncons: int, n: int,
              repeats: int) -> list[float]:
    # Distinct names per configuration: a group name is not reused within one driver.
    name = f"bench-{kind}-{mode}-{nprod}x{ncons}"
    ch = Channel.create(cluster, name, maxsize=64 if kind == "tensor" else 0)
    placement = aiorl.placement.NodePlacementStrategy([0] * nprod)
    prods = AiorlProducer.create_group().launch(cluster, placement, name=f"{name}-p")
    placement = aiorl.placement.NodePlacementStrategy([0] * ncons)
    cons = AiorlConsumer.create_group().launch(cluster, placement, name=f"{name}-c")
    window = 16 if kind == "tensor" else 1024
    try:
        prods.wait_ready()
        cons.wait_ready()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            consumed = cons.consume(ch, n // ncons, mode, 8 if kind == "tensor" else 64)
            if mode == "sequential":
                prods.produce_sequentially(ch, n // nprod).wait(600)
            else:
                prods.produce(ch, n // nprod, kind, window).wait(600)
            assert sum(consumed.wait(600)) == n
            times.append(time.perf_counter() - start)
        return times
    finally:
        prods.close()
        cons.close()
        ch.destroy().wait(30)


# ---------------------------------------------------------------------- Ray side
def run_ray(kind: str, nprod: int, ncons: int, n: int, repeats: int) -> list[float]:
    import ray
    from ray.util.queue import Queue

    @ray.remote
    class RayProducer:
        def produce(self, q: Any, n: int, kind: str, rank: int) -> None:
            tensor = _payload(kind)
            for i in range(n):
                q.put(tensor if kind == "tensor" else (rank, i))

    @ray.remote
    class RayConsumer:
        def consume(self, q: Any, n: int) -> int:
            for _ in range(n):
                q.get()
            return n

    q = Queue(maxsize=64 if kind == "tensor" else 0)
    prods = [RayProducer.remote() for _ in range(nprod)]
    cons = [RayConsumer.remote() for _ in range(ncons)]
    ray.get([a.__ray_ready__.remote() for a in prods + cons])
    times = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            consumed = [c.consume.remote(q, n // ncons) for c in cons]
            ray.get([p.produce.remote(q, n // nprod, kind, r) for r, p in enumerate(prods)])
            assert sum(ray.get(consumed)) == n
            times.append(time.perf_counter() - start)
    finally:
        for a in prods + cons:
            ray.kill(a)
        q.shutdown()
    return times


# ---------------------------------------------------------------------- report
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer items (smoke check)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ray-repeats", type=int, default=1,
                        help="repeats for Ray (slow: ~100x fewer items per second)")
    parser.add_argument("--no-ray", action="store_true", help="skip Ray even if installed")
    parser.add_argument("--only", default="",
                        help="run only the scenarios whose label contains this text")
    args = parser.parse_args()
    scale = 0.1 if args.quick else 1.0
    small_n, tensor_n = int(200_000 * scale), int(2_000 * scale)
    ray_small_n, ray_tensor_n = int(2_000 * scale), int(200 * scale)

    try:
        if args.no_ray:
            raise ImportError
        import ray

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        ray_version: str | None = ray.__version__
    except ImportError:
        ray_version = None
        print("ray not installed" if not args.no_ray else "ray skipped (--no-ray)")

    scenarios = [  # (label, kind, producers, consumers)
        ("small 1->1", "small", 1, 1),
        ("small 4->4", "small", 4, 4),
        ("1MiB tensor 1->1", "tensor", 1, 1),
        ("1MiB tensor 4->4", "tensor", 4, 4),
    ]
    rows: list[dict[str, Any]] = []
    with aiorl.Cluster(num_nodes=1) as cluster:
        if args.only in "sequential 1->1":
            times = run_aiorl(cluster, "small", "sequential", 1, 1, small_n // 2, args.repeats)
            rows.append(_row("sequential 1->1", "aiorl put/get", "small", small_n // 2, times))
            _print_row(rows[-1])
        for label, kind, nprod, ncons in scenarios:
            if args.only not in label:
                continue
            n = small_n if kind == "small" else tensor_n
            for mode in ("get_batch", "get"):
                times = run_aiorl(cluster, kind, mode, nprod, ncons, n, args.repeats)
                rows.append(_row(label, f"aiorl {mode}", kind, n, times))
                _print_row(rows[-1])
            if ray_version is not None:
                rn = ray_small_n if kind == "small" else ray_tensor_n
                rows.append(_row(label, "ray.util.queue", kind, rn,
                                 run_ray(kind, nprod, ncons, rn, args.ray_repeats)))
                _print_row(rows[-1])
    print()
    print(_table(rows, ray_version or ("skipped" if args.no_ray else "not installed")))
    out = {
        "benchmark": "channels",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                 "platform": platform.platform()},
        "ray": ray_version or "not installed",
        "load_average_at_end": os.getloadavg(),
        "note": "load_average_at_end > cpus means other jobs shared the machine",
        "rows": rows,
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "channels.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\nsaved {path}")
    if ray_version is not None:
        import ray

        ray.shutdown()
    return 0


def _row(label: str, system: str, kind: str, n: int, times: list[float]) -> dict[str, Any]:
    t = statistics.median(times)
    row: dict[str, Any] = {"scenario": label, "system": system, "items": n,
                           "seconds": [round(x, 4) for x in times], "items_per_s": n / t}
    if kind == "tensor":
        row["MB_per_s"] = n * TENSOR_ELEMS * 4 / MB / t
    return row


def _print_row(row: dict[str, Any]) -> None:
    rate = f"{row['MB_per_s']:.0f} MB/s" if "MB_per_s" in row else f"{row['items_per_s']:.0f} items/s"
    print(f"  {row['scenario']:<18} {row['system']:<24} {rate}", flush=True)


def _table(rows: list[dict[str, Any]], ray_version: str) -> str:
    lines = [f"{'scenario':<18} | {'system':<24} | {'items':>7} | {'items/s':>9} | {'MB/s':>7}",
             "-" * 78]
    for r in rows:
        mbs = f"{r['MB_per_s']:.0f}" if "MB_per_s" in r else "-"
        lines.append(f"{r['scenario']:<18} | {r['system']:<24} | {r['items']:>7} | "
                     f"{r['items_per_s']:>9.0f} | {mbs:>7}")
    if ray_version in ("skipped", "not installed"):
        lines.append(f"ray.util.queue: ray {ray_version}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
