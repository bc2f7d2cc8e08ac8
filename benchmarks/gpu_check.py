"""``make gpu-check``: issue 26's GPU targets, measured and judged in one run on one GPU.

Run: ``python benchmarks/gpu_check.py [--quick] [--skip-tests] [--out DIR]``. Needs no
network. In order, within about four minutes on one H200:

1. the GPU tests (``tests/gpu/``: ``test_gpu_*.py``, ``test_p2p_cuda``, ``test_p2p_cuda_small``,
   ``test_broadcast_cuda``, ``test_weights_cuda``; two-GPU tests skip on one GPU), their
   pytest summary line kept;
2. CUDA IPC between two workers on GPU 0 (``benchmarks/bench_gpu.py``'s measurement): one-way
   ``send_tensor`` into a posted buffer beside a device-to-device copy of the same size, and
   the round trip of a one-element tensor, CUDA against CPU;
3. weights on the GPU: a publisher and N = 1, 4 subscribers on GPU 0 pulling a state dict
   into tensors on that GPU, beside (1 + N) device copies of the model;
4. the CPU a worker uses once its transfers are done (no spinning thread);
5. (``--steps`` picks among these and the above) the copy of 1 GB in 1,000 tensors, per
   tensor and fused (``copies``); a relayed pair's CUDA path, two nodes with
   ``AIORL_P2P_DIRECT_PEERS=0`` (``relay``); a state dict of 1,000 tensors against one flat
   tensor of the same bytes, by ``send`` and as weights (``many``: ``state_dict_1000``);
   a 64 MB CUDA call argument against ``send_tensor`` of it (``call``: ``call_arg_64mb``).

Then one table: each target, the measured value, the goal, met or not; and
``benchmarks/results/gpu-<device>.json`` with ``"device"`` and ``"targets"``
(``{name: {"value", "goal", "met"}}``), to commit from the machine it ran on. Without CUDA
it says so and exits 0. ``AIORL_GPU_CHECK_DEVICE=cpu`` runs steps 2-4 with CPU tensors
instead (a dry run of this script on a machine without a GPU: its numbers mean nothing and
no result file is written).

Exit status: 0 when the run completed (targets met or not: the table says), 1 when a step
could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = [
    "tests/gpu/test_gpu_single.py",
    "tests/gpu/test_p2p_cuda.py",
    "tests/gpu/test_p2p_cuda_small.py",
    "tests/gpu/test_broadcast_cuda.py",
    "tests/gpu/test_weights_cuda.py",
    "tests/gpu/test_gpu_multi.py",
    "tests/gpu/test_gpu_node.py",
    "tests/system/test_p2p_relay.py::test_tensors_small_and_mib",  # its CUDA cases
]
#: Tensors of the weights benchmark's state dict (the size is split evenly among them).
WEIGHT_TENSORS = 64
#: The measuring steps, in the order they run (``--steps`` picks some).
STEPS = ("copies", "relay", "many", "call", "ipc", "weights")


@dataclass(frozen=True)
class Target:
    """One of issue 26's targets: ``value`` compared with ``goal`` (``at_most``: ``<=``)."""

    name: str
    value: float | None  # None: not measured in this run
    goal: float
    at_most: bool
    unit: str = ""

    @property
    def met(self) -> bool:
        if self.value is None:
            return False
        return self.value <= self.goal if self.at_most else self.value >= self.goal

    def row(self) -> list[str]:
        sign = "<=" if self.at_most else ">="
        value = "not measured" if self.value is None else f"{self.value:.3g}{self.unit}"
        return [self.name, value, f"{sign} {self.goal:g}{self.unit}",
                "met" if self.met else "NOT MET"]


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain-text table: columns as wide as their widest cell."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True))
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def judge(results: dict[str, Any]) -> list[Target]:
    """Issue 26's targets from what the steps measured (pure: unit-tested on the CPU)."""
    out: list[Target] = []
    tests = results.get("tests") or {}
    failed = tests.get("failed")
    out.append(Target("GPU tests failed", None if failed is None else float(failed), 0, True))
    ipc = results.get("ipc") or {}
    big = [r["d2d_s"] / r["ipc_s"] for r in ipc.get("sizes", []) if r["nbytes"] >= 64 << 20]
    out.append(Target("CUDA IPC one-way / device copy, 64 MB and up (worst)",
                      min(big) if big else None, 0.8, False))
    small = [r for r in ipc.get("sizes", []) if r["nbytes"] <= 1 << 10]
    rtt = ipc.get("rtt_cuda_s"), ipc.get("rtt_cpu_s")
    # The fixed cost of a CUDA message is what it costs beyond a CPU message: a 1 KB CUDA
    # one-way minus a CPU one-way (half the CPU round trip); the message itself is not CUDA's.
    out.append(Target("CUDA message fixed cost (1 KB one-way - CPU one-way)",
                      (small[0]["ipc_s"] - rtt[1] / 2) * 1e6 if small and rtt[1] else None,
                      50, True, " us"))
    out.append(Target("small CUDA tensor round trip / CPU tensor's",
                      rtt[0] / rtt[1] if rtt[0] and rtt[1] else None, 2.0, True, "x"))
    for w in results.get("weights", []):
        n, copy = w["subscribers"], w["d2d_s"]
        out.append(Target(f"weights, {n} GPU subscriber(s): publish / device copies",
                          w["publish_s"] / copy, 2.0, True, "x"))
        out.append(Target(f"weights, {n} GPU subscriber(s): publish->pulled / (1+N) copies",
                          w["update_s"] / ((1 + n) * copy), 1.5, True, "x"))
    many = results.get("state_dict_1000") or {}
    for what, flat, key in (("send", "flat_s", "many_s"),
                            ("weights publish->pulled", "weights_flat_s", "weights_many_s")):
        out.append(Target(f"state dict of 1,000 tensors / one tensor, {what}",
                          many[key] / many[flat] if many.get(flat) else None, 1.2, True, "x"))
    call = results.get("call_arg_64mb") or {}
    out.append(Target("64 MB CUDA call argument / send_tensor of it",
                      call["call_s"] / call["send_s"] if call.get("send_s") else None,
                      2.0, True, "x"))
    idle = results.get("idle_cpu")
    out.append(Target("a worker's CPU once its transfers are done",
                      None if idle is None else idle * 100, 1.0, True, " % of a core"))
    return out


def device_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"`` (the result file's name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


# ----------------------------------------------------------------------------- 1. tests
def run_tests(timeout: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_TESTS]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return {"summary": f"timed out after {timeout:.0f} s", "failed": None, "output": text}
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else f"pytest exited {done.returncode} with no output"
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    failed = counts.get("failed", 0) + counts.get("error", 0)
    return {"summary": summary, "failed": failed, "counts": counts,
            "output": done.stdout[-20000:] + done.stderr[-5000:]}


# ----------------------------------------------------------------------------- 2.-4. workers
def _worker_class() -> type:
    import torch

    import aiorl

    class Check(aiorl.Worker):
        """Both ends of every measurement; tensors on ``device`` (``cuda`` or ``cpu``)."""

        def __init__(self, device: str) -> None:
            super().__init__()
            self.device = device
            if device == "cuda":
                torch.cuda.set_device(0)
            self.state: dict[str, Any] = {}

        def _sync(self) -> None:
            if self.device == "cuda":
                torch.cuda.synchronize()

        async def one_way(self, dst: int, nbytes: int, reps: int) -> list[float]:
            """Send ``reps`` tensors of ``nbytes``; stamps just before each send."""
            t = torch.ones(max(1, nbytes // 4), device=self.device)
            self._sync()
            stamps = []
            for _ in range(reps + 1):
                await self.recv(self.worker_group_name, dst)  # the receiver posted its buffer
                stamps.append(time.perf_counter())
                await self.send_tensor(t, self.worker_group_name, dst)
            return stamps[1:]

        async def landed(self, src: int, nbytes: int, reps: int) -> list[float]:
            """Receive into a posted buffer; stamps once each has landed."""
            buf = torch.empty(max(1, nbytes // 4), device=self.device)
            stamps = []
            for _ in range(reps + 1):
                work = self.recv_tensor(buf, self.worker_group_name, src)
                await self.send(None, self.worker_group_name, src)
                await work
                self._sync()
                stamps.append(time.perf_counter())
            return stamps[1:]

        async def ping(self, dst: int, n: int, cuda: bool) -> float:
            t = torch.ones(1, device=self.device if cuda else "cpu")
            t0 = time.perf_counter()
            for _ in range(n):
                await self.send(t, self.worker_group_name, dst)
                await self.recv(self.worker_group_name, dst)
            return (time.perf_counter() - t0) / n

        async def pong(self, src: int, n: int) -> None:
            for _ in range(n):
                await self.send(await self.recv(self.worker_group_name, src),
                                self.worker_group_name, src)

        def make_state(self, mb: int, tensors: int = WEIGHT_TENSORS) -> None:
            n = (mb << 20) // 4 // tensors
            self.state = {f"w{k}": torch.zeros(n, device=self.device) for k in range(tensors)}
            self._sync()

        async def send_many(self, dst: int, nbytes: int, tensors: int, reps: int) -> list[float]:
            """Send a state dict of ``tensors`` tensors of ``nbytes`` in all (one tensor
            alone when 1) ``reps`` times; stamps just before each send."""
            n = max(1, nbytes // 4 // tensors)
            state = {f"w{k}": torch.full((n,), float(k), device=self.device)
                     for k in range(tensors)}
            payload: Any = state["w0"] if tensors == 1 else state
            self._sync()
            stamps = []
            for _ in range(reps + 1):
                await self.recv(self.worker_group_name, dst)  # the receiver is ready
                stamps.append(time.perf_counter())
                await self.send(payload, self.worker_group_name, dst)
            return stamps[1:]

        async def recv_many(self, src: int, tensors: int, reps: int) -> tuple[list[float], bool]:
            """Receive what `send_many` sends (allocated here); stamps once each landed,
            and whether every tensor held its own value."""
            stamps, whole = [], True
            for _ in range(reps + 1):
                await self.send(None, self.worker_group_name, src)
                got = await self.recv(self.worker_group_name, src)
                self._sync()
                stamps.append(time.perf_counter())
                values = [got] if tensors == 1 else [got[f"w{k}"] for k in range(tensors)]
                whole = whole and all(float(t[0]) == k and float(t[-1]) == k
                                      for k, t in enumerate(values))
            return stamps[1:], whole

        def take(self, t: Any) -> int:
            """A call's argument, landed (the call returns once it is on this GPU)."""
            self._sync()
            return int(t.numel())

        async def call_with(self, dst: int, nbytes: int, reps: int) -> float:
            """Median seconds of calling ``take`` on rank ``dst`` with a CUDA tensor of
            ``nbytes`` as the argument (a round trip: the call and its small answer)."""
            t = torch.ones(max(1, nbytes // 4), device=self.device)
            self._sync()
            peer = (await self.async_group(self.worker_group_name)).execute_on(dst)
            times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                await peer.take(t)
                times.append(time.perf_counter() - t0)
            return statistics.median(times[1:])

        def host_writes(self) -> int:
            """Versions the publisher wrote to host memory (none while every subscriber
            reads its GPU, after their first pull: docs/weights.md, "CUDA")."""
            return int(self.weight_publisher(self.worker_group_name).host_writes)

        async def publish(self, version: int, name: str = "") -> tuple[float, float]:
            for x in self.state.values():
                x.fill_(float(version))
            self._sync()
            publisher = self.weight_publisher(name or self.worker_group_name)
            t0 = time.perf_counter()
            await publisher.publish(self.state, version=version)
            return t0, time.perf_counter()

        async def pull(self, version: int, name: str = "") -> tuple[float, bool]:
            subscriber = self.weight_subscriber(name or self.worker_group_name)
            await subscriber.wait_for(version)
            got = await subscriber.pull(into=self.state)
            self._sync()
            t = time.perf_counter()
            whole = all(float(x[0]) == got and float(x[-1]) == got for x in self.state.values())
            return t, bool(whole and got == version)

        async def idle_cpu(self, seconds: float) -> float:
            """The share of one core this process used while idle for ``seconds``."""
            import asyncio

            c0, t0 = time.process_time(), time.perf_counter()
            await asyncio.sleep(seconds)
            return (time.process_time() - c0) / (time.perf_counter() - t0)

    return Check


def device_copy_s(nbytes: int, reps: int, device: str, pieces: int = 1) -> float:
    """Median seconds of copying ``nbytes`` (in ``pieces`` tensors) on ``device``."""
    import torch

    n = max(1, nbytes // 4 // pieces)
    src = [torch.ones(n, device=device) for _ in range(pieces)]
    dst = [torch.empty(n, device=device) for _ in range(pieces)]
    times = []
    for _ in range(reps + 1):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for a, b in zip(src, dst, strict=True):
                b.copy_(a)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            for a, b in zip(src, dst, strict=True):
                b.copy_(a)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def copies_s(nbytes: int, tensors: int, reps: int, device: str) -> dict[str, float]:
    """Median seconds of copying ``nbytes`` held in ``tensors`` tensors three ways: one
    flat tensor, ``copy_`` per tensor, and ``aiorl.cuda.bulk_copy.copy_grouped`` (host time
    until the copies are done: launches count)."""
    import torch

    from aiorl.cuda.bulk_copy import copy_grouped, dtype_groups

    n = max(1, nbytes // 4 // tensors)
    src = [torch.ones(n, device=device) for _ in range(tensors)]
    dst = [torch.empty(n, device=device) for _ in range(tensors)]
    flat_src = torch.ones(n * tensors, device=device)
    flat_dst = torch.empty(n * tensors, device=device)

    def timed(run: Any) -> float:
        times = []
        for _ in range(reps + 1):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def loop() -> None:
        for a, b in zip(src, dst, strict=True):
            b.copy_(a, non_blocking=True)

    groups = dtype_groups([t.dtype for t in dst])
    return {"tensors": tensors, "nbytes": nbytes, "flat_s": timed(lambda: flat_dst.copy_(flat_src)),
            "loop_s": timed(loop), "many_s": timed(lambda: copy_grouped(dst, src, groups))}


def one_way_s(pair: Any, nbytes: int, reps: int) -> float:
    """Median one-way seconds of ``send_tensor`` from rank 0 into rank 1's posted buffer."""
    landed = pair.execute_on(1).landed(0, nbytes, reps)
    (sent,) = pair.execute_on(0).one_way(1, nbytes, reps).wait(600)
    (got,) = landed.wait(600)
    return statistics.median(b - a for a, b in zip(sent, got, strict=True))


def state_dicts(cluster: Any, check: type, device: str, nbytes: int, reps: int,
                say: Any) -> dict[str, Any]:
    """A state dict of 1,000 tensors against one flat tensor of the same bytes: sent by
    ``send`` to a worker on the same GPU (received into fresh tensors), and published as
    weights to one subscriber on that GPU (pulled into its own tensors)."""
    from aiorl.placement import NodePlacementStrategy

    out: dict[str, Any] = {"nbytes": nbytes, "whole": True}
    pair = check.create_group(device).launch(cluster, NodePlacementStrategy([0, 0]),
                                             name="gpustate")
    try:
        for key, tensors in (("flat_s", 1), ("many_s", 1000)):
            landed = pair.execute_on(1).recv_many(0, tensors, reps)
            (sent,) = pair.execute_on(0).send_many(1, nbytes, tensors, reps).wait(600)
            ((got, whole),) = landed.wait(600)
            out[key] = statistics.median(b - a for a, b in zip(sent, got, strict=True))
            out["whole"] = out["whole"] and whole
        for key, tensors in (("weights_flat_s", 1), ("weights_many_s", 1000)):
            pair.make_state(nbytes >> 20, tensors).wait(300)
            times = []
            for version in range(1, reps + 3):
                pull = pair.execute_on(1).pull(version, key)
                ((t0, _t1),) = pair.execute_on(0).publish(version, key).wait(600)
                ((t, ok),) = pull.wait(600)
                out["whole"] = out["whole"] and ok
                if version > 2:
                    times.append(t - t0)
            out[key] = statistics.median(times)
    finally:
        pair.close()
    say(f"  state dict of 1,000 tensors, {nbytes >> 20} MB: send {out['many_s'] * 1e3:.2f} ms "
        f"(one tensor {out['flat_s'] * 1e3:.2f} ms), weights publish->pulled "
        f"{out['weights_many_s'] * 1e3:.2f} ms (one tensor {out['weights_flat_s'] * 1e3:.2f} "
        f"ms), every tensor right: {out['whole']}")
    return out


def call_arg(cluster: Any, check: type, device: str, nbytes: int, reps: int,
             say: Any) -> dict[str, Any]:
    """A CUDA tensor as a call's argument to a worker on the same GPU (the call's round
    trip) against ``send_tensor`` of it into a posted buffer (one way)."""
    from aiorl.placement import NodePlacementStrategy

    pair = check.create_group(device).launch(cluster, NodePlacementStrategy([0, 0]),
                                             name="gpucall")
    try:
        (call_s,) = pair.execute_on(0).call_with(1, nbytes, reps).wait(600)
        send_s = one_way_s(pair, nbytes, reps)
    finally:
        pair.close()
    say(f"  {nbytes >> 20} MB CUDA argument: call {call_s * 1e3:.2f} ms, send_tensor "
        f"{send_s * 1e3:.2f} ms")
    return {"nbytes": nbytes, "call_s": call_s, "send_s": send_s}


def relayed(check: type, device: str, sizes: list[int], reps: int, say: Any) -> dict[str, Any]:
    """A relayed pair (two nodes, ``AIORL_P2P_DIRECT_PEERS=0``: CUDA tensors staged
    through pinned host memory, over two agent hops): one-way ``send_tensor`` per size."""
    import aiorl
    from aiorl.placement import NodePlacementStrategy

    out: dict[str, Any] = {"sizes": []}
    with aiorl.Cluster(num_nodes=2, log_to_driver=False) as cluster:
        pair = check.create_group(device).launch(cluster, NodePlacementStrategy([0, 1]),
                                                 name="gpurelay",
                                                 env={"AIORL_P2P_DIRECT_PEERS": "0"})
        try:
            for nbytes in sizes:
                s = one_way_s(pair, nbytes, reps)
                out["sizes"].append({"nbytes": nbytes, "one_way_s": s})
                say(f"  relayed pair, {nbytes >> 10} KiB one-way: {s * 1e3:.2f} ms")
        finally:
            pair.close()
    return out


def measure(device: str, sizes: list[int], reps: int, weights_mb: int, subscribers: list[int],
            small_n: int, say: Any, steps: set[str]) -> dict[str, Any]:
    import aiorl
    from aiorl.placement import NodePlacementStrategy

    check = _worker_class()
    out: dict[str, Any] = {"ipc": {"sizes": []}, "weights": []}
    big = max(sizes)

    def step(name: str, key: str, run: Any) -> None:
        """Run one step; a failure is recorded under ``errors`` and the others go on."""
        if name not in steps:
            return
        try:
            out[key] = run()
        except Exception as exc:  # noqa: BLE001 - the table says what was not measured
            say(f"  {name} failed: {type(exc).__name__}: {exc}")
            out.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"

    step("copies", "copies", lambda: copies_s(big, 1000, reps, device))
    if "copies" in out:
        say(f"  copies of {big >> 20} MB in 1,000 tensors: " + ", ".join(
            f"{k[:-2]} {v * 1e3:.3f} ms" for k, v in out["copies"].items() if k.endswith("_s")))
    step("relay", "relay_cuda",
         lambda: relayed(check, device, [1 << 10, min(big, 64 << 20)], reps, say))
    with aiorl.Cluster(num_nodes=1, log_to_driver=False) as cluster:
        step("many", "state_dict_1000",
             lambda: state_dicts(cluster, check, device, big, reps, say))
        step("call", "call_arg_64mb",
             lambda: call_arg(cluster, check, device, min(big, 64 << 20), reps, say))
        if "ipc" not in steps:
            return out
        pair = check.create_group(device).launch(cluster, NodePlacementStrategy([0, 0]),
                                                 name="gpucheck")
        try:
            for nbytes in sizes:
                ipc_s = one_way_s(pair, nbytes, reps)
                d2d_s = device_copy_s(nbytes, reps, device)
                out["ipc"]["sizes"].append({"nbytes": nbytes, "ipc_s": ipc_s, "d2d_s": d2d_s})
                say(f"  {nbytes >> 10:>9} KiB one-way {ipc_s * 1e6:10.1f} us, device copy "
                    f"{d2d_s * 1e6:10.1f} us")
            for cuda in (False, True):
                pong = pair.execute_on(1).pong(0, small_n)
                (rtt,) = pair.execute_on(0).ping(1, small_n, cuda).wait(600)
                pong.wait(60)
                out["ipc"]["rtt_cuda_s" if cuda else "rtt_cpu_s"] = rtt
            say(f"  round trip, 1-element tensor: {device} {out['ipc']['rtt_cuda_s'] * 1e6:.0f} "
                f"us, CPU {out['ipc']['rtt_cpu_s'] * 1e6:.0f} us")
            out["idle_cpu"] = max(pair.idle_cpu(2.0).wait(60))
            say(f"  idle worker CPU: {out['idle_cpu'] * 100:.2f} % of a core")
        finally:
            pair.close()
        if "weights" not in steps:
            return out
        copy_s = device_copy_s(weights_mb << 20, reps, device, WEIGHT_TENSORS)
        for n in subscribers:
            group = check.create_group(device).launch(
                cluster, NodePlacementStrategy([0] * (1 + n)), name=f"gpuweights{n}")
            try:
                group.make_state(weights_mb).wait(300)
                updates, publishes, whole = [], [], True
                host_writes = 0
                for version in range(1, reps + 3):
                    pulls = group.on_ranks(list(range(1, n + 1))).pull(version)
                    ((t0, t1),) = group.execute_on(0).publish(version).wait(600)
                    got = pulls.wait(600)
                    whole = whole and all(ok for _, ok in got)
                    if version > 2:  # the first two set up slots and handles
                        updates.append(max(t for t, _ in got) - t0)
                        publishes.append(t1 - t0)
                    if version == 2:
                        (host_writes,) = group.execute_on(0).host_writes().wait(60)
                (last,) = group.execute_on(0).host_writes().wait(60)
            finally:
                group.close()
            w = {"subscribers": n, "mb": weights_mb, "d2d_s": copy_s, "whole": whole,
                 "update_s": statistics.median(updates), "publish_s": statistics.median(publishes),
                 "host_writes": last - host_writes}
            out["weights"].append(w)
            say(f"  weights {weights_mb} MB -> {n} subscriber(s): publish "
                f"{w['publish_s'] * 1e3:.1f} ms, publish->pulled {w['update_s'] * 1e3:.1f} ms, "
                f"device copy of the model {copy_s * 1e3:.2f} ms, every pull whole: {whole}, "
                f"versions written to host memory: {w['host_writes']} of {reps}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes and fewer repetitions (a smoke check)")
    parser.add_argument("--skip-tests", action="store_true", help="measure only")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                        help="where gpu-<device>.json goes")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated measuring steps, of {','.join(STEPS)}")
    args = parser.parse_args(argv)

    def say(text: str) -> None:
        print(text, flush=True)

    import torch

    device = os.environ.get("AIORL_GPU_CHECK_DEVICE") or "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        say("gpu-check: no CUDA device here; nothing to check (run it on a GPU machine).")
        return 0
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU dry run"
    say(f"gpu-check on {name}")
    t_start = time.monotonic()
    results: dict[str, Any] = {"device": name, "date": time.strftime("%Y-%m-%d"),
                               "torch": torch.__version__}
    if not args.skip_tests and device == "cuda":
        say("1/3 GPU tests ...")
        results["tests"] = run_tests(timeout=240)
        say(f"  {results['tests']['summary']}")
    quick = args.quick or device != "cuda"
    sizes = [1 << 10, 64 << 20] if quick else [1 << 10, 64 << 20, 256 << 20, 1 << 30]
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info(0)
        sizes = [n for n in sizes if 4 * n < free]
    steps = {s.strip() for s in args.steps.split(",") if s.strip()}
    unknown = steps - set(STEPS)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}: choose among {', '.join(STEPS)}")
    say(f"2/3 measuring: {', '.join(s for s in STEPS if s in steps)} ...")
    try:
        results.update(measure(device, sizes, 3 if quick else 7, 64 if quick else 1024,
                               [1, 4], 100 if quick else 1000, say, steps))
    except Exception as exc:  # noqa: BLE001 - the table says what could not be measured
        say(f"  measurement failed: {type(exc).__name__}: {exc}")
        results["error"] = f"{type(exc).__name__}: {exc}"
    targets = judge(results)
    results["targets"] = {t.name: {"value": t.value, "goal": t.goal, "met": t.met}
                          for t in targets}
    say("")
    say(table([t.row() for t in targets], ["target (issue 26)", "measured", "goal", ""]))
    met = sum(t.met for t in targets)
    say(f"\n{met} of {len(targets)} targets met on {name} in "
        f"{time.monotonic() - t_start:.0f} s")
    if device == "cuda":
        path = Path(args.out) / f"gpu-{device_slug(name)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1, default=str))
        say(f"wrote {path}")
    return 1 if "error" in results or results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
