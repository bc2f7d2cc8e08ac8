"""The worked example of docs/coming-from-rlinf.md: examples/rlinf_cluster.yaml plans
through ``aiorl plan`` and loads into the placement API as an RLinf user would."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from aiorl.cli.main import main as aiorl_main
from aiorl.placement import ComponentPlacement, FrankaConfig
from tests._paths import REPO_ROOT

pytestmark = pytest.mark.timeout(30)

EXAMPLE = REPO_ROOT / "examples" / "rlinf_cluster.yaml"


def test_aiorl_plan_prints_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert aiorl_main(["plan", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "cluster: 4 nodes, 4 cuda accelerators per node (16 in all)" in out
    assert "franka = node 3, Franka hardware" in out
    assert "profiling: nsys for worker groups actor, rollout, steps 5,10" in out
    assert "actor [0-7]: 8 processes on node group 'a800'" in out
    assert "rollout [0-3:0-1]: 2 processes on node group '4090'" in out
    assert "env [0-1]: 2 processes on node group 'franka' (Franka hardware)" in out
    assert "agent [2-3:0-7]: 8 processes on node group 'node'" in out
    assert "  profiled: actor under nsys" in out and "profiled: env" not in out


def test_the_example_loads_like_an_rlinf_config() -> None:
    cfg = OmegaConf.load(EXAMPLE)
    placement = ComponentPlacement(cfg)
    assert {c: placement.get_world_size(c) for c in placement.components} == {
        "actor": 8, "rollout": 2, "env": 2, "agent": 8}
    assert placement.get_hardware_ranks("rollout") == [0, 1, 2, 3]
    spec = placement.spec
    arms = spec.get_node_hw_configs_by_rank(3)
    assert all(isinstance(a, FrankaConfig) for a in arms)
    assert [a.robot_ip for a in arms] == ["10.10.10.1", "10.10.10.2"]
    assert spec.get_node_labels_by_rank(2) == ["4090"]
    actor = placement.get_placement("actor")
    assert {p.python_interpreter for p in actor} == {"/opt/venv/openpi/bin/python3"}
    launch = actor[0].profiler_launch("actor")
    assert launch is not None and launch.argv[:2] == ("nsys", "profile")
    assert "--capture-range=cudaProfilerApi" in launch.argv
    assert placement.get_placement("env")[1].profiler_launch("env") is None
    rollout = placement.get_placement("rollout")
    assert [p.visible_accelerators for p in rollout] == [["0", "1"], ["2", "3"]]
    assert rollout[0].env == {"GLOO_SOCKET_IFNAME": "eth1", "PYTHONPATH": "/opt/rollout/src"}


def test_a_broken_profiling_section_fails_the_plan(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(EXAMPLE.read_text().replace("backend: nsys", "backend: vtune"))
    assert aiorl_main(["plan", str(broken)]) == 2
    assert "error: profiling: Unknown profiling backend 'vtune'" in capsys.readouterr().err
