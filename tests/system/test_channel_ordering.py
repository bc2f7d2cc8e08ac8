"""Channels: one consumer sees one producer's items in queue order, prefetch included.

Each test makes one interleaving of the consumer's handle and the channel worker happen
every time (docs/ordering.md, Channels): by the order of operations issued in one loop
turn (they reach the channel worker in one message and are handled in that order), or
by stopping the channel worker (``SIGSTOP``) so that an answer arrives only after the
handle's own timers fired, as under heavy machine load.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

import aiorl
from aiorl.channels import Channel, settings

pytestmark = pytest.mark.timeout(60)


def _channel_pid(c: aiorl.Cluster, name: str) -> int:
    reply = c.runtime.run_sync(c.runtime.registry.request("lookup", {"name": f"channel.{name}:0"}))
    return int(reply["info"]["pid"])


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


async def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait (bounded) until it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while not _stopped(pid):
        assert time.monotonic() < deadline, f"channel worker {pid} did not stop"
        await asyncio.sleep(0.001)


def _fill(ch: Channel, n: int) -> None:
    """Put ``0 .. n-1`` and wait until every one is in the queue."""
    for i in range(n):
        ch.put(i, weight=1)
    ch.flush().wait(10)


@pytest.fixture
def stoppable(cluster: aiorl.Cluster, request: pytest.FixtureRequest) -> Iterator[tuple[Channel, int]]:
    """A fresh channel and its worker's pid; the worker is continued and destroyed after."""
    name = request.node.name.replace("[", "-").replace("]", "")
    ch = Channel.create(cluster, name)
    pid = _channel_pid(cluster, name)
    try:
        yield ch, pid
    finally:
        os.kill(pid, signal.SIGCONT)
        ch.destroy().wait(10)


def test_prefetch_in_flight_when_the_consumer_pauses_cannot_overtake_returned_items(
        cluster: aiorl.Cluster, stoppable: tuple[Channel, int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reorder seen under load as ``[0, 1, 2, 4, 3]``.

    A consumer served from prefetched items triggers a new prefetch, then pauses.
    The idle timer used to send the prefetched items back to the queue at once,
    while that prefetch was still on its way with *newer* items: those then went
    to the consumer's next gets, before the older items now back in the queue.
    """
    # A pause is "idle" after this long (5 ms by default): long enough that the gets
    # of one loop turn below count as streaming however loaded the machine is.
    monkeypatch.setattr(settings, "PREFETCH_IDLE", 0.25)
    ch, pid = stoppable
    n = 16
    _fill(ch, n)

    async def consume() -> list[Any]:
        burst = [ch.get() for _ in range(3)]  # gets in one turn: the handle prefetches
        got = [await w for w in burst]
        await _stop(pid)  # from now on, nothing the handle asks for is answered
        stream = ch._bind()[1].streams["default"]
        while not stream.requested:  # gets served from prefetched items, until one of
            work = ch.get()          # them makes the handle prefetch more
            assert work.done(), "not served from prefetched items"
            got.append(await work)
        assert stream.ready, "precondition: prefetched items left while a prefetch is out"
        await asyncio.sleep(3 * settings.PREFETCH_IDLE)  # the consumer pauses: the idle timer fires
        os.kill(pid, signal.SIGCONT)
        rest = [ch.get() for _ in range(n - len(got))]
        got += [await asyncio.wait_for(w, 10) for w in rest]
        return got

    assert cluster.runtime.run_sync(consume(), 30) == list(range(n))


def test_gets_waiting_keep_their_items_when_statistics_returns_prefetched_ones(
        cluster: aiorl.Cluster, stoppable: tuple[Channel, int]) -> None:
    """Two gets and then ``statistics()`` in one loop turn, on a queue that has items.

    The second get prefetches (the gets follow each other closely); ``statistics``
    must first see the prefetched items back in the queue. Withdrawing the gets' own
    requests for that, while keeping the newer prefetch, gave the gets the prefetched
    items and sent their own (older) items back: ``[2, 3]``, then 0 and 1.
    """
    ch, _ = stoppable
    n = 10
    _fill(ch, n)

    async def consume() -> tuple[list[Any], int]:
        gets = [ch.get(), ch.get()]
        stats = ch.statistics()
        got = [await w for w in gets]
        qsize = (await stats)["default"].qsize
        got += [await asyncio.wait_for(ch.get(), 10) for _ in range(n - len(got))]
        return got, qsize

    assert cluster.runtime.run_sync(consume(), 30) == (list(range(n)), n - 2)


def test_a_get_after_a_cancelled_one_takes_the_item_the_cancelled_one_gives_back(
        cluster: aiorl.Cluster, stoppable: tuple[Channel, int]) -> None:
    """Gets A and B wait; items 0, 1, 2 arrive and B is cancelled in the same turn, then
    get C is issued. B's request had already taken item 1, which comes back refused: C
    must get 1, not 2 (its request used to overtake the return of item 1)."""
    ch, _ = stoppable

    async def consume() -> list[Any]:
        first = ch.get()
        await asyncio.sleep(0.05)  # spaced out: these gets do not prefetch
        cancelled = ch.get()
        await asyncio.sleep(0.05)
        for i in range(3):
            ch.put(i, weight=1)  # reach the channel after both gets are parked there
        cancelled.cancel()
        later = ch.get()
        got = [await asyncio.wait_for(w, 10) for w in (first, later)]
        return got + [await asyncio.wait_for(ch.get(), 10)]

    assert cluster.runtime.run_sync(consume(), 30) == [0, 1, 2]


def test_a_get_after_a_cancelled_get_batch_takes_the_items_it_gives_back(
        cluster: aiorl.Cluster, stoppable: tuple[Channel, int]) -> None:
    """A waiting ``get_batch(2)`` is completed by items 0 and 1 and cancelled in the same
    turn; a get issued next must get 0 once the batch's items are back, not item 2."""
    ch, _ = stoppable

    async def consume() -> list[Any]:
        batch = ch.get_batch(2)
        await asyncio.sleep(0.05)
        for i in range(3):
            ch.put(i, weight=1)
        batch.cancel()
        gets = [ch.get() for _ in range(3)]
        return [await asyncio.wait_for(w, 10) for w in gets]

    assert cluster.runtime.run_sync(consume(), 30) == [0, 1, 2]


def test_gets_waiting_before_a_held_get_batch_are_served_before_it(
        cluster: aiorl.Cluster, stoppable: tuple[Channel, int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Streaming gets on an empty queue prefetch; a ``get_batch`` made then waits (held)
    for the prefetches, which come back empty. The gets they were to serve must get
    their own requests *before* the batch is sent: they used to get none until a later
    get, and the batch (made after them) took the first items."""
    monkeypatch.setattr(settings, "PREFETCH_IDLE", 0.25)  # the gets below count as streaming
    ch, _ = stoppable

    async def consume() -> list[Any]:
        gets = [ch.get() for _ in range(4)]
        batch = ch.get_batch(1)
        last = ch.get()
        await asyncio.sleep(0.05)  # everything above reached the channel: nothing queued
        for i in range(6):
            ch.put(i, weight=1)
        return [await asyncio.wait_for(w, 10) for w in [*gets, batch, last]]

    assert cluster.runtime.run_sync(consume(), 30) == [0, 1, 2, 3, [4], 5]


def test_a_cancelled_get_does_not_let_a_later_get_overtake_a_get_batch(
        cluster: aiorl.Cluster, stoppable: tuple[Channel, int]) -> None:
    """Gets A and B wait, then ``get_batch`` T, then get C, on an empty queue; A is
    cancelled, then items arrive. The requests sent for A and B are ahead of T at the
    channel worker, C's is behind it: cancelling A must withdraw one *ahead* of T, or
    B's spare request serves C, which gets an older item than T made before it."""
    ch, _ = stoppable

    async def consume() -> list[Any]:
        cancelled = ch.get()
        works = []
        for make in (ch.get, lambda: ch.get_batch(1), ch.get):
            await asyncio.sleep(0.05)  # spaced out: these gets do not prefetch
            works.append(make())
        await asyncio.sleep(0.05)
        cancelled.cancel()
        for i in range(3):
            ch.put(i, weight=1)
        return [await asyncio.wait_for(w, 10) for w in works]

    assert cluster.runtime.run_sync(consume(), 30) == [0, [1], 2]


# ---------------------------------------------------------------------- several consumers
class Taker(aiorl.Worker):
    """Producer and consumer of the tests with several processes on one queue."""

    async def take(self, ch: Channel, n: int, key: str = "default") -> list[Any]:
        return [await asyncio.wait_for(ch.get(key), 20) for _ in range(n)]

    async def produce(self, ch: Channel, n: int, key: str) -> int:
        for i in range(n):
            await ch.put((self.rank, i), weight=1, key=key)  # awaited one by one, as users do
        await ch.flush()
        return n

    async def consume(self, ch: Channel, key: str) -> list[Any]:
        got: list[Any] = []
        while (item := await asyncio.wait_for(ch.get(key), 60)) != "STOP":
            got.append(item)
        return got


@pytest.fixture(scope="module")
def takers(cluster: aiorl.Cluster) -> Iterator[Any]:
    group = Taker.create_group().launch(cluster, num_workers=4, name="takers")
    group.wait_ready()
    try:
        yield group
    finally:
        group.close()


def test_items_another_consumer_gave_back_never_reach_a_consumer_after_newer_ones(
        cluster: aiorl.Cluster, stoppable: tuple[Channel, int], takers: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27, item 1 (docs/ordering.md, several consumers).

    The driver streams three gets, so its handle prefetches, and then pauses holding
    prefetched items. A worker takes everything that is left. Its gets used to be served
    at once with the *newer* items; when the driver's idle timer gave its prefetched items
    back, the worker got them after those: producer order broken for that consumer. The
    channel worker now holds the worker's gets until the driver says it holds nothing.
    """
    monkeypatch.setattr(settings, "PREFETCH_IDLE", 0.5)  # the driver pauses "idle" for this long
    ch, _ = stoppable
    n = 40
    _fill(ch, n)

    async def hold_prefetched() -> tuple[list[Any], int]:
        burst = [ch.get() for _ in range(3)]  # gets in one turn: the handle prefetches
        got = [await w for w in burst]
        stream = ch._bind()[1].streams["default"]
        deadline = time.monotonic() + 10
        while stream.requested:  # its prefetch is answered: items kept for the next gets
            assert time.monotonic() < deadline
            await asyncio.sleep(0.001)
        return got, len(stream.ready)

    first, kept = cluster.runtime.run_sync(hold_prefetched(), 30)
    assert first == [0, 1, 2] and kept > 0, "precondition: the driver holds prefetched items"
    rest = takers.execute_on(0).take(ch, n - 3).wait(60)[0]
    assert rest == list(range(3, n))


@pytest.mark.timeout(600)
def test_two_producers_two_consumers_keep_each_producers_order_with_the_cpus_hogged(
        cluster: aiorl.Cluster, takers: Any) -> None:
    """The shape that broke order under load (issue 27, item 1): two producers put 1,500
    items each, awaiting every put, into a ``maxsize=16`` channel; two consumers get one
    at a time; two processes spin on the CPUs. Each consumer must see each producer's
    items in put order, in every one of 20 repetitions, and nothing lost or doubled."""
    ch = Channel.create(cluster, "two-by-two", maxsize=16)
    n, reps = 1500, 20
    producers, consumers = takers.execute_on(0, 1), takers.execute_on(2, 3)
    hogs = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
            for _ in range(2)]
    for hog in hogs:
        hog.start()
    try:
        for rep in range(reps):
            key = f"rep{rep}"
            consumed = consumers.consume(ch, key)
            assert producers.produce(ch, n, key).wait(120) == [n, n]
            for _ in range(2):
                ch.put("STOP", weight=1, key=key)
            per_consumer = consumed.wait(120)
            everything = sorted(item for got in per_consumer for item in got)
            assert everything == sorted((p, i) for p in range(2) for i in range(n)), rep
            for got in per_consumer:
                for p in range(2):
                    seq = [i for (src, i) in got if src == p]
                    assert seq == sorted(seq), f"repetition {rep}: producer {p} out of order"
    finally:
        for hog in hogs:
            hog.kill()
            hog.join(10)
        ch.destroy().wait(10)


def _spin() -> None:
    while True:
        pass
