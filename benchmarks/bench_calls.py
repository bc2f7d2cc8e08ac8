"""Call latency, throughput, tensor arguments and launch time: aiorl beside Ray and raw pyzmq.

Run: ``python benchmarks/bench_calls.py [--reps 5]``. Prints a table of medians
and writes ``benchmarks/results/calls.json``. Ray columns appear when ``ray`` is
installed (``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq

import aiorl

SEQ_CALLS = 2000
IN_FLIGHT = 1000
#: Tensor arguments, worker to worker on one machine: (label, bytes).
TENSOR_SIZES = [("1mib", 1 << 20), ("64mib", 64 << 20)]
TENSOR_CALLS = 15


class Bench(aiorl.Worker):
    def noop(self) -> None:
        return None

    async def anoop(self) -> None:
        return None

    async def call_peer(self, peer: str, n: int) -> tuple[float, float]:
        """Worker to worker: sequential latency (µs) and calls/s with 1,000 in flight."""
        runtime = self._runtime
        await runtime.call_worker(peer, "anoop")
        t = time.perf_counter()
        for _ in range(n):
            await runtime.call_worker(peer, "anoop")
        seq_us = (time.perf_counter() - t) / n * 1e6
        t = time.perf_counter()
        await asyncio.gather(*(runtime.call_worker(peer, "anoop") for _ in range(IN_FLIGHT)))
        return seq_us, IN_FLIGHT / (time.perf_counter() - t)

    def take(self, t: Any) -> int:
        return int(t.numel())

    def tensor(self, nbytes: int) -> Any:
        """A tensor of ``nbytes`` as a result (made once: the call times its travel)."""
        import torch

        made = getattr(self, "_made", None)
        if made is None or made.numel() * 4 != nbytes:
            made = self._made = torch.ones(nbytes // 4)
        return made

    async def tensor_calls(self, dst: int, nbytes: int, n: int) -> float:
        """Median ms of calling ``take`` on rank ``dst`` with a tensor of ``nbytes``."""
        import torch

        t = torch.ones(nbytes // 4)
        peer = (await self.async_group(self.worker_group_name)).execute_on(dst)
        times = []
        for _ in range(n + 1):
            start = time.perf_counter()
            await peer.take(t)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:]) * 1e3

    async def tensor_sends(self, dst: int, nbytes: int, n: int) -> float:
        """Median ms of ``send_tensor`` of ``nbytes`` to rank ``dst`` (one way, landed)."""
        import torch

        t = torch.ones(nbytes // 4)
        times = []
        for _ in range(n + 1):
            start = time.perf_counter()
            await self.send_tensor(t, self.worker_group_name, dst, async_op=True).async_wait()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:]) * 1e3

    async def tensor_recvs(self, src: int, nbytes: int, n: int) -> None:
        import torch

        buf = torch.empty(nbytes // 4)
        for _ in range(n + 1):
            await self.recv_tensor(buf, self.worker_group_name, src, async_op=True).async_wait()


def median_of(reps: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(reps))


# --------------------------------------------------------------------------- aiorl
def bench_aiorl(reps: int) -> dict[str, float]:
    out: dict[str, float] = {}

    def cluster_ready() -> float:
        t = time.perf_counter()
        c = aiorl.Cluster()
        dt = time.perf_counter() - t
        c.close()
        return dt

    out["cluster_ready_s"] = median_of(reps, cluster_ready)
    with aiorl.Cluster() as c:
        g = Bench.create_group().launch(c, name="bench")
        g.noop().wait(60)

        def seq(method: str) -> Callable[[], float]:
            def run() -> float:
                call = getattr(g, method)
                t = time.perf_counter()
                for _ in range(SEQ_CALLS):
                    call().wait()
                return (time.perf_counter() - t) / SEQ_CALLS * 1e6
            return run

        out["seq_sync_method_us"] = median_of(reps, seq("noop"))
        out["seq_async_method_us"] = median_of(reps, seq("anoop"))

        def seq_from_coroutine() -> float:
            async def main() -> float:
                t = time.perf_counter()
                for _ in range(SEQ_CALLS):
                    await g.anoop()
                return (time.perf_counter() - t) / SEQ_CALLS * 1e6
            return asyncio.run(main())

        out["seq_async_from_coroutine_us"] = median_of(reps, seq_from_coroutine)

        def in_flight() -> float:
            t = time.perf_counter()
            works = [g.anoop() for _ in range(IN_FLIGHT)]
            for w in works:
                w.wait()
            return IN_FLIGHT / (time.perf_counter() - t)

        out["in_flight_calls_per_s"] = median_of(reps, in_flight)

        def result_64mib() -> float:
            g.tensor(64 << 20).wait(60)
            times = []
            for _ in range(TENSOR_CALLS):
                t = time.perf_counter()
                g.tensor(64 << 20).wait(60)
                times.append(time.perf_counter() - t)
            return statistics.median(times) * 1e3

        out["tensor_result_64mib_ms"] = median_of(reps, result_64mib)
        g.close()

        pair = Bench.create_group().launch(
            c, aiorl.placement.NodePlacementStrategy([0, 0]), name="pair")
        runs = [pair.execute_on(0).call_peer("pair:1", SEQ_CALLS).wait(120)[0] for _ in range(reps)]
        out["worker_to_worker_seq_us"] = statistics.median(r[0] for r in runs)
        out["worker_to_worker_in_flight_per_s"] = statistics.median(r[1] for r in runs)
        for label, nbytes in TENSOR_SIZES:
            out[f"tensor_arg_{label}_ms"] = statistics.median(
                pair.execute_on(0).tensor_calls(1, nbytes, TENSOR_CALLS).wait(600)[0]
                for _ in range(reps))
            received = pair.execute_on(1).tensor_recvs(0, nbytes, TENSOR_CALLS)
            out[f"send_tensor_{label}_ms"] = pair.execute_on(0).tensor_sends(
                1, nbytes, TENSOR_CALLS).wait(600)[0]
            received.wait(60)
        pair.close()

        counter = iter(range(10**6))

        def launch8() -> float:
            t = time.perf_counter()
            grp = Bench.create_group().launch(
                c, aiorl.placement.NodePlacementStrategy([0] * 8), name=f"launch{next(counter)}")
            grp.noop().wait(120)
            dt = time.perf_counter() - t
            grp.close()
            return dt

        launch8()  # the first launch also waits for the zygote to finish importing torch
        out["launch_8_workers_s"] = median_of(reps, launch8)
    return out


# --------------------------------------------------------------------------- ray
def bench_ray(reps: int) -> dict[str, float] | None:
    try:
        import ray
    except ImportError:
        return None
    out: dict[str, float] = {}
    ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        @ray.remote
        class RayBench:
            def __init__(self) -> None:
                import torch  # noqa: F401  (aiorl workers have torch imported too)

            def noop(self) -> None:
                return None

        a = RayBench.remote()
        ray.get(a.noop.remote())

        def seq() -> float:
            t = time.perf_counter()
            for _ in range(SEQ_CALLS // 2):
                ray.get(a.noop.remote())
            return (time.perf_counter() - t) / (SEQ_CALLS // 2) * 1e6

        out["seq_sync_method_us"] = median_of(reps, seq)

        def in_flight() -> float:
            t = time.perf_counter()
            ray.get([a.noop.remote() for _ in range(IN_FLIGHT)])
            return IN_FLIGHT / (time.perf_counter() - t)

        out["in_flight_calls_per_s"] = median_of(reps, in_flight)

        def launch8() -> float:
            t = time.perf_counter()
            actors = [RayBench.remote() for _ in range(8)]
            ray.get([x.noop.remote() for x in actors])
            dt = time.perf_counter() - t
            for x in actors:
                ray.kill(x)
            return dt

        out["launch_8_workers_s"] = median_of(max(1, reps // 2), launch8)
    finally:
        ray.shutdown()
    return out


# --------------------------------------------------------------------------- raw pyzmq floor
def _zmq_server(q: Any) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    q.put(s.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        parts = s.recv_multipart()
        if len(parts[-1]) > 1024:  # a tensor's bytes: a short answer, as a call's
            parts = [parts[0], b"ok"]
        s.send_multipart(parts)


def bench_pyzmq(reps: int) -> dict[str, float]:
    q: Any = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_zmq_server, args=(q,), daemon=True)
    proc.start()
    port = q.get()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{port}")
    s.send(b"x")
    s.recv()

    def seq() -> float:
        t = time.perf_counter()
        for _ in range(SEQ_CALLS):
            s.send(b"x")
            s.recv()
        return (time.perf_counter() - t) / SEQ_CALLS * 1e6

    def in_flight() -> float:
        t = time.perf_counter()
        for _ in range(IN_FLIGHT):
            s.send(b"x")
        for _ in range(IN_FLIGHT):
            s.recv()
        return IN_FLIGHT / (time.perf_counter() - t)

    out = {"seq_sync_method_us": median_of(reps, seq), "in_flight_calls_per_s": median_of(reps, in_flight)}
    for label, nbytes in TENSOR_SIZES:
        payload = bytearray(nbytes)

        def tensor_round_trip(payload: bytearray = payload) -> float:
            times = []
            for _ in range(TENSOR_CALLS):
                start = time.perf_counter()
                s.send(payload, copy=False)
                s.recv()
                times.append(time.perf_counter() - start)
            return statistics.median(times) * 1e3

        out[f"tensor_arg_{label}_ms"] = median_of(reps, tensor_round_trip)
    s.close(0)
    proc.kill()
    proc.join()
    return out


ROWS = [
    ("seq_sync_method_us", "sequential call, plain method (µs)"),
    ("seq_async_method_us", "sequential call, async method (µs)"),
    ("seq_async_from_coroutine_us", "sequential await from a coroutine (µs)"),
    ("in_flight_calls_per_s", f"{IN_FLIGHT} calls in flight (calls/s)"),
    ("worker_to_worker_seq_us", "worker to worker, sequential (µs)"),
    ("worker_to_worker_in_flight_per_s", f"worker to worker, {IN_FLIGHT} in flight (calls/s)"),
    ("tensor_result_64mib_ms", "64 MiB tensor result to the driver (ms)"),
    ("tensor_arg_1mib_ms", "worker to worker, 1 MiB tensor argument (ms)"),
    ("send_tensor_1mib_ms", "  send_tensor of it, one way (ms)"),
    ("tensor_arg_64mib_ms", "worker to worker, 64 MiB tensor argument (ms)"),
    ("send_tensor_64mib_ms", "  send_tensor of it, one way (ms)"),
    ("launch_8_workers_s", "launch 8 torch workers to first answer (s)"),
    ("cluster_ready_s", "embedded cluster ready (s)"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    results = {"aiorl": bench_aiorl(args.reps), "pyzmq": bench_pyzmq(args.reps)}
    ray_res = None if args.no_ray else bench_ray(args.reps)
    if ray_res is not None:
        results["ray"] = ray_res
    cols = ["aiorl", "ray", "pyzmq (floor)"]
    keys = ["aiorl", "ray", "pyzmq"]
    print(f"\n{'metric':<44}" + "".join(f"{c:>16}" for c in cols) + f"{'vs ray':>10}")
    for key, label in ROWS:
        vals = [results.get(k, {}).get(key) for k in keys]
        cells = "".join(f"{v:>16.4g}" if v is not None else f"{'-':>16}" for v in vals)
        ratio = ""
        if vals[0] and vals[1]:
            better = vals[1] / vals[0] if not key.endswith("per_s") else vals[0] / vals[1]
            ratio = f"{better:>9.1f}x"
        print(f"{label:<44}{cells}{ratio:>10}")
    if ray_res is None and not args.no_ray:
        print("\n(ray is not installed: pip install -e .[bench] for the Ray column)")
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/calls.json", "w") as f:
        json.dump({"results": results, "python": sys.version, "cpus": os.cpu_count()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
