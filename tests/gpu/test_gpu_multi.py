"""Multi-GPU suite for the CUDA paths (issue 13); skipped below two GPUs.

* The worker x call x path matrix: workers with 1 and 2 GPUs each (a 2-GPU worker selects
  its second GPU in ``__init__``: tensors must land there), receive posted before and after
  the send, paths CUDA IPC (same GPU), NCCL P2P, and NCCL forced onto sockets
  (``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``).
* An 8-worker all-to-all in which every worker makes every first send at once (every
  NCCL pair set up concurrently, both directions of each sharing one communicator).
* Peer death during communicator set-up and mid-transfer: the survivor gets
  ``PeerLostError`` within 5 s and is not aborted.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import aiorl
from aiorl.placement import FlexiblePlacementStrategy, NodePlacementStrategy
from tests.gpu._gpu_workers import G

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(GPUS < 2, reason="needs two or more CUDA GPUs"),
]

SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[aiorl.Cluster]:
    with aiorl.Cluster(num_nodes=1) as c:
        yield c


def _launch(
    cluster: aiorl.Cluster,
    name: str,
    gpus: list[list[int]] | str,
    device: int,
    env: dict[str, str] | None = None,
) -> Any:
    """``gpus``: each worker's accelerators, or ``"shared"``: two workers that each see every
    GPU of node 0 (``isolate_gpu=False``), so both select ``device`` and share it (the IPC
    layouts: a flexible placement refuses one GPU listed for two workers)."""
    if gpus == "shared":
        group = G.create_group(device).launch(
            cluster, NodePlacementStrategy([0, 0]), name=name, env=env or {}, isolate_gpu=False
        )
    else:
        group = G.create_group(device).launch(
            cluster, FlexiblePlacementStrategy(gpus), name=name, env=env or {}
        )
    group.info().wait(120)
    return group


# (label, accelerators of worker 0 and 1, device each selects, environment)
LAYOUTS = [
    ("ipc-1gpu", "shared", 0, None),
    ("nccl-1gpu", [[0], [1]], 0, None),
    ("nccl-sockets-1gpu", [[0], [1]], 0, SOCKETS),
]
if GPUS >= 4:
    LAYOUTS += [
        ("nccl-2gpu", [[0, 1], [2, 3]], 1, None),
        ("nccl-sockets-2gpu", [[0, 1], [2, 3]], 1, SOCKETS),
        ("ipc-2gpu", "shared", 1, None),
    ]


@pytest.mark.parametrize(("label", "gpus", "device", "env"), LAYOUTS, ids=[x[0] for x in LAYOUTS])
@pytest.mark.parametrize("posted_first", [True, False], ids=["recv-first", "send-first"])
def test_matrix(
    cluster: aiorl.Cluster,
    label: str,
    gpus: list[list[int]] | str,
    device: int,
    env: dict[str, str] | None,
    posted_first: bool,
) -> None:
    group = _launch(cluster, f"m-{label}-{int(posted_first)}", gpus, device, env)
    try:
        infos = group.info().wait(30)
        assert [i["selected"] for i in infos] == [device, device]
        same_gpu = infos[0]["uuid"] == infos[1]["uuid"]
        assert same_gpu == label.startswith("ipc")
        for raw in (False, True):
            if posted_first:
                recv = group.execute_on(1).recv_matrix(0, raw)
                time.sleep(0.3)
                group.execute_on(0).send_matrix(1, raw).wait(120)
            else:
                sent = group.execute_on(0).send_matrix(1, raw)
                time.sleep(0.3)
                recv = group.execute_on(1).recv_matrix(0, raw)
                sent.wait(120)
            assert recv.wait(120) == [[]], (label, raw)
        for method in ("recv_where", "recv_where_async"):
            recv = getattr(group.execute_on(1), method)(0)
            group.execute_on(0).send_one(1, 4096).wait(60)
            (where,) = recv.wait(60)
            assert where["index"] == device and where["uuid"] == infos[1]["uuid"]
            assert where["ok"]
        (taken,) = group.execute_on(1).take_arg(torch.arange(4.0, device="cuda")).wait(60)
        assert taken["index"] == device
    finally:
        group.close()


def test_receiver_oom_over_nccl_then_the_next_message_is_correct(cluster: aiorl.Cluster) -> None:
    group = _launch(cluster, "nccl-oom", [[0], [1]], 0)
    try:
        group.execute_on(1).fill_memory(256).wait(60)
        big = 1 << 30
        recv = group.execute_on(1).recv_expect(0, big, None)
        assert group.execute_on(0).send_expect(1, big, 1.0).wait(120) == ["ProtocolError"]
        assert "memory" in recv.wait(120)[0].lower()
        group.execute_on(1).release_memory().wait(60)
        recv = group.execute_on(1).recv_expect(0, 1000, 2.0)
        assert group.execute_on(0).send_expect(1, 1000, 2.0).wait(60) == ["ok"]
        assert recv.wait(60) == ["ok"]
    finally:
        group.close()


def test_eight_worker_all_to_all_with_every_first_send_at_once(cluster: aiorl.Cluster) -> None:
    gpus = [[i % GPUS] for i in range(8)]
    group = _launch(cluster, "a2a", gpus, 0)
    try:
        assert group.all_to_all(8, 1 << 16).wait(240) == [[]] * 8
        assert group.all_to_all(8, 1 << 20).wait(240) == [[]] * 8  # pairs reused
    finally:
        group.close()


@pytest.mark.parametrize("when", ["during-setup", "mid-transfer"])
def test_peer_death_over_nccl(cluster: aiorl.Cluster, when: str) -> None:
    group = _launch(cluster, f"ncclkill-{when}", [[0], [1]], 0)
    try:
        victim = group.info().wait(30)[0]["pid"]
        pending = group.execute_on(1).recv_until_lost(0, 256)
        group.execute_on(0).send_forever(1, 256)
        time.sleep(0.05 if when == "during-setup" else 3.0)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        assert pending.wait(60) == ["PeerLostError"]
        assert time.monotonic() - t0 <= 5.0
        assert group.execute_on(1).alive().wait(30)  # not torn down by NCCL's watchdog
    finally:
        group.close()
