"""Chaos: a producer group -> channel -> consumer group pipeline runs its steps while a
killer SIGKILLs random workers, node agents and the registry (docs/failures.md, 30).

Asserts: no hang (every operation ends within its bound), no orphan process, every
item delivered at most once and every missing item explained by an error of the step
that made it or a later one, and the job reaches its step count with
``restart="on_failure"``. The short version (the normal suite) runs ~30 s;
``make chaos`` runs the long one (``AIORL_CHAOS_KILLS=200``).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import psutil
import pytest

import aiorl
from aiorl.transport.security import ClusterKeys
from tests.test_failures import free_port, stop_processes

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1800)]

KILLS = int(os.environ.get("AIORL_CHAOS_KILLS", "8"))
#: The short run stops killing after this long even if it has not reached KILLS.
KILL_WINDOW_S = float(os.environ.get("AIORL_CHAOS_WINDOW_S", "8" if KILLS <= 20 else "900"))
STEPS = int(os.environ.get("AIORL_CHAOS_STEPS", "8"))
ITEMS_PER_RANK = 5
EXPIRY_S = 3.0  # the default: shorter ones declare loaded (not dead) drivers dead here
#: The longest any one operation may take before the test calls it a hang: a call waits for
#: its rank's restart, and a restart whose node agent is killed meanwhile fails after the
#: spawn timeout (10 s) and is tried again; a few of those in a row fit.
OPERATION_BOUND_S = 90.0


class Producer(aiorl.Worker):
    async def produce(self, channel: aiorl.Channel, ids: list[int]) -> list[int]:
        put = []
        for i in ids:
            await channel.put(i)
            put.append(i)
        return put


class Consumer(aiorl.Worker):
    async def consume(self, channel: aiorl.Channel, n: int, wait_s: float) -> list[int]:
        got: list[int] = []
        while len(got) < n:
            try:
                got.append(await asyncio.wait_for(channel.get(), wait_s))
            except TimeoutError:
                break
        return got


class Supervisor:
    """A registry and two node agents as separate programs, restarted when they die (as
    systemd would), and a killer that SIGKILLs one of them or a worker at random times."""

    def __init__(self, tmp_path) -> None:
        self.key_file = str(tmp_path / "cluster.key")
        ClusterKeys.generate().save(self.key_file)

        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.port = self.address.rsplit(":", 1)[1]
        self.registry = self._registry()
        self.agents = [self._agent(r) for r in range(2)]
        self.kills: Counter[str] = Counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._restart_forever, daemon=True)]

    def _registry(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "aiorl.registry.service", "--host", "127.0.0.1", "--port",
             self.port, "--log-level", "ERROR", "--key-file", self.key_file,
             "--expiry", str(EXPIRY_S)])

    def _agent(self, rank: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "aiorl.node.agent", "--registry", self.address,
             "--node-rank", str(rank), "--log-level", "ERROR", "--key-file", self.key_file],
            stderr=subprocess.DEVNULL)

    def _restart_forever(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                if self.registry.poll() is not None:
                    self.registry = self._registry()
                for r, agent in enumerate(self.agents):
                    if agent.poll() is not None:  # killed, or refused its rank while the old
                        self.agents[r] = self._agent(r)  # node had not expired yet: again

    def workers(self) -> list[int]:
        pids = []
        for agent in self.agents:
            try:
                for zygote in psutil.Process(agent.pid).children():
                    pids += [p.pid for p in zygote.children()]
            except psutil.NoSuchProcess:
                pass
        return pids

    def kill_one(self, rng: random.Random) -> None:
        with self._lock:
            roll = rng.random()
            if roll < 0.7:
                workers = self.workers()
                if not workers:
                    return  # all are being restarted: a worker kill this time, so none
                victim, what = rng.choice(workers), "worker"
            elif roll < 0.85:
                victim, what = rng.choice(self.agents).pid, "node agent"
            else:
                victim, what = self.registry.pid, "registry"
            try:
                os.kill(victim, signal.SIGKILL)
                self.kills[what] += 1
            except ProcessLookupError:
                pass

    def start_killing(self, seed: int) -> threading.Thread:
        rng = random.Random(seed)

        def kill_forever() -> None:
            deadline = time.monotonic() + KILL_WINDOW_S
            while sum(self.kills.values()) < KILLS and time.monotonic() < deadline:
                if self._stop.wait(rng.uniform(0.3, 1.2)):
                    return
                self.kill_one(rng)

        killer = threading.Thread(target=kill_forever, daemon=True)
        self._threads.append(killer)
        self._threads[0].start()
        killer.start()
        return killer

    def descendants(self) -> list[int]:
        pids = []
        for p in [self.registry, *self.agents]:
            try:
                pids += [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return pids

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(5)
        stop_processes([*self.agents, self.registry])


@pytest.fixture
def chaos(tmp_path):
    sup = Supervisor(tmp_path)
    try:
        yield sup
    finally:
        left = sup.descendants()
        sup.close()
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in left):
            assert time.monotonic() < deadline, "processes outlived their node agents"
            time.sleep(0.1)


def _run_step(producers, consumers, channel, ids: list[list[int]],
              wait_s: float = 3.0) -> tuple[list[int], str]:
    """One step: each producer rank puts its ids while each consumer rank takes as many.
    Returns the ids received and the error that ended the step early ('' if none)."""
    produce = [producers.execute_on(r).produce(channel, ids[r]) for r in range(len(ids))]
    consume = consumers.consume(channel, ITEMS_PER_RANK, wait_s)
    received: list[int] = []
    error = ""
    for what, work in [*((f"produce on rank {r}", w) for r, w in enumerate(produce)),
                       ("consume", consume)]:
        try:
            result = work.wait(OPERATION_BOUND_S)
            if work is consume:
                received = [i for per_rank in result for i in per_rank]
        except aiorl.WaitTimeout:
            states = {g.worker_group_name: [
                (st.incarnation, st.restarting, st.address is not None, repr(st.error)[:80])
                for st in g._core.ranks] for g in (producers, consumers)}
            raise AssertionError(f"{what} hung under chaos; ranks (incarnation, restarting, "
                                 f"has address, error): {states}") from None
        except (aiorl.AiorlError, LookupError) as exc:
            error = error or f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return received, error


def test_pipeline_reaches_its_steps_while_processes_are_killed(chaos):
    with aiorl.Cluster(registry=chaos.address, num_nodes=2, key_file=chaos.key_file,
                       log_to_driver=False, timeout=60) as cluster:
        policy = {"restart": "on_failure", "max_restarts": 10_000, "backoff": 0.05}
        channel = aiorl.Channel.create(cluster, "chaos_items", maxsize=0,
                                       restart="on_failure")
        producers = Producer.create_group().launch(
            cluster, aiorl.placement.NodePlacementStrategy([0, 1]), name="producer", **policy)
        consumers = Consumer.create_group().launch(
            cluster, aiorl.placement.NodePlacementStrategy([1, 0]), name="consumer", **policy)
        producers.wait_ready(60)
        consumers.wait_ready(60)
        killer = chaos.start_killing(seed=int(os.environ.get("AIORL_CHAOS_SEED", "16")))
        next_id = 0
        made_in: dict[int, int] = {}  # item id -> the step that made it
        errors_at: list[int] = []  # steps that ended with an error
        received: Counter[int] = Counter()
        done = attempt = 0
        deadline = time.monotonic() + max(KILL_WINDOW_S * 3, 120)
        while done < STEPS or killer.is_alive():
            assert time.monotonic() < deadline, f"only {done} of {STEPS} steps in time"
            ids = [list(range(next_id + r * ITEMS_PER_RANK, next_id + (r + 1) * ITEMS_PER_RANK))
                   for r in range(2)]
            next_id += 2 * ITEMS_PER_RANK
            for batch in ids:
                made_in.update(dict.fromkeys(batch, attempt))
            got, error = _run_step(producers, consumers, channel, ids)
            received.update(got)
            if error:
                errors_at.append(attempt)
                time.sleep(0.2)
            else:
                done += 1
            attempt += 1
        # Drain what is still queued (the channel may have items of earlier steps).
        for _ in range(10):
            got, error = _run_step(producers, consumers, channel, [[], []], wait_s=0.5)
            received.update(got)
            if not got and not error:
                break
        twice = [i for i, n in received.items() if n > 1]
        assert not twice, f"items delivered more than once: {twice[:10]}"
        assert set(received) <= set(made_in), "received items nobody produced"
        missing = [i for i in made_in if i not in received]
        unexplained = [i for i in missing if not any(s >= made_in[i] for s in errors_at)]
        assert not unexplained, f"items lost without an error: {unexplained[:10]}"
        kills = sum(chaos.kills.values())
        report = (f"chaos: {kills} kills survived ({dict(chaos.kills)}), {done} steps done in "
                  f"{attempt} attempts, {len(made_in)} items, {len(missing)} lost and reported "
                  f"by errors in {len(errors_at)} steps")
        print(report)
        sys.stderr.write(report + "\n")
        assert done >= STEPS and kills >= min(KILLS, 3)
