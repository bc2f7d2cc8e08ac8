"""Point-to-point with CUDA tensors between real worker processes (GPU machines only).

* Two workers on the same GPU exchange CUDA IPC handles (NCCL refuses two ranks
  on one device).
* With two or more GPUs, two workers on different GPUs use an NCCL group per
  ordered pair.

Every test checks values, device kinds and ordering, mixing CPU and CUDA payloads.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import aiorl
from aiorl.placement import NodePlacementStrategy, PackedPlacementStrategy

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@dataclass
class Rollout:
    tokens: torch.Tensor  # CUDA
    logprobs: torch.Tensor  # CUDA
    rewards: torch.Tensor  # CPU
    step: int


def payloads(dev: torch.device) -> list[Any]:
    """Deterministic payloads built on ``dev`` (each side builds its own to compare)."""
    return [
        torch.arange(1000, device=dev, dtype=torch.float32),
        torch.full((16 << 20,), 2.5, device=dev),  # 64 MB
        torch.ones(3, 5, device=dev, dtype=torch.bfloat16),
        {"cpu": torch.arange(300_000), "gpu": torch.arange(7, device=dev), "n": 5},
        [torch.zeros(2, device=dev), torch.ones(4), "x"],
        Rollout(
            torch.arange(64, device=dev).reshape(8, 8),
            torch.full((8,), -1.0, device=dev),
            torch.ones(8),
            step=3,
        ),
        torch.empty(0, device=dev),
    ]


def state_dict(dev: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """1,000 tensors of mixed dtypes and odd sizes (a trainer's state dict, shrunk): more
    storages than `SHARES_PER_PEER`, bytes that are not all whole words, a 0-d tensor."""
    out: dict[str, torch.Tensor] = {}
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16, torch.uint8]
    for k in range(1000):
        dtype = dtypes[k % len(dtypes)]
        n = 1 + (k * 37 + seed) % 513
        t = torch.arange(n, device=dev).remainder(7).to(dtype) if dtype != torch.bool else (
            torch.arange(n, device=dev).remainder(2 + seed % 3) == 0)
        out[f"layer{k}.weight"] = t
    out["step"] = torch.tensor(seed, device=dev)
    return out


def same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and a.device.type == b.device.type
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(b, dict):
        return isinstance(a, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(b, Rollout):
        return (
            isinstance(a, Rollout)
            and same(a.tokens, b.tokens)
            and same(a.logprobs, b.logprobs)
            and same(a.rewards, b.rewards)
            and a.step == b.step
        )
    return a == b


class C(aiorl.Worker):
    def _dev(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def info(self) -> tuple[int, str]:
        from aiorl.cuda.devices import device_uuid

        return os.getpid(), device_uuid(torch.cuda.current_device())

    async def send_payloads(self, dst: int) -> int:
        objs = payloads(self._dev())
        for obj in objs:
            await self.send(obj, self.worker_group_name, dst)
        return len(objs)

    def recv_payloads_sync(self, src: int) -> list[int]:
        want = payloads(self._dev())
        works = [self.recv(self.worker_group_name, src) for _ in want]
        return [
            i for i, (w, x) in enumerate(zip(works, want, strict=True)) if not same(w.wait(60), x)
        ]

    async def recv_payloads(self, src: int) -> list[int]:
        bad = []
        for i, x in enumerate(payloads(self._dev())):
            if not same(await self.recv(self.worker_group_name, src), x):
                bad.append(i)
        return bad

    async def send_tensors(self, dst: int) -> int:
        dev = self._dev()
        for t in (
            torch.arange(1 << 20, device=dev, dtype=torch.float32),  # CUDA -> CUDA
            torch.arange(1 << 20, dtype=torch.float32),  # CPU -> CUDA
            torch.arange(1 << 20, device=dev, dtype=torch.float32),
        ):  # CUDA -> CPU
            await self.send_tensor(t, self.worker_group_name, dst)
        return 3

    async def recv_tensors(self, src: int) -> list[bool]:
        dev = self._dev()
        want = torch.arange(1 << 20, dtype=torch.float32)
        bufs = [
            torch.empty(1 << 20, device=dev),
            torch.empty(1 << 20, device=dev),
            torch.empty(1 << 20),
        ]
        out = []
        for b in bufs:
            got = await self.recv_tensor(b, self.worker_group_name, src)
            out.append(got is b and torch.equal(b.cpu(), want))
        return out

    async def exchange(self, n: int) -> int:
        """Ranks 0 and 1 each send n mixed CUDA/CPU messages to the other and check order."""
        peer, g, dev = 1 - self.rank, self.worker_group_name, self._dev()
        sends = []
        for i in range(n):
            if i % 3 == 0:
                sends.append(self.send_tensor(torch.full((1000,), float(i), device=dev), g, peer))
            elif i % 3 == 1:
                sends.append(
                    self.send({"i": i, "t": torch.full((10,), float(i), device=dev)}, g, peer)
                )
            else:
                sends.append(self.send(torch.full((10,), float(i)), g, peer))
            if i % 20 == 0:
                await asyncio.sleep(0)
        for i in range(n):
            if i % 3 == 0:
                buf = torch.empty(1000, device=dev)
                await self.recv_tensor(buf, g, peer)
                assert bool((buf == i).all()), f"cuda tensor {i} out of order"
            elif i % 3 == 1:
                got = await self.recv(g, peer)
                assert got["i"] == i and got["t"].is_cuda and bool((got["t"] == i).all())
            else:
                got = await self.recv(g, peer)
                assert not got.is_cuda and bool((got == i).all()), f"cpu tensor {i} out of order"
        for w in sends:
            await w
        return n

    async def recv_expect_loss(self, src: int) -> str:
        try:
            await self.recv_tensor(torch.empty(10, device=self._dev()), self.worker_group_name, src)
            return "received"
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__

    async def send_state_dicts(self, dst: int, rounds: int) -> int:
        """``rounds`` times the same state dict (`state_dict`), then a fresh one: its
        tensors are many more storages than a receiver keeps shared between messages."""
        sd = state_dict(self._dev(), 0)
        for r in range(rounds):
            for t in sd.values():
                t.fill_(r) if t.dtype != torch.bool else t.fill_(bool(r % 2))
            await self.send(sd, self.worker_group_name, dst)
        await self.send(state_dict(self._dev(), rounds), self.worker_group_name, dst)
        return rounds + 1

    async def recv_state_dicts(self, src: int, rounds: int) -> list[str]:
        bad = []
        for r in range(rounds + 1):
            got = await self.recv(self.worker_group_name, src)
            want = state_dict(self._dev(), 0)
            for t in want.values():
                if r < rounds:
                    t.fill_(r) if t.dtype != torch.bool else t.fill_(bool(r % 2))
            if r == rounds:
                want = state_dict(self._dev(), rounds)
            bad += [f"{r}:{k}" for k in want if not same(got.get(k), want[k])]
        return bad

    def noncontiguous(self, dst: int) -> str:
        try:
            self.send(torch.ones(4, 6, device=self._dev()).t(), self.worker_group_name, dst)
            return "no error"
        except ValueError as exc:
            return str(exc)


@pytest.fixture(scope="module")
def cluster():
    with aiorl.Cluster(num_nodes=1) as c:
        yield c


def _pair(cluster: Any, name: str, strategy: Any) -> Any:
    g = C.create_group().launch(cluster, name=name, placement_strategy=strategy)
    g.info().wait(120)
    return g


@pytest.fixture(scope="module")
def same_gpu(cluster: Any):
    g = _pair(cluster, "cuda-ipc", NodePlacementStrategy([0, 0]))
    (_, u0), (_, u1) = g.info().wait(60)
    if u0 != u1:
        g.close()
        pytest.skip("the two workers did not land on the same GPU")
    yield g
    g.close()


@pytest.fixture(scope="module")
def two_gpus(cluster: Any):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs for NCCL between workers")
    g = _pair(cluster, "cuda-nccl", PackedPlacementStrategy(0, 1))
    (_, u0), (_, u1) = g.info().wait(60)
    assert u0 != u1
    yield g
    g.close()


@pytest.fixture(params=["same_gpu", "two_gpus"])
def pair(request: Any) -> Any:
    return request.getfixturevalue(request.param)


def test_payloads_keep_device_kinds(pair: Any) -> None:
    recv = pair.execute_on(1).recv_payloads_sync(0)
    time.sleep(0.2)
    assert pair.execute_on(0).send_payloads(1).wait(120) == [7]
    assert recv.wait(120) == [[]]
    # Sent first, received later, other direction.
    assert pair.execute_on(1).send_payloads(0).wait(120) == [7]
    assert pair.execute_on(0).recv_payloads(1).wait(120) == [[]]


def test_send_tensor_across_devices(pair: Any) -> None:
    recv = pair.execute_on(1).recv_tensors(0)
    assert pair.execute_on(0).send_tensors(1).wait(60) == [3]
    assert recv.wait(60) == [[True, True, True]]


def test_interleaved_both_directions(pair: Any) -> None:
    assert pair.execute_on(0, 1).exchange(300).wait(120) == [300, 300]


def test_state_dicts_of_a_thousand_tensors(pair: Any) -> None:
    """Resent state dicts reuse their shares; a fresh one replaces them; values exact."""
    recv = pair.execute_on(1).recv_state_dicts(0, 3)
    assert pair.execute_on(0).send_state_dicts(1, 3).wait(120) == [4]
    assert recv.wait(120) == [[]]


def test_noncontiguous_cuda_tensor(pair: Any) -> None:
    assert "contiguous" in pair.execute_on(0).noncontiguous(1).wait(30)[0]


def test_peer_killed_during_cuda_recv(cluster: Any) -> None:
    g = _pair(cluster, "cuda-kill", NodePlacementStrategy([0, 0]))
    try:
        (_, _), (victim, _) = g.info().wait(60)
        pending = g.execute_on(0).recv_expect_loss(1)
        time.sleep(0.5)
        t = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        assert pending.wait(30) == ["PeerLostError"]
        assert time.monotonic() - t <= 5.0
    finally:
        g.close()
