"""CUDA weight publication: a GPU publisher, subscribers on its GPU (CUDA IPC) and on the host.

Skipped where CUDA is unavailable; runs wherever a GPU is.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import aiorl
from aiorl.placement import NodePlacementStrategy

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = {"w": (1 << 20, torch.float32), "h": (300_000, torch.bfloat16), "b": (7, torch.float32)}


def model(fill: float, device: str) -> dict[str, torch.Tensor]:
    return {n: torch.full((numel,), fill, dtype=dt, device=device)
            for n, (numel, dt) in SHAPES.items()}


class GpuTrainer(aiorl.Worker):
    def __init__(self) -> None:
        self.sd = model(0, "cuda:0")

    async def publish(self, version: int) -> int:
        for t in self.sd.values():
            t.fill_(version)
        return await self.weight_publisher("gpu-w").publish(self.sd, version)


class GpuRollout(aiorl.Worker):
    def __init__(self, device: str) -> None:
        self.sd = model(-1, device)

    async def pull(self) -> tuple[int, list[float], str]:
        version = await self.weight_subscriber("gpu-w").pull(into=self.sd)
        values = sorted({float(v) for t in self.sd.values() for v in torch.unique(t.float())})
        return version, values, str(next(iter(self.sd.values())).device)

    def opened_gpu_slots(self) -> int:
        sub: Any = self.weight_subscriber("gpu-w")
        return len(sub._gpu_slots)


@pytest.fixture(scope="module")
def cluster():
    with aiorl.Cluster(num_nodes=1) as c:
        yield c


def test_gpu_publisher_to_gpu_and_cpu_subscribers(cluster):
    pub = GpuTrainer.create_group().launch(cluster, NodePlacementStrategy([0]), name="gpupub")
    on_gpu = GpuRollout.create_group("cuda:0").launch(
        cluster, NodePlacementStrategy([0, 0]), name="gpusub")
    on_cpu = GpuRollout.create_group("cpu").launch(cluster, NodePlacementStrategy([0]),
                                                   name="cpusub")
    try:
        for version in (1, 2, 3):
            assert pub.publish(version).wait(120) == [version]
            assert on_gpu.pull().wait(120) == [(version, [float(version)], "cuda:0")] * 2
            assert on_cpu.pull().wait(120) == [(version, [float(version)], "cpu")]
        # The subscribers on the publisher's GPU copied device to device (CUDA IPC).
        assert on_gpu.opened_gpu_slots().wait(30) == [1, 1]
        assert on_cpu.opened_gpu_slots().wait(30) == [0]
    finally:
        for g in (pub, on_gpu, on_cpu):
            g.close()
