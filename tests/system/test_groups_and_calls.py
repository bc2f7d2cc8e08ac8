"""The core runtime with real processes: groups, calls, errors, failures, attach mode."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

import aiorl
from aiorl.util.collector import YOUNG_THRESHOLD
from tests._processes import alive

pytestmark = pytest.mark.timeout(120)


class Echo(aiorl.Worker):
    """Defined in the test module: shipped to the workers by value."""

    def __init__(self, factor: int = 1) -> None:
        super().__init__()
        self.factor = factor
        self.calls: list[int] = []

    def scale(self, x: int) -> tuple[int, int]:
        return self.rank, x * self.factor

    async def name(self) -> str:
        return self.worker_name

    def env(self) -> dict[str, str]:
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_LOCAL_RANK",
                "NODE_LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"]
        return {k: os.environ[k] for k in keys if k in os.environ}

    def pid(self) -> int:
        return os.getpid()

    def record(self, i: int) -> None:
        self.calls.append(i)

    def recorded(self) -> list[int]:
        return self.calls

    def shout(self, word: str) -> None:
        print(word)

    def fail(self, message: str) -> None:
        raise KeyError(message)

    async def afail(self) -> None:
        raise ZeroDivisionError("async boom")

    async def sleep(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "slept"

    def block(self, seconds: float) -> str:
        time.sleep(seconds)
        return "blocked"

    async def bounded_before_first_await(self) -> bool:
        # asyncio.timeout()/wait_for() need a current task even before the first await.
        inside_task = asyncio.current_task() is not None
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(5):
                pass
        return inside_task

    def _private(self) -> None:
        pass


class BadInit(aiorl.Worker):
    def __init__(self) -> None:
        super().__init__()
        raise RuntimeError("cannot start: missing model file")

    def f(self) -> None:
        pass


def test_rank_ordered_results_sync_and_async(cluster):
    group = Echo.create_group(3).launch(
        cluster, aiorl.placement.NodePlacementStrategy([0, 0, 0, 0]), name="ordered")
    try:
        assert group.scale(2).wait(60) == [(r, 6) for r in range(4)]
        assert group.name().wait(10) == [f"ordered:{r}" for r in range(4)]

        async def from_coroutine():
            return await group.scale(1)

        assert asyncio.run(from_coroutine()) == [(r, 3) for r in range(4)]
    finally:
        group.close()


def test_async_method_runs_in_a_task_from_its_first_step(cluster):
    group = Echo.create_group().launch(cluster, name="eager")
    assert group.bounded_before_first_await().wait(30) == [True]
    group.close()


def test_execute_on_then_all_again(cluster):
    group = Echo.create_group().launch(
        cluster, aiorl.placement.NodePlacementStrategy([0] * 4), name="subset")
    try:
        assert group.execute_on(0, 3).scale(5).wait(60) == [(0, 5), (3, 5)]
        assert len(group.scale(1).wait(10)) == 4  # the next call goes to all ranks
        with pytest.raises(IndexError):
            group.execute_on(4)
        # A view is immutable and cached: holding one does not redirect the group's calls.
        view = group.on_ranks(2, 1)
        assert view is group.execute_on([2, 1]) and view.ranks == (2, 1)
        assert [r for r, _ in group.scale(0).wait(10)] == [0, 1, 2, 3]
        assert view.scale(2).wait(10) == [(2, 2), (1, 2)]
        assert view.execute_on(0).scale(3).wait(10) == [(0, 3)]
    finally:
        group.close()


def test_remote_errors_carry_rank_type_and_traceback(cluster):
    group = Echo.create_group().launch(cluster, name="errors")
    try:
        with pytest.raises(aiorl.RemoteError) as info:
            group.fail("no such key").wait(60)
        err = info.value
        assert err.rank == 0 and err.worker_name == "errors:0"
        assert err.exc_type.endswith("KeyError")
        assert "in fail" in err.remote_traceback and "no such key" in str(err)
        with pytest.raises(aiorl.RemoteError, match="ZeroDivisionError"):
            group.afail().wait(10)
        # The worker survives its method's exception.
        assert group.scale(1).wait(10) == [(0, 1)]
        with pytest.raises(AttributeError, match="private"):
            group._private()
        with pytest.raises(AttributeError, match="no method"):
            group.missing()
    finally:
        group.close()


def test_init_failure_is_worker_init_error(cluster):
    group = BadInit.create_group().launch(cluster, name="badinit")
    try:
        with pytest.raises(aiorl.WorkerInitError) as info:
            group.f().wait(60)
        assert "missing model file" in str(info.value)
        assert "RuntimeError" in info.value.exc_type
    finally:
        group.close()


def test_two_groups_side_by_side_and_duplicate_name(cluster):
    a = Echo.create_group(2).launch(cluster, name="side_a")
    b = Echo.create_group(3).launch(cluster, name="side_b")
    try:
        assert a.scale(1).wait(60) == [(0, 2)]
        assert b.scale(1).wait(60) == [(0, 3)]
        with pytest.raises(aiorl.RemoteError, match="already exists"):
            Echo.create_group().launch(cluster, name="side_a")
    finally:
        a.close()
        b.close()


def test_sixteen_workers_on_one_node(cluster):
    group = Echo.create_group().launch(
        cluster, aiorl.placement.NodePlacementStrategy([0] * 16), name="sixteen")
    try:
        envs = group.env().wait(90)
        assert [int(e["RANK"]) for e in envs] == list(range(16))
        assert {e["WORLD_SIZE"] for e in envs} == {"16"}
        assert len({e["MASTER_PORT"] for e in envs}) == 1
        assert len(set(group.pid().wait(10))) == 16
    finally:
        group.close()


def test_plain_methods_run_in_order_async_concurrently(cluster):
    group = Echo.create_group().launch(cluster, name="ordering")
    try:
        works = [group.record(i) for i in range(200)]
        for w in works:
            w.wait(60)
        assert group.recorded().wait(10) == [list(range(200))]
        start = time.monotonic()
        sleeps = [group.sleep(0.5) for _ in range(5)]
        assert [w.wait(10) for w in sleeps] == [["slept"]] * 5
        assert time.monotonic() - start < 2.0  # concurrent, not 2.5 s in sequence
    finally:
        group.close()


def test_calls_before_ready_are_queued_and_then_chain(cluster):
    group = Echo.create_group(7).launch(cluster, name="early")
    try:
        work = group.scale(1)  # sent before the worker exists
        chained = work.then(lambda results: results[0][1] + 1)
        assert chained.wait(60) == 8
        assert work.get_next_work() is chained
        assert work.get_last_work() is chained
    finally:
        group.close()


def test_sigkill_worker_fails_pending_and_later_calls(cluster):
    group = Echo.create_group().launch(cluster, name="victim")
    try:
        (pid,) = group.pid().wait(60)
        pending = group.block(30)
        time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(aiorl.PeerLostError) as info:
            pending.wait(10)
        assert time.monotonic() - start < 5
        assert "SIGKILL" in str(info.value) and "victim:0" in str(info.value)
        with pytest.raises(aiorl.PeerLostError):
            group.scale(1).wait(5)
    finally:
        group.close()


def test_wait_timeout_cancels_locally(cluster):
    group = Echo.create_group().launch(cluster, name="timeouts")
    try:
        group.scale(1).wait(60)
        work = group.sleep(5)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            work.wait(0.2)
        assert time.monotonic() - start < 1
        assert work.done()
    finally:
        group.close()


def test_from_group_name_attaches(cluster):
    group = Echo.create_group(4).launch(cluster, name="named")
    try:
        group.scale(1).wait(60)
        again = aiorl.WorkerGroup.from_group_name(cluster, Echo, "named")
        assert again.scale(2).wait(10) == [(0, 8)]
        with pytest.raises(aiorl.RemoteError, match="no worker group"):
            aiorl.WorkerGroup.from_group_name(cluster, Echo, "nonexistent")
    finally:
        group.close()


def test_a_group_closed_elsewhere_ends_without_deaths(cluster, caplog):
    """Closed by its owner, a group is over for a view attached to it too: the view hears
    CLOSED, no rank is reported dead (nor restarted), and its calls fail with PeerLostError."""
    group = Echo.create_group(2).launch(cluster, name="ended")
    try:
        view = aiorl.WorkerGroup.from_group_name(cluster, Echo, "ended")
        assert view.scale(1).wait(30) == [(0, 2)]
        events = view.events()
        with caplog.at_level(logging.INFO, logger="aiorl.group"):
            group.close()
            kinds = [events.get(timeout=10).kind]
            while kinds[-1] is not aiorl.EventKind.CLOSED:
                kinds.append(events.get(timeout=10).kind)
        assert aiorl.EventKind.DIED not in kinds, kinds
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        with pytest.raises(aiorl.PeerLostError, match="ended is closed"):
            view.scale(1).wait(10)
    finally:
        group.close()


def test_method_name_clash_is_rejected():
    class Clashing(aiorl.Worker):
        def execute_on(self) -> None:
            pass

    with pytest.raises(ValueError, match="execute_on"):
        Clashing.create_group()


def test_a_method_that_shadows_the_worker_api_is_rejected_by_name():
    """``async def send(self, x)`` in a worker hid aiorl.Worker.send (a confusing TypeError
    later, when a peer's send reached it): create_group names the clash at once. Subclasses
    that aiorl ships (PollingWorker) are not the user's and may refine the base."""

    class Shadowing(aiorl.Worker):
        async def send(self, x: int) -> int:
            return x

        def group(self) -> str:
            return "mine"

    with pytest.raises(ValueError, match=r"Shadowing defines group and send, which shadow "
                       r"aiorl.Worker's own API of the same name .* rename them"):
        Shadowing.create_group()

    class Polling(aiorl.PollingWorker):
        def poll(self) -> None:
            pass

    assert Polling.create_group() is not None


def _children(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def test_close_leaves_no_process_behind():
    before = _children(os.getpid())
    with aiorl.Cluster(num_nodes=2) as c:
        group = Echo.create_group().launch(
            c, aiorl.placement.NodePlacementStrategy([0, 1]), name="cleanup")
        pids = group.pid().wait(60)
        spawned = _children(os.getpid()) - before
        # registry, 2 agents, 2 zygotes and the 2 workers, all descendants of this driver
        assert set(pids) <= spawned and len(spawned) >= 7
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (set(spawned) & alive(spawned)):
        time.sleep(0.1)
    assert not alive(spawned), f"left behind: {alive(spawned)}"




def test_sigkill_node_agent_kills_its_workers():
    with aiorl.Cluster(num_nodes=1) as c:
        group = Echo.create_group().launch(c, aiorl.placement.NodePlacementStrategy([0, 0]), name="orphans")
        pids = group.pid().wait(60)
        agent_pid = c.nodes[0]["pid"]
        os.kill(agent_pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and alive(pids):
            time.sleep(0.05)
        assert not alive(pids), f"workers {alive(pids)} outlived their node agent"
        with pytest.raises(aiorl.PeerLostError):
            group.scale(1).wait(10)


@pytest.fixture
def separate_cluster_processes(tmp_path):
    """A registry and two node agents started as independent programs (attach mode)."""
    procs: list[subprocess.Popen[bytes]] = []
    key_file = str(tmp_path / "cluster.key")
    registry = subprocess.Popen(
        [sys.executable, "-m", "aiorl.registry.service", "--host", "127.0.0.1", "--port", "0",
         "--print-address", "--log-level", "WARNING", "--key-file", key_file],
        stdout=subprocess.PIPE)
    procs.append(registry)
    try:
        address = registry.stdout.readline().decode().strip().split("=", 1)[1]
        for rank in (0, 1):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "aiorl.node.agent", "--registry", address,
                 "--node-rank", str(rank), "--accelerators", "2", "--log-level", "WARNING",
                 "--key-file", key_file]))
        yield address, key_file
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        registry.stdout.close()


def test_attach_mode_two_nodes(separate_cluster_processes):
    address, key_file = separate_cluster_processes
    with aiorl.Cluster(registry=address, num_nodes=2, key_file=key_file) as c:
        assert c.num_nodes == 2 and c.num_accelerators == 4
        group = Echo.create_group().launch(c, name="attached")  # one per accelerator
        infos = group.env().wait(60)
        assert [e["CUDA_VISIBLE_DEVICES"] for e in infos] == ["0", "1", "0", "1"]
        assert group.name().wait(10) == [f"attached:{r}" for r in range(4)]
        out = subprocess.run([sys.executable, "-m", "aiorl.cli.main", "status", "--registry", address],
                             capture_output=True, text=True, timeout=30,
                             env={**os.environ, "AIORL_KEY_FILE": key_file})
        assert out.returncode == 0, out.stderr
        assert "attached" in out.stdout and "4/4" in out.stdout
    # Closing an attached driver tears down its groups but leaves the cluster up.
    with aiorl.Cluster(registry=address, num_nodes=2, key_file=key_file) as c:
        status = c.runtime.run_sync(c.runtime.registry.request("status"))
        assert all(w["state"] == "dead" for w in status["workers"] if w["name"].startswith("attached"))


def test_worker_output_reaches_the_driver_with_the_worker_name(cluster, capsys):
    group = Echo.create_group().launch(cluster, name="loud")
    try:
        group.shout("token-7f3a").wait(60)
        deadline = time.monotonic() + 5
        err = ""
        while time.monotonic() < deadline and "token-7f3a" not in err:
            time.sleep(0.1)
            err += capsys.readouterr().err
        assert "(loud:0 pid=" in err and "token-7f3a" in err
    finally:
        group.close()


_FREEZE_PROBE = """
import gc
default = gc.get_threshold()[0]
at_start = gc.get_freeze_count()  # 0 on 3.11; the interpreter's own objects on 3.12
import aiorl

class Probe(aiorl.Worker):
    def collector(self):
        return gc.get_freeze_count(), gc.get_threshold()[0]

with aiorl.Cluster() as cluster:
    frozen, young = gc.get_freeze_count(), gc.get_threshold()[0]
    aiorl.Cluster().close()  # a second Cluster in the process freezes nothing more
    once = gc.get_freeze_count() == frozen
    (worker_frozen, worker_young), = Probe.create_group().launch(cluster).collector().wait(60)
    print(frozen - at_start, once, young, worker_frozen, worker_young, default)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("setting", [None, "0"])
def test_the_driver_and_workers_tune_their_collector_unless_told_not_to(
        setting: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AIORL_GC_FREEZE"}
    if setting is not None:
        env["AIORL_GC_FREEZE"] = setting
    out = subprocess.run([sys.executable, "-c", _FREEZE_PROBE], env=env, capture_output=True,
                         text=True, timeout=80)
    assert out.returncode == 0, out.stderr
    frozen, once, young, worker_frozen, worker_young, default = out.stdout.split()
    assert once == "True"
    # A worker's heap is frozen by its zygote before the fork either way.
    assert int(worker_frozen) > 10_000
    if setting == "0":
        assert int(frozen) == 0
        assert young == worker_young == default  # Python's own
    else:
        assert int(frozen) > 10_000  # the imports (aiorl, zmq, numpy...) are out of the GC's way
        assert int(young) == int(worker_young) == YOUNG_THRESHOLD
