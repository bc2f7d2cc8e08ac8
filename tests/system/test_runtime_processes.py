"""Hardening of the runtime's own processes and peer resolution (issue: hardening, items 4 and 6).

Each test here failed before its fix, with real processes:
- ten concurrent first calls to one worker: nine waited 60 s for a watch that was overwritten;
- an embedded Cluster made in a short-lived thread: its agent died with the thread
  (a parent-death signal follows the creating thread, not the process);
- a SIGKILLed driver left its embedded registry running forever.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import aiorl

pytestmark = pytest.mark.timeout(90)


class Target(aiorl.Worker):
    def echo(self, x: int) -> int:
        return x


class Caller(aiorl.Worker):
    async def fan_in(self, target: str, n: int) -> list[int]:
        calls = [self._runtime.call_worker(target, "echo", i) for i in range(n)]
        return list(await asyncio.wait_for(asyncio.gather(*calls), 20))


def test_ten_concurrent_first_calls_to_one_worker_are_all_answered(cluster):
    target = Target.create_group().launch(cluster, name="fanin-target")
    caller = Caller.create_group().launch(cluster, name="fanin-caller")
    try:
        target.wait_ready(30)
        started = time.monotonic()
        assert caller.fan_in("fanin-target:0", 10).wait(30) == [list(range(10))]
        assert time.monotonic() - started < 10
    finally:
        caller.close()
        target.close()


def test_cluster_created_in_a_short_lived_thread_outlives_the_thread():
    made: list[aiorl.Cluster] = []
    thread = threading.Thread(target=lambda: made.append(aiorl.Cluster(num_nodes=1)))
    thread.start()
    thread.join(60)
    (cluster,) = made
    try:
        time.sleep(0.5)  # a thread-bound death signal would have fired by now
        group = Target.create_group().launch(cluster, name="after-thread")
        assert group.echo(7).wait(30) == [7]
        group.close()
    finally:
        cluster.close()


def test_embedded_processes_exit_when_the_driver_is_killed():
    script = textwrap.dedent("""
        import time, aiorl
        cluster = aiorl.Cluster(num_nodes=1)
        print("READY", flush=True)
        time.sleep(120)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert driver.stdout is not None
        assert driver.stdout.readline().strip() == b"READY"
        children = psutil.Process(driver.pid).children(recursive=True)
        assert len(children) >= 3  # registry, agent, zygote
        driver.kill()
        driver.wait()
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        if driver.stdout is not None:
            driver.stdout.close()


def test_held_requests_that_cannot_leave_are_reported_not_dropped():
    """Requests held to the end of a loop turn and then refused by libzmq (a DEALER whose
    connection was dropped after a failed handshake has nowhere to send) reach the owner's
    ``on_send_failed``, which fails what waits on them; they were dropped silently, and
    their callers waited until a timeout, if any."""
    import zmq

    from aiorl.transport.connection import ZmqLink
    from aiorl.transport.sockets import make_socket

    async def main() -> list[BaseException]:
        sock = make_socket(zmq.DEALER, identity=b"held-test", keys=None)  # never connected
        failures: list[BaseException] = []
        watched = ZmqLink(sock, lambda frames: None, asyncio.get_running_loop(),
                           on_send_failed=failures.append)
        try:
            with pytest.raises(zmq.Again):
                watched.send([b"first"])  # the turn's first message leaves (and fails) at once
            watched.send([b"second"])  # held until the turn ends
            watched.send([b"third"])
            for _ in range(3):
                await asyncio.sleep(0)
        finally:
            watched.close()
        return failures

    failures = asyncio.run(main())
    assert len(failures) == 1 and isinstance(failures[0], zmq.Again)
