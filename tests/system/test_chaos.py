"""Chaos: a producer group -> channel -> consumer group -> weight publication pipeline runs
its steps while a killer SIGKILLs random workers, the weights' directory, node agents and
the registry (docs/failures.md, 32 and 37).

Each step the consumer's rank 0 (the trainer) publishes a new weight version through
``aiorl.weights`` and each producer (a rollout) waits for at least the last version
published, pulls the newest, and says which version it got and whether every tensor holds
that version's number.

Asserts: no hang (every operation ends within its bound), no orphan process, every
item delivered at most once and every missing item explained by an error of the step
that made it or a later one, every pulled version complete and never older than one the
same subscriber pulled before, the job reaches its step count with
``restart="on_failure"``, and once the killing stops a new weight version reaches every
rollout within RECOVERY_S (the restarted trainer, rollouts and directory work together).
The short version (the normal suite) runs ~15-40 s on the 2-core VM; ``make chaos`` runs
the long one (``AIORL_CHAOS_KILLS=200``; ``AIORL_CHAOS_VERBOSE=1`` prints each step).

`test_grpo_pipeline_under_system_chaos` is issue 51's system chaos: a GRPO-shaped pipeline
(trainer, 4 rollouts on two nodes, reward worker, channel, weights every round, p2p direct
and relayed) while each round one process of any kind is SIGKILLed or SIGSTOPped; it checks
every round's operations against the `Ledger`'s invariants and prints a summary table
(``AIORL_CHAOS_ROUNDS``: 10 in the normal suite, 300 in ``make chaos``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import aiorl
from aiorl.node.logdirs import KEPT_ENDED_AGENT_LOGS, agent_logs_parent
from aiorl.transport.security import ClusterKeys
from aiorl.weights import host_directory
from tests._processes import gone_within, wait_listening
from tests.system.test_failures import free_port, stop_processes

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
#: How long after the last kill the weights may take to reach every rollout again (agents
#: restart and import torch; the trainer, rollouts and directory are restarted).
RECOVERY_S = 120.0
#: The weights the trainer publishes each step and the rollouts pull.
WEIGHTS = "chaos_policy"
#: How long a rollout waits for the version it needs (the trainer or the directory may be
#: restarting; a version whose trainer died before a restarted directory heard of it never
#: comes, and the step fails: the next step's publish brings a newer one).
WEIGHT_WAIT_S = 15.0


def policy(version: int) -> dict[str, torch.Tensor]:
    """A small state dict whose every element is ``version``: a torn or mixed copy shows."""
    return {"w": torch.full((4096,), float(version)),
            "b": torch.full((1000,), version, dtype=torch.int64)}


class Producer(aiorl.Worker):
    """A rollout: pulls the newest weights, then puts its items."""

    def __init__(self) -> None:
        self.process = uuid.uuid4().hex  # which process of the rank pulled (a restart is another)
        self.weights = policy(-1)

    async def produce(self, channel: aiorl.Channel, ids: list[int], min_version: int | None
                      ) -> tuple[list[int], str, int, bool]:
        """Pull a version >= ``min_version`` (none if None), put ``ids``; returns the ids
        put, this process, the version pulled (-1: none) and whether every pulled tensor
        holds it."""
        version, intact = -1, True
        if min_version is not None:
            _, version, intact = await self.pull_at_least(min_version)
        put = []
        for i in ids:
            await channel.put(i)
            put.append(i)
        return put, self.process, version, intact

    async def pull_at_least(self, min_version: int, pull_bound: float = WEIGHT_WAIT_S
                            ) -> tuple[str, int, bool]:
        """Wait for ``min_version`` (WaitTimeout after WEIGHT_WAIT_S), pull the newest (a
        TimeoutError after ``pull_bound``): this process, the version, intact."""
        sub = self.weight_subscriber(WEIGHTS)
        await sub.wait_for(min_version, timeout=WEIGHT_WAIT_S)
        for t in self.weights.values():
            t.fill_(-1)
        version = await asyncio.wait_for(sub.pull(into=self.weights), pull_bound)
        return self.process, version, all(bool((t == version).all())
                                          for t in self.weights.values())


class Consumer(aiorl.Worker):
    async def publish(self, version: int) -> int:
        """Rank 0 is the trainer: publish ``version`` of the weights."""
        return int(await self.weight_publisher(WEIGHTS).publish(policy(version), version))

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
    systemd would), and a killer that SIGKILLs one of them or a worker at random times.

    ``env`` is added to the programs' environment (and so to their zygotes' and workers');
    with ``log_dir`` each program's stderr is appended to a file there, for a post-mortem
    (the default: the registry's goes to the test's, the agents' nowhere). Processes it
    SIGSTOPs (`pause`) are SIGCONTed by `resume` or, whatever happened, by `close`: a
    stopped process would outlive its SIGTERM and the test."""

    def __init__(self, tmp_path: Path, env: dict[str, str] | None = None,
                 log_dir: str | None = None) -> None:
        self.key_file = str(tmp_path / "cluster.key")
        ClusterKeys.generate().save(self.key_file)
        self.env = {**os.environ, **(env or {})}
        self.log_dir = log_dir

        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.port = self.address.rsplit(":", 1)[1]
        self.registry = self._registry()
        try:
            wait_listening(self.address)
        except TimeoutError:
            self.registry.kill()
            raise
        self.agents = [self._agent(r) for r in range(2)]
        self.kills: Counter[str] = Counter()
        #: The weights directory's pid now (None while it is unknown): killed on purpose too.
        self.directory_pid: Callable[[], int | None] = lambda: None
        #: Pids SIGSTOPped and not SIGCONTed yet.
        self.stopped: set[int] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._restart_forever, daemon=True)]

    def _program(self, args: list[str], name: str, stderr: int | None
                 ) -> subprocess.Popen[bytes]:
        if self.log_dir is None:
            return subprocess.Popen(args, env=self.env, stderr=stderr)
        with open(os.path.join(self.log_dir, f"{name}.log"), "ab") as log:
            return subprocess.Popen(args, env=self.env, stderr=log)

    def _registry(self) -> subprocess.Popen[bytes]:
        return self._program(
            [sys.executable, "-m", "aiorl.registry.service", "--host", "127.0.0.1", "--port",
             self.port, "--log-level", self._level, "--key-file", self.key_file,
             "--expiry", str(EXPIRY_S)], "registry", None)

    def _agent(self, rank: int) -> subprocess.Popen[bytes]:
        return self._program(
            [sys.executable, "-m", "aiorl.node.agent", "--registry", self.address,
             "--node-rank", str(rank), "--log-level", self._level, "--key-file", self.key_file],
            f"agent-{rank}", subprocess.DEVNULL)

    @property
    def _level(self) -> str:
        """Warnings go to the post-mortem files; without them only errors, to the test's."""
        return "ERROR" if self.log_dir is None else "WARNING"

    def _restart_forever(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                if self.registry.poll() is not None:
                    self.registry = self._registry()
                for r, agent in enumerate(self.agents):
                    if agent.poll() is not None:  # killed, or refused its rank while the old
                        self.agents[r] = self._agent(r)  # node had not expired yet: again

    def zygotes(self) -> list[int]:
        """The node agents' zygotes (each agent's one child)."""
        pids = []
        for agent in self.agents:
            try:
                pids += [z.pid for z in psutil.Process(agent.pid).children()]
            except psutil.NoSuchProcess:
                pass
        return pids

    def named_workers(self) -> dict[str, int]:
        """Worker name (``group:rank``) -> pid of every worker the zygotes forked that has
        named itself (its title is ``aiorl::<name> (...)``); one just forked has not yet."""
        named = {}
        for zygote in self.zygotes():
            try:
                children = psutil.Process(zygote).children()
            except psutil.NoSuchProcess:
                continue
            for child in children:
                try:
                    title = " ".join(child.cmdline())
                except psutil.Error:
                    continue
                if title.startswith("aiorl::"):
                    named[title.removeprefix("aiorl::").split(" ", 1)[0]] = child.pid
        return named

    def pause(self, pid: int) -> bool:
        """SIGSTOP ``pid`` (whether it was there to stop); `resume` or `close` SIGCONTs it."""
        with self._lock:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                return False
            self.stopped.add(pid)
            return True

    def resume(self, pid: int) -> None:
        with self._lock:
            self.stopped.discard(pid)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def supervise(self) -> None:
        """Start restarting what dies (once)."""
        if self._threads[0].ident is None and not self._stop.is_set():
            self._threads[0].start()

    def workers(self) -> list[int]:
        pids = []
        for zygote in self.zygotes():
            try:
                pids += [p.pid for p in psutil.Process(zygote).children()]
            except psutil.NoSuchProcess:
                pass
        return pids

    def kill_one(self, rng: random.Random) -> None:
        roll = rng.random()
        directory = self.directory_pid() if roll < 0.15 else None
        with self._lock:
            if directory is not None:
                victim, what = directory, "weights directory"
            elif roll < 0.7:
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
        self.supervise()
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
        for pid in list(self.stopped):
            self.resume(pid)
        stop_processes([*self.agents, self.registry])


@contextlib.contextmanager
def _supervised(tmp_path: Path, **kwargs: Any) -> Iterator[Supervisor]:
    """A `Supervisor`, closed however the test ends; no process may outlive its agent."""
    sup = Supervisor(tmp_path, **kwargs)
    try:
        yield sup
    finally:
        left = sup.descendants()
        sup.close()
        assert gone_within(left, 10), "processes outlived their node agents"


@pytest.fixture
def chaos(tmp_path):
    with _supervised(tmp_path) as sup:
        yield sup


@dataclasses.dataclass
class Step:
    """What one step did: the items received, the pulls of the producers that finished
    (rank, process, version pulled, intact) and the error that ended it early ('' if none)."""

    received: list[int]
    pulls: list[tuple[int, str, int, bool]]
    error: str


def _run_step(producers, consumers, channel, ids: list[list[int]], min_version: int | None,
              wait_s: float = 3.0) -> Step:
    """One step: each producer rank pulls a weight version >= ``min_version`` (none if
    None) and puts its ids while each consumer rank takes as many."""
    produce = [producers.execute_on(r).produce(channel, ids[r], min_version)
               for r in range(len(ids))]
    consume = consumers.consume(channel, ITEMS_PER_RANK, wait_s)
    step = Step([], [], "")
    for what, work in [*((f"produce on rank {r}", w) for r, w in enumerate(produce)),
                       ("consume", consume)]:
        try:
            result = _bounded(what, work, producers, consumers)
            if work is consume:
                step.received = [i for per_rank in result for i in per_rank]
            elif min_version is not None:
                _, process, version, intact = result[0]
                step.pulls.append((produce.index(work), process, version, intact))
        except (aiorl.AiorlError, LookupError) as exc:
            step.error = step.error or _describe(exc)
    return step


def _bounded(what: str, work, *groups):
    """``work``'s result, or an AssertionError naming the hang and the ranks' states."""
    try:
        return work.wait(OPERATION_BOUND_S)
    except aiorl.WaitTimeout:
        raise AssertionError(f"{what} hung under chaos; {_rank_states(groups)}") from None


def _rank_states(groups: Sequence[aiorl.WorkerGroup[Any]]) -> str:
    states = {g.worker_group_name: [
        (st.incarnation, st.restarting, st.address is not None, repr(st.error)[:80])
        for st in g._shared.ranks] for g in groups}
    return f"ranks (incarnation, restarting, has address, error): {states}"


def _node_lists(cluster: aiorl.Cluster) -> str:
    """The driver's node list and the registry's, side by side (node rank, agent pid)."""
    runtime = cluster.runtime
    try:
        nodes = runtime.run_sync(runtime.registry.nodes(timeout=5), timeout=6)
        registry = str([(n.node_rank, n.pid) for n in nodes])
    except (aiorl.AiorlError, TimeoutError) as exc:
        registry = _describe(exc)
    return (f"the driver's nodes: {[(n['node_rank'], n.get('pid')) for n in cluster.nodes]}, "
            f"the registry's: {registry}")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def _directory_pid(cluster: aiorl.Cluster) -> int | None:
    """The weights directory's pid, if the registry answers now (the killer's thread)."""
    runtime = cluster.runtime
    try:
        record = runtime.run_sync(runtime.registry.lookup(f"weights.{WEIGHTS}:0", timeout=2),
                                  timeout=3)
    except (aiorl.AiorlError, LookupError, TimeoutError):
        return None
    return int(record.info.pid) or None if record.state == "ready" else None


def _weights_recover(trainer, producers, consumers, version: int
                     ) -> list[tuple[str, int, bool]]:
    """Once the killing has stopped, publish ``version`` (or a newer one, if a publish's
    version was lost with its trainer) until every rollout pulls it; returns each rank's
    (process, version pulled, intact). The weight path recovers within RECOVERY_S: the
    trainer, the rollouts and the directory all came back."""
    deadline = time.monotonic() + RECOVERY_S
    while True:
        try:
            _bounded("publish", trainer.publish(version), consumers)
            pulls = _bounded("pull", producers.pull_at_least(version), producers)
            assert all(got >= version for _, got, _ in pulls), (version, pulls)
            return pulls
        except (aiorl.AiorlError, LookupError) as exc:
            assert time.monotonic() < deadline, (
                f"the weights did not reach every rollout within {RECOVERY_S:g} s of the last "
                f"kill: {_describe(exc)}")
            version += 1
            time.sleep(0.5)


def _count_restarts(events) -> int:
    """How many ``restarted`` events a group's stream holds so far (its history)."""
    count = 0
    while True:
        try:
            count += events.get(timeout=0).kind == "restarted"
        except aiorl.WaitTimeout:
            return count


def test_pipeline_reaches_its_steps_while_processes_are_killed(chaos):
    with aiorl.Cluster(registry=chaos.address, num_nodes=2, key_file=chaos.key_file,
                       log_to_driver=False, timeout=60) as cluster:
        policy_ = {"restart": "on_failure", "max_restarts": 10_000, "backoff": 0.05}
        channel = aiorl.Channel.create(cluster, "chaos_items", maxsize=0,
                                       restart="on_failure", max_restarts=10_000, backoff=0.05)
        # Hosted by the driver, so that it is restarted however often its users die.
        directory = host_directory(cluster, WEIGHTS, node_rank=0)
        producers = Producer.create_group().launch(
            cluster, aiorl.placement.NodePlacementStrategy([0, 1]), name="producer", **policy_)
        consumers = Consumer.create_group().launch(
            cluster, aiorl.placement.NodePlacementStrategy([1, 0]), name="consumer", **policy_)
        producers.wait_ready(60)
        consumers.wait_ready(60)
        trainer = consumers.execute_on(0)
        published = trainer.publish(1).wait(60)[0]  # the version every step waits for at least
        chaos.directory_pid = lambda: _directory_pid(cluster)
        killer = chaos.start_killing(seed=int(os.environ.get("AIORL_CHAOS_SEED", "16")))
        next_id = 0
        made_in: dict[int, int] = {}  # item id -> the step that made it
        errors_at: list[int] = []  # steps that ended with an error
        received: Counter[int] = Counter()
        pulled: dict[tuple[int, str], list[int]] = {}  # (rank, process) -> versions pulled
        publishes_failed = 0
        done = attempt = 0
        deadline = time.monotonic() + max(KILL_WINDOW_S * 3, 120)
        while done < STEPS or killer.is_alive():
            assert time.monotonic() < deadline, f"only {done} of {STEPS} steps in time"
            version = attempt + 2  # versions only grow, whichever trainer process publishes
            try:
                published = _bounded("publish", trainer.publish(version), consumers)[0]
                publish_error = ""
            except (aiorl.AiorlError, LookupError) as exc:
                publish_error = _describe(exc)
                publishes_failed += 1
            ids = [list(range(next_id + r * ITEMS_PER_RANK, next_id + (r + 1) * ITEMS_PER_RANK))
                   for r in range(2)]
            next_id += 2 * ITEMS_PER_RANK
            for batch in ids:
                made_in.update(dict.fromkeys(batch, attempt))
            step = _run_step(producers, consumers, channel, ids, published)
            if os.environ.get("AIORL_CHAOS_VERBOSE"):
                sys.stderr.write(f"step {attempt}: kills={sum(chaos.kills.values())} "
                                 f"pulls={[(r, v) for r, _, v, _ in step.pulls]} "
                                 f"error={step.error[:160]!r} publish={publish_error[:160]!r}\n")
            received.update(step.received)
            for rank, process, got, intact in step.pulls:
                assert intact, f"rank {rank} pulled version {got} torn or mixed"
                assert published <= got <= version, (
                    f"rank {rank} pulled version {got}, not in {published}..{version}")
                pulled.setdefault((rank, process), []).append(got)
            if step.error:
                errors_at.append(attempt)
            if step.error or publish_error:
                time.sleep(0.2)
            else:
                done += 1
            attempt += 1
        recovered = _weights_recover(trainer, producers, consumers, version + 1)
        for rank, (process, got, intact) in enumerate(recovered):
            assert intact, f"rank {rank} pulled version {got} torn or mixed after the chaos"
            pulled.setdefault((rank, process), []).append(got)
        # Drain what is still queued (the channel may have items of earlier steps).
        for _ in range(10):
            step = _run_step(producers, consumers, channel, [[], []], None, wait_s=0.5)
            received.update(step.received)
            if not step.received and not step.error:
                break
        twice = [i for i, n in received.items() if n > 1]
        assert not twice, f"items delivered more than once: {twice[:10]}"
        assert set(received) <= set(made_in), "received items nobody produced"
        missing = [i for i in made_in if i not in received]
        unexplained = [i for i in missing if not any(s >= made_in[i] for s in errors_at)]
        assert not unexplained, f"items lost without an error: {unexplained[:10]}"
        backwards = {who: vs for who, vs in pulled.items() if vs != sorted(vs)}
        assert not backwards, f"a subscriber's versions went backwards: {backwards}"
        restarts = _count_restarts(directory.events())
        kills = sum(chaos.kills.values())
        seen = {v for vs in pulled.values() for v in vs}
        report = (f"chaos: {kills} kills survived ({dict(chaos.kills)}), {done} steps done in "
                  f"{attempt} attempts, {len(made_in)} items, {len(missing)} lost and reported "
                  f"by errors in {len(errors_at)} steps; weights: {attempt - publishes_failed} "
                  f"versions published in steps ({publishes_failed} failed), "
                  f"{len(seen)} distinct versions pulled in {sum(map(len, pulled.values()))} "
                  f"pulls by {len(pulled)} subscriber processes, none torn or going back, "
                  f"directory restarted {restarts} times")
        print(report)
        sys.stderr.write(report + "\n")
        assert done >= STEPS and kills >= min(KILLS, 3)


# ------------------------------------------------------------------------------ system chaos
# Issue 51's system chaos: a GRPO-shaped pipeline (a trainer, 4 rollouts on two nodes, a
# reward worker, a channel, weights published every round, p2p direct and relayed) while,
# each round, one process of any kind is SIGKILLed or SIGSTOPped.

#: Chaos rounds (``make chaos``: 300); the short run in the normal suite stops the chaos
#: after ROUNDS_WINDOW_S even if it has not done them all (but not before MIN_ROUNDS).
ROUNDS = int(os.environ.get("AIORL_CHAOS_ROUNDS", "10"))
MIN_ROUNDS = min(ROUNDS, 4)
ROUNDS_WINDOW_S = float(os.environ.get("AIORL_CHAOS_ROUNDS_WINDOW_S",
                                       "25" if ROUNDS <= 30 else "14400"))
ROLLOUT, TRAINER, REWARD, GRPO_CHANNEL = "rollout", "trainer", "reward", "grpo_items"
#: The rollouts' nodes, by rank, and the reward worker's. The rollouts run with
#: ``AIORL_P2P_DIRECT_PEERS=0``: their messages to the reward on the other node go through
#: both node agents (relayed pairs), those on the reward's node stay direct (a same-node
#: pair always is). A rank whose node is down when it restarts moves to the other node
#: (`Supervision._relocate`), so each send's route is judged from where both ends ran.
ROLLOUT_NODES = (0, 0, 1, 1)
REWARD_NODE = 1
VICTIMS = ("rollout", "trainer", "reward", "channel host", "weights directory", "zygote",
           "node agent", "registry")
#: The worker-name prefix of each victim kind that is a worker (its title, `named_workers`).
WORKER_VICTIMS = {"rollout": f"{ROLLOUT}:", "trainer": f"{TRAINER}:", "reward": f"{REWARD}:",
                  "channel host": f"channel.{GRPO_CHANNEL}:", "weights directory": f"weights.{WEIGHTS}:"}
SIGNALS = ("SIGKILL", "SIGSTOP")
#: A SIGSTOPped process is SIGCONTed after a random time in this range (seconds).
STOP_S = (0.5, 4.0)
#: How long each rollout generates (sleeps) between its pull and its puts, at random: the
#: chaos strikes within a round's first second, while its operations are in flight.
GENERATE_S = (0.2, 1.0)
#: Inside a worker, each part of a round (a pull, the puts, a send, a take) ends, with its
#: result or a typed error, within PART_BOUND_S (below OPERATION_BOUND_S, so that the worker
#: names its hang before the driver's call does).
PART_BOUND_S = 60.0
#: A message whose send returned reaches the receiver's loop within this, unless its pair
#: failed (a SIGSTOPped agent or registry delays it by at most STOP_S).
DELIVERY_BOUND_S = 30.0
#: How long the trainer's get_batch waits for a round's items (a SIGSTOPped host: <= 4 s);
#: fewer than asked means some were lost with a host that died, and it takes what is there.
TAKE_WAIT_S = 8.0
#: A part of the pipeline (a rank, the channel host, the weights) all of whose operations
#: failed for this long is stuck: under ``restart="on_failure"`` with both nodes restarted,
#: every one comes back within seconds, and one round's chaos hits one process.
STUCK_S = 180.0
#: A loss is explained by a failure of its pair (p2p), or of the channel host or the trainer
#: (items), that happened during its round or that the driver learned of within this after
#: the round ended (a death reaches the driver through the registry: its expiry, or the
#: registry's own restart when both were hit).
EXPLAIN_LAG_S = 30.0

#: One part's outcome: "ok" or the typed error's class (or "hang", or "untyped <class>"),
#: the result (or the error's first line) and the seconds it took.
Outcome = tuple[str, Any, float]


async def _part(work: Awaitable[Any]) -> Outcome:
    """Run one part of a round within PART_BOUND_S and say how it ended."""
    t0 = time.monotonic()
    try:
        return "ok", await asyncio.wait_for(work, PART_BOUND_S), time.monotonic() - t0
    except aiorl.AiorlError as exc:  # typed, WaitTimeout included (a bound the API honours)
        return type(exc).__name__, _describe(exc), time.monotonic() - t0
    except TimeoutError:  # our own bound: the operation did not end by itself
        return "hang", f"did not end within {PART_BOUND_S:g} s", time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - reported: an untyped error is a bug
        return f"untyped {type(exc).__name__}", _describe(exc), time.monotonic() - t0


class Rollout(Producer):
    """A GRPO rollout: each round it pulls the policy, puts its samples into the channel and
    sends the reward worker a stamped tensor, each part bounded and its outcome reported."""

    async def step(self, channel: aiorl.Channel, ids: list[int], min_version: int,
                   stamp: int, generate_s: float) -> dict[str, Any]:
        """Pull a version >= ``min_version``, generate for ``generate_s`` (a sleep: the
        round's operations are in flight when the chaos strikes), then put ``ids`` and send
        ``stamp`` at once."""
        put: list[int] = []

        async def put_all() -> None:
            for i in ids:
                await channel.put(i, weight=1)
                put.append(i)

        async def send() -> float:  # when the send returned
            await self.send(torch.tensor([stamp, os.getpid()]), REWARD, 0)
            return time.time()

        pull = await _part(self.pull_at_least(min_version, PART_BOUND_S))
        await asyncio.sleep(generate_s)
        puts, sent = await asyncio.gather(_part(put_all()), _part(send()))
        return {"process": self.process, "node": self.worker_info.node_rank, "pull": pull,
                "put": puts, "put_ids": put, "send": sent}


class Trainer(Consumer):
    """The GRPO trainer: publishes the policy (`Consumer.publish`) and takes the rollouts'
    samples with get_batch. What it took is kept until the driver's next take acknowledges
    it, so that an answer lost on the way loses no item: the next take repeats it."""

    def __init__(self) -> None:
        self.process = uuid.uuid4().hex
        self.taken: list[int] = []  # taken and not acknowledged yet
        self.dropped = 0  # acknowledged (and dropped) before taken[0]

    async def take(self, channel: aiorl.Channel, n: int, acked: tuple[str, int]
                   ) -> dict[str, Any]:
        """``get_batch(n)`` within TAKE_WAIT_S, then whatever else is queued (get_nowait);
        returns everything taken and not acknowledged (``acked``: the driver has this
        process's first so many items), from its place ``first``."""
        if acked[0] == self.process:
            del self.taken[:acked[1] - self.dropped]
            self.dropped = acked[1]
        items = self.taken

        async def take_all() -> None:
            if n:
                try:
                    items.extend(await asyncio.wait_for(channel.get_batch(n), TAKE_WAIT_S))
                except TimeoutError:
                    pass  # fewer than n: its reserved items go back (cancelled), taken below
            while True:
                try:
                    items.append(await channel.get_nowait())
                except aiorl.QueueEmpty:
                    return

        return {"process": self.process, "take": await _part(take_all()),
                "first": self.dropped, "items": list(items)}


class Reward(aiorl.Worker):
    """The reward worker: receives every rollout's stamps, one receiving task per rollout
    rank for as long as it lives, and tells the driver what came (and which receives
    failed). What it told is kept until the driver's next collect acknowledges it, so that
    an answer lost on the way (a pending call fails when the connection breaks) loses no
    news: the next collect repeats it."""

    def __init__(self) -> None:
        self.process = uuid.uuid4().hex
        self.started = time.time()
        #: (sequence number, rollout rank, "stamp" | "error" | "untyped", stamp or error
        #: class, sender pid or error text, when)
        self.entries: list[tuple[Any, ...]] = []
        self.numbered = 0
        self.receiving: list[asyncio.Task[None]] = []
        self.news: asyncio.Event | None = None

    def _note(self, *entry: Any) -> None:
        assert self.news is not None
        self.entries.append((self.numbered, *entry))
        self.numbered += 1
        self.news.set()

    async def _receive(self, rank: int) -> None:
        while True:
            try:
                got = await self.recv(ROLLOUT, rank)
                self._note(rank, "stamp", int(got[0]), int(got[1]), time.time())
            except aiorl.AiorlError as exc:  # its sender died (or is being restarted)
                self._note(rank, "error", type(exc).__name__, _describe(exc), time.time())
                await asyncio.sleep(0.2)
            except Exception as exc:  # noqa: BLE001 - reported: an untyped error is a bug
                self._note(rank, "untyped", type(exc).__name__, _describe(exc), time.time())
                await asyncio.sleep(0.2)

    async def collect(self, expect: dict[int, int], since: float,
                      acked: tuple[str, int]) -> dict[str, Any]:
        """What came and was not acknowledged yet (``acked``: the driver has what this
        process numbered up to there), once each rank of ``expect`` delivered its stamp (or
        a receive from it failed), DELIVERY_BOUND_S at most. A process started after
        ``since`` (the round's start) waits for nothing: what was sent this round went to
        its predecessor."""
        if not self.receiving:
            self.news = asyncio.Event()
            loop = asyncio.get_running_loop()
            self.receiving = [loop.create_task(self._receive(r))
                              for r in range(len(ROLLOUT_NODES))]
        assert self.news is not None
        if acked[0] == self.process:
            self.entries = [e for e in self.entries if e[0] > acked[1]]
        deadline = time.monotonic() + (DELIVERY_BOUND_S if self.started <= since else 0.0)

        def settled(rank: int, stamp: int) -> bool:
            return any(e[1] == rank and (e[2] != "stamp" or e[3] >= stamp) for e in self.entries)

        while not all(settled(r, s) for r, s in expect.items()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.news.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.news.wait(), left)
        return {"process": self.process, "node": self.worker_info.node_rank,
                "entries": list(self.entries)}


@dataclasses.dataclass
class Action:
    """One round's chaos: the victim's kind, the signal, the pid signalled (None: no
    process of that kind was there, all being restarted) and how long it stayed stopped."""

    round: int
    kind: str
    signal: str
    pid: int | None = None
    stopped_s: float = 0.0


class RoundChaos:
    """One action per round, from a thread of its own: a random victim kind and signal; a
    random moment within the round's first second, when its operations are in flight; and for
    SIGSTOP a SIGCONT after STOP_S. A round's action is over (its victim resumed) before the
    next round begins, so each round's outcomes belong to one action. The Supervisor joins
    the thread and SIGCONTs what is still stopped when it closes, however the test ends."""

    def __init__(self, sup: Supervisor, seed: int) -> None:
        self.sup = sup
        self.rng = random.Random(seed)
        self._rounds: queue.Queue[int] = queue.Queue()
        self._done: queue.Queue[Action] = queue.Queue()
        thread = threading.Thread(target=self._run, daemon=True)
        sup._threads.append(thread)
        sup.supervise()
        thread.start()

    def begin(self, round_: int) -> None:
        self._rounds.put(round_)

    def finish(self) -> Action:
        """The action of the round begun last, once it is over (within 30 s: at most 1 s
        to strike, 3 s to find a victim and STOP_S stopped, on a loaded machine)."""
        try:
            return self._done.get(timeout=30)
        except queue.Empty:
            raise AssertionError("the chaos thread did not finish its round's action") from None

    def victims(self, kind: str) -> list[int]:
        sup = self.sup
        if kind in WORKER_VICTIMS:
            return [pid for name, pid in sup.named_workers().items()
                    if name.startswith(WORKER_VICTIMS[kind])]
        if kind == "zygote":
            return sup.zygotes()
        with sup._lock:  # a dead program not restarted yet is a zombie: not a victim
            programs = sup.agents if kind == "node agent" else [sup.registry]
            return [p.pid for p in programs if p.poll() is None]

    def _run(self) -> None:
        while not self.sup._stop.is_set():
            try:
                round_ = self._rounds.get(timeout=0.1)
            except queue.Empty:
                continue
            self._done.put(self._act(round_))

    def _act(self, round_: int) -> Action:
        action = Action(round_, self.rng.choice(VICTIMS), self.rng.choice(SIGNALS))
        stop = self.sup._stop
        if stop.wait(self.rng.uniform(0.0, 1.0)):
            return action
        deadline = time.monotonic() + 3.0
        while action.pid is None:
            pids = self.victims(action.kind)
            if pids:
                pid = self.rng.choice(pids)
                if action.signal == "SIGSTOP":
                    action.pid = pid if self.sup.pause(pid) else None
                else:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        action.pid = pid
            if action.pid is None and (time.monotonic() > deadline or stop.wait(0.2)):
                return action
        if action.signal == "SIGSTOP" and action.pid is not None:
            action.stopped_s = self.rng.uniform(*STOP_S)
            stop.wait(action.stopped_s)
            self.sup.resume(action.pid)
        return action


class Hang(Exception):
    """An operation that did not end within its bound: the run stops there."""


class Ledger:
    """What the rounds did and the invariants checked against it: every operation ends
    within its bound; a put that returned is taken once, unless the channel host or the
    trainer failed; a stamp whose send returned is received once and in order, unless its
    pair failed; pulled versions are whole and never go back for one subscriber process.
    A failure *explains* a loss when it happened in the loss's round or the driver learned
    of it within EXPLAIN_LAG_S after (`explained`)."""

    def __init__(self) -> None:
        self.span: dict[int, tuple[float, float]] = {}  # round -> (start, end), wall clock
        #: "channel" or "pair <rank>" -> (when, what) of each failure seen there.
        self.trouble: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
        self.process: dict[str, str] = {}  # "rollout 2", "trainer", "reward" -> its process now
        self.failures: list[str] = []  # broken invariants (silent losses, order, torn, ...)
        self.notes: list[str] = []  # what a post-mortem wants: stamps that missed their round
        self.hangs: list[str] = []
        # channel items
        self.put_in: dict[int, int] = {}  # item -> the round its put returned in
        self.asked: set[int] = set()  # every item a rollout was asked to put
        self.taken_in: dict[int, int] = {}
        #: The trainer process and how many of its items the driver has.
        self.took: tuple[str, int] = ("", 0)
        # p2p stamps (a stamp is its round's number)
        #: Pairs whose last stamp was not received in its round, with no failure to explain
        #: it: the reward does not wait for them again until one of their stamps is, so that
        #: a pair that loses everything costs one DELIVERY_BOUND_S, not one per round (each
        #: lost stamp is judged at the end all the same).
        self.overdue: set[int] = set()
        #: (rank, stamp) whose send returned -> when; and when the reward got it.
        self.sent: dict[tuple[int, int], float] = {}
        self.received_at: dict[tuple[int, int], float] = {}
        #: (rank, stamp) -> "relayed" (the sender ran on another node than the reward, as
        #: last seen) or "direct".
        self.route: dict[tuple[int, int], str] = {}
        self.reward_node = REWARD_NODE
        #: The reward process and the number of its last entry the driver has.
        self.acked: tuple[str, int] = ("", -1)
        self.stamped: set[tuple[int, int]] = set()  # (rank, stamp) a rollout was asked to send
        self.delivered_in: dict[tuple[int, int], int] = {}
        self.last: dict[tuple[int, str], int] = {}  # (rank, receiving process) -> last stamp
        # weights
        self.published = 0  # the newest version whose publish returned
        self.tried = 0  # the newest version a publish was tried for
        self.publish_failed = 0
        self.pulled: dict[tuple[int, str], list[int]] = {}
        #: Each part of the pipeline -> when an operation on it last succeeded.
        self.answered: dict[str, float] = {}

    def ok(self, who: str) -> None:
        self.answered[who] = time.monotonic()

    def stuck(self) -> list[str]:
        """The parts none of whose operations succeeded for STUCK_S."""
        return [who for who, t in self.answered.items() if time.monotonic() - t > STUCK_S]

    def fail(self, scope: str, why: str, when: float | None = None) -> None:
        self.trouble[scope].append((time.time() if when is None else when, why))

    def seen(self, who: str, process: str, scopes: list[str]) -> None:
        """``who`` answered from ``process``: a new one means its predecessor died."""
        before = self.process.get(who)
        self.process[who] = process
        if before is not None and before != process:
            for scope in scopes:
                self.fail(scope, f"{who} restarted")

    def explained(self, scope: str, round_: int) -> bool:
        start, end = self.span[round_]
        return any(start <= t <= end + EXPLAIN_LAG_S for t, _ in self.trouble[scope])

    def pull(self, rank: int, process: str, version: int, intact: bool, floor: int) -> None:
        if not intact:
            self.failures.append(f"rank {rank} pulled version {version} torn or mixed")
        if not floor <= version <= self.tried:
            self.failures.append(f"rank {rank} pulled version {version}, not in "
                                 f"{floor}..{self.tried}")
        versions = self.pulled.setdefault((rank, process), [])
        if versions and version < versions[-1]:
            self.failures.append(f"rank {rank} (process {process[:8]}) pulled version "
                                 f"{version} after {versions[-1]}")
        versions.append(version)

    def taken(self, items: list[int], round_: int) -> None:
        for i in items:
            if i in self.taken_in:
                self.failures.append(f"item {i} taken twice (rounds {self.taken_in[i]}, "
                                     f"{round_})")
            elif i not in self.asked:
                self.failures.append(f"item {i} taken but never put")
            self.taken_in.setdefault(i, round_)

    def received(self, rank: int, receiver: str, stamp: int, round_: int) -> None:
        key = (rank, receiver)
        if (rank, stamp) not in self.stamped:
            self.failures.append(f"pair {rank}: stamp {stamp} received but never sent")
        elif stamp <= self.last.get(key, 0) or (rank, stamp) in self.delivered_in:
            self.failures.append(f"pair {rank}: stamp {stamp} received after "
                                 f"{self.last.get(key)} (twice or out of order)")
        self.last[key] = max(stamp, self.last.get(key, 0))
        self.delivered_in.setdefault((rank, stamp), round_)

    def verdict(self) -> dict[str, int]:
        """Judge every loss and late arrival once the run is over; the counts for the table."""
        counts: Counter[str] = Counter()
        for i, x in self.put_in.items():
            got = self.taken_in.get(i)
            if got is None:
                if self.explained("channel", x):
                    counts["items lost with a failure"] += 1
                else:
                    counts["silent losses"] += 1
                    self.failures.append(f"silent loss: item {i}, put in round {x}, never taken")
            elif got > x:  # its round's take failed (its answer is repeated) or missed it
                counts["items late"] += 1
        silent: dict[int, list[int]] = collections.defaultdict(list)
        for rank, stamp in sorted(self.sent):
            got = self.delivered_in.get((rank, stamp))
            scope = f"pair {rank}"
            if got is None:
                if self.explained(scope, stamp):
                    counts["stamps lost with a failure"] += 1
                else:
                    counts["silent losses"] += 1
                    silent[rank].append(stamp)
            else:
                counts["stamps late"] += got > stamp
                took = self.received_at[rank, stamp] - self.sent[rank, stamp]
                if took > DELIVERY_BOUND_S and not self.explained(scope, stamp):
                    self.hangs.append(f"stall: pair {rank} ({self.route[rank, stamp]}) stamp "
                                      f"{stamp} reached the reward {took:.1f} s after its send "
                                      f"returned, with no failure of the pair")
        for rank, stamps in silent.items():
            routes = sorted({self.route[rank, s] for s in stamps})
            self.failures.append(
                f"silent loss: pair {rank} ({' and '.join(routes)}): {len(stamps)} stamps whose "
                f"send returned were never received, and neither end failed: rounds "
                f"{_ranges(stamps)}")
        return counts


def _ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3, 7``."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


class SummaryTable:
    """The outcomes of every round, by the round's victim kind and signal."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], dict[str, Any]] = {}

        #: The first error text seen for each operation and error class.
        self.examples: dict[str, str] = {}

    @staticmethod
    def blank() -> dict[str, Any]:
        return {"rounds": 0, "missed": 0, "ops": Counter(), "max_s": 0.0, "examples": {}}

    def add(self, kind: str, sig: str, round_row: dict[str, Any]) -> None:
        """Add one round's outcomes (``round_row``) to the row of its victim and signal."""
        row = self.rows.setdefault((kind, sig), self.blank())
        for key in ("rounds", "missed", "ops"):
            row[key] += round_row[key]
        row["max_s"] = max(row["max_s"], round_row["max_s"])
        for key, text in round_row["examples"].items():
            self.examples.setdefault(key, text)

    @staticmethod
    def op(row: dict[str, Any], what: str, outcome: str, seconds: float,
           detail: Any = None) -> None:
        key = "ok" if outcome == "ok" else f"{what} {outcome}"
        row["ops"][key] += 1
        row["max_s"] = max(row["max_s"], seconds)
        if outcome != "ok":
            row["examples"].setdefault(key, str(detail))

    def render(self, head: str, tail: list[str]) -> str:
        lines = [head, f"{'victim':<18} {'signal':<8} {'rounds':>6} {'missed':>6} {'ops':>5} "
                       f"{'max s':>6}  outcomes (ok, and errors by operation and class)"]
        order = [(k, s) for k in VICTIMS for s in SIGNALS] + [("(recovery)", "-")]
        for key in order:
            if key not in self.rows:
                continue
            r = self.rows[key]
            ops: Counter[str] = r["ops"]
            outcomes = ", ".join(f"{name} {n}" for name, n in
                                 sorted(ops.items(), key=lambda kv: (kv[0] != "ok", kv[0])))
            lines.append(f"{key[0]:<18} {key[1]:<8} {r['rounds']:>6} {r['missed']:>6} "
                         f"{sum(ops.values()):>5} {r['max_s']:>6.1f}  {outcomes}")
        lines += tail
        lines += [f"  e.g. {key}: {text[:300]}" for key, text in sorted(self.examples.items())]
        return "\n".join(lines)


def _call(what: str, work: aiorl.AsyncWork[Any], groups: list[aiorl.WorkerGroup[Any]],
          row: dict[str, Any]) -> tuple[str, Any]:
    """A driver call's (outcome, value) within OPERATION_BOUND_S, its time in ``row``;
    raises Hang (with `_bounded`'s diagnostic) when it does not end in time."""
    t0 = time.monotonic()
    try:
        out: tuple[str, Any] = "ok", _bounded(what, work, *groups)
    except AssertionError as exc:
        raise Hang(str(exc)) from None
    except (aiorl.AiorlError, LookupError) as exc:
        out = type(exc).__name__, _describe(exc)
    SummaryTable.op(row, what, out[0], time.monotonic() - t0, out[1])
    return out


def _part_outcome(what: str, outcome: Outcome, ledger: Ledger, row: dict[str, Any]) -> bool:
    """Count a worker part's outcome; whether it is ok. A hang or an untyped error breaks
    the invariants."""
    name, detail, seconds = outcome
    SummaryTable.op(row, what, name, seconds, detail)
    if name == "hang":
        ledger.hangs.append(f"{what}: {detail}")
    elif name.startswith("untyped"):
        ledger.failures.append(f"{what} raised {name}: {detail}")
    return name == "ok"


def _events(streams: dict[str, aiorl.GroupEvents], ledger: Ledger) -> None:
    """Deaths the driver heard of (group events so far): each is a failure of what it hits."""
    pairs = [f"pair {r}" for r in range(len(ROLLOUT_NODES))]
    for group, stream in streams.items():
        while True:
            try:
                event = stream.get(timeout=0)
            except (aiorl.WaitTimeout, StopIteration):
                break
            if event.kind == aiorl.EventKind.GAVE_UP:
                ledger.failures.append(f"gave up: {event}")
            if event.kind not in (aiorl.EventKind.DIED, aiorl.EventKind.RESTARTING,
                                  aiorl.EventKind.RESTARTED):
                continue
            scopes = {ROLLOUT: [f"pair {event.rank}"], REWARD: pairs,
                      TRAINER: ["channel"]}.get(group, ["channel"] if group.startswith(
                          "channel.") else [])
            for scope in scopes:
                ledger.fail(scope, str(event), event.time)


def _grpo_round(round_: int, groups: dict[str, aiorl.WorkerGroup[Any]], channel: aiorl.Channel,
                ledger: Ledger, row: dict[str, Any], rng: random.Random,
                wait_for_all: bool = False) -> bool:
    """One round: publish ``round_``, each rollout pulls, puts and sends its stamp, the
    trainer takes the items, the reward reports the stamps; the invariants are checked as
    the answers come. Whether every operation succeeded and everything arrived in the round.
    The reward waits for every pair's stamp with ``wait_for_all``, else not for the
    overdue pairs (`Ledger.overdue`)."""
    trainer, rollouts, reward = groups[TRAINER].execute_on(0), groups[ROLLOUT], groups[REWARD]
    everything = list(groups.values())
    start = time.time()
    ledger.span[round_] = (start, start)
    clean = True
    ledger.tried = round_
    floor = ledger.published
    outcome, value = _call("publish", trainer.publish(round_), everything, row)
    if outcome == "ok":
        ledger.published = round_
        ledger.ok(TRAINER)
    else:
        ledger.publish_failed += 1
        clean = False
    ids = [[round_ * 1000 + r * 100 + i for i in range(ITEMS_PER_RANK)]
           for r in range(len(ROLLOUT_NODES))]
    steps = [rollouts.execute_on(r).step(channel, ids[r], floor, round_, rng.uniform(*GENERATE_S))
             for r in range(len(ROLLOUT_NODES))]
    this_round: list[int] = []
    sent: list[int] = []  # the ranks whose send returned this round
    expect = {}  # rank -> the stamp the reward waits for (see Ledger.overdue)
    for r, work in enumerate(steps):
        ledger.asked.update(ids[r])
        ledger.stamped.add((r, round_))
        outcome, value = _call("step", work, everything, row)
        if outcome != "ok":  # a failure of the pair only if the rollout died (events, seen)
            clean = False
            continue
        got = value[0]
        ledger.ok(f"{ROLLOUT} {r}")
        ledger.seen(f"rollout {r}", got["process"], [f"pair {r}"])
        if _part_outcome("pull", got["pull"], ledger, row):
            ledger.ok("weights")
            process, version, intact = got["pull"][1]
            ledger.pull(r, process, version, intact, floor)
        else:
            clean = False
        clean &= _part_outcome("put", got["put"], ledger, row)
        ledger.put_in.update(dict.fromkeys(got["put_ids"], round_))
        this_round += got["put_ids"]
        if _part_outcome("send", got["send"], ledger, row):
            ledger.sent[r, round_] = got["send"][1]
            ledger.route[r, round_] = "relayed" if got["node"] != ledger.reward_node else "direct"
            sent.append(r)
            if r not in ledger.overdue or wait_for_all:
                expect[r] = round_
        else:
            ledger.fail(f"pair {r}", f"round {round_}: send: {got['send'][1]}")
            clean = False
    outcome, value = _call("take", trainer.take(channel, len(this_round), ledger.took),
                           everything, row)
    if outcome == "ok":
        got = value[0]
        ledger.seen(TRAINER, got["process"], ["channel"])
        ledger.ok(TRAINER)
        if _part_outcome("take", got["take"], ledger, row):
            ledger.ok("channel host")
        else:
            ledger.fail("channel", f"round {round_}: take: {got['take'][1]}")
            clean = False
        have = ledger.took[1] if ledger.took[0] == got["process"] else 0
        ledger.taken(got["items"][have - got["first"]:], round_)
        ledger.took = (got["process"], got["first"] + len(got["items"]))
    else:  # its answer is lost, not its items (the next take repeats them)
        clean = False
    clean &= all(i in ledger.taken_in for i in this_round)
    pairs = [f"pair {r}" for r in range(len(ROLLOUT_NODES))]
    moved: set[int] = set()  # the ranks whose stamps (of any round) came this round
    outcome, value = _call("collect", reward.collect(expect, start, ledger.acked), everything,
                           row)
    came: dict[int, list[tuple[Any, ...]]] = collections.defaultdict(list)
    if outcome == "ok":
        got = value[0]
        ledger.ok(REWARD)
        ledger.seen(REWARD, got["process"], pairs)
        ledger.reward_node = got["node"]
        for seq, r, kind, what, detail, when in got["entries"]:
            if got["process"] == ledger.acked[0] and seq <= ledger.acked[1]:
                continue  # told before (and its acknowledgement did not arrive)
            came[r].append((kind, what))
            if kind == "stamp":
                ledger.received(r, got["process"], what, round_)
                ledger.received_at.setdefault((r, what), when)
                moved.add(r)
            else:
                ledger.fail(f"pair {r}", f"reward's recv: {what}: {detail}", when)
                if kind == "untyped":
                    ledger.failures.append(f"reward's recv from {r} raised {what}: {detail}")
            ledger.acked = (got["process"], seq)
    else:  # its answer is lost, not the news (the next collect repeats it)
        clean = False
    for r in sent:
        if (r, round_) in ledger.delivered_in:
            ledger.overdue.discard(r)
            continue
        clean = False
        ledger.notes.append(
            f"round {round_}: pair {r} ({ledger.route[r, round_]}): its send "
            f"returned, its stamp did not come within the round ({outcome}); the reward saw "
            f"{came[r] if outcome == 'ok' else value}; the pair's failures so far: "
            f"{ledger.trouble[f'pair {r}'][-3:]}")
        if ledger.explained(f"pair {r}", round_) or (r in ledger.overdue and r in moved):
            ledger.overdue.discard(r)  # failed, or moving again: waited for next round
        else:
            ledger.overdue.add(r)
    ledger.span[round_] = (start, time.time())
    return clean


@pytest.fixture
def grpo_chaos(tmp_path: Path) -> Iterator[tuple[Supervisor, str]]:
    """A `Supervisor` whose programs, and so their zygotes and workers, keep their runtime
    files (agents' log directories, lanes) in a fresh private directory of this test; for a
    post-mortem, the programs' stderr and the driver's aiorl and asyncio warnings (the
    groups' deaths and restarts, tasks that failed) go to files under ``tmp_path/logs``."""
    rundir = tempfile.mkdtemp(prefix="aiorl-chaos-")  # short: socket paths fit in 107 bytes
    logs = tmp_path / "logs"
    logs.mkdir()
    driver_log = logging.FileHandler(logs / "driver.log")
    driver_log.setLevel(logging.WARNING)
    driver_log.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in ("aiorl", "asyncio"):
        logging.getLogger(name).addHandler(driver_log)
    try:
        with _supervised(tmp_path, env={"XDG_RUNTIME_DIR": rundir}, log_dir=str(logs)) as sup:
            yield sup, rundir
    finally:
        for name in ("aiorl", "asyncio"):
            logging.getLogger(name).removeHandler(driver_log)
        driver_log.close()
        shutil.rmtree(rundir, ignore_errors=True)


def _tagged(rundir: str) -> list[int]:
    """The live processes that run with ``rundir`` as their runtime directory: everything
    this test's registry and agents started, wherever it was reparented."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if (p.environ().get("XDG_RUNTIME_DIR") == rundir
                    and p.status() != psutil.STATUS_ZOMBIE):
                found.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return found


def _files_left(rundir: str) -> list[str]:
    """What the stopped cluster left in its runtime directory beyond what aiorl keeps on
    purpose: the worker logs (``<agent dir>/*.log``) of at most KEPT_ENDED_AGENT_LOGS killed
    agents (aiorl/node/logdirs.py). Sockets (lanes) and anything else are leftovers."""
    parent = os.path.join(rundir, os.path.basename(agent_logs_parent()))
    left = []
    for root, _, files in os.walk(rundir):
        for name in files:
            path = os.path.join(root, name)
            inside = os.path.relpath(path, parent).split(os.sep)
            if (len(inside) == 2 and inside[0] != ".." and name.endswith(".log")
                    and os.path.isfile(path) and not os.path.islink(path)):
                continue  # a worker's log, kept for a post-mortem
            left.append(os.path.relpath(path, rundir))
    kept = os.listdir(parent) if os.path.isdir(parent) else []
    if len(kept) > KEPT_ENDED_AGENT_LOGS:
        left.append(f"{len(kept)} agent log directories (aiorl keeps {KEPT_ENDED_AGENT_LOGS})")
    return left


@pytest.mark.timeout(int(900 + 30 * ROUNDS))
def test_grpo_pipeline_under_system_chaos(grpo_chaos: tuple[Supervisor, str]) -> None:
    """Issue 51's system chaos. A trainer (node 0), 4 rollouts (2 per node, relayed to the
    reward across nodes, direct on its node), a reward worker (node 1), a channel (node 1)
    and the weights' directory (node 0), all ``restart="on_failure"``; each round the
    trainer publishes a version, each rollout pulls it, puts its items and sends the
    reward a stamped tensor, the trainer get_batches the items and the reward reports the
    stamps. Each round a chaos thread SIGKILLs or SIGSTOPs (0.5-4 s) one process of a
    random kind: rollout, trainer, reward, channel host, weights directory, zygote, node
    agent or registry.

    Checked (`Ledger`): every operation ends, with a result or a typed error, within its
    bound (0 hangs); every put that returned is taken once, and every stamp whose send
    returned is received once and in order, unless the channel host or trainer (items) or
    the pair (stamps) failed in that round (0 silent losses); every pulled version is whole
    and never older than one the same process pulled before; once the chaos stops the
    pipeline has a clean round within RECOVERY_S; and once it stops, no process of the
    cluster runs and nothing is left in its runtime directory but the worker logs aiorl
    keeps on purpose (0 leftovers). The summary table goes to stdout and stderr.
    """
    sup, rundir = grpo_chaos
    seed = int(os.environ.get("AIORL_CHAOS_SEED", "16"))
    ledger, table = Ledger(), SummaryTable()
    rng = random.Random(seed)
    rounds = 0
    t0 = time.monotonic()
    policy_: dict[str, Any] = {"restart": "on_failure", "max_restarts": 10_000, "backoff": 0.05}
    try:
        with aiorl.Cluster(registry=sup.address, num_nodes=2, key_file=sup.key_file,
                           log_to_driver=False, timeout=60) as cluster:
            channel = aiorl.Channel.create(cluster, GRPO_CHANNEL, maxsize=0, node_rank=1,
                                           restart="on_failure", max_restarts=10_000,
                                           backoff=0.05)
            directory = host_directory(cluster, WEIGHTS, node_rank=0)
            place = aiorl.placement.NodePlacementStrategy
            groups: dict[str, aiorl.WorkerGroup[Any]] = {
                TRAINER: Trainer.create_group().launch(cluster, place([0]), name=TRAINER,
                                                       **policy_),
                ROLLOUT: Rollout.create_group().launch(
                    cluster, place(list(ROLLOUT_NODES)), name=ROLLOUT,
                    env={"AIORL_P2P_DIRECT_PEERS": "0"}, **policy_),
                REWARD: Reward.create_group().launch(cluster, place([REWARD_NODE]),
                                                     name=REWARD, **policy_),
            }
            for g in groups.values():
                g.wait_ready(120)
            streams = {name: g.events() for name, g in groups.items()}
            streams[f"channel.{GRPO_CHANNEL}"] = channel.worker_group.events()
            streams[f"weights.{WEIGHTS}"] = directory.events()
            chaos = RoundChaos(sup, seed)
            started = time.monotonic()
            for who in (TRAINER, REWARD, "channel host", "weights",
                        *(f"{ROLLOUT} {r}" for r in range(len(ROLLOUT_NODES)))):
                ledger.ok(who)
            noted = 0
            stuck: list[str] = []
            try:
                while rounds < ROUNDS and (rounds < MIN_ROUNDS
                                           or time.monotonic() - started < ROUNDS_WINDOW_S):
                    rounds += 1
                    row = SummaryTable.blank()
                    chaos.begin(rounds)
                    try:
                        _grpo_round(rounds, groups, channel, ledger, row, rng)
                    finally:
                        action = chaos.finish()
                        row["rounds"], row["missed"] = 1, int(action.pid is None)
                        table.add(action.kind, action.signal, row)
                        _events(streams, ledger)
                    if os.environ.get("AIORL_CHAOS_VERBOSE"):
                        sys.stderr.write(f"round {rounds}: {action} {dict(row['ops'])} "
                                         f"{row['max_s']:.1f} s\n")
                        for note in ledger.notes[noted:]:
                            sys.stderr.write(f"  {note}\n")
                    noted = len(ledger.notes)
                    stuck = ledger.stuck()
                    if stuck:  # the rest of the run would repeat it: stop, say where it is
                        ledger.failures.append(
                            f"stuck: every operation on {', '.join(stuck)} failed for "
                            f"{STUCK_S:g} s (until round {rounds}); {_node_lists(cluster)}; "
                            f"{_rank_states(list(groups.values()))}; see {sup.log_dir}")
                        break
                # The chaos is over: the pipeline has a clean round within RECOVERY_S.
                deadline = time.monotonic() + RECOVERY_S
                while not stuck:
                    rounds += 1
                    row = SummaryTable.blank()
                    row["rounds"] = 1
                    clean = _grpo_round(rounds, groups, channel, ledger, row, rng,
                                        wait_for_all=True)
                    table.add("(recovery)", "-", row)
                    _events(streams, ledger)
                    if clean:
                        break
                    if time.monotonic() > deadline:
                        ledger.failures.append(
                            f"no clean round within {RECOVERY_S:g} s of the chaos's end: "
                            f"{_node_lists(cluster)}; {_rank_states(list(groups.values()))}")
                        break
            except Hang as exc:
                ledger.hangs.append(str(exc))
            finally:
                sup._stop.set()  # no more chaos: what it stopped resumes, the groups close
                for pid in list(sup.stopped):
                    sup.resume(pid)
    finally:
        left = sup.descendants()
        sup.close()
        gone = gone_within(left, 10)
        tagged = _tagged(rundir)
        files = _files_left(rundir)
        report = _system_chaos_report(table, ledger, seed, rounds, time.monotonic() - t0,
                                      tagged, files, gone, sup.log_dir)
        print(report)
        sys.stderr.write(report + "\n")
    assert not ledger.hangs, ledger.hangs[:5]
    assert not ledger.failures, ledger.failures[:10]
    assert gone and not tagged, f"processes left running: {tagged}"
    assert not files, f"files left behind: {files[:20]}"
    chaos_rounds = sum(r["rounds"] for k, r in table.rows.items() if k[0] != "(recovery)")
    assert chaos_rounds >= MIN_ROUNDS, chaos_rounds


def _system_chaos_report(table: SummaryTable, ledger: Ledger, seed: int, rounds: int,
                         took: float, tagged: list[int], files: list[str], gone: bool,
                         logs: str | None) -> str:
    """The summary table: per victim kind and signal, the rounds, the rounds whose victim
    was not there to signal (missed), the operations' outcomes and the longest one; then the
    totals, and every broken invariant."""
    counts = ledger.verdict()
    chaos_rounds = sum(r["rounds"] for k, r in table.rows.items() if k[0] != "(recovery)")
    ops: Counter[str] = Counter()
    for r in table.rows.values():
        ops.update(r["ops"])
    total = sum(ops.values())
    leftovers = len(tagged) + len(files) + (not gone)
    taken = sum(1 for i in ledger.put_in if i in ledger.taken_in)
    relayed = sum(1 for key in ledger.sent if ledger.route[key] == "relayed")
    delivered = sum(1 for k in ledger.sent if k in ledger.delivered_in)
    weights_bad = sum("pulled version" in f for f in ledger.failures)
    head = (f"system chaos (seed {seed}): bounds: driver call {OPERATION_BOUND_S:g} s, worker "
            f"part {PART_BOUND_S:g} s, p2p delivery {DELIVERY_BOUND_S:g} s, take wait "
            f"{TAKE_WAIT_S:g} s, weights wait {WEIGHT_WAIT_S:g} s; a loss is explained by a "
            f"failure seen within {EXPLAIN_LAG_S:g} s of its round")
    tail = [
        f"totals: {chaos_rounds} chaos rounds (+{rounds - chaos_rounds} to recover) in "
        f"{took:.0f} s, {total} operations ({ops['ok']} ok, {total - ops['ok']} typed errors), "
        f"hangs {len(ledger.hangs)}, silent losses {counts['silent losses']}, leftovers "
        f"{leftovers} ({len(tagged)} processes, {len(files)} files)",
        f"channel: {len(ledger.put_in)} puts returned, {taken} taken once "
        f"({counts['items late']} in a later round), {counts['items lost with a failure']} "
        "lost with their host or trainer",
        f"p2p: {len(ledger.sent)} sends returned ({relayed} relayed, "
        f"{len(ledger.sent) - relayed} direct), {delivered} received once in order "
        f"({counts['stamps late']} in a later round), {counts['stamps lost with a failure']} "
        "lost with their pair",
        f"weights: {ledger.tried - ledger.publish_failed} versions published "
        f"({ledger.publish_failed} publishes failed), {sum(map(len, ledger.pulled.values()))} "
        f"pulls by {len(ledger.pulled)} subscriber processes, {weights_bad} torn, outside the "
        "published range or going back",
    ]
    lines = [table.render(head, tail)]
    problems = ledger.hangs + ledger.failures
    lines += [f"FAILED: {p}" for p in problems[:40]]
    if problems:  # for the post-mortem: the stamps that missed their round, and why not
        lines += [f"note: {n[:600]}" for n in ledger.notes[:20]]
        lines.append(f"post-mortem: the programs' stderr and the driver's warnings are in {logs}")
    return "\n".join(lines)

class LaneTarget(aiorl.Worker):
    """A worker whose callers reach it by lane, and that can break its own end of them."""

    async def echo(self, i: int) -> int:
        await asyncio.sleep(0.001 * (i % 5))
        return i

    def slow(self, i: int) -> int:  # the method thread answers, from another thread
        time.sleep(0.002)
        return i

    async def break_lanes(self) -> int:
        """Shut every lane of its callers down at its end (a reset from the server)."""
        from aiorl.runtime.runtime import current_runtime

        runtime = current_runtime()
        assert runtime is not None
        return _shut_down([conn.sock for conn in runtime.endpoint._lanes.values()])


def _shut_down(socks: list) -> int:
    """Reset connections as a crashing peer or a kernel would: both ends see them break."""
    import socket as socket_module

    for sock in socks:
        sock.shutdown(socket_module.SHUT_RDWR)
    return len(socks)


async def _break_driver_lane(endpoint, address: str) -> int:
    """The driver's end of its lane to ``address``, reset on the driver's loop."""
    return _shut_down([endpoint._peers[address].connection.sock])


LANE_BREAKS = int(os.environ.get("AIORL_CHAOS_LANE_BREAKS", "6"))


def test_calls_end_while_lanes_break_under_load():
    """Lanes broken from either end while calls are in flight: every call is answered or
    fails with a typed error (ConnectionLostError when neither its answer nor a verdict
    came), none waits for ever, and calls after the breaks are answered (by ZMQ)."""
    with aiorl.Cluster(num_nodes=1, timeout=60, log_to_driver=False) as cluster:
        group = LaneTarget.create_group().launch(cluster, num_workers=LANE_BREAKS,
                                                 name="lanechaos")
        try:
            group.echo(0).wait(60)
            endpoint = cluster.runtime.endpoint
            addresses = [info.endpoint for info in group.worker_info_list]
            assert all(endpoint.connection_kind(a) == "lane" for a in addresses)
            rng = random.Random(int(os.environ.get("AIORL_CHAOS_SEED", "16")))
            outcomes: Counter[str] = Counter()
            broken = {"driver": 0, "worker": 0}
            order = list(range(LANE_BREAKS))
            rng.shuffle(order)
            t0 = time.monotonic()
            for n, rank in enumerate(order):
                view = group.execute_on(rank)
                works = [view.echo(i) if i % 2 else view.slow(i) for i in range(300)]
                expected = list(range(300))
                if n % 2:  # the worker resets its end; its own answer may be lost with it
                    works.append(view.break_lanes())
                    expected.append(1)
                    broken["worker"] += 1
                else:
                    broken["driver"] += cluster.runtime.run_sync(
                        _break_driver_lane(endpoint, addresses[rank]), timeout=30)
                works += [view.echo(i) for i in range(300, 400)]
                expected += range(300, 400)
                for i, work in enumerate(works):
                    try:
                        got = work.wait(OPERATION_BOUND_S)
                        assert got == [expected[i]], (got, expected[i])
                        outcomes["answered"] += 1
                    except aiorl.WaitTimeout as exc:
                        raise AssertionError(f"call {i} to rank {rank} waited for ever") from exc
                    except aiorl.AiorlError as exc:
                        outcomes[type(exc).__name__] += 1
            after = group.echo(7).wait(60)
            assert after == [7] * LANE_BREAKS
            assert all(endpoint.connection_kind(a) == "zmq" for a in addresses)
            report = (f"lane chaos: {sum(broken.values())} lanes broken ({broken}) under "
                      f"{sum(outcomes.values())} calls in {time.monotonic() - t0:.1f} s: "
                      f"{dict(outcomes)}; every call ended, later calls answered by ZMQ")
            print(report)
            sys.stderr.write(report + "\n")
            assert set(outcomes) <= {"answered", "ConnectionLostError"}, outcomes
        finally:
            group.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", ["node agent", "receiving worker"])
def test_relayed_stream_when_the_receivers_side_is_killed_mid_stream(chaos, victim):
    """A pair relayed through both node agents (``AIORL_P2P_DIRECT_PEERS=0``) streams
    stamped 1 MiB messages; the receiver's node agent (its zygote and workers die with it)
    or the receiving worker is SIGKILLed mid-stream. The sender fails with PeerLostError
    (no hang), the receiver got a prefix of the stream in order, the sending agent never
    held more than the per-receiver bound, and nothing outlives its agent (the fixture)."""
    from aiorl.node.p2p_relay import DEFAULT_DEST_BYTES
    from tests.system.test_relay_flow import RELAY_ENV, SLACK, F, Sampler, until

    with aiorl.Cluster(registry=chaos.address, num_nodes=2, key_file=chaos.key_file,
                       log_to_driver=False, timeout=60) as cluster:
        g = F.create_group().launch(cluster, aiorl.placement.NodePlacementStrategy([0, 1]),
                                    name="relaychaos", env=RELAY_ENV)
        assert len(set(g.node().wait(60))) == 2
        receiver_pid = g.execute_on(1).pid().wait(30)[0]
        recv = g.execute_on(1).drain(0, 10)
        assert g.execute_on(0).stream(1, 10).wait(60) == [[10, ""]]
        assert recv.wait(60) == [[10, True, ""]]
        with chaos._lock:  # the supervisor restarts a killed agent: not while we look
            sender_agent, receiver_agent = chaos.agents[0].pid, chaos.agents[1].pid
        sampler = Sampler(sender_agent)
        drain = g.execute_on(1).drain(0, 0)
        stream = g.execute_on(0).stream(1, 0)
        assert until(lambda: g.execute_on(1).received().wait(10)[0] >= 30, 60)
        os.kill(receiver_agent if victim == "node agent" else receiver_pid, signal.SIGKILL)
        t_kill = time.monotonic()
        sent, error = _bounded("the relayed stream", stream, g)[0]
        took = time.monotonic() - t_kill
        assert error == "PeerLostError", (sent, error)
        try:
            got, ordered, _ = drain.wait(30)[0]
            assert ordered and got <= sent, (got, sent)
        except aiorl.AiorlError:
            pass  # the receiver died before it could answer: its prefix is unknown
        back = until(lambda: sampler.now()[0] <= sampler.before[0] + SLACK, 2.0)
        sampler.stop()
        line = sampler.report(f"relayed chaos, {victim} killed: {sent} MiB sent, the sender "
                              f"failed {took:.1f} s after the kill; sending agent",
                              sampler.now())
        sys.stderr.write(line + "\n")
        assert sampler.peak_rss <= sampler.before[0] + DEFAULT_DEST_BYTES, line
        assert back, line
        g.close()
