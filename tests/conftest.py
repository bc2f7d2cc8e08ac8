"""Shared fixtures, a guard that fails the run if any aiorl process it started outlives it,
and Ctrl-C restored for the processes the tests start."""

from __future__ import annotations

import os
import signal
import time
import uuid

import psutil
import pytest

import aiorl

_MARKERS = ("aiorl.node", "aiorl.registry", "aiorl-node", "aiorl-registry")


def aiorl_processes() -> list[psutil.Process]:
    """Registry, node agent, zygote and worker processes (workers are our zygotes' children)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "ppid"]):
        if p.info["pid"] == os.getpid():
            continue
        cmd = " ".join(p.info["cmdline"] or [])
        if any(m in cmd for m in _MARKERS):  # forked workers keep the zygote's command line
            found.append(p)
    return found


#: Every process this test run starts carries this tag in its environment (registries,
#: agents, zygotes and the workers they fork inherit it; the pytest-xdist workers inherit the
#: controller's): the leftover guard ends only processes with our tag, never a cluster
#: another user or another run started on the same machine.
SESSION_TAG = "AIORL_TEST_SESSION"
os.environ.setdefault(SESSION_TAG, uuid.uuid4().hex)


def pytest_configure(config: pytest.Config) -> None:
    """Give the processes the tests start the default Ctrl-C.

    Tests send SIGINT as a terminal would and expect ``KeyboardInterrupt``. A suite started as
    a background job of a shell without job control (``make test-stress &``) inherits SIGINT
    ignored, and Python keeps an inherited ignore, for itself and for every process it starts:
    those tests would then wait in vain. A caught signal is reset to the default in a child.
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _ours(p: psutil.Process) -> bool:
    """Started by this test run: its environment carries this run's tag.

    (Other runs and hand-started clusters may run aiorl on the same machine; their processes
    are not ours, whoever their parent is. One whose environment cannot be read is not ours.)"""
    try:
        return p.environ().get(SESSION_TAG) == os.environ[SESSION_TAG]
    except (psutil.Error, OSError):
        return False


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        # A pytest-xdist worker: the others, which share its tag, may still run clusters.
        # The controller checks once every worker has finished.
        return
    deadline = time.monotonic() + 10
    left = [p for p in aiorl_processes() if _ours(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in aiorl_processes() if _ours(p)]
    if left:
        lines = "\n".join(f"  pid {p.pid}: {' '.join(p.cmdline())}" for p in left if p.is_running())
        print(f"\nERROR: {len(left)} aiorl process(es) outlived the test session:\n{lines}")
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        session.exitstatus = 1


@pytest.fixture(scope="module")
def cluster():
    """One embedded single-node cluster per test module."""
    with aiorl.Cluster(num_nodes=1) as c:
        yield c
