"""Shared fixtures, and a guard that fails the run if any aiorl process outlives it."""

from __future__ import annotations

import os
import time

import psutil
import pytest

import aiorl

_MARKERS = ("aiorl.node", "aiorl.registry", "aiorl-node", "aiorl-registry")


def aiorl_processes(exclude: set[int] = frozenset()) -> list[psutil.Process]:  # type: ignore[assignment]
    """Registry, node agent, zygote and worker processes (workers are our zygotes' children)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "ppid"]):
        if p.info["pid"] in exclude or p.info["pid"] == os.getpid():
            continue
        cmd = " ".join(p.info["cmdline"] or [])
        if any(m in cmd for m in _MARKERS):
            found.append(p)
    # Forked workers keep their zygote's command line ("-m aiorl.node.zygote").
    return found


_preexisting: set[int] = set()


def pytest_sessionstart(session: pytest.Session) -> None:
    _preexisting.update(p.pid for p in aiorl_processes())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    deadline = time.monotonic() + 10
    left = aiorl_processes(_preexisting)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = aiorl_processes(_preexisting)
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
