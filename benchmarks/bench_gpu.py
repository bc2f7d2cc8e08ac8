"""CUDA point-to-point: aiorl beside raw device copies and raw NCCL (issue 13).

Run: ``python benchmarks/bench_gpu.py [--reps 7] [--max-size 8GB] [--quick]`` on a GPU
machine. Without CUDA it prints why and exits 0 (nothing to measure). Prints a table of
medians and writes ``benchmarks/results/gpu.json``.

What is measured (one-way times, ``time.perf_counter`` stamps taken in the two processes,
CLOCK_MONOTONIC, so comparable across processes of one host):

* **Same GPU** (two workers on GPU 0, the CUDA IPC path): ``send_tensor`` into a posted
  ``recv_tensor`` buffer, 1 KB - 8 GiB; beside a raw device-to-device ``copy_`` of the same
  size and a pinned host<->device copy, both timed with CUDA events in one process.
* **Two GPUs** (workers on GPUs 0 and 1, the NCCL path): aiorl ``send_tensor``; raw
  ``torch.distributed`` NCCL ``send``/``recv`` and ``batch_isend_irecv`` between two plain
  processes on the same GPUs.
* **Small message latency**: a 4-byte CUDA tensor vs a small CPU object, A -> B, median.
* **Fixed cost per message** (issue 26): the 1 KB one-way of a CUDA ``send_tensor`` into a
  posted CUDA buffer minus that of a CPU ``send_tensor`` into a posted CPU buffer: what the
  CUDA path adds to a message. Measured on both roads a small CUDA tensor can take: inline
  through pinned host memory (the default up to ``AIORL_CUDA_INLINE_BYTES``, 64 KiB) and
  CUDA IPC (a second pair of workers started with ``AIORL_CUDA_INLINE_BYTES=0``).

Targets (issue 13): IPC >= 80 % of a raw device copy from 64 MB; NCCL >= 90 % of raw
NCCL send/recv; small CUDA message latency <= 2x a CPU message. The table marks each.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import torch

SIZES = {
    "1KB": 1 << 10,
    "1MB": 1 << 20,
    "64MB": 64 << 20,
    "256MB": 256 << 20,
    "1GB": 1 << 30,
    "4GB": 4 << 30,
    "8GB": 8 << 30,
}
RESULTS = os.path.join(os.path.dirname(__file__), "results", "gpu.json")


def _size(text: str) -> int:
    return SIZES[text.upper()] if text.upper() in SIZES else int(text)


# ----------------------------------------------------------------------------- raw copies
def raw_copies(nbytes: int, reps: int) -> dict[str, float]:
    """Median seconds of a device copy and of pinned host->device / device->host copies."""
    n = nbytes // 4
    a = torch.ones(n, device="cuda")
    b = torch.empty(n, device="cuda")
    host = torch.empty(n, pin_memory=True)
    out: dict[str, list[float]] = {"d2d": [], "h2d": [], "d2h": []}
    for _ in range(reps):
        for key, (dst, src) in {"d2d": (b, a), "h2d": (b, host), "d2h": (host, a)}.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            out[key].append(start.elapsed_time(end) / 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


# ----------------------------------------------------------------------------- aiorl
def _worker_class() -> Any:
    import aiorl

    class Bench(aiorl.Worker):
        def __init__(self, device: int) -> None:
            super().__init__()
            torch.cuda.set_device(device)
            self.dev = torch.device("cuda", device)

        async def send_sizes(self, sizes: list[int], reps: int,
                             cpu: bool = False) -> list[list[float]]:
            stamps = []
            for nbytes in sizes:
                t = torch.ones(max(1, nbytes // 4), device="cpu" if cpu else self.dev)
                row = []
                for _ in range(reps + 1):
                    await self.recv("gpubench", 1)  # the receiver posted its buffer
                    torch.cuda.synchronize()
                    row.append(time.perf_counter())
                    await self.send_tensor(t, "gpubench", 1)
                stamps.append(row[1:])
            return stamps

        async def recv_sizes(self, sizes: list[int], reps: int,
                             cpu: bool = False) -> list[list[float]]:
            stamps = []
            for nbytes in sizes:
                buf = torch.empty(max(1, nbytes // 4), device="cpu" if cpu else self.dev)
                row = []
                for _ in range(reps + 1):
                    work = self.recv_tensor(buf, "gpubench", 0)
                    await self.send(None, "gpubench", 0)
                    await work
                    row.append(time.perf_counter())
                stamps.append(row[1:])
            return stamps

        async def small(self, n: int, cuda: bool) -> float:
            """Rank 0: median one-way latency of n small messages (ping-pong / 2)."""
            other = 1 - self.rank
            payload: Any = torch.ones(1, device=self.dev) if cuda else 1
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                if self.rank == 0:
                    await self.send(payload, "gpubench", other)
                    await self.recv("gpubench", other)
                else:
                    await self.recv("gpubench", other)
                    await self.send(payload, "gpubench", other)
                times.append((time.perf_counter() - t0) / 2)
            return statistics.median(times[n // 10 :])

    return Bench


def _one_way(group: Any, sizes: list[int], reps: int, cpu: bool = False) -> dict[int, float]:
    """Median one-way seconds per size, into a posted buffer (CPU tensors with ``cpu``)."""
    recv = group.execute_on(1).recv_sizes(sizes, reps, cpu)
    (sent,) = group.execute_on(0).send_sizes(sizes, reps, cpu).wait(3600)
    (landed,) = recv.wait(3600)
    return {
        n: statistics.median(b - a for a, b in zip(s, r, strict=True))
        for n, s, r in zip(sizes, sent, landed, strict=True)
    }


def fixed_costs(reps: int) -> dict[str, float]:
    """1 KB one-way on both small-tensor roads and for a CPU tensor, and small-message
    latencies (seconds): the fixed cost of a CUDA message is its excess over the CPU one."""
    import aiorl
    from aiorl.placement import NodePlacementStrategy

    kb = 1 << 10
    out: dict[str, float] = {}
    with aiorl.Cluster(num_nodes=1, log_to_driver=False) as cluster:
        for road, limit in (("inline", None), ("ipc", "0")):
            env = {} if limit is None else {"AIORL_CUDA_INLINE_BYTES": limit}
            group = _worker_class().create_group(0).launch(
                cluster, NodePlacementStrategy([0, 0]), name="gpubench", env=env)
            try:
                out[f"{road}_1kb_s"] = _one_way(group, [kb], max(reps, 50))[kb]
                if road == "inline":
                    out["cpu_1kb_s"] = _one_way(group, [kb], max(reps, 50), cpu=True)[kb]
                out[f"{road}_small_s"] = group.small(500, True).wait(600)[0]
            finally:
                group.close()
    for road in ("inline", "ipc"):
        out[f"{road}_fixed_s"] = out[f"{road}_1kb_s"] - out["cpu_1kb_s"]
    return out


def aiorl_run(gpus: tuple[int, int], sizes: list[int], reps: int) -> dict[str, Any]:
    import aiorl
    from aiorl.placement import FlexiblePlacementStrategy, NodePlacementStrategy

    with aiorl.Cluster(num_nodes=1, log_to_driver=False) as cluster:
        # Two workers on one GPU are placed by node: a GPU is one worker's accelerator, so
        # FlexiblePlacementStrategy([[0], [0]]) is refused (the H200 run of 2026-11-26).
        placement = (NodePlacementStrategy([0, 0]) if gpus[0] == gpus[1]
                     else FlexiblePlacementStrategy([[gpus[0]], [gpus[1]]]))
        group = _worker_class().create_group(0).launch(cluster, placement, name="gpubench")
        try:
            one_way = _one_way(group, sizes, reps)
            small_cuda = group.small(500, True).wait(600)[0]
            small_cpu = group.small(500, False).wait(600)[0]
        finally:
            group.close()
    return {"one_way_s": one_way, "small_cuda_s": small_cuda, "small_cpu_s": small_cpu}


# ----------------------------------------------------------------------------- raw NCCL
def _nccl_peer(rank: int, port: int, sizes: list[int], reps: int, batch: bool, q: Any) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        device_id=torch.device("cuda", rank),
    )
    out = {}
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4), device="cuda")
        times = []
        for _ in range(reps + 1):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if batch:
                op = dist.isend if rank == 0 else dist.irecv
                for w in dist.batch_isend_irecv([dist.P2POp(op, t, 1 - rank)]):
                    w.wait()
            elif rank == 0:
                dist.send(t, 1)
            else:
                dist.recv(t, 0)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[nbytes] = statistics.median(times[1:])
    if rank == 1:
        q.put(out)
    dist.destroy_process_group()


def raw_nccl(sizes: list[int], reps: int, batch: bool) -> dict[int, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_nccl_peer, args=(r, port, sizes, reps, batch, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    result: dict[int, float] = q.get(timeout=3600)
    for p in procs:
        p.join(60)
    return result


# ----------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--max-size", default="8GB")
    parser.add_argument("--quick", action="store_true", help="sizes up to 64MB, 3 reps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing to measure (run it on a GPU machine).")
        return 0
    limit = _size("64MB" if args.quick else args.max_size)
    reps = 3 if args.quick else args.reps
    free, _ = torch.cuda.mem_get_info(0)
    sizes = [n for n in SIZES.values() if n <= limit and 3 * n < free]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "sizes": sizes}
    raw = {n: raw_copies(n, reps) for n in sizes}
    ipc = aiorl_run((0, 0), sizes, reps)
    results["same_gpu"] = {"raw": raw, "aiorl": ipc}
    print(f"{'size':>8} {'ipc GB/s':>9} {'d2d GB/s':>9} {'h2d GB/s':>9} {'ipc/d2d':>8}")
    for name, n in SIZES.items():
        if n not in raw:
            continue
        ratio = raw[n]["d2d"] / ipc["one_way_s"][n]
        mark = "" if n < 64 << 20 else ("  ok" if ratio >= 0.8 else "  BELOW 80%")
        print(
            f"{name:>8} {n / ipc['one_way_s'][n] / 1e9:9.2f} {n / raw[n]['d2d'] / 1e9:9.2f}"
            f" {n / raw[n]['h2d'] / 1e9:9.2f} {ratio:8.2f}{mark}"
        )
    ratio = ipc["small_cuda_s"] / ipc["small_cpu_s"]
    print(
        f"small message: CUDA {ipc['small_cuda_s'] * 1e6:.0f} us, CPU "
        f"{ipc['small_cpu_s'] * 1e6:.0f} us, ratio {ratio:.2f}"
        f"{'  ok' if ratio <= 2 else '  ABOVE 2x'}"
    )
    fixed = fixed_costs(reps)
    results["fixed_cost"] = fixed
    for road in ("inline", "ipc"):
        cost = fixed[f"{road}_fixed_s"] * 1e6
        print(
            f"1 KB one-way, {road:>6} road: {fixed[f'{road}_1kb_s'] * 1e6:.0f} us (CPU tensor "
            f"{fixed['cpu_1kb_s'] * 1e6:.0f} us): fixed cost {cost:.0f} us"
            f"{'  ok' if cost <= 50 else '  ABOVE 50 us'}; small message "
            f"{fixed[f'{road}_small_s'] * 1e6:.0f} us"
        )
    if torch.cuda.device_count() >= 2:
        nccl = aiorl_run((0, 1), sizes, reps)
        send_recv = raw_nccl(sizes, reps, batch=False)
        batched = raw_nccl(sizes, reps, batch=True)
        results["two_gpus"] = {"aiorl": nccl, "raw_send_recv": send_recv, "raw_batch": batched}
        print(f"{'size':>8} {'aiorl GB/s':>11} {'nccl GB/s':>10} {'batch GB/s':>11} {'ratio':>6}")
        for name, n in SIZES.items():
            if n not in send_recv:
                continue
            ratio = send_recv[n] / nccl["one_way_s"][n]
            print(
                f"{name:>8} {n / nccl['one_way_s'][n] / 1e9:11.2f} "
                f"{n / send_recv[n] / 1e9:10.2f} {n / batched[n] / 1e9:11.2f} {ratio:6.2f}"
                f"{'  ok' if ratio >= 0.9 else '  BELOW 90%'}"
            )
    else:
        print("one GPU: the NCCL comparison needs two")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
