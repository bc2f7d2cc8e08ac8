"""The first messages between two workers: every one completes, in order, in bounded time.

Each round launches a fresh group (so every pair is new: nothing resolved, no set-up done)
and calls every rank at once, without waiting for the group to be ready, so a rank that
starts early sends to and receives from ranks still in ``__init__``. Every rank then sends
to every other rank and receives from it, in a random interleaving (receives posted before
or after the messages arrive), some ranks from their method thread and some from the event
loop, with payloads that take every CPU path on their first use: inline objects and
tensors, shared memory (a ``send`` of >= 256 KiB, which needs the ``p2p.hello`` set-up
first), the one-copy pull (``send_tensor`` of >= 1 MiB, set-up too) and, across nodes, ZMQ
frames. Each operation has its own deadline; one that misses it is reported with the p2p
state of the rank that waited (what is in the Sender's backlog, the Inbox's queues).

``AIORL_FIRST_SEND_ROUNDS`` runs more rounds (the long stress run of docs/ordering.md).
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import sys
import time
from typing import Any

import pytest
import torch

import aiorl
from aiorl.p2p import get_p2p
from aiorl.placement import NodePlacementStrategy

ROUNDS = int(os.environ.get("AIORL_FIRST_SEND_ROUNDS", "6"))
OP_TIMEOUT_S = float(os.environ.get("AIORL_FIRST_SEND_TIMEOUT", "15"))

pytestmark = pytest.mark.timeout(max(120, ROUNDS * 30))
# Ranks 0-1 and 2-3 share a node: same-node pairs take shm/CMA, the others ZMQ frames.
NODES = [0, 0, 1, 1]

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
    value = float(seed * 1000 + src * 100 + index)
    n = KINDS[kind][1]
    if kind == "object":
        return {"value": value, "src": src}
    return torch.full((n,), value)


class FirstContact(aiorl.Worker):
    def __init__(self, seed: int) -> None:
        super().__init__()
        # Ranks become ready at different times: early ones send to peers still starting.
        time.sleep(random.Random(f"{seed}/{self.rank}/init").random() * 0.3)

    async def exchange(self, seed: int, world: int) -> list[str]:
        """Send this round's messages to every peer and receive theirs, from the event loop."""
        started: list[Any] = []
        rng = random.Random(f"{seed}/{self.rank}/pauses")
        for op, peer in self._steps(seed, world):
            self._start(op, peer, seed, started)
            if rng.random() < 0.4:
                await asyncio.sleep(rng.random() * 0.01)
        failures: list[str] = []
        for what, work, check in started:
            try:
                got = await asyncio.wait_for(work.async_wait(), OP_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - reported with the p2p state
                failures.append(f"{self.rank}: {what}: {type(exc).__name__}: {exc}")
                continue
            if not check(got):
                failures.append(f"{self.rank}: {what}: wrong content")
        return self._report(failures)

    def exchange_from_thread(self, seed: int, world: int) -> list[str]:
        """The same from the method thread (the operations reach the loop through ``submit``)."""
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
        return self._report(failures)

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


def _run_round(cluster: Any, seed: int) -> tuple[list[str], int]:
    """One fresh group: every rank called at once, before any is known to be ready."""
    world = len(NODES)
    group = FirstContact.create_group(seed).launch(
        cluster, name=f"first{seed}", placement_strategy=NodePlacementStrategy(NODES)
    )
    try:
        rng = random.Random(f"{seed}/methods")
        calls = []
        for rank in range(world):
            view = group.execute_on(rank)
            method = view.exchange if rng.random() < 0.6 else view.exchange_from_thread
            calls.append(method(seed, world))
        failures: list[str] = []
        for rank, call in enumerate(calls):
            try:
                failures += call.wait(OP_TIMEOUT_S + 60)[0]
            except Exception as exc:  # noqa: BLE001 - the round's report names it
                failures.append(f"{rank}: the exchange call failed: {exc!r}")
        messages = sum(len(plan(seed, s, d)) for s in range(world) for d in range(world) if s != d)
        return failures, messages
    finally:
        group.close()


def test_first_sends_between_fresh_workers_complete(cluster2: Any) -> None:
    """Every pair's first messages, both directions at once, complete in order within the
    per-operation deadline (the first-send hang of issue 16 would miss it)."""
    base = int(os.environ.get("AIORL_FIRST_SEND_SEED", "0")) or random.randrange(1, 1 << 20)
    total = 0
    started = time.monotonic()
    for r in range(ROUNDS):
        seed = base + r
        failures, messages = _run_round(cluster2, seed)
        total += messages
        print(f"round {r} seed {seed}: {messages} messages, "
              f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        assert not failures, f"round with seed {seed}:\n" + "\n".join(failures)
    print(f"{ROUNDS} rounds, {total} messages on {ROUNDS * 12} fresh pairs "
          f"in {time.monotonic() - started:.1f} s (base seed {base})")
