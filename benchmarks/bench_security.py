"""What authentication costs: call latency and 64 MB transfers, per transport and mechanism.

Run: ``python benchmarks/bench_security.py``. Two processes, each with an aiorl
Endpoint: over loopback TCP without authentication and with CURVE (authentication
and encryption; what multi-machine clusters use), and over Unix sockets in a private
directory without authentication and with PLAIN (what embedded clusters use). Writes
``benchmarks/results/security.json``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
from typing import Any

import uvloop

from aiorl.transport.endpoint import Endpoint
from aiorl.transport.security import ClusterKeys, make_private_directory

CALLS = 3000
BIG = 64 * 1024 * 1024


def _server(q: Any, keys: ClusterKeys | None, host: str) -> None:
    async def main() -> None:
        ep = Endpoint("server", keys=keys, host=host)
        ep.handle("ping", lambda m: m.reply(None))
        ep.handle("sink", lambda m: m.reply(sum(len(memoryview(f)) for f in m.frames)))
        q.put(ep.address)
        await asyncio.sleep(3600)

    uvloop.run(main())


def measure(keys: ClusterKeys | None, host: str, reps: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    proc = ctx.Process(target=_server, args=(q, keys, host), daemon=True)
    proc.start()
    address = q.get()

    async def client() -> dict[str, float]:
        ep = Endpoint("client", keys=keys, host=host)
        await ep.request(address, "ping", timeout=10)
        lat, bulk = [], []
        payload = os.urandom(1024 * 1024) * 64
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(CALLS):
                await ep.request(address, "ping")
            lat.append((time.perf_counter() - t) / CALLS * 1e6)
            t = time.perf_counter()
            n, _ = await ep.request(address, "sink", frames=[payload])
            bulk.append((time.perf_counter() - t) * 1e3)
            assert n == BIG
        ep.close()
        return {"call_us": statistics.median(lat), "transfer_64mb_ms": statistics.median(bulk)}

    try:
        return uvloop.run(client())
    finally:
        proc.kill()
        proc.join()


def main() -> int:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    ipc = f"ipc://{make_private_directory('aiorl-bench-')}"
    modes = {
        "tcp none": measure(None, "127.0.0.1", reps),
        "tcp curve": measure(ClusterKeys.generate("curve"), "127.0.0.1", reps),
        "ipc none": measure(None, ipc, reps),
        "ipc plain": measure(ClusterKeys.generate("plain"), ipc, reps),
    }
    shutil.rmtree(ipc.removeprefix("ipc://"), ignore_errors=True)
    print(f"{'metric':<30}" + "".join(f"{m:>12}" for m in modes))
    for key, label in [("call_us", "sequential call (µs)"), ("transfer_64mb_ms", "64 MB request (ms)")]:
        cells = "".join(f"{modes[m][key]:>12.1f}" for m in modes)
        print(f"{label:<30}{cells}")
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/security.json", "w") as f:
        json.dump(modes, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
