"""A newcomer's fourth round: what got in the way of a new user porting a Ray program and
writing an RL pipeline from the docs alone.

Each test drives real processes (a driver script, an embedded cluster, the CLI), because the
failures were in what starts where: the directory a driver runs in, a port nobody listens on,
a consumer killed mid-run.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import aiorl
from aiorl.cluster.driver import probe_tcp
from aiorl.util.processes import python_module_command

pytestmark = pytest.mark.timeout(120)

_BASE_MODULE = textwrap.dedent("""\
    import aiorl

    class Base(aiorl.Worker):
        def hello(self):
            return "base"
""")

_DRIVER = textwrap.dedent("""\
    import aiorl
    from r4_base import Base

    class Child(Base):
        def where(self):
            import aiorl
            return aiorl.__file__, self.hello()

    if __name__ == "__main__":
        with aiorl.Cluster(num_nodes=1) as cluster:
            group = Child.create_group().launch(cluster, num_workers=1, name="child")
            print("RESULT", *group.where().wait(60)[0], flush=True)
""")


def test_a_folder_named_aiorl_in_the_working_directory_does_not_replace_the_package(tmp_path):
    """Run from a directory holding an ``aiorl/`` folder (the clone's parent directory, or
    any empty one), every rank used to fail with "module 'aiorl' has no attribute
    'Worker'": ``python -m`` put that directory first in the agent, the zygote and so every
    worker, and the folder became the ``aiorl`` package."""
    scripts, cwd = tmp_path / "scripts", tmp_path / "cwd"
    (cwd / "aiorl").mkdir(parents=True)
    scripts.mkdir()
    (scripts / "r4_base.py").write_text(_BASE_MODULE)
    (scripts / "driver.py").write_text(_DRIVER)
    out = subprocess.run([sys.executable, str(scripts / "driver.py")], cwd=cwd,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert f"RESULT {aiorl.__file__} base" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.parametrize("interpreter", ["ours", "another"])
def test_a_module_command_leaves_the_working_directory_out_then_last(tmp_path, interpreter):
    """Both spellings (``-P`` for this interpreter, ``-c`` code for one that may be older)
    import the installed package, not a folder of its name in the working directory."""
    site, cwd = tmp_path / "site", tmp_path / "cwd"
    (cwd / "aiorl").mkdir(parents=True)
    site.mkdir()
    (site / "r4_probe.py").write_text(
        "import sys, aiorl\n"
        "from aiorl.node.zygote import working_directory_last\n"
        "working_directory_last()\n"
        "print(aiorl.__file__, sys.path[-1], sys.argv[1:])\n")
    python = None
    if interpreter == "another":  # a wrapper: a path that is not this interpreter's
        python = str(tmp_path / "python-wrapper")
        pathlib.Path(python).write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        os.chmod(python, 0o755)
    command = python_module_command("r4_probe", "x", "y", interpreter=python)
    assert ("-P" in command) == (interpreter == "ours" and sys.version_info >= (3, 11))
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [aiorl.__file__, str(cwd), "['x',", "'y']"]


# ---------------------------------------------------------------------------- a wrong port
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_port_nobody_listens_on_fails_in_seconds_naming_the_address() -> None:
    """ZMQ's connects retry in silence, so a wrong port used to look like a registry still
    starting: the driver waited its whole timeout (60 s by default)."""
    port = _free_port()
    started = time.monotonic()
    with pytest.raises(aiorl.RegistryUnavailable) as caught:
        aiorl.Cluster(registry=f"127.0.0.1:{port}", timeout=60)
    assert time.monotonic() - started <= 5
    assert f"nothing listens at tcp://127.0.0.1:{port}" in str(caught.value)
    assert "refused" in str(caught.value)


def test_a_port_that_accepts_but_does_not_answer_is_waited_for() -> None:
    """Something listens (a registry still starting, or under load): the driver waits its
    timeout, as for a host that does not answer at all."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # the kernel accepts; nothing ever answers
        port = listener.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(aiorl.RegistryUnavailable, match="no answer from .* within 4 s"):
            aiorl.Cluster(registry=f"127.0.0.1:{port}", timeout=4)
        assert time.monotonic() - started >= 4


def test_the_probe_tells_refused_from_accepted() -> None:
    async def probe(address: str) -> str:
        return await probe_tcp(address)

    assert asyncio.run(probe(f"tcp://127.0.0.1:{_free_port()}")) == "refused"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        assert asyncio.run(probe(f"tcp://127.0.0.1:{listener.getsockname()[1]}")) == "accepted"
    assert asyncio.run(probe("ipc:///nowhere")) == "silent"


# ---------------------------------------------------------------------------- the doctor
class Rollout(aiorl.Worker):
    def fill(self, n: int) -> None:
        channel = self.connect_channel("r4-rollouts")
        for i in range(n):  # blocks once the channel is full and nobody takes
            channel.put(i, async_op=False)
        channel.flush().wait(300)


class Learner(aiorl.Worker):
    async def take(self, n: int) -> int:
        channel = self.connect_channel("r4-rollouts")
        for _ in range(n):
            await channel.get()
        return os.getpid()


def test_the_doctor_names_a_dead_sole_consumer_with_blocked_producers() -> None:
    """The learner (the only consumer) is SIGKILLed; the rollouts wait in ``put`` for ever.
    The doctor used to say "no wait on a dead peer" while listing the putters waiting."""
    with aiorl.Cluster(num_nodes=1) as cluster:
        aiorl.Channel.create(cluster, "r4-rollouts", maxsize=4)
        rollouts = Rollout.create_group().launch(cluster, num_workers=2, name="rollout")
        learner = Learner.create_group().launch(cluster, num_workers=1, name="learner")
        filling = rollouts.fill(20)  # the learner takes 2, 4 more fit: both ranks then wait
        pid = learner.take(2).wait(60)[0]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        report = cluster.doctor()
        while not any("is dead" in w for w in report.dead_peer_waits):
            assert time.monotonic() < deadline, aiorl.cluster.doctor.format_report(report)
            time.sleep(0.3)  # the state forms in other processes: polled, briefly
            report = cluster.doctor()
        assert report.exit_code == 1
        texts = sorted(report.dead_peer_waits)
        assert [t.split(" waits")[0] for t in texts] == ["rollout:0", "rollout:1"], texts
        for text in texts:
            assert "put on channel 'r4-rollouts'" in text, text
            assert "which is full and has no consumer alive (learner:0 is dead)" in text, text
        assert "consumers: learner:0" in aiorl.cluster.doctor.format_report(report)
        assert not filling.done()
