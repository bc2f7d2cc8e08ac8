"""TokenTable and TurnBatcher: the shared bookkeeping of every protocol."""

from __future__ import annotations

import asyncio

import pytest

from aiorl.util.batching import TurnBatcher
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
