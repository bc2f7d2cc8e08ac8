"""SIGINT and SIGTERM reach the main thread: aiorl's own threads block them
(`aiorl.util.threads`), and the processes aiorl starts do not inherit the block.

A signal sent to a process goes to any thread that does not block it; CPython runs the
handler on the main thread but wakes that thread only if the signal landed on it, so a
driver blocked in ``work.wait()`` missed a Ctrl-C that landed on one of aiorl's threads
(seen under ``make test-stress``). The masks are read from ``/proc``: what the kernel uses.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest

from aiorl.util.threads import RuntimeThread, blocked, unblocked

SHIELDED_BITS = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))


def _status(pid: int, tid: int | None = None) -> dict[str, str]:
    with open(f"/proc/{pid}/task/{tid or pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _blocked_bits(pid: int, tid: int | None = None) -> int:
    """The SigBlk mask of thread ``tid`` of ``pid`` (its main thread if None)."""
    return int(_status(pid, tid)["SigBlk"], 16)


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def _comm(pid: int, tid: int) -> str:
    with open(f"/proc/{pid}/task/{tid}/comm") as f:
        return f.read().strip()


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


# A driver that waits on a long call on its main thread, once per line "wait" on its stdin;
# each Ctrl-C it takes there is printed. argv: "blocked" to start its cluster in a thread
# that blocks both signals (as aiorl's own threads do), "numpy" to import numpy first (its
# OpenBLAS pool then takes signals: a library's threads are not aiorl's to mask).
_DRIVER = textwrap.dedent("""\
    import faulthandler, os, signal, sys, threading, time
    if "numpy" in sys.argv:
        import numpy
    import aiorl
    from aiorl.util.threads import blocked

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view when stuck
    signal.signal(signal.SIGUSR2, lambda *_: None)  # the test's second signal: handled

    class Slow(aiorl.Worker):
        def method_thread(self):
            return os.getpid(), threading.get_native_id()

        def hold(self):
            time.sleep(3600)

    if "blocked" in sys.argv:
        with blocked():
            cluster = aiorl.Cluster(num_nodes=1)
    else:
        cluster = aiorl.Cluster(num_nodes=1)
    with cluster:
        group = Slow.create_group().launch(cluster, num_workers=1, name="slow")
        [(pid, tid)] = group.method_thread().wait(60)
        work = group.hold()
        print("ready", pid, tid, flush=True)
        for line in sys.stdin:
            try:
                print("waiting", flush=True)
                work.wait(3600)  # a lock wait on the main thread
            except KeyboardInterrupt:
                print("interrupted", flush=True)
        group.close()
    print("done", flush=True)
""")


class _Driver:
    """The driver program above, its output lines as they come, and its process tree."""

    def __init__(self, tmp_path, *args: str) -> None:
        script = tmp_path / "driver.py"
        script.write_text(_DRIVER)
        self.proc = subprocess.Popen([sys.executable, str(script), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self._err.extend(self.proc.stderr or ()),
                         daemon=True).start()
        self.tree: list[psutil.Process] = []

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def line(self, within: float) -> str | None:
        try:
            return self._lines.get(timeout=within)
        except queue.Empty:
            return None

    def expect(self, word: str, within: float) -> list[str]:
        line = self.line(within)
        if line is None or line.split()[:1] != [word]:
            raise AssertionError(f"expected {word!r} within {within} s, got {line!r}; "
                                 f"the driver's threads:\n{self.stacks()}")
        return line.split()[1:]

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stacks(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
        return "".join(self._err)[-6000:]

    def finish(self) -> None:
        """End its loop (stdin closed) and wait for it; kill whatever is left of its tree."""
        self.tree = self.tree or _tree(self.pid)
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        finally:
            for p in self.tree:
                try:
                    p.kill()
                except psutil.Error:
                    pass


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("started_from", ["main", "blocked"])
def test_only_the_main_thread_of_every_process_of_a_cluster_takes_them(tmp_path,
                                                                        started_from) -> None:
    """During a long call: in the driver, the registry, the node agent and its zygote, every
    thread but the main one blocks SIGINT and SIGTERM; in the worker too, but its method
    thread, which runs the user's code (a process started there must take SIGTERM). Every
    main thread takes both, also when the cluster was started from a thread that blocks
    them ("blocked": what aiorl's own threads do; a mask survives fork and exec)."""
    driver = _Driver(tmp_path, started_from)
    try:
        worker_pid, method_tid = map(int, driver.expect("ready", 120))
        driver.tree = _tree(driver.pid)
        processes = {driver.pid: "driver"}
        for p in driver.tree:
            cmd = " ".join(p.cmdline())
            processes[p.pid] = ("worker" if p.pid == worker_pid else "registry"
                                if "aiorl.registry" in cmd else "zygote"
                                if "aiorl.node.zygote" in cmd else "agent"
                                if "aiorl.node.agent" in cmd else cmd)
        assert sorted(processes.values()) == ["agent", "driver", "registry", "worker", "zygote"]
        takers = []
        for pid, kind in processes.items():
            assert _blocked_bits(pid) & SHIELDED_BITS == 0, f"the {kind}'s main thread blocks them"
            for tid in _threads(pid):
                if tid == pid or (pid == worker_pid and tid == method_tid):
                    continue
                if _blocked_bits(pid, tid) & SHIELDED_BITS != SHIELDED_BITS:
                    takers.append(f"{kind} thread {tid} ({_comm(pid, tid)})")
        assert not takers, f"threads other than the main one take SIGINT/SIGTERM: {takers}"
        # The method thread keeps the default mask (documented in aiorl.util.threads).
        assert _blocked_bits(worker_pid, method_tid) & SHIELDED_BITS == 0
        driver.send("wait")
        driver.expect("waiting", 30)
        os.kill(driver.pid, signal.SIGINT)
        driver.expect("interrupted", 30)
    finally:
        driver.finish()
    assert driver.proc.returncode == 0, driver.stacks()


@contextmanager
def _busy_cpus() -> Iterator[None]:
    """One spinning process per CPU (what ``tests/stress.py`` does to the whole suite)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(max(os.cpu_count() or 2, 2))]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _waiting_in_the_kernel(pid: int, within: float = 10.0) -> None:
    """Until the main thread of ``pid`` sleeps in a futex (its lock wait), where only a
    signal it takes itself would wake it (``/proc/PID/wchan``; not checked if hidden)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read()
        if "futex" in wchan or wchan in ("", "0"):
            return
        time.sleep(0.005)
    raise AssertionError(f"the driver's main thread is not waiting on a lock: {wchan}")


ROUNDS = 10


@pytest.mark.timeout(240)
@pytest.mark.parametrize("imports", ["aiorl", "numpy"])
def test_ctrl_c_reaches_a_waiting_driver_every_time_on_a_busy_machine(tmp_path, imports) -> None:
    """Each round, while spinning processes keep every CPU busy: the driver's main thread
    waits on a long call, then gets SIGINT and, right after it, SIGUSR2 (handled). The
    second signal finds the main thread woken but not yet run, so the kernel hands it to
    another thread, which takes the lowest pending one, SIGINT, if it does not block it:
    the main thread's wait then never ended (before aiorl's threads blocked it, and with
    numpy imported by aiorl on the main thread: OpenBLAS's pool took it). With "numpy"
    the program imports numpy itself first, so OpenBLAS's threads take SIGINT now and then:
    the main thread's wait in aiorl, in slices, still raises within a slice."""
    driver = _Driver(tmp_path, *(["numpy"] if imports == "numpy" else []))
    try:
        driver.expect("ready", 120)
        driver.tree = _tree(driver.pid)
        latencies = []
        with _busy_cpus():
            for _ in range(ROUNDS):
                driver.send("wait")
                driver.expect("waiting", 30)
                _waiting_in_the_kernel(driver.pid)
                sent = time.monotonic()
                os.kill(driver.pid, signal.SIGINT)
                os.kill(driver.pid, signal.SIGUSR2)
                driver.expect("interrupted", 10)
                latencies.append(time.monotonic() - sent)
        assert max(latencies) < 10, latencies
    finally:
        driver.finish()
    assert driver.proc.returncode == 0, driver.stacks()
