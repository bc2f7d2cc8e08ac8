"""Small CUDA tensors (issue 26): the inline road through pinned host memory, on one GPU.

Two workers on GPU 0. Each check runs with the default limit (64 KiB: small tensors go
inline) and with ``AIORL_CUDA_INLINE_BYTES=0`` (everything by CUDA IPC), so both roads
keep the same contract: the caller's pending stream work is what arrives, values, dtypes,
``Parameter``, the receiver's device, posted buffers (CUDA and CPU) filled in place, and
one order per pair across small and large messages. Skipped without CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import aiorl
from aiorl.placement import NodePlacementStrategy

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SLEEP_CYCLES = 50_000_000  # ~tens of ms of GPU busy-wait ahead of a fill


class Small(aiorl.Worker):
    def __init__(self) -> None:
        super().__init__()
        torch.cuda.set_device(0)
        self.dev = torch.device("cuda", 0)

    async def send_all(self, dst: int) -> None:
        g = self.worker_group_name
        t = torch.zeros(1000, device=self.dev)
        torch.cuda._sleep(SLEEP_CYCLES)
        t.fill_(4.0)  # queued behind the sleep: the send must wait for it
        await self.send(t, g, dst)
        p = torch.nn.Parameter(torch.arange(6.0, device=self.dev))
        await self.send({"p": p, "i": torch.arange(5, device=self.dev), "n": 3}, g, dst)
        await self.send_tensor(torch.full((256,), 7.0, device=self.dev), g, dst)  # CUDA buf
        await self.send_tensor(torch.full((256,), 8.0, device=self.dev), g, dst)  # CPU buf
        works = [  # small, large (IPC whatever the limit), small: one order
            self.send(torch.full((16,), float(k), device=self.dev) if k != 1
                      else torch.full((1 << 20,), 1.0, device=self.dev), g, dst)
            for k in range(3)
        ]
        for w in works:
            await w

    async def recv_all(self, src: int) -> list[str]:
        g, bad = self.worker_group_name, []
        t = await self.recv(g, src)
        if t.device != self.dev or not bool((t == 4.0).all()):
            bad.append(f"race: {t.device} {t[:3].tolist()}")
        obj = await self.recv(g, src)
        if not isinstance(obj["p"], torch.nn.Parameter) or not obj["p"].requires_grad:
            bad.append("Parameter lost")
        if obj["p"].device != self.dev or obj["p"].tolist() != list(range(6)):
            bad.append("parameter values")
        if obj["i"].dtype != torch.int64 or obj["i"].tolist() != list(range(5)) or obj["n"] != 3:
            bad.append("dict values")
        buf = torch.full((256,), -1.0, device=self.dev)
        torch.cuda._sleep(SLEEP_CYCLES)
        buf.fill_(-2.0)  # queued before the receive: the payload must land after it
        got = await self.recv_tensor(buf, g, src)
        if got is not buf or not bool((buf == 7.0).all()):
            bad.append("CUDA recv_tensor buffer")
        cpu = torch.zeros(256)
        got = await self.recv_tensor(cpu, g, src)
        if got is not cpu or not bool((cpu == 8.0).all()):
            bad.append("CPU recv_tensor buffer")
        for k in range(3):
            x = await self.recv(g, src)
            want = 1.0 if k == 1 else float(k)
            if x.device != self.dev or not bool((x == want).all()):
                bad.append(f"order: message {k} holds {x[0].item()}")
        return bad

    async def ping(self, dst: int, n: int) -> float:
        import time

        t = torch.ones(1, device=self.dev)
        t0 = time.perf_counter()
        for _ in range(n):
            await self.send(t, self.worker_group_name, dst)
            t = await self.recv(self.worker_group_name, dst)
        return (time.perf_counter() - t0) / n

    async def pong(self, src: int, n: int) -> None:
        for _ in range(n):
            await self.send(await self.recv(self.worker_group_name, src),
                            self.worker_group_name, src)


@pytest.fixture(scope="module")
def cluster() -> Iterator[aiorl.Cluster]:
    with aiorl.Cluster(num_nodes=1) as c:
        yield c


@pytest.mark.parametrize("limit", ["65536", "0"], ids=["inline", "ipc"])
def test_small_cuda_tensors_keep_the_contract_on_both_roads(
    cluster: aiorl.Cluster, limit: str
) -> None:
    group = Small.create_group().launch(
        cluster, NodePlacementStrategy([0, 0]), name=f"small{limit}",
        env={"AIORL_CUDA_INLINE_BYTES": limit},
    )
    try:
        recv = group.execute_on(1).recv_all(0)
        group.execute_on(0).send_all(1).wait(120)
        assert recv.wait(120) == [[]]
        pong = group.execute_on(1).pong(0, 200)
        (rtt,) = group.execute_on(0).ping(1, 200).wait(120)
        pong.wait(60)
        print(f"round trip of a 1-element CUDA tensor, limit {limit}: {rtt * 1e6:.0f} us")
    finally:
        group.close()
