"""``make gpu-check`` (benchmarks/gpu_check.py): its verdicts, and its run without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests._paths import REPO_ROOT

ROOT = REPO_ROOT
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_targets_are_judged_against_issue_26s_goals() -> None:
    results = {
        "tests": {"failed": 0},
        "ipc": {"sizes": [{"nbytes": 1 << 10, "ipc_s": 135e-6, "d2d_s": 5e-6},
                          {"nbytes": 64 << 20, "ipc_s": 50e-6, "d2d_s": 41e-6},
                          {"nbytes": 1 << 30, "ipc_s": 1e-3, "d2d_s": 0.6e-3}],
                "rtt_cuda_s": 300e-6, "rtt_cpu_s": 190e-6},
        "weights": [{"subscribers": 4, "d2d_s": 1e-3, "publish_s": 1.5e-3, "update_s": 8e-3}],
        "idle_cpu": 0.002,
    }
    verdict = {t.name: (t.value, t.met) for t in gpu_check.judge(results)}
    assert verdict["GPU tests failed"] == (0, True)
    value, met = verdict["CUDA IPC one-way / device copy, 64 MB and up (worst)"]
    assert value == pytest.approx(0.6) and not met  # the worst size decides
    value, met = verdict["CUDA message fixed cost (1 KB one-way - CPU one-way)"]
    assert value == pytest.approx(40) and met  # 135 us one-way, of which 95 a CPU message's
    assert verdict["small CUDA tensor round trip / CPU tensor's"][1]
    assert verdict["weights, 4 GPU subscriber(s): publish / device copies"][1]
    value, met = verdict["weights, 4 GPU subscriber(s): publish->pulled / (1+N) copies"]
    assert value == pytest.approx(1.6) and not met
    assert verdict["a worker's CPU once its transfers are done"] == (pytest.approx(0.2), True)


def test_what_was_not_measured_is_not_met() -> None:
    targets = gpu_check.judge({})
    assert targets and all(t.value is None and not t.met for t in targets)
    assert "not measured" in gpu_check.table([t.row() for t in targets], ["a", "b", "c", "d"])


def test_the_result_file_is_named_after_the_device() -> None:
    assert gpu_check.device_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_check.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: make gpu-check measures it")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device here" in done.stdout
    assert list(tmp_path.iterdir()) == []  # no result file without a GPU
