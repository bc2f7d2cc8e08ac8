"""A cluster started by hand beside the test run: the run leaves it alone, and it stops itself
through its daemons' pid files (docs/deploy.md's "By hand").

The registry and the agent are started as an operator would, from a shell that puts them in
the background and exits (``setsid ... &``): they are orphans, reparented to PID 1 and born
after the run began, without the run's tag in their environment. The leftover guard of
tests/conftest.py must not count them as the run's own (it used to, and SIGKILLed them at
the end of ``make test``); a cluster the test starts itself is the run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

import aiorl
from tests._processes import gone_within, wait_listening
from tests.conftest import SESSION_TAG, _ours
from tests.system.test_failures import free_port


def _by_hand(tmp_path, *argv: str) -> int:
    """Start ``python -m argv`` from a shell that exits at once, without this run's tag;
    returns the daemon's pid, read from its --pid-file once it wrote it."""
    pid_path = tmp_path / f"{argv[0]}.pid"
    env = {k: v for k, v in os.environ.items() if k != SESSION_TAG}
    command = " ".join([sys.executable, "-m", *argv, "--pid-file", str(pid_path)])
    subprocess.run(["sh", "-c", f"setsid {command} >/dev/null 2>&1 </dev/null &"], env=env,
                   check=True, timeout=30)
    deadline = time.monotonic() + 60
    while not pid_path.exists() or not pid_path.read_text().strip():
        assert time.monotonic() < deadline, f"{argv[0]} wrote no pid file"
        time.sleep(0.05)
    return int(pid_path.read_text())


def _stop(pid_path) -> int:
    """As docs/deploy.md says: kill -TERM "$(cat FILE)"."""
    pid = int(pid_path.read_text())
    os.kill(pid, signal.SIGTERM)
    return pid


@pytest.mark.timeout(120)
def test_a_hand_started_cluster_is_not_the_runs_and_stops_by_its_pid_files(tmp_path) -> None:
    key = str(tmp_path / "cluster.key")
    address = f"tcp://127.0.0.1:{free_port()}"
    registry = _by_hand(tmp_path, "aiorl.registry.service", "--host", "127.0.0.1", "--port",
                        address.rsplit(":", 1)[1], "--key-file", key, "--log-level", "ERROR")
    pids = [registry]
    try:
        wait_listening(address)
        agent = _by_hand(tmp_path, "aiorl.node.agent", "--registry", address, "--key-file",
                         key, "--log-level", "ERROR")
        pids.append(agent)
        for pid in pids:
            p = psutil.Process(pid)
            assert p.ppid() == 1  # an orphan born during the run: what the old guard took
            assert not _ours(p), f"the run would end hand-started pid {pid}"
        # A second daemon refuses a pid file that names a live one.
        clash = subprocess.run(
            [sys.executable, "-m", "aiorl.registry.service", "--port", "0", "--insecure",
             "--pid-file", str(tmp_path / "aiorl.registry.service.pid")],
            capture_output=True, text=True, timeout=60)
        assert clash.returncode != 0 and f"holds pid {registry}" in clash.stderr
        # It works, and the run's own cluster beside it is the run's.
        with aiorl.Cluster(registry=address, key_file=key, num_nodes=1, timeout=60) as c:
            assert len(c.nodes) == 1
        with aiorl.Cluster(num_nodes=1) as own:
            children = psutil.Process().children(recursive=True)
            started = [p for p in children if p.pid in {c.pid for c in own._embedded.children}]
            assert started and all(_ours(p) for p in started)
        # Stopped by its pid files, agent first: each exits and removes its file.
        _stop(tmp_path / "aiorl.node.agent.pid")
        assert gone_within([agent], 30), "the agent did not stop on SIGTERM"
        _stop(tmp_path / "aiorl.registry.service.pid")
        assert gone_within([registry], 30), "the registry did not stop on SIGTERM"
        assert not (tmp_path / "aiorl.node.agent.pid").exists()
        assert not (tmp_path / "aiorl.registry.service.pid").exists()
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
