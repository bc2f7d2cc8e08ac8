"""GPU-related behaviour of node agents that runs without a GPU (real agents, real workers).

* Issue 13 item 11: an agent started under its own ``CUDA_VISIBLE_DEVICES`` (indices or GPU
  UUIDs) gives each worker the *physical* devices its local placement indices stand for.
* Issue 13 item 13: a worker that exits after a failed ``__init__`` still closes its P2P
  engine (its runtime's closers run), which releases what the CUDA paths hold.
* Issue 13 item 12: a zygote preload that initialises CUDA must not hand workers a broken
  CUDA state: the zygote notices and starts workers as fresh interpreters instead.
  (No GPU here: the preload fakes "CUDA initialised" through ``torch.cuda._initialized``,
  the flag ``torch.cuda.is_initialized()`` reads.)
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

import aiorl
from aiorl.node.visible_devices import physical_visible_devices
from aiorl.placement import (
    FlexiblePlacementStrategy,
    NodePlacementStrategy,
    PackedPlacementStrategy,
)

pytestmark = pytest.mark.timeout(60)


class EnvReporter(aiorl.Worker):
    def visible(self) -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    def started_by_exec(self) -> bool:
        import sys

        return "aiorl.node.exec_worker" in sys.orig_argv  # not the title /proc shows


def test_workers_get_physical_gpus_through_the_agents_index_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the embedded agent inherits it
    with aiorl.Cluster(accelerators_per_node=4) as cluster:
        singles = EnvReporter.create_group().launch(
            cluster, PackedPlacementStrategy(0, 3), name="masked"
        )
        pairs = EnvReporter.create_group().launch(
            cluster, FlexiblePlacementStrategy([[0, 1], [2, 3]]), name="pairs"
        )
        try:
            assert singles.visible().wait(30) == ["4", "5", "6", "7"]
            assert pairs.visible().wait(30) == ["4,5", "6,7"]
            assert singles.started_by_exec().wait(30) == [False] * 4  # a plain zygote forks
        finally:
            singles.close()
            pairs.close()


def test_workers_get_physical_gpus_through_the_agents_uuid_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,GPU-bb,GPU-cc,GPU-dd")
    with aiorl.Cluster(accelerators_per_node=4) as cluster:
        group = EnvReporter.create_group().launch(
            cluster, FlexiblePlacementStrategy([[1], [3]]), name="uuids"
        )
        try:
            assert group.visible().wait(30) == ["GPU-bb", "GPU-dd"]
        finally:
            group.close()


def test_mapping_rules() -> None:
    assert physical_visible_devices("0,2", None, 4) == "0,2"  # unmasked agent
    assert physical_visible_devices("1", "3,1", 2) == "1"
    assert physical_visible_devices("0", "3,1", 2) == "3"
    assert physical_visible_devices("GPU-x", "3,1", 2) == "GPU-x"  # already physical
    # A mask shorter than the declared accelerators is not a device list (test machines).
    assert physical_visible_devices("3", "0", 8) == "3"
    with pytest.raises(ValueError, match="local GPU 2 does not exist"):
        physical_visible_devices("2", "3,1", 2)


def test_zygote_that_initialised_cuda_starts_workers_by_exec(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AIORL_ZYGOTE_PRELOAD", "tests.gpu._fake_cuda_preload")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    with aiorl.Cluster() as cluster:
        # CPU workers by node rank: on a GPU machine the cluster declares its GPUs, and
        # num_workers=2 would ask for two of them.
        group = EnvReporter.create_group().launch(cluster, NodePlacementStrategy([0, 0]),
                                                  name="cudazyg")
        try:
            assert group.started_by_exec().wait(60) == [True, True]
        finally:
            group.close()
    err = capfd.readouterr().err
    assert "tests.gpu._fake_cuda_preload" in err and "initialised CUDA" in err


def test_a_group_with_its_own_torch_allocator_settings_starts_by_exec(
        cluster: aiorl.Cluster) -> None:
    """torch reads ``PYTORCH_CUDA_ALLOC_CONF`` when it is imported, which the zygote did: a
    forked worker asking for another allocator failed on the H200 (issue 26). Such a
    group starts by exec; a group without the setting still forks."""
    special = EnvReporter.create_group().launch(
        cluster, NodePlacementStrategy([0]), name="allocconf",
        env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    plain = EnvReporter.create_group().launch(cluster, NodePlacementStrategy([0]),
                                              name="allocplain")
    try:
        assert special.started_by_exec().wait(60) == [True]
        assert plain.started_by_exec().wait(60) == [False]
    finally:
        special.close()
        plain.close()


class FailsAfterUsingP2P(aiorl.Worker):
    """Uses its P2P engine, then fails in ``__init__``: the engine must still be closed."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        engine = self._p2p_engine()
        engine.runtime.on_close(lambda: open(marker, "w").close())
        raise RuntimeError("init fails on purpose")

    def ping(self) -> None:
        """Never reached: ``__init__`` fails."""

    def _p2p_engine(self) -> Any:
        from aiorl.p2p import get_p2p

        return get_p2p(self._runtime)


def test_the_p2p_engine_is_closed_when_a_worker_exits_after_a_failed_init(
    cluster: aiorl.Cluster, tmp_path: Any
) -> None:
    marker = str(tmp_path / "closed")
    group = FailsAfterUsingP2P.create_group(marker).launch(cluster, num_workers=1, name="initfail")
    try:
        with pytest.raises(aiorl.WorkerInitError, match="on purpose"):
            group.ping().wait(30)
    finally:
        group.close()
    deadline = time.monotonic() + 10
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(marker)  # the runtime's closers (P2P.close among them) ran
