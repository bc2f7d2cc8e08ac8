"""A newcomer's fourth round: what got in the way of a new user porting a Ray program and
writing an RL pipeline from the docs alone.

Each test drives real processes (a driver script, an embedded cluster, the CLI), because the
failures were in what starts where: the directory a driver runs in, a port nobody listens on,
a consumer killed mid-run.
"""

from __future__ import annotations

import asyncio
import glob
import os
import pathlib
import pty
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest

import aiorl
from aiorl.cluster.driver import probe_tcp
from aiorl.util.processes import python_module_command
from tests._paths import REPO_ROOT
from tests._processes import gone_within

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
    # A host that does not answer: a listener whose accept queue is full drops new SYNs, so
    # the connect gets no answer at all, as from a host that is down or filtered.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        waiting = [socket.socket() for _ in range(3)]
        try:
            for s in waiting:
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))  # fills the queue; the rest go unanswered
            assert asyncio.run(probe_tcp(f"tcp://127.0.0.1:{port}", within=0.3)) == "silent"
        finally:
            for s in waiting:
                s.close()


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
        # Until both rollouts wait (the second may block in put a moment after the first).
        while sum("is dead" in w for w in report.dead_peer_waits) < 2:
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


# ---------------------------------------------------------------------------- Ray habits
class Member(aiorl.Worker):
    def __init__(self, seed: int = 0, scale: int = 1) -> None:
        super().__init__()
        self.seed, self.scale = seed, scale

    def whoami(self) -> int:
        return self.rank

    def drawn(self) -> tuple[int, int]:
        return self.seed, self.scale

    def ask(self, other: Any, rank: int) -> int:
        return other.execute_on(rank).whoami().wait_one(30)

    async def ask_async(self, other: Any) -> list[int]:
        return await other.whoami()

    def ask_view(self, view: Any) -> list[int]:
        return view.whoami().wait(30)


@pytest.fixture(scope="module")
def cluster() -> Iterator[aiorl.Cluster]:
    with aiorl.Cluster(num_nodes=1) as c:
        yield c


@pytest.fixture(scope="module")
def members(cluster: aiorl.Cluster) -> Iterator[aiorl.WorkerGroup[Member]]:
    group = Member.create_group().launch(cluster, num_workers=3, name="member")
    group.wait_ready(120)
    yield group
    group.close()


def test_ray_spellings_are_answered_with_aiorls(members: Any) -> None:
    with pytest.raises(TypeError, match=r"group.whoami.remote\(...\) is Ray's spelling: in "
                                        r"aiorl call group.whoami\(...\) directly"):
        members.whoami.remote(5)
    with pytest.raises(AttributeError, match=r"has no \.remote \(Ray's spelling\)"):
        members.remote(5)
    with pytest.raises(TypeError, match=r"Member.remote\(0\) is Ray's spelling: in aiorl, "
                                        r"Member.create_group\(0\).launch\(cluster, "):
        Member.remote(0)
    work = members.whoami()
    for name in ("get", "result"):
        with pytest.raises(AttributeError, match=rf"an AsyncWork has no .{name}\(\): "
                                                 r"work.wait\(timeout\) blocks"):
            getattr(work, name)()
    assert work.wait(30) == [0, 1, 2]
    with pytest.raises(AttributeError, match="'AsyncWork' object has no attribute 'nope'"):
        work.nope  # noqa: B018 - the attribute access is the test


def test_indexing_a_group_is_execute_on(members: Any) -> None:
    assert members[1] is members.execute_on(1)
    assert members[2].whoami().wait_one(30) == 2
    with pytest.raises(IndexError, match="rank 7 is not a member of group member"):
        members[7]  # noqa: B018
    with pytest.raises(TypeError, match=r"group.execute_on\(0, 3\)"):
        members[0:2]  # noqa: B018


def test_a_group_handle_passed_to_a_worker_arrives_as_its_own_handle(cluster: Any,
                                                                    members: Any) -> None:
    """Ray users pass actor handles to other actors: the handle used to fail to pickle
    ("cannot pickle '_thread.lock' object")."""
    asker = Member.create_group().launch(cluster, num_workers=1, name="asker")
    try:
        assert asker.ask(members, 2).wait_one(60) == 2
        assert asker.ask_async(members).wait_one(60) == [0, 1, 2]
        assert asker.ask_view(members.execute_on(2, 0)).wait_one(60) == [2, 0]
    finally:
        asker.close()


def test_per_rank_constructor_arguments_in_one_call(cluster: Any) -> None:
    """Ray's [P.remote(seed) for seed in seeds]: each actor its own seed. P.create_group(0)
    gave every rank the same, in silence."""
    group = Member.create_group(aiorl.PerRank([10, 20, 30]), scale=aiorl.PerRank(range(3))
                                ).launch(cluster, num_workers=3, name="seeded")
    try:
        assert group.drawn().wait(60) == [(10, 0), (20, 1), (30, 2)]
    finally:
        group.close()
    with pytest.raises(ValueError, match=r"Member.create_group\(...\): scale= is a PerRank of "
                                         r"2 value\(s\) and the launch places 3 rank\(s\)"):
        Member.create_group(scale=aiorl.PerRank([1, 2])).launch(cluster, num_workers=3)
    with pytest.raises(ValueError, match="give one value per rank"):
        aiorl.PerRank([])


def test_the_coming_from_ray_page_shows_the_new_rows() -> None:
    page = (REPO_ROOT / "docs" / "coming-from-ray.md"
            ).read_text()
    assert "| a constructor argument per actor: `[P.remote(seed) for seed in seeds]` | " \
           "`P.create_group(aiorl.PerRank(seeds)).launch(cluster, num_workers=len(seeds))`" in page
    assert "`group[3].method(x)`, the same as `group.execute_on(3).method(x)`" in page
    assert "actor handle passed to another actor: `b.use.remote(a)` | `b.use(a)`" in page


# ---------------------------------------------------------------------------- status --watch
def test_status_watch_in_a_terminal_without_rich(cluster: aiorl.Cluster, members: Any,
                                                 tmp_path: pathlib.Path) -> None:
    """``rich`` is not a dependency: ``aiorl status --watch`` in a terminal crashed with
    ModuleNotFoundError after the documented install. It draws a plain table instead."""
    hidden = tmp_path / "no-rich" / "rich"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'rich'\")\n")
    key_file = cluster._embedded.key_file if cluster._embedded and cluster.keys else None
    extra = ["--key-file", key_file] if key_file else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(hidden.parent), os.environ.get("PYTHONPATH")]))}
    main, terminal = pty.openpty()
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "aiorl.cli.main", "status", "--watch", "--count", "2",
             "--interval", "0.3", "--registry", cluster.registry_address, *extra],
            stdout=terminal, stderr=subprocess.PIPE, env=env)
        os.close(terminal)
        terminal = -1
        chunks = []
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        _, stderr = child.communicate(timeout=60)
    finally:
        os.close(main)
        if terminal >= 0:
            os.close(terminal)
    out = b"".join(chunks).decode()
    assert child.returncode == 0, stderr.decode()[-3000:]
    assert "ModuleNotFoundError" not in stderr.decode()
    assert out.count("\x1b[H\x1b[2J") == 2, out  # redrawn in place, once per refresh
    assert "member:1" in out and "calls/s" in out, out


# ---------------------------------------------------------------------------- noise
_UNWAITED = textwrap.dedent("""\
    import time
    import aiorl

    class Slow(aiorl.Worker):
        def slow(self):
            time.sleep(60)

    with aiorl.Cluster(num_nodes=1) as cluster:
        group = Slow.create_group().launch(cluster, num_workers=1, name="slow")
        group.wait_ready(60)
        group.slow()            # nobody waits on it: failed by the close below
        group.slow()
    import gc
    gc.collect()
    print("done", flush=True)
""")


def test_a_call_nobody_waited_on_is_quiet_when_its_cluster_closes(tmp_path) -> None:
    """It printed "Future exception was never retrieved ... this Cluster is closed" at exit:
    the program closed the Cluster itself, so that failure tells it nothing."""
    script = tmp_path / "unwaited.py"
    script.write_text(_UNWAITED)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-3000:]
    assert "never retrieved" not in out.stderr, out.stderr
    assert "PeerLostError" not in out.stderr, out.stderr


_INTERRUPTED = textwrap.dedent("""\
    import faulthandler, signal, time
    import aiorl

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view when stuck

    class Idle(aiorl.Worker):
        def ping(self):
            return 1

    with aiorl.Cluster(num_nodes=1) as cluster:
        group = Idle.create_group().launch(cluster, num_workers=1, name="idle")
        group.ping().wait(60)
        try:  # "ready" inside: the test's Ctrl-C may come as soon as it is read
            print("ready", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:  # stopping takes a moment, as aiorl demo's does
            print("interrupted", flush=True)
            time.sleep(1)
            group.close()
""")


def test_ctrl_c_in_a_terminal_reaches_the_driver_alone(tmp_path) -> None:
    """A terminal's Ctrl-C signals its whole foreground process group. The embedded registry
    was in it, exited first, and the driver logged "the embedded registry ... exited with
    code 0: closing the Cluster" while stopping as asked."""
    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED)
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert driver.stdout is not None
        assert driver.stdout.readline().strip() == "ready"
        os.killpg(driver.pid, signal.SIGINT)  # what the terminal does
        try:
            out, err = driver.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            driver.send_signal(signal.SIGUSR1)  # every thread's stack, then the failure
            time.sleep(2)
            driver.kill()
            out, err = driver.communicate()
            raise AssertionError(f"the driver did not stop within 60 s of Ctrl-C; its "
                                 f"stdout:\n{out}\nits threads:\n{err}") from None
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    assert driver.returncode == 0 and "interrupted" in out, err
    assert "embedded registry" not in err and "closing the Cluster" not in err, err


def test_a_channel_client_leaving_with_nothing_in_flight_is_not_a_warning(caplog) -> None:
    """Every worker death logged "re-queueing 0 undelivered answer(s)" in the channel's host."""
    from aiorl.channels.host import ChannelServer

    class Endpoint:
        loop = asyncio.new_event_loop()

        def handle(self, op: Any, fn: Any) -> None:
            pass

    endpoint = Endpoint()
    try:
        server = ChannelServer(endpoint, "quiet")  # type: ignore[arg-type]
        with caplog.at_level("DEBUG", logger="aiorl"):
            server._client_gone(b"gone", [])
        assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    finally:
        endpoint.loop.close()


# ---------------------------------------------------------------------------- leftovers
class Pinger(aiorl.Worker):
    def ping(self) -> int:
        return os.getpid()


def test_a_killed_agents_lanes_are_removed_by_aiorl_status(monkeypatch) -> None:
    """A SIGKILLed ``aiorl-node`` cannot remove its directory: its lane sockets stayed in the
    temp directory for ever. ``aiorl status`` (and the next agent) removes them; the worker
    logs stay for a post-mortem, the newest few only."""
    base = tempfile.mkdtemp(prefix="r4-", dir="/tmp")  # short: a runtime dir must be <= 70
    monkeypatch.setenv("XDG_RUNTIME_DIR", base)
    monkeypatch.setenv("AIORL_INSECURE", "1")
    env = {**os.environ}
    registry = subprocess.Popen(
        [sys.executable, "-m", "aiorl.registry.service", "--host", "127.0.0.1", "--port", "0",
         "--print-address", "--insecure", "--exit-on-stdin-close"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    agent = None
    try:
        assert registry.stdout is not None
        address = registry.stdout.readline().decode().strip().split("=", 1)[1]
        agent = subprocess.Popen(
            [sys.executable, "-m", "aiorl.node.agent", "--registry", address, "--insecure",
             "--log-level", "WARNING"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        assert agent.stdout is not None
        assert agent.stdout.readline().decode().startswith("AIORL_NODE_READY=")
        with aiorl.Cluster(registry=address) as cluster:
            group = Pinger.create_group().launch(cluster, num_workers=1, name="pinger")
            worker_pid = group.ping().wait_one(60)
            (log_dir,) = glob.glob(os.path.join(base, f"aiorl-node-logs-{os.getuid()}",
                                                f"{agent.pid}-*"))
            lanes = os.path.join(log_dir, "lanes")
            assert glob.glob(os.path.join(lanes, "*")), "the worker made no lane"
            agent.kill()
            agent.wait(30)
            assert gone_within([worker_pid], 30)  # its workers die with it
        out = subprocess.run([sys.executable, "-m", "aiorl.cli.main", "status", "--registry",
                              address, "--timeout", "5"], capture_output=True, text=True,
                             timeout=60, env={**os.environ})
        assert out.returncode == 0, out.stderr
        assert not os.path.exists(lanes)
        assert os.path.isdir(log_dir) and glob.glob(os.path.join(log_dir, "*.log")), \
            "the worker logs are kept for a post-mortem"
    finally:
        for process in (agent, registry):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        for stream in (registry.stdin, registry.stdout, agent and agent.stdout):
            if stream:
                stream.close()
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------- the README
ROOT = REPO_ROOT


def test_the_readme_is_what_a_newcomer_needs_and_the_figures_moved_with_their_sources() -> None:
    readme = (ROOT / "README.md").read_text()
    venv, demo = readme.index("python3 -m venv .venv"), readme.index("make demo")
    assert venv < demo, "the fresh venv comes before the commands that install into it"
    assert "create_group(64)" not in readme  # read as a group size: the argument is named
    assert "create_group(hidden=64)" in readme
    assert len(readme.splitlines()) <= 150, "performance history belongs in docs/benchmarks.md"
    assert "docs/benchmarks.md" in readme
    assert "benchmarks.md" in (ROOT / "mkdocs.yml").read_text()
    page = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    tables = [i for i, line in enumerate(page)
              if line.startswith("|---") and not page[i - 2].startswith("|")]
    assert len(tables) >= 8
    for i in tables:  # each table's figures say which script printed them
        before = "\n".join(page[max(0, i - 16):i])
        scripts = re.findall(r"benchmarks/(\w+\.py)|(bench_\w+\.py)|make (gpu-check)", before)
        assert scripts, f"docs/benchmarks.md line {i}: a table with no script named above it"
        for found in scripts:
            name = next(x for x in found if x)
            assert name == "gpu-check" or (ROOT / "benchmarks" / name).exists(), name
