"""One weight update, 1 publisher -> N subscribers on one node: aiorl.weights side by side.

Run: ``python benchmarks/bench_weights.py [--size-mb 1024] [--subs 1,4,8] [--reps 3]
[--tensors N]``.
Prints a table of medians, writes ``benchmarks/results/weights.json`` and plots time
against subscribers to ``docs/img/weights.png`` (when matplotlib is importable).

The state dict: ~200 tensors of mixed sizes (a few large "embedding" tensors, many
mid-sized matrices, small biases), half fp32 and half bf16, ``--size-mb`` in total. Every
subscriber receives it *in place*, into a state dict of its own allocated beforehand.
``--tensors N`` makes it N tensors of one size instead (fp32 and bf16 in turn), where the
cost per tensor shows. The
time of one update runs from the moment the publisher starts (``time.perf_counter``, one
clock for every process of the host) to the moment the last subscriber holds the version.

* ``floor``: the machine's limit for this pattern, measured in the same run: one process
  copies the state into shared memory and raises an event; N processes copy it out into
  their own tensors (numpy, tensor by tensor). One memcpy in plus N out, nothing else.
* ``aiorl.weights``: ``publish(sd, version)`` in one worker; N workers blocked in
  ``wait_for(version)`` then ``pull(into=sd)``.
* ``aiorl N sends``: the publisher ``send``\\ s the state dict to each subscriber (the
  shared-memory P2P path); each ``recv``\\ s it and copies it into its own state dict.
* ``ray torch`` / ``ray numpy``: ``ray.put`` once, then every actor ``ray.get``\\ s it and
  copies into its own state dict (torch tensors, or numpy arrays which Ray maps without
  a copy). Only when ``import ray`` works.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import aiorl
from aiorl.placement import NodePlacementStrategy

RESULTS = Path(__file__).parent / "results" / "weights.json"
PLOT = Path(__file__).parent.parent / "docs" / "img" / "weights.png"
NUM_TENSORS = 200
#: Every timed update, by series and subscriber count (written to the results file).
RAW: dict[str, dict[int, list[float]]] = {}


#: ``--tensors``: that many tensors of one size instead of the mixed state dict (0: mixed);
#: from the environment, which the workers and floor readers inherit.
EQUAL_TENSORS = int(os.environ.get("BENCH_WEIGHTS_TENSORS", "0"))


def make_state(total_bytes: int, fill: float = 0.0) -> dict[str, torch.Tensor]:
    """~200 tensors summing to ``total_bytes``: 4 large, 96 mid-sized, 100 small; fp32/bf16
    (or `EQUAL_TENSORS` of one size)."""
    weights = ([1.0] * EQUAL_TENSORS if EQUAL_TENSORS
               else [40.0] * 4 + [8.0] * 96 + [0.05] * (NUM_TENSORS - 100))
    scale = total_bytes / sum(weights)
    sd: dict[str, torch.Tensor] = {}
    for i, w in enumerate(weights):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        numel = max(1, int(w * scale) // dtype.itemsize)
        sd[f"layer.{i}.{'w' if w > 1 else 'b'}"] = torch.full((numel,), fill, dtype=dtype)
    return sd


def state_bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def copy_into(dst: dict[str, Any], src: dict[str, Any]) -> None:
    """In-place copy of a received state dict (tensors or numpy arrays) into ``dst``."""
    for name, t in dst.items():
        s = src[name]
        if isinstance(s, np.ndarray):
            np.copyto(t.numpy(), s)  # Ray maps arrays read-only from its object store
        else:
            t.copy_(s)


# --------------------------------------------------------------------------- aiorl
class Publisher(aiorl.Worker):
    def __init__(self, total_bytes: int) -> None:
        self.sd = make_state(total_bytes, 1.0)

    async def publish(self, version: int) -> float:
        t0 = time.perf_counter()
        await self.weight_publisher("bench").publish(self.sd, version)
        return t0

    def ping(self) -> None:
        pass

    async def send_all(self, n: int) -> float:
        t0 = time.perf_counter()
        works = [self.send(self.sd, "wsubs", r) for r in range(n)]
        for w in works:
            await w
        return t0


class Subscriber(aiorl.Worker):
    def __init__(self, total_bytes: int) -> None:
        self.sd = make_state(total_bytes)

    async def pull(self, version: int) -> float:
        sub = self.weight_subscriber("bench")
        await sub.wait_for(version)
        got = await sub.pull(into=self.sd)
        assert got == version, (got, version)
        return time.perf_counter()

    def ping(self) -> None:
        pass

    async def recv_copy(self) -> float:
        received = await self.recv("wpub", 0)
        copy_into(self.sd, received)
        return time.perf_counter()


def bench_local(total_bytes: int, subs: list[int], reps: int) -> dict[str, dict[int, float]]:
    """The floor, aiorl.weights and N sends, interleaved rep by rep (the same load for all)."""
    out: dict[str, dict[int, float]] = {"floor": {}, "aiorl.weights": {}, "aiorl N sends": {}}
    with aiorl.Cluster(num_nodes=1) as cluster:
        pub = Publisher.create_group(total_bytes).launch(
            cluster, NodePlacementStrategy([0]), name="wpub")
        group = Subscriber.create_group(total_bytes).launch(
            cluster, NodePlacementStrategy([0] * max(subs)), name="wsubs")
        pub.ping().wait(300)
        group.ping().wait(300)
        floor = Floor(total_bytes, max(subs))  # started once the workers are up (2 cores)
        try:
            version = 0
            for n in subs:
                some = group.execute_on(list(range(n)))
                times: dict[str, list[float]] = {k: [] for k in out}
                for rep in range(reps + 1):  # the first update of each size is a warm-up
                    version += 1
                    t_floor = floor.update(n)
                    ends = some.pull(version)
                    t0 = pub.publish(version).wait(300)[0]
                    t_weights = max(ends.wait(300)) - t0
                    ends = some.recv_copy()
                    t0 = pub.send_all(n).wait(300)[0]
                    t_sends = max(ends.wait(300)) - t0
                    if rep:
                        times["floor"].append(t_floor)
                        times["aiorl.weights"].append(t_weights)
                        times["aiorl N sends"].append(t_sends)
                for k in out:
                    out[k][n] = statistics.median(times[k])
                    RAW.setdefault(k, {})[n] = times[k]
                print(f"  n={n}: floor {out['floor'][n]:.3f} s, weights "
                      f"{out['aiorl.weights'][n]:.3f} s, sends {out['aiorl N sends'][n]:.3f} s",
                      flush=True)
        finally:
            floor.close()
    return out


# --------------------------------------------------------------------------- floor
def _offsets(sd: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    out, off = {}, 0
    for name, t in sd.items():
        n = t.numel() * t.element_size()
        out[name] = (off, n)
        off += (n + 63) // 64 * 64
    return out


class Floor:
    """One memcpy of the state into shared memory (here) plus one out per reader process."""

    def __init__(self, total_bytes: int, readers: int) -> None:
        from multiprocessing.shared_memory import SharedMemory

        # spawn, not fork: a child forked after torch ran a parallel copy can hang in OpenMP.
        ctx = mp.get_context("spawn")
        self.src = make_state(total_bytes, 1.0)
        self.layout = _offsets(self.src)
        size = sum((b + 63) // 64 * 64 for _, b in self.layout.values())
        self.shm = SharedMemory(create=True, size=size)
        assert self.shm.buf is not None
        self.arr = np.frombuffer(self.shm.buf, dtype=np.uint8)
        self.go = ctx.Event()
        self.ready, self.done = ctx.Queue(), ctx.Queue()
        self.conns, self.procs = [], []
        for _ in range(readers):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_floor_reader, args=(total_bytes, self.shm.name, child,
                                                        self.go, self.ready, self.done))
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for _ in range(readers):
            self.ready.get(timeout=300)  # each reader built its state dict

    def update(self, n: int) -> float:
        """One update to the first ``n`` readers: seconds from the write's start to the last
        reader's end."""
        self.go.clear()
        for conn in self.conns[:n]:
            conn.send(True)
        for _ in range(n):
            self.ready.get(timeout=300)
        t0 = time.perf_counter()
        for name, (off, nb) in self.layout.items():
            np.copyto(self.arr[off : off + nb], self.src[name].view(-1).view(torch.uint8).numpy())
        self.go.set()
        return float(max(self.done.get(timeout=300) for _ in range(n))) - t0

    def close(self) -> None:
        for conn in self.conns:
            conn.send(False)
        for p in self.procs:
            p.join(60)
        del self.arr
        self.shm.close()
        self.shm.unlink()


def _floor_reader(total_bytes: int, shm_name: str, conn: Any, go: Any, ready: Any,
                  done: Any) -> None:
    from multiprocessing.shared_memory import SharedMemory

    torch.set_num_threads(1)
    dst = make_state(total_bytes)
    layout = _offsets(dst)
    shm = SharedMemory(name=shm_name)
    assert shm.buf is not None
    src = np.frombuffer(shm.buf, dtype=np.uint8)
    ready.put(True)
    while conn.recv():
        ready.put(True)
        go.wait()
        for name, (off, n) in layout.items():
            np.copyto(dst[name].view(-1).view(torch.uint8).numpy(), src[off : off + n])
        done.put(time.perf_counter())
    del src
    shm.close()


# --------------------------------------------------------------------------- ray
def bench_ray(total_bytes: int, subs: list[int], reps: int) -> dict[str, dict[int, float]] | str:
    try:
        import ray
    except ImportError:
        return "skipped: ray is not installed"
    ray.init(num_cpus=max(subs), include_dashboard=False, log_to_driver=False,
             object_store_memory=max(2 * total_bytes + (256 << 20), 1 << 30))
    try:

        @ray.remote
        class Sink:
            def __init__(self, total: int) -> None:
                self.sd = make_state(total)

            def take(self, refs: list[Any]) -> float:
                copy_into(self.sd, ray.get(refs[0]))
                return time.perf_counter()

            def ready(self) -> None:
                pass

            def use_byte_views(self) -> None:
                """numpy has no bf16: receive byte arrays into byte views of the tensors."""
                self.sd = {k: v.view(-1).view(torch.uint8) for k, v in self.sd.items()}

        actors = [Sink.remote(total_bytes) for _ in range(max(subs))]  # type: ignore[attr-defined]
        ray.get([a.ready.remote() for a in actors])
        src = make_state(total_bytes, 1.0)
        out: dict[str, dict[int, float]] = {"ray torch": {}, "ray numpy": {}}
        for kind, payload in (("ray torch", src),
                              ("ray numpy", {k: v.view(torch.uint8).numpy()
                                             for k, v in src.items()})):
            if kind == "ray numpy":
                ray.get([a.use_byte_views.remote() for a in actors])
            for n in subs:
                times = []
                for rep in range(reps + 1):
                    t0 = time.perf_counter()
                    ref = ray.put(payload)
                    t = max(ray.get([a.take.remote([ref]) for a in actors[:n]])) - t0
                    del ref
                    if rep:
                        times.append(t)
                out[kind][n] = statistics.median(times)
                RAW.setdefault(kind, {})[n] = times
                print(f"  {kind} n={n}: {out[kind][n]:.3f} s", flush=True)
        return out
    finally:
        ray.shutdown()


# --------------------------------------------------------------------------- main
def plot(results: dict[str, Any], subs: list[int]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, series in results["series"].items():
        ax.plot(subs, [series[str(n)] for n in subs], marker="o", label=label,
                linewidth=3 if label == "aiorl.weights" else 1.5,
                linestyle="--" if label == "floor" else "-")
    ax.set_xlabel("subscribers (one node)")
    ax.set_ylabel("seconds per update (median)")
    ax.set_xticks(subs)
    ax.set_title(f"{results['size_mb']} MB state dict ({results['num_tensors']} tensors, "
                 f"fp32/bf16), 1 publisher")
    ax.grid(alpha=0.3)
    ax.legend()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)
    return str(PLOT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--subs", default="1,4,8")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--tensors", type=int, default=0,
                        help="that many tensors of one size instead of the mixed ~200")
    args = parser.parse_args(argv)
    global EQUAL_TENSORS
    EQUAL_TENSORS = args.tensors
    os.environ["BENCH_WEIGHTS_TENSORS"] = str(args.tensors)  # before any process starts
    subs = [int(x) for x in args.subs.split(",")]
    total = args.size_mb << 20
    sd = make_state(total)
    print(f"state dict: {len(sd)} tensors, {state_bytes(sd) / 2**20:.0f} MB; "
          f"subscribers {subs}; {args.reps} reps (+1 warm-up)", flush=True)
    del sd
    series = bench_local(total, subs, args.reps)
    ray_out = "skipped: --no-ray" if args.no_ray else bench_ray(total, subs, args.reps)
    if isinstance(ray_out, dict):
        series.update(ray_out)
    results: dict[str, Any] = {
        "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                 "torch": torch.__version__, "loadavg_at_start": os.getloadavg()},
        "size_mb": args.size_mb, "num_tensors": args.tensors or NUM_TENSORS, "reps": args.reps,
        "series": {k: {str(n): v for n, v in s.items()} for k, s in series.items()},
        "ray": ray_out if isinstance(ray_out, str) else "ran",
        "raw": {k: {str(n): v for n, v in s.items()} for k, s in RAW.items()},
    }
    floor = series["floor"]
    results["weights_over_floor"] = {str(n): series["aiorl.weights"][n] / floor[n] for n in subs}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    results["plot"] = plot(results, subs)

    print("\nseconds per update (median), 1 publisher -> N subscribers, one node")
    print(f"{'':>16}" + "".join(f"{f'N={n}':>10}" for n in subs))
    for label, s in series.items():
        print(f"{label:>16}" + "".join(f"{s[n]:>10.3f}" for n in subs))
    print(f"{'weights/floor':>16}"
          + "".join(f"{results['weights_over_floor'][str(n)]:>10.2f}" for n in subs))
    print(f"\nplot: {results['plot']}; results: {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
