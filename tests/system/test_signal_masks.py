"""SIGINT and SIGTERM reach the main thread: aiorl's own threads block them
(`aiorl.util.threads`), and the processes aiorl starts do not inherit the block.

A signal sent to a process goes to any thread that does not block it; CPython runs the
handler on the main thread but wakes that thread only if the signal landed on it, so a
driver blocked in ``work.wait()`` missed a Ctrl-C that landed on one of aiorl's threads
(seen under ``make test-stress``). The masks are read from ``/proc``: what the kernel uses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from aiorl.util.threads import RuntimeThread, blocked, unblocked

SHIELDED_BITS = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))


def _blocked_bits(pid: int, tid: int | None = None) -> int:
    """The SigBlk mask of thread ``tid`` of ``pid`` (its main thread if None)."""
    path = f"/proc/{pid}/task/{tid or pid}/status"
    with open(path) as f:
        for line in f:
            if line.startswith("SigBlk:"):
                return int(line.split()[1], 16)
    raise AssertionError(f"no SigBlk in {path}")


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.timeout(30)
def test_a_runtime_thread_blocks_both_and_its_starter_keeps_its_mask() -> None:
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    seen: list[int] = []
    child_mask: list[int] = []

    def run() -> None:
        seen.append(_blocked_bits(os.getpid(), threading.get_native_id()))
        with unblocked():  # what a process started from here inherits
            child = subprocess.Popen(["sleep", "30"])
        try:
            child_mask.append(_blocked_bits(child.pid))
        finally:
            child.kill()
            child.wait()

    t = RuntimeThread(target=run, name="aiorl-test-masked")
    t.start()
    t.join(20)
    assert seen and seen[0] & SHIELDED_BITS == SHIELDED_BITS
    assert child_mask and child_mask[0] & SHIELDED_BITS == 0
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
    with blocked():
        assert _blocked_bits(os.getpid(), threading.get_native_id()) & SHIELDED_BITS == SHIELDED_BITS
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


_DRIVER = textwrap.dedent("""\
    import faulthandler, signal, sys, time
    import aiorl

    faulthandler.register(signal.SIGUSR1, all_threads=True)

    class Slow(aiorl.Worker):
        def hold(self):
            time.sleep(120)

    with aiorl.Cluster(num_nodes=1) as cluster:
        group = Slow.create_group().launch(cluster, num_workers=1, name="slow")
        work = group.hold()
        print("ready", flush=True)
        try:
            work.wait(600)  # a lock wait on the main thread: woken only by a signal it takes
        except KeyboardInterrupt:
            print("interrupted", flush=True)
""")


@pytest.mark.timeout(120)
def test_a_driver_waiting_on_a_call_takes_ctrl_c_on_its_main_thread(tmp_path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert driver.stdout is not None
        assert driver.stdout.readline().strip() == "ready"
        main = driver.pid
        others = [t for t in _threads(main) if t != main]
        assert others, "the driver runs aiorl's threads"
        unmasked = [t for t in others
                    if _blocked_bits(main, t) & SHIELDED_BITS != SHIELDED_BITS]
        assert not unmasked, (f"threads {unmasked} of the driver take SIGINT/SIGTERM: "
                              + ", ".join(psutil.Process(main).threads().__repr__()))
        assert _blocked_bits(main) & SHIELDED_BITS == 0
        # The daemons it started, and their workers, take both on their main thread.
        for child in psutil.Process(main).children(recursive=True):
            assert _blocked_bits(child.pid) & SHIELDED_BITS == 0, child.cmdline()
        os.kill(main, signal.SIGINT)  # to the process: the kernel picks an unblocking thread
        started = time.monotonic()
        try:
            out, err = driver.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            driver.send_signal(signal.SIGUSR1)
            time.sleep(2)
            driver.kill()
            out, err = driver.communicate()
            raise AssertionError(f"the driver did not stop within 60 s of SIGINT:\n{err}") from None
        assert "interrupted" in out, err
        assert time.monotonic() - started < 30
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
