"""``Worker.broadcast`` of CUDA payloads between real worker processes (GPU machines only).

* Members on one GPU: the source is that GPU's representative; the others copy its tensors
  through CUDA IPC handles (NCCL refuses two ranks on one device).
* With two or more GPUs: the representatives of the GPUs run one NCCL broadcast on a
  communicator created for them; a member sharing a GPU with one copies by IPC from it.

Every test checks values and device kinds, mixing CPU and CUDA tensors in one object.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import aiorl
from aiorl.placement import NodePlacementStrategy, PackedPlacementStrategy
from tests.gpu.test_p2p_cuda import payloads, same

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class CB(aiorl.Worker):
    def gpu(self) -> str:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return str(getattr(props, "uuid", torch.cuda.current_device()))

    async def payloads(self, members: list[Any], src: tuple[str, int]) -> list[int]:
        """Broadcast every payload from ``src``; the indexes of the wrong ones."""
        dev = torch.device("cuda", torch.cuda.current_device())
        me = (self.worker_group_name, self.rank)
        bad = []
        for i, want in enumerate(payloads(dev)):
            got = await self.broadcast(want if me == src else None, members, src, async_op=True)
            if not same(got, want):
                bad.append(i)
        return bad


@pytest.fixture(scope="module")
def cluster() -> Iterator[aiorl.Cluster]:
    with aiorl.Cluster(num_nodes=1) as c:
        yield c


def _run(groups: list[Any], members: list[Any], src: tuple[str, int]) -> list[Any]:
    works = [g.payloads(members, src) for g in groups]
    return [x for w in works for x in w.wait(150)]


def test_members_on_one_gpu_copy_by_ipc(cluster: Any) -> None:
    g = CB.create_group().launch(cluster, name="cb1", placement_strategy=NodePlacementStrategy(
        [0, 0, 0]))
    try:
        if len(set(g.gpu().wait(120))) != 1:
            pytest.skip("the workers did not land on one GPU")
        members = [("cb1", [0, 1, 2])]
        assert _run([g], members, ("cb1", 0)) == [[]] * 3
        assert _run([g], members, ("cb1", 2)) == [[]] * 3
    finally:
        g.close()


def test_gpus_joined_by_nccl_and_ipc(cluster: Any) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs for NCCL between workers")
    packed = CB.create_group().launch(cluster, name="cbn",
                                      placement_strategy=PackedPlacementStrategy(0, 1))
    extra = CB.create_group().launch(cluster, name="cbx",
                                     placement_strategy=NodePlacementStrategy([0]))
    try:
        gpus = packed.gpu().wait(120)
        assert gpus[0] != gpus[1]
        members = [("cbn", [0, 1]), ("cbx", 0)]
        assert _run([packed, extra], members, ("cbn", 0)) == [[]] * 3
        assert _run([packed, extra], members, ("cbn", 1)) == [[]] * 3  # same communicator
        assert _run([packed, extra], members, ("cbx", 0)) == [[]] * 3
    finally:
        packed.close()
        extra.close()
