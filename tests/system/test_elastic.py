"""Elastic groups (docs/failures.md, invariant 29): add_ranks / remove_ranks while calls
run; each call keeps the membership of the epoch it started in. Real processes."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

import aiorl
from aiorl.group.group_events import EventKind
from tests._processes import gone_within

pytestmark = pytest.mark.timeout(90)


class Roller(aiorl.Worker):
    def whoami(self) -> tuple[int, str]:
        return self.rank, os.environ["WORLD_SIZE"]

    def pid(self) -> int:
        return os.getpid()

    async def slow(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return self.rank


def test_grow_during_a_group_call_keeps_the_calls_epoch(cluster):
    group = Roller.create_group().launch(cluster, num_workers=2, name="growing")
    try:
        group.wait_ready(60)
        running = group.slow(1.0)  # epoch 0: ranks 0 and 1
        bigger = group.add_ranks(2)
        assert (group.epoch, bigger.epoch) == (0, 1)
        assert bigger.members == (0, 1, 2, 3) and bigger.world_size == 4
        assert running.wait(30) == [0, 1]  # not widened by the growth
        assert bigger.whoami().wait(60) == [(0, "2"), (1, "2"), (2, "4"), (3, "4")]
        assert group.whoami().wait(10) == [(0, "2"), (1, "2")]  # the old view keeps its ranks
        assert bigger.execute_on(3).slow(0).wait(10) == [3]
        events = bigger.events()
        kinds = [(e.kind, e.rank) for e in [events.get(timeout=5) for _ in range(2)]]
        assert kinds == [(EventKind.ADDED, 2), (EventKind.ADDED, 3)]
    finally:
        group.close()


def test_shrink_during_a_group_call_fails_only_what_names_the_removed_rank(cluster):
    group = Roller.create_group().launch(cluster, num_workers=3, name="shrinking")
    try:
        pids = group.pid().wait(60)
        involving = group.slow(30)  # names rank 1
        sparing = group.execute_on(0, 2).slow(0.5)
        time.sleep(0.2)
        smaller = group.remove_ranks([1])
        started = time.monotonic()
        with pytest.raises(aiorl.PeerLostError, match="removed"):
            involving.wait(10)
        assert time.monotonic() - started < 2
        assert sparing.wait(10) == [0, 2]
        assert smaller.epoch == 1 and smaller.members == (0, 2) and smaller.world_size == 2
        assert smaller.slow(0).wait(10) == [0, 2]
        with pytest.raises(aiorl.PeerLostError, match="removed"):
            group.slow(0).wait(10)  # an epoch-0 view still names rank 1
        with pytest.raises(IndexError):
            smaller.execute_on(1)
        assert gone_within([pids[1]], 10), "the removed rank's process kept running"
        # Rank numbers are never reused: the next rank is 3.
        regrown = smaller.add_ranks(1)
        assert regrown.members == (0, 2, 3) and regrown.epoch == 2
        assert regrown.slow(0).wait(60) == [0, 2, 3]
    finally:
        group.close()
