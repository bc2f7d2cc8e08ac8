"""The first messages between two workers: every one completes, in order, in bounded time.

Each round launches a fresh group (so every pair is new: nothing resolved, no set-up done)
and calls every rank at once, without waiting for the group to be ready, so a rank that
starts early sends to and receives from ranks still in ``__init__``. Every rank then sends
to every other rank and receives from it, in a random interleaving (receives posted before
or after the messages arrive), some ranks from their method thread and some from the event
loop, with payloads that take every CPU path on their first use: inline objects and
tensors, shared memory (a ``send`` of >= 256 KiB, which needs the ``p2p.hello`` set-up
first), the one-copy pull (``send_tensor`` of >= 1 MiB, set-up too) and, across nodes, ZMQ
frames. Each rank also greets a long-lived worker from ``__init__``, and every group name
is used by two groups in a row, so that worker gets first messages from a new process of a
name it knows as dead (the hang of docs/failures.md invariant 38). Each operation has its
own deadline; one that misses it is reported with the p2p state of the rank that waited
(what is in the Sender's backlog, the Inbox's queues).

``AIORL_FIRST_SEND_ROUNDS`` runs more rounds (the long stress run), and
``AIORL_FIRST_SEND_SEED`` replays one.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import sys
import time
from typing import Any

import pytest
import torch

import aiorl
from aiorl.group.group_events import EventKind
from aiorl.p2p import get_p2p
from aiorl.placement import NodePlacementStrategy

ROUNDS = int(os.environ.get("AIORL_FIRST_SEND_ROUNDS", "8"))
OP_TIMEOUT_S = float(os.environ.get("AIORL_FIRST_SEND_TIMEOUT", "15"))

pytestmark = pytest.mark.timeout(max(120, ROUNDS * 30))
# Ranks 0-1 and 2-3 share a node: same-node pairs take shm/CMA, the others ZMQ frames.
NODES = [0, 0, 1, 1]
HUB = "firsthub"

#: Message kinds: (sent with send_tensor, number of float32 elements).
KINDS: dict[str, tuple[bool, int]] = {
    "object": (False, 0),  # a small dict, inline
    "small_tensor": (True, 100),  # inline, into a recv_tensor buffer
    "shm": (False, 80_000),  # 320 KB: shared memory on one node (needs the set-up)
    "cma": (True, 300_000),  # 1.2 MB send_tensor: the receiver pulls it (needs the set-up)
}


def plan(seed: int, src: int, dst: int) -> list[str]:
    """The kinds of the messages ``src`` sends ``dst`` in round ``seed`` (both ends know it)."""
    rng = random.Random(f"{seed}/{src}>{dst}")
    return [rng.choice(list(KINDS)) for _ in range(rng.randint(1, 5))]


def payload(kind: str, seed: int, src: int, index: int) -> Any:
    """Message ``index`` of kind ``kind`` from ``src`` (the receiver rebuilds it to compare)."""
    value = float(seed * 1000 + src * 100 + index)
    n = KINDS[kind][1]
    if kind == "object":
        return {"value": value, "src": src}
    return torch.full((n,), value)


class FirstContact(aiorl.Worker):
    def __init__(self, seed: int, hub: str) -> None:
        super().__init__()
        # A first message before this rank is ready, to a worker that outlives the round
        # (and may know an earlier group of this name).
        self.send(f"hello from pid {os.getpid()}", hub, 0).wait(OP_TIMEOUT_S)
        # Ranks become ready at different times: early ones send to peers still starting.
        time.sleep(random.Random(f"{seed}/{self.rank}/init").random() * 0.3)

    def pid(self) -> int:
        return os.getpid()

    async def exchange(self, seed: int, world: int) -> tuple[list[str], float, Any]:
        """Send this round's messages to every peer and receive theirs, from the event loop.
        Returns what failed, how long it took and the paths set up toward each peer."""
        t0 = time.monotonic()
        started: list[Any] = []
        rng = random.Random(f"{seed}/{self.rank}/pauses")
        for op, peer in self._steps(seed, world):
            self._start(op, peer, seed, started)
            if rng.random() < 0.4:
                await asyncio.sleep(rng.random() * 0.01)
        failures: list[str] = []
        deadline = time.monotonic() + OP_TIMEOUT_S
        for what, work, check in started:
            try:
                remaining = max(0.01, deadline - time.monotonic())
                got = await asyncio.wait_for(work.async_wait(), remaining)
            except Exception as exc:  # noqa: BLE001 - reported with the p2p state
                failures.append(f"{self.rank}: {what}: {type(exc).__name__}: {exc}")
                continue
            if not check(got):
                failures.append(f"{self.rank}: {what}: wrong content")
        return self._report(failures), time.monotonic() - t0, self._probed(world)

    def exchange_from_thread(self, seed: int, world: int) -> tuple[list[str], float, Any]:
        """The same from the method thread (the operations reach the loop through ``submit``)."""
        t0 = time.monotonic()
        started: list[Any] = []
        rng = random.Random(f"{seed}/{self.rank}/pauses")
        for op, peer in self._steps(seed, world):
            self._start(op, peer, seed, started)
            if rng.random() < 0.4:
                time.sleep(rng.random() * 0.01)
        failures: list[str] = []
        deadline = time.monotonic() + OP_TIMEOUT_S
        for what, work, check in started:
            try:
                got = work.wait(max(0.01, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - reported with the p2p state
                failures.append(f"{self.rank}: {what}: {type(exc).__name__}: {exc}")
                continue
            if not check(got):
                failures.append(f"{self.rank}: {what}: wrong content")
        return self._report(failures), time.monotonic() - t0, self._probed(world)

    def _probed(self, world: int) -> dict[int, list[str]]:
        """By peer: the payload paths whose set-up question this rank asked it."""
        senders = get_p2p(self._runtime).statistics().senders
        out: dict[int, list[str]] = {}
        for peer in range(world):
            stats = senders.get(f"{self.worker_group_name}:{peer}")
            if stats is not None:
                out[peer] = sorted(n for n, p in stats.paths.items() if p.usable is not None)
        return out

    def _steps(self, seed: int, world: int) -> list[tuple[str, int]]:
        """This rank's sends to and receives from every peer, in a random order."""
        steps = [(op, p) for p in range(world) if p != self.rank for op in ("send", "recv")]
        random.Random(f"{seed}/{self.rank}/order").shuffle(steps)
        return steps

    def _start(self, op: str, peer: int, seed: int, out: list[Any]) -> None:
        """Start this round's sends to ``peer`` or receives from it; appends
        ``(description, work, check)`` for each."""
        group = self.worker_group_name
        src, dst = (self.rank, peer) if op == "send" else (peer, self.rank)
        for i, kind in enumerate(plan(seed, src, dst)):
            as_tensor = KINDS[kind][0]
            if op == "send":
                obj = payload(kind, seed, self.rank, i)
                work = (self.send_tensor if as_tensor else self.send)(obj, group, peer)
                out.append((f"send #{i} ({kind}) to {peer}", work, lambda _got: True))
                continue
            want = payload(kind, seed, peer, i)
            if as_tensor:
                buf = torch.empty_like(want)
                work = self.recv_tensor(buf, group, peer)
                check = functools.partial(_filled, buf, want)
            else:
                work = self.recv(group, peer)
                check = functools.partial(_same, want=want)
            out.append((f"recv #{i} ({kind}) from {peer}", work, check))

    def _report(self, failures: list[str]) -> list[str]:
        if failures:
            stats = get_p2p(self._runtime).statistics()
            failures.append(f"{self.rank}: p2p state: {stats}")
        return failures


def _filled(buf: torch.Tensor, want: torch.Tensor, got: Any) -> bool:
    return got is buf and torch.equal(buf, want)


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    return bool(got == want)


@pytest.fixture(scope="module")
def cluster2():
    with aiorl.Cluster(num_nodes=2) as c:
        yield c


@pytest.fixture(scope="module")
def hub(cluster2: Any):
    """A worker every round's ranks greet; its launch also warms both nodes' zygotes."""
    group = Greeter.create_group(None).launch(
        cluster2, name=HUB, placement_strategy=NodePlacementStrategy([0, 1])
    )
    group.wait_ready(120)
    yield group.execute_on(0)
    group.close()


def _run_round(cluster: Any, hub: Any, seed: int, name: str) -> tuple[list[str], int, float]:
    """One fresh group: every rank called at once, before any is known to be ready.
    Returns what failed, the number of messages, and the longest exchange (first operation
    started to last one done, in a worker)."""
    world = len(NODES)
    group = FirstContact.create_group(seed, HUB).launch(
        cluster, name=name, placement_strategy=NodePlacementStrategy(NODES)
    )
    try:
        rng = random.Random(f"{seed}/methods")
        calls = []
        for rank in range(world):
            view = group.execute_on(rank)
            method = view.exchange if rng.random() < 0.6 else view.exchange_from_thread
            calls.append(method(seed, world))
        failures: list[str] = []
        longest = 0.0
        for rank, call in enumerate(calls):
            try:
                failed, took, probed = call.wait(OP_TIMEOUT_S + 60)[0]
            except Exception as exc:  # noqa: BLE001 - the round's report names it
                failures.append(f"{rank}: the exchange call failed: {exc!r}")
                continue
            failures += failed
            longest = max(longest, took)
            for peer in range(world):
                if peer == rank or NODES[peer] != NODES[rank]:
                    continue
                for path in {"shm", "cma"} & set(plan(seed, rank, peer)):
                    if path not in probed.get(peer, ()):
                        failures.append(f"{rank}: no {path} set-up with {peer}: {probed}")
        pids = group.pid().wait(OP_TIMEOUT_S)
        for rank in range(world):
            try:
                greeting = hub.recv_from(name, rank).wait(OP_TIMEOUT_S + 10)[0]
            except Exception as exc:  # noqa: BLE001 - the round's report names it
                failures.append(f"hub: the greeting of {name}:{rank} failed: {exc!r}")
                continue
            if greeting != f"hello from pid {pids[rank]}":
                failures.append(f"hub: {name}:{rank} greeted {greeting!r}, not pid {pids[rank]}")
        messages = sum(len(plan(seed, s, d)) for s in range(world) for d in range(world) if s != d)
        return failures, messages + world, longest
    finally:
        group.close()


def test_first_sends_between_fresh_workers_complete(cluster2: Any, hub: Any) -> None:
    """Every pair's first messages, both directions at once, complete in order within the
    per-operation deadline (the first-send hang of issue 16 would miss it)."""
    base = int(os.environ.get("AIORL_FIRST_SEND_SEED", "0")) or random.randrange(1, 1 << 20)
    total = 0
    started = time.monotonic()
    longest = 0.0
    for r in range(ROUNDS):
        seed = base + r
        t0 = time.monotonic()
        # Every name twice in a row: a new group under the name of one just closed.
        failures, messages, took = _run_round(cluster2, hub, seed, f"first{base + r // 2}")
        total += messages
        longest = max(longest, took)
        print(
            f"round {r} seed {seed}: {messages} messages, exchange {took:.2f} s, "
            f"round {time.monotonic() - t0:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        assert not failures, f"round with seed {seed}:\n" + "\n".join(failures)
    print(
        f"{ROUNDS} rounds, {total} messages on {ROUNDS * 12} fresh pairs "
        f"in {time.monotonic() - started:.1f} s (base seed {base}); "
        f"longest exchange {longest:.2f} s"
    )


class Greeter(aiorl.Worker):
    """Greets worker ``to`` from ``__init__``, before it is ready: a restarted rank (or a new
    group of a name) reaches ``to`` before ``to`` can have heard that it is ready."""

    def __init__(self, to: tuple[str, int] | None) -> None:
        super().__init__()
        if to is not None and to != (self.worker_group_name, self.rank):
            self.send(f"hello from pid {os.getpid()}", *to).wait(20)
            time.sleep(0.5)  # ready well after the greeting arrived

    def pid(self) -> int:
        return os.getpid()

    def recv_from(self, group: str, rank: int) -> Any:
        return self.recv(group, rank).wait(10)

    async def send_after_watch_limit(self, watches: int, group: str, rank: int) -> str:
        """Use up this process's registry watches, then send to a worker not resolved yet."""

        def ignore(*_event: Any) -> None:
            pass

        registry = self._runtime.registry
        await asyncio.gather(
            *(registry.watch(f"nobody{i}", ignore) for i in range(watches)),
            return_exceptions=True,
        )
        try:
            await asyncio.wait_for(self.send("x", group, rank).async_wait(), 10)
        except Exception as exc:  # noqa: BLE001 - the test inspects the type and message
            return f"{type(exc).__name__}: {exc}"
        return "completed"

    def toward_bad_names(self, groups: list[str]) -> list[str]:
        """What each operation naming ``group:0`` does, for each group (bounded)."""
        out = []
        for group in groups:
            for op in (
                functools.partial(self.send, "x", group, 0),
                functools.partial(self.send_tensor, torch.ones(2), group, 0),
                functools.partial(self.recv, group, 0),
                functools.partial(self.recv_tensor, torch.empty(2), group, 0),
            ):
                try:
                    op().wait(5)
                    out.append("completed")
                except Exception as exc:  # noqa: BLE001 - the test inspects the type
                    out.append(type(exc).__name__)
        return out


def test_a_restarted_ranks_first_message_is_not_failed_by_its_predecessors_death(
    cluster2: Any,
) -> None:
    """The receiver knows the name as dead (its first process was killed) when the new
    process's first message arrives: that message is kept for the next receive, not
    dropped with the predecessor's death (it was, and that receive never completed)."""
    group = Greeter.create_group(("greeter", 0)).launch(
        cluster2, num_workers=2, name="greeter", restart="on_failure", backoff=0.05
    )
    try:
        receiver = group.execute_on(0)
        pids = group.pid().wait(60)
        assert receiver.recv_from("greeter", 1).wait(30) == [f"hello from pid {pids[1]}"]
        events = group.events()
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            event = events.get(timeout=max(0.01, deadline - time.monotonic()))
            if event.kind == EventKind.RESTARTED and event.rank == 1:
                break
        new_pid = group.execute_on(1).pid().wait(30)[0]
        assert receiver.recv_from("greeter", 1).wait(30) == [f"hello from pid {new_pid}"]
    finally:
        group.close()


def test_a_new_group_of_a_closed_groups_name_reaches_a_worker_that_knew_the_old_one(
    cluster2: Any,
) -> None:
    """Same as above for a name reused by a new group: the first message of its worker is
    not failed by the death of the old group's worker of that name."""
    hub = Greeter.create_group(None).launch(cluster2, name="hub")
    try:
        for _ in range(2):
            spoke = Greeter.create_group(("hub", 0)).launch(cluster2, name="spoke")
            try:
                (pid,) = spoke.pid().wait(60)
                assert hub.recv_from("spoke", 0).wait(30) == [f"hello from pid {pid}"]
            finally:
                spoke.close()
    finally:
        hub.close()


def test_a_malformed_worker_name_is_a_value_error_at_the_call(hub: Any) -> None:
    """A name outside the group-name grammar raised inside the resolution task on the loop,
    where nothing reported it: the send or receive waited for ever. It is refused at once."""
    bad = ["bad name", "a..b", "*", ".x"]
    assert hub.toward_bad_names(bad).wait(60) == [["ValueError"] * 4 * len(bad)]


def test_a_resolution_the_registry_refuses_fails_the_send(cluster2: Any, hub: Any) -> None:
    """The registry refuses a watch beyond 10,000 per client (ProtocolError). That error
    ended the resolution task without a word: the send waited for ever. It fails now."""
    group = Greeter.create_group(None).launch(cluster2, name="watcher")
    try:
        outcome = group.send_after_watch_limit(10_000, HUB, 1).wait(60)[0]
    finally:
        group.close()
    assert outcome.startswith("PeerLostError") and "too many watches" in outcome, outcome
