"""The p2p NCCL pair order carried out on a real torch.distributed group of two processes.

Gloo stands in for NCCL, which needs two GPUs: both pair point-to-point operations in the
order they are issued. The orders come from `PairOrder` runs simulated in
``tests/unit/p2p/test_gpu_bookkeeping.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.unit.p2p.test_gpu_bookkeeping import _simulated_pair


def _elements(sender: str, token: int) -> int:
    """A size per transfer, so that two mis-paired operations cannot pass unnoticed."""
    return 7 * token + (3 if sender == "actor:0" else 1)


def _replay(rank: int, port: int, issued: list[tuple[str, str, int]], out: Any) -> None:
    """One process: issue a side's operations on a real Gloo group, in its order, all in
    flight at once (as the NCCL pair's work thread issues them), then check what landed."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    try:
        works, landed = [], []
        for op, sender, token in issued:
            n = _elements(sender, token)
            if op == "send":
                works.append(dist.isend(torch.full((n,), float(token)), dst=1 - rank))
            else:
                buf = torch.full((n,), -1.0)
                landed.append((token, buf))
                works.append(dist.irecv(buf, src=1 - rank))
        for work in works:
            work.wait()
        out.put((rank, all(bool((buf == token).all()) for token, buf in landed), len(landed)))
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        out.put((rank, f"{type(exc).__name__}: {exc}", 0))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(3))
def test_the_pair_order_pairs_real_transfers_on_a_gloo_group(seed: int) -> None:
    """The issue orders PairOrder produces, carried out by two processes on a real
    torch.distributed group (Gloo standing in for NCCL, which needs two GPUs: both pair
    point-to-point operations in issue order). Every transfer lands in the buffer meant
    for it; an order that differed would mis-pair sizes or hang (issue 26)."""
    import multiprocessing
    import socket

    a, b = _simulated_pair(seed)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_replay, args=(rank, port, side.issued, out), daemon=True)
             for rank, side in enumerate((a, b))]
    for proc in procs:
        proc.start()
    try:
        results = sorted(out.get(timeout=90) for _ in procs)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    receives = [sum(op == "recv" for op, _, _ in side.issued) for side in (a, b)]
    assert results == [(0, True, receives[0]), (1, True, receives[1])]
    assert receives[0] > 5 and receives[1] > 5  # both directions carried transfers
