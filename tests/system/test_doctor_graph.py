"""``aiorl doctor``'s one wait-for graph: hangs that cross mechanisms, planted in real processes.

* the RL pipeline deadlock: the trainer waits ``get_batch`` on channel 'traj' for items the
  rollouts put only after ``weight_subscriber('policy').wait_for(v)``, and the trainer
  publishes version v only after that batch: one DEADLOCK naming the channel, the weight
  name and the versions (and never "no producer alive": the producers are alive);
* a ``wait_for`` on a weight name nobody publishes: NO PUBLISHER;
* a cycle of calls through ``async def`` methods across three groups: a DEADLOCK;
* a broadcast one member never calls: a STRAGGLER naming it;
* a ``get_batch`` whose producers all returned: NO PRODUCER AT WORK;
* no false alarm: the same pipeline without the off-by-one, with slow steps, is never
  reported while it runs.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import aiorl
from tests.system.test_doctor import _until as until_true

pytestmark = pytest.mark.timeout(120)


class Trainer(aiorl.Worker):
    async def train(self, channel: str, weights: str, steps: int, batch: int) -> int:
        """Publish version 0, then per step: take a batch, publish the next version."""
        ch = self.connect_channel(channel)
        pub = self.weight_publisher(weights)
        sd = {"w": torch.zeros(16)}
        await pub.publish(sd, 0)
        for step in range(steps):
            await ch.get_batch(batch)
            sd["w"].fill_(step + 1)
            await pub.publish(sd, step + 1)
        return steps


class Rollout(aiorl.Worker):
    async def generate(self, channel: str, weights: str, steps: int, lag: int,
                       slow: float = 0.0) -> int:
        """Per step: wait for version ``step + lag`` (1 is the off-by-one that deadlocks: the
        trainer publishes it only after a batch of this step's items), then put one item."""
        ch = self.connect_channel(channel)
        sub = self.weight_subscriber(weights)
        for step in range(steps):
            await sub.wait_for(step + lag)
            await asyncio.sleep(slow)
            await ch.put(step, weight=1)
        return steps

    async def wait_version(self, weights: str, version: int) -> int:
        return await self.weight_subscriber(weights).wait_for(version)


class Ring(aiorl.Worker):
    """``ask`` calls the next group's ``ask``; ``answer`` waits for this worker's own ``ask``
    to return. With a `Closer` at the end calling the first one's ``answer``: a cycle of
    calls through async methods."""

    def __init__(self, next_group: str) -> None:
        super().__init__()
        self.next_group = next_group
        self.done = asyncio.Event()

    async def ask(self) -> str:
        group = await self.async_group(self.next_group)
        try:
            return (await group.ask())[0]
        finally:
            self.done.set()

    async def answer(self) -> str:
        await self.done.wait()
        return "answered"


class Closer(aiorl.Worker):
    def __init__(self, first_group: str) -> None:
        super().__init__()
        self.first_group = first_group

    async def ask(self) -> str:
        group = await self.async_group(self.first_group)
        return (await group.answer())[0]


class Feeder(aiorl.Worker):
    async def feed(self, channel: str, n: int) -> int:
        ch = self.connect_channel(channel)
        for i in range(n):
            await ch.put(i, weight=1)
        return n


class Eater(aiorl.Worker):
    async def eat(self, channel: str, weight: int) -> int:
        return len(await self.connect_channel(channel).get_batch(weight))


class Member(aiorl.Worker):
    async def share(self, skip: int) -> object:
        """Every rank but ``skip`` calls one broadcast from rank 0 over the group; ``skip``
        is busy elsewhere (for longer than the test)."""
        if self.rank == skip:
            await asyncio.sleep(600)
            return None
        group = [(self.worker_group_name, [0, 1, 2])]
        return await self.broadcast("hello" if self.rank == 0 else None, group,
                                    (self.worker_group_name, 0), async_op=True)


def _until(predicate, timeout: float = 30.0):
    """`tests.system.test_doctor._until`, with this file's longer default bound."""
    return until_true(predicate, timeout, 0.5)


def test_trainer_and_rollouts_deadlock_through_a_channel_and_weights(cluster):
    aiorl.Channel.create(cluster, "traj")
    trainer = Trainer.create_group().launch(cluster, num_workers=1, name="trainer")
    rollouts = Rollout.create_group().launch(cluster, num_workers=2, name="rollout")
    try:
        trainer.wait_ready(120)
        rollouts.wait_ready(120)
        training = trainer.train("traj", "policy", 3, 2)
        generating = rollouts.generate("traj", "policy", 3, lag=1)

        def found() -> aiorl.cluster.doctor.DoctorReport | None:
            report = cluster.doctor()
            return report if report.deadlocks else None

        report = _until(found)
        assert report is not None, "no deadlock found"
        assert report.exit_code == 1
        text = "\n".join(report.findings)
        # One line for both rollouts, from the trainer: the channel, the weight name and
        # versions, and how long the rollouts waited.
        (line,) = report.findings
        assert line.startswith(
            "DEADLOCK: trainer:0 waits get_batch on channel 'traj', which waits a put from "
            "rollout:0 and rollout:1, which each wait wait_for version >= 1 (latest 0) on "
            "weights 'policy' for "), line
        assert line.endswith(" s, which waits a publish from trainer:0 (a cycle: none of them "
                             "can go on)"), line
        assert "no producer alive" not in text, text
        assert not training.done() and not generating.done()
    finally:
        trainer.close()
        rollouts.close()


def test_a_wait_for_on_a_name_nobody_publishes(cluster):
    rollouts = Rollout.create_group().launch(cluster, num_workers=1, name="orphan")
    try:
        rollouts.wait_ready(120)
        waiting = rollouts.wait_version("ghost", 1)

        def found() -> aiorl.cluster.doctor.DoctorReport | None:
            report = cluster.doctor()
            return report if report.dead_peer_waits else None

        report = _until(found)
        assert report is not None, "no finding"
        (text,) = [f for f in report.findings if f.startswith("NO PUBLISHER")]
        assert text.startswith("NO PUBLISHER: orphan:0 waits wait_for version >= 1 (latest "
                               "none) on weights 'ghost' for "), text
        assert text.endswith("and no live process publishes 'ghost'"), text
        assert report.exit_code == 1
        assert not waiting.done()
    finally:
        rollouts.close()


def test_a_call_cycle_through_async_methods_across_three_groups(cluster):
    a = Ring.create_group("ring-b").launch(cluster, num_workers=1, name="ring-a")
    b = Ring.create_group("ring-c").launch(cluster, num_workers=1, name="ring-b")
    c = Closer.create_group("ring-a").launch(cluster, num_workers=1, name="ring-c")
    try:
        for g in (a, b, c):
            g.wait_ready(120)
        # a.ask -> b.ask -> c.ask -> a.answer, which waits for a.ask to return.
        stuck = a.ask()

        def found() -> aiorl.cluster.doctor.DoctorReport | None:
            report = cluster.doctor()
            return report if report.deadlocks else None

        report = _until(found)
        assert report is not None, "no deadlock found"
        text = "\n".join(report.findings)
        assert "DEADLOCK: ring-a:0 waits a call answered by ring-b:0, which waits a call " \
               "answered by ring-c:0, which waits a call answered by ring-a:0" in text, text
        assert not stuck.done()
    finally:
        for g in (a, b, c):
            g.close()


def test_a_broadcast_member_that_never_calls_is_named(cluster):
    members = Member.create_group().launch(cluster, num_workers=3, name="bmember")
    try:
        members.wait_ready(120)
        sharing = members.share(2)

        def found() -> aiorl.cluster.doctor.DoctorReport | None:
            report = cluster.doctor()
            return report if report.stragglers else None

        report = _until(found)
        assert report is not None, "no finding"
        (text,) = report.findings
        assert text.startswith("STRAGGLER: bmember:0's broadcast #0 to 3 members: 2 of 3 "
                               "called it; still waiting after "), text
        assert text.endswith(" s for bmember:2, which never called broadcast"), text
        assert report.exit_code == 0  # it may still call: a straggler, not a hang
        assert not sharing.done()
    finally:
        members.close()


def test_a_get_batch_whose_producers_all_finished(cluster):
    aiorl.Channel.create(cluster, "leftovers")
    feeders = Feeder.create_group().launch(cluster, num_workers=2, name="feeder")
    eater = Eater.create_group().launch(cluster, num_workers=1, name="eater")
    try:
        assert feeders.feed("leftovers", 2).wait(60) == [2, 2]
        eating = eater.eat("leftovers", 5)  # 4 items exist: the batch never completes

        def found() -> aiorl.cluster.doctor.DoctorReport | None:
            report = cluster.doctor(interval=1.0)
            return report if report.idle_waits else None

        report = _until(found)
        assert report is not None, "no finding"
        (text,) = report.findings
        assert text == ("NO PRODUCER AT WORK: eater:0 waits get_batch on channel 'leftovers', "
                        "which is empty; its producers (feeder:0, feeder:1) are alive but run "
                        "nothing (their calls returned): nothing will put into it unless a new "
                        "call is made"), text
        assert report.exit_code == 0
        assert not eating.done()
    finally:
        feeders.close()
        eater.close()


def test_a_healthy_pipeline_with_slow_steps_is_never_reported(cluster):
    aiorl.Channel.create(cluster, "healthy")
    trainer = Trainer.create_group().launch(cluster, num_workers=1, name="htrainer")
    rollouts = Rollout.create_group().launch(cluster, num_workers=2, name="hrollout")
    try:
        trainer.wait_ready(120)
        rollouts.wait_ready(120)
        steps = 12
        training = trainer.train("healthy", "hpolicy", steps, 2)
        generating = rollouts.generate("healthy", "hpolicy", steps, lag=0, slow=0.4)
        seen = 0
        while not training.done():
            report = cluster.doctor()
            assert report.findings == [], report.findings
            seen += 1
            time.sleep(0.3)
        assert training.wait(60) == [steps]
        assert generating.wait(60) == [steps, steps]
        assert seen >= 3, "the pipeline ended before the doctor looked at it"
    finally:
        trainer.close()
        rollouts.close()


def test_a_wait_any_producer_can_end_is_no_deadlock_while_one_is_free():
    """The graph's rule without processes: every wait is an "any of" wait, so a trainer fed
    by two rollouts, one of which waits for the trainer's weights, is not stuck while the
    other rollout runs; once both wait, the cycles are one deadlock told in one line."""
    from aiorl.cluster.doctor import Wait, _cycles, _merged, _sentence, _stuck

    edges = [Wait("t:0", "channel 'c'", "get_batch on"),
             Wait("channel 'c'", "r:0", "a put from"), Wait("channel 'c'", "r:1", "a put from"),
             Wait("r:0", "weights 'w'", "wait_for version >= 1 (latest 0) on", 3.0),
             Wait("weights 'w'", "t:0", "a publish from")]
    assert _stuck(edges, {}) == set()  # r:1 runs: it may put
    both = [*edges, Wait("r:1", "weights 'w'", "wait_for version >= 1 (latest 0) on", 4.0)]
    stuck = _stuck(both, {})
    assert stuck == {"t:0", "r:0", "r:1", "channel 'c'", "weights 'w'"}
    (cycle,) = _merged(_cycles(both))
    assert _sentence(cycle) == (
        "t:0 waits get_batch on channel 'c', which waits a put from r:0 and r:1, which each "
        "wait wait_for version >= 1 (latest 0) on weights 'w' for 4.0 s, which waits a "
        "publish from t:0")
    # A dead producer is never free: the other one alone decides.
    assert _stuck(edges, {"r:1": "dead"}) == {"t:0", "r:0", "channel 'c'", "weights 'w'"}
