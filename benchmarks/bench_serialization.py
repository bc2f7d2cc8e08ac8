"""Where out-of-band pickle buffers start to pay: the OOB_THRESHOLD measurement.

For payload sizes from 4 KiB to 4 MiB, sends a numpy array through an aiorl Endpoint to another
process and back (dumps -> frames -> loads on both sides), once with the buffer inside the pickle
stream and once as its own (zero-copy) frame. ``aiorl.transport.serialization.OOB_THRESHOLD``
is set from where the second wins. Then, in this process, the codec's own cost per tensor:
``dumps`` and ``loads`` of a state dict of 1,000 CPU tensors (64 MiB, every buffer out of
band: no bytes are copied, what is left is the work per tensor). Run:
``python benchmarks/bench_serialization.py``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import numpy as np
import uvloop

from aiorl.transport import serialization
from aiorl.transport.endpoint import Endpoint

SIZES = [4 << 10, 16 << 10, 32 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]


def _server(q: Any) -> None:
    async def main() -> None:
        ep = Endpoint("echo", keys=None)

        def echo(m: Any) -> None:
            obj = serialization.loads(m.frames)
            m.reply(None, serialization.dumps(obj, oob_threshold=m.meta))

        ep.handle("echo", echo)
        q.put(ep.address)
        await asyncio.sleep(3600)

    uvloop.run(main())


async def client(address: str) -> list[tuple[int, float, float]]:
    ep = Endpoint("client", keys=None)
    rows = []
    for size in SIZES:
        arr = np.random.bytes(size)
        obj = np.frombuffer(arr, dtype=np.uint8)
        timings = {}
        for label, threshold in (("inband", 1 << 62), ("oob", 0)):
            runs = []
            n = max(20, int(2e7 // size))
            for _ in range(3):
                t = time.perf_counter()
                for _ in range(n):
                    _, frames = await ep.request(address, "echo", threshold,
                                                 serialization.dumps(obj, oob_threshold=threshold))
                    serialization.loads(frames)
                runs.append((time.perf_counter() - t) / n * 1e6)
            timings[label] = statistics.median(runs)
        rows.append((size, timings["inband"], timings["oob"]))
    ep.close()
    return rows


def state_dict_codec(reps: int = 7, rounds: int = 20) -> tuple[float, float]:
    """Best-of-``reps`` ms of ``dumps`` and of ``loads`` of 1,000 tensors of 64 KiB each."""
    import torch

    state = {f"layer{i}.weight": torch.ones(16_384) for i in range(1000)}
    frames = serialization.dumps(state)
    dumps_ms = loads_ms = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(rounds):
            frames = serialization.dumps(state)
        dumps_ms = min(dumps_ms, (time.perf_counter() - start) / rounds * 1e3)
        start = time.perf_counter()
        for _ in range(rounds):
            serialization.loads(frames)
        loads_ms = min(loads_ms, (time.perf_counter() - start) / rounds * 1e3)
    return dumps_ms, loads_ms


def main() -> int:
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    proc = ctx.Process(target=_server, args=(q,), daemon=True)
    proc.start()
    try:
        rows = uvloop.run(client(q.get()))
    finally:
        proc.kill()
        proc.join()
    print(f"{'size':>10}{'in-band µs':>14}{'out-of-band µs':>16}")
    for size, inband, oob in rows:
        print(f"{size >> 10:>8}Ki{inband:>14.1f}{oob:>16.1f}{'  <- OOB wins' if oob < inband else ''}")
    dumps_ms, loads_ms = state_dict_codec()
    print(f"\nstate dict of 1,000 tensors (64 MiB): dumps {dumps_ms:.2f} ms, loads "
          f"{loads_ms:.2f} ms (best of 7)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
