"""Tests for ``aiorl plan`` (aiorl/cli/plan.py) and for placement's import cost."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aiorl.cli import plan
from tests._paths import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

REPO = REPO_ROOT

VALID_YAML = """\
cluster:
  num_nodes: 2
  component_placement:
    actor,inference: 0-1:0-3,3-5,7-10:7-14
    agent:
      node_group: node
      placement: 0-1:0-199
    env:
      node_group: franka
      placement: 0-1:0-3
  node_groups:
    - label: franka
      node_ranks: 1
      hardware:
        type: Franka
        configs:
          - {node_rank: 1, robot_ip: 10.0.0.1}
          - {node_rank: 1, robot_ip: 10.0.0.2}
      env_configs:
        - node_ranks: 1
          env_vars:
            - ROS_DOMAIN_ID: 7
"""

INVALID_YAML = """\
cluster:
  num_nodes: 2
  component_placement:
    actor: 0-3,4-6:4-7
"""


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiorl.cli.plan", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )


@pytest.fixture
def valid_config(tmp_path: Path) -> Path:
    path = tmp_path / "valid.yaml"
    path.write_text(VALID_YAML)
    return path


def test_plan_valid_config_prints_grids(valid_config: Path) -> None:
    result = _run_cli(str(valid_config), "--accelerators-per-node", "8")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert ["node", "0", "0-1", "2-3", ".", "4", "5", "6", ".", "7-8"] in rows
    assert ["node", "1", "9-10", "11-12", "13-14", ".", ".", ".", ".", "."] in rows
    assert ["node", "0", "0-99"] in rows and ["node", "1", "100-199"] in rows
    assert ["Franka:0", "Franka:1"] in rows and ["node", "1", "0-1", "2-3"] in rows
    assert "env on node 1: ROS_DOMAIN_ID=7" in result.stdout
    assert "actor,inference [0-1:0-3,3-5,7-10:7-14]: 15 processes" in result.stdout
    assert result.stdout.startswith("cluster: 2 nodes, 8 cuda accelerators per node")


def test_plan_overrides_and_per_node_counts(valid_config: Path) -> None:
    result = _run_cli(str(valid_config), "--num-nodes", "3", "--accelerators-per-node", "8,8,0")
    assert result.returncode == 0, result.stderr
    assert "3 nodes" in result.stdout
    # Too few accelerators for 7-10 -> a placement error, exit 2.
    result = _run_cli(str(valid_config), "--accelerators-per-node", "4")
    assert result.returncode == 2
    assert result.stderr.startswith("error: '7-10:7-14': resource rank 10 is out of range")


def test_plan_invalid_config_exits_2_with_the_segment(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(INVALID_YAML)
    result = _run_cli(str(path), "--accelerators-per-node", "8")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: '4-6:4-7': 4 processes cannot be spread over 3")
    assert "component 'actor'" in result.stderr


def test_plan_unreadable_file_exits_2(tmp_path: Path) -> None:
    result = _run_cli(str(tmp_path / "missing.yaml"))
    assert result.returncode == 2
    assert result.stderr.startswith("error: cannot read")
    broken = tmp_path / "broken.yaml"
    broken.write_text("cluster: [unclosed\n")
    result = _run_cli(str(broken))
    assert result.returncode == 2
    assert result.stderr.startswith("error:")


def test_add_parser_and_run_in_process(
    valid_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="aiorl")
    plan.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", str(valid_config), "--accelerators-per-node", "8"])
    assert args.func is plan.run
    assert args.func(args) == 0
    assert "15 processes" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["plan", str(valid_config), "--accelerators-per-node", "x"])


def test_placement_import_is_light() -> None:
    # Measured against whatever `import aiorl` already loads, so the check stays meaningful
    # once aiorl/__init__.py exists: placement itself must add no heavy module.
    code = textwrap.dedent(
        """
        import sys
        import aiorl
        before = set(sys.modules)
        import aiorl.placement
        added = set(sys.modules) - before
        print(",".join(m for m in ("torch", "zmq", "omegaconf", "yaml") if m in added))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
