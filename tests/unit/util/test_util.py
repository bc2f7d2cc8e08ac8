"""TokenTable and TurnBatcher: the shared bookkeeping of every protocol."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from aiorl.util.batching import TurnBatcher
from aiorl.util.method_thread import MethodThread
from aiorl.util.tokens import TokenTable

pytestmark = pytest.mark.timeout(30)


def test_token_table_issues_unique_tokens_and_sweeps_a_lost_peer() -> None:
    table: TokenTable[tuple[str, int]] = TokenTable()
    tokens = [table.issue(("a" if i % 2 else "b", i)) for i in range(6)]
    assert tokens == [1, 2, 3, 4, 5, 6] and len(table) == 6
    assert table.pop(tokens[0]) == ("b", 0) and table.pop(tokens[0]) is None
    assert [v for v in table.take_where(lambda v: v[0] == "a")] == [("a", 1), ("a", 3), ("a", 5)]
    assert table.next_token() == 7 and 7 not in table
    assert table.take_all() == [("b", 2), ("b", 4)] and len(table) == 0


async def test_turn_batcher_sends_per_key_at_the_end_of_the_turn_in_order() -> None:
    sent: list[tuple[str, list[int]]] = []
    batcher: TurnBatcher[str, int] = TurnBatcher(
        asyncio.get_running_loop(), lambda k, items: sent.append((k, items)), max_items=3)
    assert batcher.first_in_turn() and not batcher.first_in_turn()
    for i in range(4):
        batcher.add("p", i)
    batcher.add("q", 9)
    assert sent == [("p", [0, 1, 2])]  # the item limit flushed early
    assert batcher.take("q") == [9] and batcher.held("p") == 1
    await asyncio.sleep(0)
    assert sent == [("p", [0, 1, 2]), ("p", [3])]
    assert batcher.first_in_turn()  # a new turn


async def test_turn_batcher_flushes_at_the_byte_limit() -> None:
    sent: list[list[bytes]] = []
    batcher: TurnBatcher[int, bytes] = TurnBatcher(
        asyncio.get_running_loop(), lambda _k, items: sent.append(items), max_bytes=10)
    batcher.add(0, b"x" * 6, 6)
    batcher.add(0, b"y" * 6, 6)
    assert sent == [[b"x" * 6, b"y" * 6]]


def test_method_thread_runs_jobs_in_order_and_keeps_the_executor_contract():
    mt = MethodThread("test-method-thread")
    seen: list[int] = []
    for i in range(100):
        mt.run(seen.append, i)
    assert mt.submit(lambda: len(seen)).result(5) == 100  # after every job given before it
    failing = mt.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(5)

    async def in_executor() -> str:  # what the worker does to construct its instance
        return await asyncio.get_running_loop().run_in_executor(mt, lambda: "built")

    assert asyncio.run(in_executor()) == "built"
    gate = threading.Event()
    mt.run(gate.wait, 5)  # holds the thread while the next jobs queue up
    pending = mt.submit(seen.append, -1)
    mt.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert pending.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        mt.run(seen.append, 0)
    mt.shutdown(wait=True)
    assert -1 not in seen
    with pytest.raises(concurrent.futures.CancelledError):
        pending.result(0)
