"""Where a CUDA message's time goes: the machine's unit costs and a profile of both workers.

Issue 26's fixed cost per CUDA message (hundreds of µs on an H100 where a CPU message costs
~100 µs one way) is spent somewhere between two workers on one GPU. This script measures,
in one run on one GPU:

1. **unit costs** in a worker process: a system call (``time.sleep(0)``), a hand-off to
   another thread and back, ``torch.cuda.Event.query()``, ``Event.synchronize()`` of a
   recorded event, ``torch.cuda.synchronize()``, a 4-byte device->host copy and a
   host->device copy from pinned memory (each the median of many);
2. **a cProfile of each worker's event-loop thread** (where every aiorl callback runs)
   during ``--pings`` round trips of a one-element CUDA tensor, during ``--transfers``
   one-way 64 MB ``send_tensor`` calls into a posted buffer, and during ``--state-dicts``
   sends of a state dict of 1,000 tensors (256 MB): the top functions by own time
   and by cumulative time, with call counts (cProfile slows Python calls, so read the
   shares and counts, not the absolute times).

Run on a GPU machine: ``python benchmarks/profile_gpu_messages.py [--out DIR]``; it writes
``profile-gpu-messages.txt`` (and prints it). Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _worker_class(device: str) -> Any:
    import cProfile
    import io
    import pstats
    import threading

    import torch

    import aiorl

    def median_us(fn: Any, n: int) -> float:
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) * 1e6

    class Probe(aiorl.Worker):
        def unit_costs(self) -> dict[str, float]:
            out: dict[str, float] = {}
            out["system call (os.getppid())"] = median_us(os.getppid, 5000)
            out["time.sleep(0)"] = median_us(lambda: time.sleep(0), 2000)
            go, back = threading.Event(), threading.Event()
            stop = False

            def echo() -> None:
                while True:
                    go.wait()
                    go.clear()
                    back.set()
                    if stop:
                        return

            thread = threading.Thread(target=echo, daemon=True)
            thread.start()

            def hop() -> None:
                go.set()
                back.wait()
                back.clear()

            out["thread hand-off and back"] = median_us(hop, 2000)
            stop = True
            go.set()
            thread.join(5)
            if device != "cuda":
                return out
            x = torch.ones(1, device="cuda")
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            torch.cuda.synchronize()
            out["Event.query() (done)"] = median_us(event.query, 5000)
            blocking = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]

            def record_sync(e: Any = blocking) -> None:
                e.record()
                e.synchronize()

            out["Event.record + synchronize (blocking-sync event)"] = median_us(record_sync, 2000)
            out["Event.record + synchronize (spin event)"] = median_us(
                lambda: record_sync(torch.cuda.Event()), 2000)  # type: ignore[no-untyped-call]
            out["torch.cuda.synchronize()"] = median_us(torch.cuda.synchronize, 2000)
            out["4-byte device->host (x.cpu())"] = median_us(x.cpu, 2000)
            pinned = torch.ones(1).pin_memory()

            def to_device() -> None:
                x.copy_(pinned, non_blocking=True)
                torch.cuda.synchronize()

            out["4-byte pinned host->device, synchronized"] = median_us(to_device, 2000)
            out["pinned allocation of 4 bytes"] = median_us(
                lambda: torch.empty(1, pin_memory=True), 500)
            return out

        async def _profiled(self, work: Any) -> tuple[float, str]:
            profile = cProfile.Profile()
            t0 = time.perf_counter()
            profile.enable()
            try:
                await work()
            finally:
                profile.disable()
            elapsed = time.perf_counter() - t0
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(25)
            return elapsed, text.getvalue()

        async def ping(self, n: int) -> tuple[float, str]:
            t = torch.ones(1, device=device)
            group = self.worker_group_name

            async def work() -> None:
                for _ in range(n):
                    await self.send(t, group, 1)
                    await self.recv(group, 1)

            return await self._profiled(work)

        async def pong(self, n: int) -> tuple[float, str]:
            group = self.worker_group_name

            async def work() -> None:
                for _ in range(n):
                    await self.send(await self.recv(group, 0), group, 0)

            return await self._profiled(work)

        async def push(self, nbytes: int, n: int) -> tuple[float, str]:
            t = torch.ones(nbytes // 4, device=device)
            if device == "cuda":
                torch.cuda.synchronize()
            group = self.worker_group_name

            async def work() -> None:
                for _ in range(n):
                    await self.recv(group, 1)  # the receiver posted its buffer
                    await self.send_tensor(t, group, 1)

            return await self._profiled(work)

        async def land(self, nbytes: int, n: int) -> tuple[float, str]:
            buf = torch.empty(nbytes // 4, device=device)
            group = self.worker_group_name

            async def work() -> None:
                for _ in range(n):
                    received = self.recv_tensor(buf, group, 0)
                    await self.send(None, group, 0)
                    await received
                if device == "cuda":
                    torch.cuda.synchronize()

            return await self._profiled(work)

        async def push_many(self, nbytes: int, tensors: int, n: int) -> tuple[float, str]:
            """Send one state dict of ``tensors`` tensors (``nbytes`` in all) ``n`` times."""
            state = {f"w{k}": torch.ones(nbytes // 4 // tensors, device=device)
                     for k in range(tensors)}
            group = self.worker_group_name

            async def work() -> None:
                for _ in range(n):
                    await self.recv(group, 1)  # the receiver is ready
                    await self.send(state, group, 1)

            return await self._profiled(work)

        async def land_many(self, n: int) -> tuple[float, str]:
            group = self.worker_group_name

            async def work() -> None:
                for _ in range(n):
                    await self.send(None, group, 0)
                    await self.recv(group, 0)
                if device == "cuda":
                    torch.cuda.synchronize()

            return await self._profiled(work)

    return Probe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pings", type=int, default=500)
    parser.add_argument("--transfers", type=int, default=50)
    parser.add_argument("--state-dicts", type=int, default=20,
                        help="state dicts of 1,000 tensors (256 MB) sent")
    parser.add_argument("--out", default=".", help="where profile-gpu-messages.txt goes")
    parser.add_argument("--device", default="cuda",
                        help="cpu: a dry run of this script with CPU tensors")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("profile_gpu_messages: no CUDA device here: nothing to profile")
        return 0
    import aiorl
    from aiorl.placement import NodePlacementStrategy

    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (dry run)"
    lines: list[str] = [f"device: {name}"]
    probe = _worker_class(args.device)
    with aiorl.Cluster(num_nodes=1, log_to_driver=False) as cluster:
        pair = probe.create_group().launch(cluster, NodePlacementStrategy([0, 0]),
                                           name="profile")
        try:
            (costs,) = pair.execute_on(0).unit_costs().wait(300)
            lines.append("\n== unit costs in a worker (median, us)")
            lines += [f"{v:10.1f}  {k}" for k, v in costs.items()]
            for name, first, second in (
                    (f"{args.pings} round trips of a 1-element CUDA tensor",
                     lambda: pair.execute_on(1).pong(args.pings),
                     lambda: pair.execute_on(0).ping(args.pings)),
                    (f"{args.transfers} one-way 64 MB send_tensor into a posted buffer",
                     lambda: pair.execute_on(1).land(64 << 20, args.transfers),
                     lambda: pair.execute_on(0).push(64 << 20, args.transfers)),
                    (f"{args.state_dicts} state dicts of 1,000 tensors (256 MB) by send",
                     lambda: pair.execute_on(1).land_many(args.state_dicts),
                     lambda: pair.execute_on(0).push_many(256 << 20, 1000, args.state_dicts))):
                other = first()  # type: ignore[no-untyped-call]
                ((elapsed, text),) = second().wait(600)  # type: ignore[no-untyped-call]
                ((other_elapsed, other_text),) = other.wait(600)
                lines.append(f"\n== {name}: {elapsed:.3f} s under cProfile")
                lines.append("-- rank 0 (sender / pinger), its loop thread")
                lines.append(text)
                lines.append(f"-- rank 1 (receiver), its loop thread ({other_elapsed:.3f} s)")
                lines.append(other_text)
        finally:
            pair.close()
    report = "\n".join(lines)
    print(report)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "profile-gpu-messages.txt").write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
