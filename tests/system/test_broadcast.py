"""``Worker.broadcast`` between real worker processes on an embedded two-node cluster.

Members: ``bt:0`` (the "trainer", node 0) and ``br:0..3`` (the "rollouts"; ranks 0-1 on node 0,
ranks 2-3 on node 1). From ``bt:0`` the payload reaches ``br:0``/``br:1`` through one shared
segment and node 1 once, at its relay ``br:2``, which passes it on to ``br:3``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import aiorl
from aiorl.collective import get_broadcaster, plan_broadcast, relay_tree
from aiorl.names import WorkerAddress
from aiorl.placement import NodePlacementStrategy
from tests.system.test_p2p import KINDS, make, same

pytestmark = pytest.mark.timeout(90)

T, R = "bt", "br"
ALL = [(T, 0), (R, [0, 1, 2, 3])]  # default source: bt:0, the first address
BIG = 1 << 20  # float32 elements: 4 MB, over the shared-memory threshold


def _explode(why: str) -> Any:
    raise RuntimeError(why)


class LoadsNowhere:
    """Pickles fine; unpickling it raises (on every receiver)."""

    def __reduce__(self) -> Any:
        return (_explode, ("cannot be rebuilt here",))


class B(aiorl.Worker):
    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return self.worker_info.node_id

    def _is(self, src: tuple[str, int]) -> bool:
        return (self.worker_group_name, self.rank) == src

    def kinds_sync(self, kinds: list[str], src: tuple[str, int]) -> list[str]:
        """Blocking calls from the method thread (RLinf's default ``async_op=False``)."""
        bad = []
        for k in kinds:
            got = self.broadcast(make(k) if self._is(src) else None, groups=ALL, src=src)
            if not same(got, make(k)):
                bad.append(k)
        return bad

    async def kinds_async(self, kinds: list[str], src: tuple[str, int]) -> list[str]:
        """Every broadcast started at once (``async_op=True``), then awaited in order."""
        works = [
            self.broadcast(make(k) if self._is(src) else None, ALL, src, async_op=True)
            for k in kinds
        ]
        return [k for k, w in zip(kinds, works, strict=True) if not same(await w, make(k))]

    async def alternating_sources(self, n: int) -> list[int]:
        """``n`` broadcasts in flight at once, sources alternating between the two nodes, big
        and small payloads mixed: each member gets them in call order."""
        works = []
        for i in range(n):
            src = (T, 0) if i % 2 == 0 else (R, 3)
            obj = {"i": i, "t": torch.full((BIG if i % 3 == 0 else 8,), float(i))}
            works.append(self.broadcast(obj if self._is(src) else None, ALL, src, async_op=True))
        got = [await w for w in works]
        return [g["i"] for g in got if bool((g["t"] == g["i"]).all())]

    async def source_gets_its_object(self) -> bool:
        obj = {"t": torch.ones(BIG)}
        got = await self.broadcast(obj if self._is((T, 0)) else None, ALL, async_op=True)
        return got is obj if self._is((T, 0)) else same(got, obj)

    async def private_copies(self) -> bool:
        """Members that read one shared segment write into their copies independently."""
        t = torch.arange(BIG, dtype=torch.float32)
        got = await self.broadcast(t if self._is((T, 0)) else None, ALL, async_op=True)
        mine = float(self.rank + 1) if self.worker_group_name == R else 0.0
        if self.worker_group_name == R:
            got += mine
        await self.broadcast(None, ALL, async_op=True)  # a barrier: everyone has written
        return bool(torch.equal(got, torch.arange(BIG, dtype=torch.float32) + mine))

    async def interleaved_with_send(self) -> Any:
        """``bt:0`` sends then broadcasts; ``br:0`` broadcasts then receives: two streams."""
        if self._is((T, 0)):
            await self.send("p2p", R, 0)
            return await self.broadcast("collective", ALL, async_op=True)
        got = await self.broadcast(None, ALL, async_op=True)
        if self._is((R, 0)):
            return [got, await self.recv(T, 0)]
        return got

    async def undecodable_then_fine(self) -> list[str]:
        source = self._is((T, 0))
        out = []
        try:
            await self.broadcast(LoadsNowhere() if source else None, ALL, async_op=True)
            out.append("completed")
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out.append(f"{type(exc).__name__}: {exc}")
        out.append(repr(await self.broadcast(7 if source else None, ALL, async_op=True)))
        return out

    def bad_calls(self) -> list[list[str]]:
        cases: list[tuple[Any, Any]] = [
            (None, None),
            ((T, 0), None),
            ([], None),
            ([(T,)], None),
            ([(3, 0)], None),
            ([(R, [])], None),
            ([(R, [0, "1"])], None),
            ([(R, "0")], None),
            ([(R, [0, 1])], None),  # this worker (bt:0) is not a member
            ([(T, 0), (T, [0])], None),
            (ALL, "bt:0"),
            (ALL, (0, 0)),
            (ALL, (T, [0])),
            (ALL, (R, 7)),
        ]
        out = []
        for groups, src in cases:
            try:
                self.broadcast(1, groups=groups, src=src)
                out.append(["none", ""])
            except (TypeError, ValueError) as exc:
                out.append([type(exc).__name__, str(exc)])
        return out

    async def stats(self) -> Any:
        gc.collect()
        await asyncio.sleep(0.2)  # give-backs of released segments travel to their owners
        return get_broadcaster(self._runtime).statistics()

    async def expect_loss(self, members: list[Any]) -> tuple[str, str, float]:
        obj = torch.ones(BIG) if self.rank == 0 else None
        try:
            await self.broadcast(obj, members, async_op=True)
            return "completed", "", time.monotonic()
        except Exception as exc:  # noqa: BLE001 - the test inspects the type
            return type(exc).__name__, str(exc), time.monotonic()

    async def unknown_member(self) -> list[str]:
        out = []
        for members in ([(T, 0), ("nosuchgroup", 0)], [(T, 0), (R, 9)]):
            try:
                await asyncio.wait_for(
                    self.broadcast(1, members, async_op=True).async_wait(), 10)
                out.append("completed")
            except Exception as exc:  # noqa: BLE001
                out.append(f"{type(exc).__name__}: {exc}")
        return out

    async def after_loss(self, members: list[Any]) -> str:
        try:
            await asyncio.wait_for(self.broadcast(1, members, async_op=True).async_wait(), 5)
            return "completed"
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def cluster2() -> Iterator[aiorl.Cluster]:
    with aiorl.Cluster(num_nodes=2) as c:
        yield c


@pytest.fixture(scope="module")
def groups(cluster2: Any) -> Iterator[tuple[Any, Any]]:
    t = B.create_group().launch(cluster2, name=T, placement_strategy=NodePlacementStrategy([0]))
    r = B.create_group().launch(
        cluster2, name=R, placement_strategy=NodePlacementStrategy([0, 0, 1, 1])
    )
    nodes = t.node().wait(60) + r.node().wait(60)
    assert nodes[0] == nodes[1] == nodes[2] != nodes[3] == nodes[4]
    yield t, r
    t.close()
    r.close()


def everyone(groups: Any, method: str, *args: Any) -> list[Any]:
    t, r = groups
    works = [getattr(t, method)(*args), getattr(r, method)(*args)]
    return [x for w in works for x in w.wait(60)]


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_payload_kind_cross_group(groups: Any, mode: str) -> None:
    assert everyone(groups, f"kinds_{mode}", KINDS, (T, 0)) == [[]] * 5


def test_explicit_source_on_the_other_node(groups: Any) -> None:
    kinds = ["tensor_big", "dict", "dataclass", "int"]
    assert everyone(groups, "kinds_async", kinds, (R, 3)) == [[]] * 5


def test_broadcasts_in_flight_from_alternating_sources_keep_call_order(groups: Any) -> None:
    assert everyone(groups, "alternating_sources", 12) == [list(range(12))] * 5


def test_source_returns_its_own_object_and_copies_are_private(groups: Any) -> None:
    assert everyone(groups, "source_gets_its_object") == [True] * 5
    assert everyone(groups, "private_copies") == [True] * 5


def test_broadcast_and_send_between_the_same_pair_do_not_mix(groups: Any) -> None:
    got = everyone(groups, "interleaved_with_send")
    assert got == ["collective", ["collective", "p2p"], "collective", "collective", "collective"]


def test_a_member_that_cannot_take_the_object_fails_it_everywhere(groups: Any) -> None:
    got = everyone(groups, "undecodable_then_fine")
    for error, after in got:
        assert error.startswith("ProtocolError: worker br:"), error
        assert "could not take the broadcast: RuntimeError: cannot be rebuilt here" in error
        assert after == "7"  # the member set goes on


def test_bytes_are_written_once_per_node(groups: Any) -> None:
    t, r = groups
    before = t.stats().wait(30) + r.stats().wait(30)
    payload = 4 * BIG  # bytes of the one tensor in source_gets_its_object
    assert everyone(groups, "source_gets_its_object") == [True] * 5
    after = t.stats().wait(30) + r.stats().wait(30)
    src, relay = (after[0], before[0]), (after[3], before[3])
    # Node 0: written once into one segment, read there by br:0 and br:1.
    assert src[0].shm_bytes_written - src[1].shm_bytes_written == payload
    assert src[0].shm_readers - src[1].shm_readers == 2
    # Node 1: sent across once, to its relay, which writes it once for br:3 and itself.
    assert src[0].frame_bytes_sent - src[1].frame_bytes_sent == payload
    assert relay[0].relayed - relay[1].relayed == 1
    assert relay[0].shm_bytes_written - relay[1].shm_bytes_written == payload
    assert relay[0].shm_readers - relay[1].shm_readers == 2
    for i in (1, 2, 4):  # nobody else wrote or sent anything
        assert after[i].shm_bytes_written == before[i].shm_bytes_written
        assert after[i].frame_bytes_sent == before[i].frame_bytes_sent
    # Every reader's views are gone: the segments are back in their pools.
    assert src[0].segments_in_use == relay[0].segments_in_use == 0
    assert all(s.pending == 0 for s in after)


def test_validation_errors_as_rlinf_raises_them(groups: Any) -> None:
    t, _ = groups
    got = t.bad_calls().wait(30)[0]
    assert got == [
        ["ValueError", "groups must be provided with explicit ranks."],
        ["TypeError", "groups must be a list of (group_name, rank) tuples."],
        ["ValueError", "groups must contain at least one entry."],
        ["TypeError", "Each groups entry must be a (group_name, ranks) tuple."],
        ["TypeError", "group_name must be a string. But got <class 'int'>."],
        ["ValueError", "ranks list must not be empty."],
        ["TypeError", "All ranks must be integers or tuples. But got <class 'str'>."],
        ["TypeError", "ranks must be an int, tuple, list[int], list[tuple[int]]. "
                      "But got <class 'str'>."],
        ["ValueError", "Worker bt:0 is not part of the broadcast group."],
        ["ValueError", "Worker bt:0 appears more than once in the broadcast group."],
        ["TypeError", "src must be a (group_name, rank) tuple. But got 'bt:0'."],
        ["TypeError", "src_group_name must be a string. But got <class 'int'>."],
        ["TypeError", "src_ranks must be an int or tuple. But got <class 'list'>."],
        ["ValueError", "src br:7 is not part of the broadcast group."],
    ]


def test_a_member_that_does_not_exist_is_a_lookup_error(groups: Any) -> None:
    t, _ = groups
    nogroup, norank = t.unknown_member().wait(30)[0]
    assert nogroup.startswith("LookupError: ") and "nosuchgroup" in nogroup, nogroup
    assert norank.startswith("LookupError: ") and "br:9" in norank, norank


@pytest.mark.parametrize("victim", [1, 0], ids=["receiver", "source"])
def test_member_killed_mid_broadcast_fails_every_other_member(cluster2: Any, victim: int) -> None:
    g = B.create_group().launch(
        cluster2, name=f"bk{victim}", placement_strategy=NodePlacementStrategy([0, 0, 1, 1])
    )
    members = [(f"bk{victim}", [0, 1, 2, 3])]
    try:
        pids = g.pid().wait(60)
        survivors = [r for r in range(4) if r != victim]
        pending = [g.execute_on(r).expect_loss(members) for r in survivors]
        time.sleep(0.5)  # the others called; the victim never will
        t = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        for w in pending:
            name, text, when = w.wait(10)[0]
            assert name == "PeerLostError", (name, text)
            assert f"bk{victim}:{victim}" in text
            assert when - t <= 5.0
        again = [g.execute_on(r).after_loss(members) for r in survivors]
        assert [w.wait(10)[0] for w in again] == ["PeerLostError"] * 3
    finally:
        g.close()


def test_relay_tree_is_one_relay_per_other_node() -> None:
    members = ["a:0", "a:1", "b:0", "b:1", "b:2", "a:10"]
    nodes = {"a:0": "n0", "a:1": "n0", "b:0": "n1", "b:1": "n1", "b:2": "n2", "a:10": "n1"}
    tree = relay_tree("a:1", members, nodes)
    assert tree.local == ("a:0",)
    assert tree.relays == {"a:10": ("b:0", "b:1"), "b:2": ()}
    plan = plan_broadcast([("b", [1, 0]), ("a", 0)], None, WorkerAddress("a", 0))
    assert plan.src == "b:1" and plan.members == ("b:1", "b:0", "a:0")
    same_set = plan_broadcast([("a", 0), ("b", [0, 1])], ("a", 0), WorkerAddress("b", 0))
    assert same_set.set_id == plan.set_id


def test_a_bug_inside_a_broadcast_is_not_taken_for_a_missing_member() -> None:
    """An IndexError or KeyError is a LookupError too: taken for a member that never
    existed, it failed the whole set with only "list index out of range" (issue 26)."""
    from aiorl.collective.rounds import member_gone
    from aiorl.errors import PeerLostError

    assert member_gone(PeerLostError("worker g:1 is gone"))
    assert member_gone(LookupError("broadcast failed: no worker g:9"))
    assert not member_gone(IndexError("list index out of range"))
    assert not member_gone(KeyError("k"))
    assert not member_gone(ValueError("v"))


class _RecordingEndpoint:
    """What `CudaBroadcast` uses of an endpoint, recording what it would send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, Any]] = []

    def handle(self, op: str, handler: Any) -> None:
        pass

    def send_oneway(self, address: str, op: str, meta: Any, frames: Any = ()) -> None:
        self.sent.append((address, op, meta))


class _CudaHost:
    """A broadcaster as `CudaBroadcast` sees it: member ``g:0`` on one GPU with two others."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.endpoint = _RecordingEndpoint()
        self.name = "g:0"
        self.node_id = "node"
        self.waiter: Any = None

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def address_of(self, member: str) -> str | None:
        return f"ipc://{member}"


def test_source_on_one_gpu_sends_no_ipc_for_an_all_empty_cuda_payload() -> None:
    """H200 failure 5 of issue 26 ("LookupError: list index out of range"): members on one
    GPU, the source the GPU's representative and an all-empty CUDA payload
    (``torch.empty(0, device="cuda")``, the last of test_p2p_cuda's payloads). The source
    handed its followers IPC handles of the payload's non-empty tensors, none, and took the
    device from the first. Its followers allocate an all-empty payload themselves, so the
    source must send them nothing. Runs without CUDA: nothing here reaches the GPU."""
    from aiorl.collective.nccl_broadcast import CudaBroadcast
    from aiorl.p2p.message import OutMessage
    from aiorl.protocol.broadcast import CudaPlan
    from aiorl.protocol.p2p import K_CUDA

    host = _CudaHost()
    try:
        cuda = CudaBroadcast(host)  # type: ignore[arg-type]
        out = OutMessage(K_CUDA, ["float32", [0], False], None, [], [torch.empty(0)])
        followers = {"g:1": "g:0", "g:2": "g:0"}
        desc = CudaPlan("key", None, ("g:0",), 0, followers, (("float32", (0,)),))
        cuda.send("set", 1, out, desc)  # raised IndexError before the fix
        assert host.endpoint.sent == []
        with pytest.raises(ValueError, match="no CUDA tensor"):
            cuda._serve("set", 1, ["g:1"], [], None)
    finally:
        host.loop.close()
