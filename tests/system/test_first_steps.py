"""A newcomer's path (issue 18): the interfaces users reach for first, and errors that teach.

Each error test asserts the message text, because the message is the interface here: it must
say what went wrong and what to write instead.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

import aiorl
from aiorl.cluster.embedded import running_embedded_clusters, runtime_files_dir
from aiorl.group.group import _strategy
from aiorl.placement import ClusterSpec, ComponentPlacement, NodePlacementStrategy
from aiorl.runtime.session import WorkerSession
from aiorl.transport.security import ClusterKeys
from tests._paths import REPO_ROOT

pytestmark = pytest.mark.timeout(90)


class Reward(aiorl.Worker):
    def score(self, x: int) -> int:
        return x * 10 + self.rank

    def pid(self) -> int:
        return os.getpid()

    def lookup(self, key: str) -> Any:
        return {}[key]

    def devices(self) -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    async def forgot_await(self) -> Any:
        return self.recv("nobody", 0)  # an AsyncWork, returned instead of awaited

    async def forgot_to_await_a_receive(self, src_rank: int) -> Any:
        return self.recv("reward", src_rank)  # posted, returned instead of awaited

    async def send_to(self, obj: Any, dst_rank: int) -> None:
        await self.send(obj, "reward", dst_rank)

    async def receive_from(self, src_rank: int) -> Any:
        return await self.recv("reward", src_rank)

    async def launch_again(self) -> None:
        session = WorkerSession.current()
        await session.refresh()
        await Reward.create_group().launch_async(session, name="reward")


class Trainer(aiorl.Worker):
    def __init__(self) -> None:
        super().__init__()
        self.reward = self.group("reward")  # __init__ runs on the method thread: it may wait

    def step(self, x: int) -> int:
        result: list[int] = self.reward.execute_on(1).score(x).wait(30)
        return result[0]

    async def astep(self, x: int) -> list[int]:
        reward = await self.async_group("reward", Reward)
        result: list[int] = await reward.score(x)
        return result

    async def group_on_the_loop(self) -> None:
        self.group("reward")

    def misspelt(self) -> Any:
        return self.reward.scroe(1).wait(30)


@contextlib.contextmanager
def registry_on(key: pathlib.Path) -> Iterator[str]:
    """A registry process with ``key`` (made if missing) on a free port; its address. Killed
    after, its pipes closed."""
    registry = subprocess.Popen(
        [sys.executable, "-m", "aiorl.registry.service", "--host", "127.0.0.1", "--port", "0",
         "--print-address", "--key-file", str(key), "--exit-on-stdin-close"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert registry.stdout is not None
        yield registry.stdout.readline().decode().strip().split("=", 1)[1]
    finally:
        registry.kill()
        registry.wait()
        for stream in (registry.stdin, registry.stdout):
            if stream:
                stream.close()


@pytest.fixture(scope="module")
def cluster():
    with aiorl.Cluster(num_nodes=1, accelerators_per_node=4) as c:
        yield c


@pytest.fixture(scope="module")
def reward(cluster):
    group = Reward.create_group().launch(cluster, name="reward", num_workers=2)
    yield group
    group.close()


# ---------------------------------------------------------------------------- placement
def test_num_workers_and_placement_strings_launch(cluster, reward) -> None:
    assert reward.world_size == 2
    assert reward.devices().wait(60) == ["0", "1"]  # one declared accelerator each
    trainer = Trainer.create_group().launch(cluster, "2-3", name="trainer-placed")
    try:
        assert trainer.world_size == 2
        assert trainer.step(1).wait(60) == [11, 11]
    finally:
        trainer.close()


def test_num_workers_spreads_cpu_workers_over_nodes_in_blocks() -> None:
    strategy = _strategy(ClusterSpec(2), None, 5, "g")
    assert [p.node_rank for p in strategy.get_placement(ClusterSpec(2))] == [0, 0, 0, 1, 1]
    gpus = _strategy(ClusterSpec(2, accelerators_per_node=4), None, 6, "g")
    placed = gpus.get_placement(ClusterSpec(2, accelerators_per_node=4))
    assert [(p.node_rank, p.visible_accelerators) for p in placed][4:] == [(1, ["0"]), (1, ["1"])]


def test_placement_mistakes_say_what_to_pass() -> None:
    spec = ClusterSpec(1, accelerators_per_node=4)
    with pytest.raises(aiorl.PlacementError, match="num_workers=5 asks for one accelerator per "
                       "worker, and the cluster declares 4; for CPU workers pass "
                       r"NodePlacementStrategy"):
        _strategy(spec, None, 5, "g")
    with pytest.raises(TypeError, match=r"placement string such as '0-3', or None; got list"):
        _strategy(spec, [0, 1], None, "g")
    cp = ComponentPlacement({"cluster": {"component_placement": {"actor": "0-3"}}}, spec)
    with pytest.raises(TypeError, match=r"pass placement.get_strategy\('component'\)"):
        _strategy(spec, cp, None, "g")
    with pytest.raises(TypeError, match="give placement_strategy or num_workers, not both"):
        _strategy(spec, NodePlacementStrategy([0]), 2, "g")
    with pytest.raises(aiorl.PlacementError, match=r"'0-9': .*out of range.*in placement '0-9', "
                       "group 'g'"):
        _strategy(spec, "0-9", None, "g").get_placement(spec)


# ---------------------------------------------------------------------------- worker -> group
def test_a_worker_calls_another_group_by_name(cluster, reward) -> None:
    trainer = Trainer.create_group().launch(cluster, NodePlacementStrategy([0]), name="trainer")
    try:
        assert trainer.step(4).wait(60) == [41]
        assert trainer.astep(5).wait(60) == [[50, 51]]
        with pytest.raises(RuntimeError, match=r"use `await self.async_group\('reward'\)`"):
            trainer.group_on_the_loop().wait(30)
        # Without the class, any public name is sent; a misspelt one fails in the worker.
        with pytest.raises(AttributeError, match="scroe"):
            trainer.misspelt().wait(30)
    finally:
        trainer.close()


# ---------------------------------------------------------------------------- errors
def test_a_remote_key_error_is_a_key_error_and_keeps_its_traceback(reward) -> None:
    with pytest.raises(KeyError) as info:
        reward.execute_on(1).lookup("missing").wait(30)
    err = info.value
    assert isinstance(err, aiorl.RemoteError)
    assert err.rank == 1 and err.exc_type == "builtins.KeyError"
    assert "in lookup" in err.remote_traceback and "return {}[key]" in err.remote_traceback


def test_an_unawaited_asyncwork_can_be_neither_returned_nor_sent(reward) -> None:
    with pytest.raises(aiorl.RemoteError, match="did you forget `await`"):
        reward.forgot_await().wait(30)
    pending = reward.score(1)
    with pytest.raises(TypeError, match="cannot be returned from a worker method or sent: .* "
                       "did you forget `await`"):
        reward.score(pending)
    pending.wait(30)


def test_a_receive_returned_unawaited_consumes_nothing(reward) -> None:
    """The worker answers "did you forget await" and cancels the receive it returned: the
    next message from that sender goes to the next receive, not to the forgotten one."""
    with pytest.raises(aiorl.RemoteError, match="did you forget `await`"):
        reward.execute_on(0).forgot_to_await_a_receive(1).wait(30)
    reward.execute_on(1).send_to("first", 0).wait(30)
    assert reward.execute_on(0).receive_from(1).wait(20) == ["first"]


def test_a_duplicate_group_name_is_a_value_error(cluster, reward) -> None:
    with pytest.raises(aiorl.GroupExistsError, match="a worker group named 'reward' already "
                       "exists") as info:
        Reward.create_group().launch(cluster, name="reward")
    assert isinstance(info.value, ValueError)
    with pytest.raises(aiorl.GroupExistsError, match="'reward' already exists"):
        reward.execute_on(0).launch_again().wait(30)  # the same from inside a worker


def test_aiorl_status_finds_the_embedded_cluster(cluster, reward) -> None:
    reward.wait_ready(60)
    mine = [e for e in running_embedded_clusters() if e.pid == os.getpid()]
    assert [e.registry for e in mine] == [cluster.registry_address]
    path = cluster._embedded.runtime_file
    assert os.path.dirname(path) == runtime_files_dir()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(runtime_files_dir()).st_mode) == 0o700
    env = {k: v for k, v in os.environ.items() if k != "AIORL_REGISTRY"}
    # Other programs of this user may run embedded clusters too: name ours.
    out = subprocess.run([sys.executable, "-m", "aiorl.cli.main", "status", "--pid",
                          str(os.getpid())], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"registry {cluster.registry_address}" in out.stdout
    assert "reward:1" in out.stdout and "ready" in out.stdout


def test_a_closed_cluster_fails_at_once_and_forgets_its_runtime_file() -> None:
    c = aiorl.Cluster(num_nodes=1)
    path = c._embedded.runtime_file if c._embedded else None
    c.close()
    assert path is not None and not os.path.exists(path)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"this Cluster is closed .* create a new "
                       r"aiorl.Cluster\(\)"):
        Reward.create_group().launch(c, name="late")
    assert time.monotonic() - started < 1
    assert "closed" in repr(c)


def test_wrong_key_and_wrong_address_are_told_apart(tmp_path) -> None:
    key = tmp_path / "cluster.key"
    with registry_on(key) as address:
        other = tmp_path / "other.key"
        ClusterKeys.generate().save(str(other))

        def status(*args: str, timeout: int = 10, **env: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "aiorl.cli.main", "status", "--registry", address,
                 "--timeout", str(timeout), *args], capture_output=True, text=True, timeout=60,
                env={**os.environ, **env})

        assert status("--key-file", str(key)).returncode == 0
        # A CURVE key mismatch is silence to the client: it cannot tell it from a wrong address.
        wrong = status("--key-file", str(other), timeout=2)
        assert wrong.returncode == 1
        assert f"no answer from {address} to 'status' within 2 s (wrong address, or a key " \
               "mismatch" in wrong.stderr
        missing = status(AIORL_INSECURE="1")  # no key: the registry refuses, and we know it
        assert f"{address} refused 'status': wrong or missing key" in missing.stderr


# ---------------------------------------------------------------------------- nothing left
DRIVER = textwrap.dedent("""
    import aiorl

    class Idle(aiorl.Worker):
        def ping(self):
            return 1

    cluster = aiorl.Cluster(num_nodes=1)
    Idle.create_group().launch(cluster, num_workers=2, name="idle").ping().wait(60)
    print("ready", flush=True)
    import time
    time.sleep(120)
""")


def test_sigkill_of_an_embedded_driver_leaves_no_process_behind() -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE)
    try:
        assert driver.stdout is not None
        assert driver.stdout.readline().strip() == b"ready"
        descendants = psutil.Process(driver.pid).children(recursive=True)
        kinds = " ".join(" ".join(p.cmdline()) for p in descendants)
        assert "aiorl.registry" in kinds and "aiorl.node.agent" in kinds
        assert len(descendants) >= 5  # registry, agent, zygote, two workers
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        gone, alive = psutil.wait_procs(descendants, timeout=10)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
        # Its runtime file outlived it; the next reader (maybe another program's) removes it.
        assert driver.pid not in [e.pid for e in running_embedded_clusters()]
        assert not glob.glob(os.path.join(runtime_files_dir(), f"{driver.pid}-*.json"))
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        if driver.stdout:
            driver.stdout.close()



def test_node_agent_logs_live_under_one_bounded_directory(monkeypatch, tmp_path) -> None:
    """``aiorl-node`` without ``--log-dir``: one per-user parent; ended agents' directories
    beyond the newest few are removed by the next agent (a killed agent cannot clean up)."""
    from aiorl.node import agent

    base = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # short and private, as a runtime dir
    monkeypatch.setenv("XDG_RUNTIME_DIR", base)
    try:
        parent = os.path.join(base, f"aiorl-node-logs-{os.getuid()}")
        os.makedirs(parent, mode=0o700)
        dead = [os.path.join(parent, f"{pid}-x") for pid in range(2**22 + 1, 2**22 + 8)]
        for age, path in enumerate(dead):  # the first is the newest
            os.mkdir(path)
            os.utime(path, (time.time() - age * 60, time.time() - age * 60))
        live = os.path.join(parent, f"{os.getpid()}-live")
        os.mkdir(live)
        mine = agent.default_log_dir()
        assert os.path.dirname(mine) == parent and os.path.basename(mine).startswith(
            f"{os.getpid()}-")
        assert stat.S_IMODE(os.stat(mine).st_mode) == 0o700
        kept = sorted(os.listdir(parent))
        assert kept == sorted([os.path.basename(p) for p in dead[:agent.KEPT_ENDED_AGENT_LOGS]]
                              + [f"{os.getpid()}-live", os.path.basename(mine)])
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_an_agent_starts_while_another_removes_old_log_directories(monkeypatch) -> None:
    """Two agents starting together on one node both prune ended agents' directories: one that
    the other removed between the listing and the look is skipped, not a crash at start."""
    from aiorl.node import agent

    base = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    monkeypatch.setenv("XDG_RUNTIME_DIR", base)
    try:
        parent = os.path.join(base, f"aiorl-node-logs-{os.getuid()}")
        os.makedirs(parent, mode=0o700)
        raced = os.path.join(parent, f"{2**22 + 1}-raced")
        os.mkdir(raced)
        listdir = os.listdir

        def listdir_then_the_other_agent_removes(path: str) -> list[str]:
            names = listdir(path)
            if os.path.isdir(raced):
                os.rmdir(raced)  # the other agent, between our listing and our look
            return names

        monkeypatch.setattr(agent.os, "listdir", listdir_then_the_other_agent_removes)
        mine = agent.default_log_dir()
        assert os.path.dirname(mine) == parent
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------- documentation
def test_every_export_documents_itself_with_an_example() -> None:
    """Every class in ``aiorl.__all__`` has an example, and each public member it defines has
    a docstring (the API reference is generated from them)."""
    import inspect

    missing = []
    for name in aiorl.__all__:
        obj = getattr(aiorl, name)
        if "Example" not in (inspect.getdoc(obj) or ""):
            missing.append(f"{name}: no example")
        for member, value in vars(obj).items():
            if member.startswith("_"):
                continue
            fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if (callable(value) or isinstance(value, property)) and not fn.__doc__:
                missing.append(f"{name}.{member}: no docstring")
    assert not missing, missing


def test_the_api_reference_covers_every_export() -> None:
    root = REPO_ROOT / "docs" / "reference"
    text = (root / "api.md").read_text() + (root / "errors.md").read_text()
    missing = [name for name in aiorl.__all__ if f"::: aiorl.{name}\n" not in text]
    assert not missing, f"docs/reference does not render {missing}"


def test_every_export_documents_itself_in_the_style_the_site_renders() -> None:
    """The reference is rendered by mkdocstrings from Google-style Markdown docstrings: a
    Sphinx role (``:class:`X```) or an ``Example::`` literal block shows up as literal text
    on the site. Scans everything in ``aiorl.__all__``, every object the reference pages
    render (``::: name``), and the public members their classes define."""
    import importlib
    import inspect
    import re

    role = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`[^`]*`?")
    literal_example = re.compile(r"^\s*Examples?::\s*$", re.MULTILINE)
    root = REPO_ROOT / "docs" / "reference"
    rendered = re.findall(r"^::: ([\w.]+)$", "\n".join(
        page.read_text() for page in sorted(root.glob("*.md"))), re.MULTILINE)

    def resolve(path: str) -> Any:
        parts = path.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj: Any = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for part in parts[i:]:
                obj = getattr(obj, part)
            return obj
        raise ImportError(path)

    objects = {f"aiorl.{name}": getattr(aiorl, name) for name in aiorl.__all__}
    objects.update((path, resolve(path)) for path in rendered)
    offenders = []
    for path, obj in sorted(objects.items()):
        docs = {path: inspect.getdoc(obj)}
        if inspect.isclass(obj):
            for cls in obj.__mro__:
                if not cls.__module__.startswith("aiorl"):
                    continue
                for member, value in vars(cls).items():
                    if member.startswith("_"):
                        continue
                    fn = value.fget if isinstance(value, property) else getattr(
                        value, "__func__", value)
                    docs.setdefault(f"{path}.{member}", inspect.getdoc(fn)
                                    if callable(fn) or isinstance(value, property) else None)
        for where, doc in docs.items():
            for found in role.findall(doc or "") + literal_example.findall(doc or ""):
                offenders.append(f"{where}: {found.strip()}")
    assert not offenders, ("Sphinx markup the site shows as literal text; use [`X`][aiorl.X] "
                           "(or `X`) and an 'Example:' section with a fenced code block: "
                           + "; ".join(offenders))


def test_every_public_dotted_name_the_docs_use_resolves_after_import_aiorl() -> None:
    """`aiorl.weights.host_directory` in the docs raised AttributeError after `import aiorl`
    (the package exposed placement lazily, not weights). Every dotted name the docs use that
    starts with a public name of the package resolves from `import aiorl` alone (internal
    module paths, given for `python -m` or as logger names, are not the user's API)."""
    import re

    root = REPO_ROOT
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    public = set(aiorl.__all__) | {"placement", "weights"}
    missing = []
    for page in pages:
        for m in re.finditer(r"(?<![\w./-])aiorl(?:\.[A-Za-z_][A-Za-z0-9_]*)+", page.read_text()):
            parts = m.group(0).split(".")[1:]
            if parts[0] not in public:
                continue
            obj: Any = aiorl
            for part in parts:
                if not hasattr(obj, part):
                    missing.append(f"{m.group(0)} ({page.relative_to(root)})")
                    break
                obj = getattr(obj, part)
    assert not missing, "dotted names that do not resolve after `import aiorl`: " + \
        ", ".join(sorted(set(missing)))


def test_workers_are_named_after_themselves_in_ps_and_top(reward) -> None:
    """`ps` and `top` showed every worker as `python -m aiorl.node.zygote 26 <pid>`: a worker
    names its process after itself (as Ray shows `ray::Rollout`), keeping how it started."""
    for rank, pid in enumerate(reward.execute_on(0, 1).pid().wait(60)):
        process = psutil.Process(pid)
        title = " ".join(process.cmdline())
        assert title.startswith(f"aiorl::reward:{rank} (python -m aiorl.node."), title
        with open(f"/proc/{pid}/comm") as comm:  # top's short name: 15 characters
            assert comm.read().strip() == f"aiorl::reward:{rank}"[:15]
        # The environment the process started with stays readable (Slurm and tools find a
        # job's processes by it): the title did not take its room.
        assert process.environ().get("PATH") == os.environ["PATH"]


def test_an_argument_that_cannot_travel_is_named(reward) -> None:
    """The error named `tuple` (the call's arguments as a whole); it names the argument."""
    import threading

    with pytest.raises(TypeError, match=r"argument 0 of score\(\) cannot be serialized \(lock\): "
                       r"TypeError: cannot pickle '_thread.lock' object"):
        reward.score(threading.Lock())
    with pytest.raises(TypeError, match=r"keyword argument 'x' of score\(\)"):
        reward.score(x=threading.Lock())


def test_the_cli_options_say_what_they_do() -> None:
    def help_of(*command: str) -> str:
        return subprocess.run([sys.executable, "-m", "aiorl.cli.main", *command, "--help"],
                              capture_output=True, text=True, timeout=60, check=True).stdout

    assert "--key-file FILE" in help_of("demo")  # a demo attached to a cluster needs its key
    assert "seconds to wait for the registry's answer" in help_of("status")


def test_a_driver_with_the_wrong_key_is_told_so_at_once(tmp_path) -> None:
    """A wrong key and a wrong address both took 10 s and read alike. A CURVE key mismatch
    breaks every handshake, which the driver sees within about a second and names."""
    key, other = tmp_path / "cluster.key", tmp_path / "other.key"
    ClusterKeys.generate().save(str(key))
    ClusterKeys.generate().save(str(other))
    with registry_on(key) as address:
        script = textwrap.dedent(f"""\
            import time, aiorl
            started = time.monotonic()
            try:
                aiorl.Cluster(registry={address!r}, key_file={str(other)!r}, timeout=60)
            except aiorl.RegistryUnavailable as exc:
                print(round(time.monotonic() - started, 1), exc)
            """)
        env = {k: v for k, v in os.environ.items() if k != "AIORL_REGISTRY"}
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=90, env=env)
        seconds, _, message = out.stdout.strip().partition(" ")
        assert "answers but drops this driver at the handshake" in message, out
        assert "this process's key is not that cluster's" in message
        assert float(seconds) < 8, f"the key mismatch took {seconds} s to tell"
