"""``aiorl demo`` end to end: real subprocesses, real cluster, no processes left behind.

Other test sessions may run on the same machine at the same time, so "left behind" is
judged on the demo's own process tree (its descendants, recorded while it runs, and any
agent started with ``--parent-pid <demo pid>``), not on every aiorl process in the table.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.timeout(120)

_MARKERS = ("aiorl.node", "aiorl.registry", "aiorl-node", "aiorl-registry")


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _aiorl_pids() -> set[int]:
    pids = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if any(m in cmd for m in _MARKERS):
            pids.add(p.info["pid"])
    return pids


class DemoRun:
    """``python -m aiorl.cli.main demo ...`` in a subprocess, watching its process tree."""

    def __init__(self, *args: str, tmp_path: Path) -> None:
        self.before = _aiorl_pids()
        self.out_path = tmp_path / "stdout.txt"
        self.err_path = tmp_path / "stderr.txt"
        self._out = open(self.out_path, "w")  # noqa: SIM115 - closed in finish()
        self._err = open(self.err_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            # faulthandler: a demo that does not finish shows its threads (SIGABRT, finish()).
            [sys.executable, "-X", "faulthandler", "-m", "aiorl.cli.main", "demo", *args],
            stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.descendants: dict[int, psutil.Process] = {}

    def _record(self) -> None:
        try:
            for c in psutil.Process(self.proc.pid).children(recursive=True):
                self.descendants.setdefault(c.pid, c)
        except psutil.Error:
            pass

    def stdout(self) -> str:
        return self.out_path.read_text()

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._record()
            if re.search(pattern, self.stdout(), re.M):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} not seen; stdout:\n{self.stdout()}\n"
                             f"stderr:\n{self.err_path.read_text()}")

    def finish(self, timeout: float = 100) -> tuple[int, str, str]:
        deadline = time.monotonic() + timeout
        try:
            while self.proc.poll() is None:
                self._record()
                if time.monotonic() > deadline:
                    self.proc.send_signal(signal.SIGABRT)  # its threads' stacks, on stderr
                    try:
                        self.proc.wait(5)
                    except subprocess.TimeoutExpired:
                        self.proc.kill()
                    raise AssertionError("aiorl demo did not finish in time; its stderr:\n"
                                         + self.err_path.read_text()[-8000:])
                time.sleep(0.1)
        finally:
            self._out.close()
            self._err.close()
        return self.proc.returncode, self.stdout(), self.err_path.read_text()

    def leftovers(self) -> list[str]:
        """The demo's processes still alive (after a grace period for reaping)."""
        deadline = time.monotonic() + 5
        while True:
            left = [p for p in self.descendants.values() if _alive(p)]
            own_marker = f"--parent-pid {self.proc.pid}"
            for pid in _aiorl_pids() - self.before:
                try:
                    p = psutil.Process(pid)
                    if own_marker in " ".join(p.cmdline()) and _alive(p):
                        left.append(p)
                except psutil.Error:
                    pass
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        out = []
        for p in left:
            try:
                out.append(f"pid {p.pid}: {' '.join(p.cmdline())}")
            except psutil.Error:
                pass
        return out


def test_demo_trains_and_cleans_up(tmp_path: Path) -> None:
    run = DemoRun("--steps", "5", "--rollouts", "2", "--trainers", "2", tmp_path=tmp_path)
    code, out, err = run.finish()
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    # Not a terminal: one line per training step, then the summary.
    assert len(re.findall(r"^step\s+\d+/5 ", out, re.M)) == 5, out
    assert re.search(r"^steps done\s+5/5\b", out, re.M), out
    version = re.search(r"^final weight version\s+(\d+)", out, re.M)
    assert version and int(version.group(1)) >= 1, out
    for worker in ("rollout:0", "rollout:1", "trainer:0", "trainer:1"):
        assert re.search(rf"^{worker}\s", out, re.M), out
    # Trainer 0 pushed every version to the rollouts (P2P): they report the updates.
    # (stderr too: the demo logs there why a rollout's final count is short.)
    assert re.search(r"^rollout:0 .*5 weight updates", out, re.M), f"{out}\n{err[-4000:]}"
    # The registry, agents, zygotes and workers all ran under the demo...
    assert len(run.descendants) >= 4, run.descendants
    # ...and none outlived it.
    assert run.leftovers() == []


def test_demo_with_placement_on_two_nodes(tmp_path: Path) -> None:
    cfg = tmp_path / "placement.yaml"
    cfg.write_text(
        "cluster:\n"
        "  num_nodes: 2\n"
        "  component_placement:\n"
        "    rollout: '0:0,1:1'\n"
        "    trainer: '1:0'\n"
    )
    run = DemoRun("--steps", "3", "--placement", str(cfg), "--batch-weight", "256",
                  tmp_path=tmp_path)
    code, out, err = run.finish()
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert re.search(r"^steps done\s+3/3\b", out, re.M), out
    assert "2 node(s)" in out
    assert re.search(r"^rollout:0\s+0\s", out, re.M), out  # worker, node columns
    assert re.search(r"^rollout:1\s+1\s", out, re.M), out
    assert re.search(r"^trainer:0\s+1\s", out, re.M), out
    assert not re.search(r"^trainer:1\s", out, re.M), out  # the placement says one trainer
    assert run.leftovers() == []


def test_invalid_placement_exits_with_the_placement_error(tmp_path: Path) -> None:
    from aiorl.placement import ClusterSpec, ComponentPlacement, PlacementError

    text = "cluster:\n  num_nodes: 1\n  component_placement:\n    rollout: '0-3'\n    trainer: 0\n"
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(PlacementError) as expected:
        ComponentPlacement({"cluster": {"num_nodes": 1, "component_placement": {
            "rollout": "0-3", "trainer": 0}}}, ClusterSpec(1))
    run = DemoRun("--placement", str(cfg), tmp_path=tmp_path)
    code, out, err = run.finish(timeout=60)
    assert code == 2, f"stdout:\n{out}\nstderr:\n{err}"
    assert str(expected.value) in err
    assert err.startswith("error: ")
    assert run.descendants == {}  # rejected before anything started


def test_placement_disagreeing_with_rollouts_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "p.yaml"
    cfg.write_text("cluster:\n  component_placement:\n    rollout: '0:0-2'\n    trainer: 0\n")
    run = DemoRun("--placement", str(cfg), "--rollouts", "2", tmp_path=tmp_path)
    code, _, err = run.finish(timeout=60)
    assert code == 2
    assert "--rollouts 2 disagrees" in err and "3 process(es)" in err


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_stops_everything(tmp_path: Path, sig: signal.Signals, code: int) -> None:
    run = DemoRun("--steps", "100000", tmp_path=tmp_path)
    try:
        run.wait_for(r"^step\s+2/", timeout=90)  # training is under way
    finally:
        run.proc.send_signal(sig)
    rc, out, err = run.finish(timeout=60)
    assert rc == code, f"stdout:\n{out}\nstderr:\n{err}"
    assert "stopping the workers and the cluster" in err
    assert "Traceback" not in err, err
    assert run.leftovers() == []
