"""Point-to-point between two workers of one node: aiorl side by side with Gloo, memcpy and Ray.

Run: ``python benchmarks/bench_p2p.py [--reps 7] [--quick]``. Prints a table of
medians and writes ``benchmarks/results/p2p.json``. ``--relay`` measures instead, on two
nodes, a direct pair beside a pair relayed through both node agents (``aiorl.p2p.p2p_relay``)
and writes ``benchmarks/results/p2p_relay.json``.

What is measured (both ends are separate processes on this host; times are taken
with ``time.perf_counter``, which is CLOCK_MONOTONIC and so comparable across
processes of one host):

* ``small_rtt_us``: an int sent A -> B and back, per round trip (async methods).
* ``small_oneway_msgs_per_s``: A sends N small objects back to back; from A's
  first send to B's last completed receive.
* ``bandwidth``: for each size, B posts its receive and tells A (a small
  message, not timed); A stamps ``t0`` and sends; B stamps ``t1`` when its
  receive completes. One-way time is ``t1 - t0``, median of ``reps``. Two aiorl
  forms: ``send_tensor``/``recv_tensor`` into a preallocated buffer (on one node
  the receiver pulls the bytes with one ``process_vm_readv`` copy from 1 MiB up),
  and ``send``/``recv`` of the tensor as an object (on one node the sender copies
  into a reused shared segment and the received tensor views it: no copy on the
  receiving side).
* ``state_dict_ms``: the 64 MB ``send``/``recv`` again, as a dict of 1,000 tensors of their
  own storage each (a model's state dict): what pickling and copying per tensor adds.
* Gloo: ``torch.distributed`` send/recv between two plain processes, timed the
  same way (the "ready" is a 1-element Gloo message).
* memcpy: ``numpy.copyto`` of the same size in one process (the floor for any
  path that copies once; 2 cores here).
* Ray: a tensor passed to another actor's method, timed from ``.remote()`` to the
  method's start (only when ``import ray`` works).
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

import numpy as np
import torch

import aiorl
from aiorl.placement import NodePlacementStrategy

SIZES = {"1KB": 1 << 10, "1MB": 1 << 20, "64MB": 64 << 20, "256MB": 256 << 20}
SMALL_RTT_N = 2000
ONEWAY_N = 100_000
#: The "state dict" row: 64 MB as this many tensors of its own storage each (a model's).
STATE_DICT_TENSORS = 1000


class Peer(aiorl.Worker):
    """Rank 0 sends, rank 1 receives."""

    def _other(self) -> int:
        return 1 - self.rank

    async def pingpong(self, n: int) -> float:
        other = self._other()
        if self.rank == 0:
            await self.recv(self.worker_group_name, other)  # both sides up
            t = time.perf_counter()
            for i in range(n):
                await self.send(i, self.worker_group_name, other)
                await self.recv(self.worker_group_name, other)
            return (time.perf_counter() - t) / n * 1e6
        await self.send("go", self.worker_group_name, other)
        for _ in range(n):
            x = await self.recv(self.worker_group_name, other)
            await self.send(x, self.worker_group_name, other)
        return 0.0

    async def oneway(self, n: int) -> float:
        other = self._other()
        if self.rank == 0:
            await self.recv(self.worker_group_name, other)
            t0 = time.perf_counter()
            last = None
            for i in range(n):
                last = self.send(i, self.worker_group_name, other)
            await last
            return t0
        works = [self.recv(self.worker_group_name, other) for _ in range(n)]
        await self.send("go", self.worker_group_name, other)
        for i, w in enumerate(works):
            if await w != i:
                raise AssertionError("out of order")
        return time.perf_counter()

    async def bw(self, nbytes: int, reps: int, mode: str) -> list[float]:
        """Rank 0: list of t0 per rep; rank 1: list of t1 per rep (after 2 warm-up reps that
        touch fresh buffers and create shared segments). ``mode``: ``tensor``
        (send_tensor/recv_tensor), ``object`` (send/recv of the tensor), ``dict`` (send/recv
        of the same bytes as a dict of `STATE_DICT_TENSORS` tensors)."""
        other = self._other()
        stamps: list[float] = []
        if self.rank == 0:
            x: Any = torch.arange(nbytes, dtype=torch.uint8)  # values 0..255 repeating
            if mode == "dict":
                x = {f"layer{i}.weight": part.clone()
                     for i, part in enumerate(x.chunk(STATE_DICT_TENSORS))}
            for _ in range(reps + 2):
                await self.recv(self.worker_group_name, other)
                stamps.append(time.perf_counter())
                w = (
                    self.send_tensor(x, self.worker_group_name, other)
                    if mode == "tensor"
                    else self.send(x, self.worker_group_name, other)
                )
                await w
            return stamps[2:]
        buf = torch.empty(nbytes, dtype=torch.uint8)
        expect = torch.arange(nbytes, dtype=torch.uint8)
        for i in range(reps + 2):
            w = (
                self.recv_tensor(buf, self.worker_group_name, other)
                if mode == "tensor"
                else self.recv(self.worker_group_name, other)
            )
            self.send(None, self.worker_group_name, other)
            got = await w
            stamps.append(time.perf_counter())
            if mode == "dict":
                got = torch.cat(list(got.values()))
            if i == reps + 1 and not torch.equal(got, expect):
                raise AssertionError(f"{mode} {nbytes} B: wrong data")
            del got
        return stamps[2:]


# --------------------------------------------------------------------------- aiorl
def bench_aiorl(reps: int, sizes: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with aiorl.Cluster(num_nodes=1) as c:
        g = Peer.create_group().launch(
            c, name="p2pbench", placement_strategy=NodePlacementStrategy([0, 0])
        )
        g.pingpong(50).wait(120)  # warm-up
        out["small_rtt_us"] = statistics.median(
            g.pingpong(SMALL_RTT_N).wait(120)[0] for _ in range(reps)
        )
        rates = []
        for _ in range(max(3, reps // 2)):
            t0, t1 = g.oneway(ONEWAY_N).wait(120)
            rates.append(ONEWAY_N / (t1 - t0))
        out["small_oneway_msgs_per_s"] = statistics.median(rates)
        for mode in ("tensor", "object"):
            res = {}
            for label, n in sizes.items():
                r = reps if n < (128 << 20) else max(3, reps // 2)
                t0s, t1s = g.bw(n, r, mode).wait(300)
                res[label] = statistics.median(b - a for a, b in zip(t0s, t1s, strict=True)) * 1e3
            out[f"{mode}_ms"] = res
        t0s, t1s = g.bw(sizes["64MB"], reps, "dict").wait(300)
        out["state_dict_ms"] = statistics.median(
            b - a for a, b in zip(t0s, t1s, strict=True)) * 1e3
        g.close()
    return out


def bench_relay(reps: int, sizes: dict[str, int]) -> dict[str, Any]:
    """Two nodes (an embedded cluster): a direct pair beside a pair relayed through the two
    node agents (``AIORL_P2P_DIRECT_PEERS=0``, `aiorl.p2p.p2p_relay`), same measurements."""
    out: dict[str, Any] = {}
    with aiorl.Cluster(num_nodes=2) as c:
        for route, env in (("direct", None), ("relayed", {"AIORL_P2P_DIRECT_PEERS": "0"})):
            g = Peer.create_group().launch(
                c, name=f"p2p{route}", placement_strategy=NodePlacementStrategy([0, 1]), env=env
            )
            g.pingpong(50).wait(120)  # warm-up
            res: dict[str, Any] = {
                "small_rtt_us": statistics.median(
                    g.pingpong(SMALL_RTT_N).wait(120)[0] for _ in range(reps)
                )
            }
            rates = []
            for _ in range(max(3, reps // 2)):
                t0, t1 = g.oneway(ONEWAY_N // 4).wait(120)
                rates.append(ONEWAY_N // 4 / (t1 - t0))
            res["small_oneway_msgs_per_s"] = statistics.median(rates)
            tensor_ms = {}
            for label, n in sizes.items():
                t0s, t1s = g.bw(n, reps, "tensor").wait(300)
                tensor_ms[label] = statistics.median(b - a for a, b in zip(t0s, t1s, strict=True)) * 1e3
            res["tensor_ms"] = tensor_ms
            out[route] = res
            g.close()
    return out


def print_relay(results: dict[str, Any], sizes: dict[str, int]) -> None:
    d, r = results["direct"], results["relayed"]
    print("\ntwo nodes of one machine: a direct pair and a pair relayed through both node agents")
    print(f"{'':>28} {'direct':>12} {'relayed':>12} {'relayed/direct':>15}")
    rows = [("small object round trip, us", d["small_rtt_us"], r["small_rtt_us"]),
            ("small one-way, msg/s", d["small_oneway_msgs_per_s"], r["small_oneway_msgs_per_s"])]
    rows += [(f"send_tensor {label} one-way, ms", d["tensor_ms"][label], r["tensor_ms"][label])
             for label in sizes]
    for name, a, b in rows:
        print(f"{name:>28} {a:>12,.3f} {b:>12,.3f} {b / a:>14.2f}x")


# --------------------------------------------------------------------------- gloo
def _gloo_proc(rank: int, port: int, sizes: dict[str, int], reps: int, q: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ready = torch.zeros(1)
    result: dict[str, list[float]] = {}
    for label, n in sizes.items():
        r = reps if n < (128 << 20) else max(3, reps // 2)
        stamps = []
        if rank == 0:
            x = torch.arange(n, dtype=torch.uint8)
            for _ in range(r + 2):
                dist.recv(ready, 1)
                stamps.append(time.perf_counter())
                dist.send(x, 1)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
            for _ in range(r + 2):
                dist.send(ready, 0)
                dist.recv(buf, 0)
                stamps.append(time.perf_counter())
        result[label] = stamps[2:]
    q.put((rank, result))
    dist.destroy_process_group()


def bench_gloo(reps: int, sizes: dict[str, int]) -> dict[str, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gloo_proc, args=(r, port, sizes, reps, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    return {
        label: statistics.median(b - a for a, b in zip(got[0][label], got[1][label], strict=True))
        * 1e3
        for label in sizes
    }


# --------------------------------------------------------------------------- memcpy, ray
def bench_memcpy(reps: int, sizes: dict[str, int]) -> dict[str, float]:
    out = {}
    for label, n in sizes.items():
        src = np.arange(n, dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        times = []
        for _ in range(max(reps, 5)):
            t = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t)
        out[label] = statistics.median(times) * 1e3
    return out


def bench_ray(reps: int, sizes: dict[str, int]) -> dict[str, Any] | str:
    try:
        import ray
    except ImportError:
        return "skipped: ray is not installed"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class Sink:
            def take(self, t: Any) -> float:
                return time.perf_counter()

            def ping(self, x: int) -> int:
                return x

        a = Sink.remote()
        ray.get(a.ping.remote(0))
        t = time.perf_counter()
        for i in range(SMALL_RTT_N // 4):
            ray.get(a.ping.remote(i))
        out: dict[str, Any] = {"small_rtt_us": (time.perf_counter() - t) / (SMALL_RTT_N // 4) * 1e6}
        res = {}
        for label, n in sizes.items():
            x = torch.arange(n, dtype=torch.uint8)
            times = []
            for _ in range(reps if n < (128 << 20) else max(3, reps // 2)):
                t0 = time.perf_counter()
                times.append(ray.get(a.take.remote(x)) - t0)
            res[label] = statistics.median(times) * 1e3
        out["object_ms"] = res
        return out
    finally:
        ray.shutdown()


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="skip 256MB")
    parser.add_argument("--relay", action="store_true",
                        help="only a direct pair beside a relayed pair, on two nodes (1KB-64MB)")
    args = parser.parse_args(argv)
    sizes = dict(SIZES)
    if args.quick or args.relay:
        sizes.pop("256MB")
    if args.relay:
        relay = bench_relay(args.reps, sizes)
        print_relay(relay, sizes)
        os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
        path = os.path.join(os.path.dirname(__file__), "results", "p2p_relay.json")
        with open(path, "w") as f:
            json.dump({"cpus": os.cpu_count(), "python": sys.version.split()[0],
                       "reps": args.reps, **relay}, f, indent=2)
        print(f"saved {path}")
        return 0
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "host": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "loadavg_at_start": os.getloadavg(),
        },
        "reps": args.reps,
    }
    results["aiorl"] = bench_aiorl(args.reps, sizes)
    results["gloo_ms"] = bench_gloo(args.reps, sizes)
    results["memcpy_ms"] = bench_memcpy(args.reps, sizes)
    results["ray"] = bench_ray(args.reps, sizes)
    results["total_s"] = time.perf_counter() - t_start

    a, ray = results["aiorl"], results["ray"]
    ray_obj = ray.get("object_ms", {}) if isinstance(ray, dict) else {}

    def cell(v: Any, unit: str = "") -> str:
        return "-" if v is None else f"{v:.3f}{unit}" if isinstance(v, float) else str(v)

    print(
        f"\nsmall object round trip: aiorl {a['small_rtt_us']:.1f} us"
        + (f", ray {ray['small_rtt_us']:.1f} us" if isinstance(ray, dict) else "")
    )
    print(f"small one-way throughput: aiorl {a['small_oneway_msgs_per_s']:,.0f} msg/s\n")
    header = ["size", "send_tensor/recv_tensor", "send/recv (object)", "gloo", "memcpy", "ray"]
    print("one-way time, ms (median)")
    print(" | ".join(f"{h:>24}" for h in header))
    for label in sizes:
        row = [
            label,
            a["tensor_ms"][label],
            a["object_ms"][label],
            results["gloo_ms"][label],
            results["memcpy_ms"][label],
            ray_obj.get(label),
        ]
        print(" | ".join(f"{cell(v):>24}" for v in row))
    print("\nbandwidth, GB/s")
    for label, n in sizes.items():
        bw = {
            k: n / (v * 1e-3) / 1e9
            for k, v in (
                ("tensor", a["tensor_ms"][label]),
                ("object", a["object_ms"][label]),
                ("gloo", results["gloo_ms"][label]),
                ("memcpy", results["memcpy_ms"][label]),
            )
        }
        print(f"{label:>6}: " + ", ".join(f"{k} {v:.2f}" for k, v in bw.items()))
    print(f"\n64MB as a state dict of {STATE_DICT_TENSORS:,} tensors, send/recv one-way: "
          f"{a['state_dict_ms']:.3f} ms ({a['state_dict_ms'] / a['object_ms']['64MB']:.2f}x "
          f"one 64MB tensor)")
    if not isinstance(ray, dict):
        print(f"\nray: {ray}")
    print(f"\ntotal {results['total_s']:.0f} s")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(__file__), "results", "p2p.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
