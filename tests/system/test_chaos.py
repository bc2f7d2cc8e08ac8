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
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable

import psutil
import pytest
import torch

import aiorl
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

    async def pull_at_least(self, min_version: int) -> tuple[str, int, bool]:
        """Wait for ``min_version``, pull the newest: this process, the version, intact."""
        sub = self.weight_subscriber(WEIGHTS)
        await sub.wait_for(min_version, timeout=WEIGHT_WAIT_S)
        for t in self.weights.values():
            t.fill_(-1)
        version = await asyncio.wait_for(sub.pull(into=self.weights), WEIGHT_WAIT_S)
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
    systemd would), and a killer that SIGKILLs one of them or a worker at random times."""

    def __init__(self, tmp_path) -> None:
        self.key_file = str(tmp_path / "cluster.key")
        ClusterKeys.generate().save(self.key_file)

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
        assert gone_within(left, 10), "processes outlived their node agents"


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
        states = {g.worker_group_name: [
            (st.incarnation, st.restarting, st.address is not None, repr(st.error)[:80])
            for st in g._shared.ranks] for g in groups}
        raise AssertionError(f"{what} hung under chaos; ranks (incarnation, restarting, "
                             f"has address, error): {states}") from None


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
