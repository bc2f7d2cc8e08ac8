"""The rules of one channel queue (aiorl.channels.weighted_queue) and the wire form of queue
keys (aiorl.channels.items), in process: no channel worker, no cluster."""

from __future__ import annotations

import asyncio
import enum
from typing import Any

import pytest

import aiorl
from aiorl.channels import QueueStats
from aiorl.channels.items import key_from_wire, wire_key
from aiorl.channels.weighted_queue import Done, WeightedQueue
from aiorl.errors import QueueEmpty, QueueFull


class Color(enum.Enum):
    RED = "red"


def _items(done: list[Done], waiter: Any) -> list[Any] | None:
    for d in done:
        if d.waiter == waiter:
            return None if d.items is None else [item for item, *_ in d.items]
    raise AssertionError(f"{waiter!r} was not completed")


def _completed(done: list[Done]) -> set[Any]:
    return {d.waiter for d in done}


def test_queue_fifo_and_counters() -> None:
    q: WeightedQueue[str] = WeightedQueue()
    for i, w in enumerate([1.0, 2.0, 0.5]):
        assert _completed(q.put(f"x{i}", w, ("p", i))) == {("p", i)}
    assert (q.qsize(), q.weight, q.full(), q.empty()) == (3, 3.5, False, False)
    assert [_items(q.get(("g", i)), ("g", i)) for i in range(3)] == [["x0"], ["x1"], ["x2"]]
    assert q.empty() and q.weight == 0.0 and q.is_idle()


def test_queue_get_batch_rule() -> None:
    q: WeightedQueue[str] = WeightedQueue()
    for name, w in [("a", 1), ("b", 2), ("c", 3)]:
        q.put(name, w, name)
    assert _items(q.get("g1", 3.0), "g1") == ["a", "b"]  # 1 + 2 reaches 3
    assert _items(q.get("g2", 3.0), "g2") == ["c"]  # exactly 3
    q.put("heavy", 10, "h")
    q.put("light", 1, "l")
    assert _items(q.get("g3", 3.0), "g3") == ["heavy"]  # heavier than the batch: alone
    # Below the batch weight the getter waits, reserving what it has seen.
    assert q.get("g4", 5.0) == []
    assert q.stats() == QueueStats(0, 0.0, 0, 0, 1, 1)  # "light" is reserved
    assert q.put("m", 2, "m") == [Done("m", None)]
    done = q.put("n", 2, "n")
    assert _items(done, "g4") == ["light", "m", "n"]
    with pytest.raises(ValueError):
        q.get("bad", 0.0)


def test_queue_maxsize_backpressure_and_nowait() -> None:
    q: WeightedQueue[int] = WeightedQueue(maxsize=2)
    q.put(0, 1, "p0")
    q.put_nowait(1, 1)
    assert q.full()
    with pytest.raises(QueueFull):
        q.put_nowait(2, 1)
    assert q.put(2, 1, "p2") == []  # parked
    assert q.put(3, 1, "p3") == []
    assert q.stats().waiting_putters == 2
    done = q.get("g0")
    assert _items(done, "g0") == [0]
    assert _completed(done) == {"g0", "p2"}  # the first parked putter is admitted
    (item, _, _), done = q.get_nowait()
    assert item == 1 and _completed(done) == {"p3"}
    assert [q.get_nowait()[0][0] for _ in range(2)] == [2, 3]
    with pytest.raises(QueueEmpty):
        q.get_nowait()


def test_queue_batch_heavier_than_maxsize_completes() -> None:
    q: WeightedQueue[int] = WeightedQueue(maxsize=2)
    assert q.get("g", 5.0) == []
    done: list[Done] = []
    for i in range(5):
        done += q.put(i, 1, ("p", i))  # each is reserved at once, so none waits
    assert _items(done, "g") == [0, 1, 2, 3, 4]
    assert q.is_idle()


def test_queue_getters_are_served_in_order() -> None:
    q: WeightedQueue[str] = WeightedQueue()
    q.get("batch", 2.0)
    q.get("single")
    done = q.put("a", 1, "pa")
    assert _completed(done) == {"pa"}  # reserved by the batch getter ahead
    done = q.put("b", 1, "pb") + q.put("c", 1, "pc")
    assert _items(done, "batch") == ["a", "b"] and _items(done, "single") == ["c"]


def test_queue_cancel_and_unget_keep_order() -> None:
    q: WeightedQueue[str] = WeightedQueue(maxsize=1)
    q.put("a", 1, "pa")
    q.put("b", 1, "pb")  # parked
    assert q.cancel("pb") == (True, [])
    assert q.cancel("pb") == (False, [])
    assert _items(q.get("g"), "g") == ["a"]
    assert q.is_idle()
    # A waiting batch getter's reservation goes back to the front when it is cancelled.
    q2: WeightedQueue[str] = WeightedQueue()
    q2.get("batch", 10.0)
    q2.put("x", 1, "px")
    q2.put("y", 1, "py")
    found, done = q2.cancel("batch")
    assert found and done == []
    assert [q2.get_nowait()[0][0] for _ in range(2)] == ["x", "y"]
    # Items handed out but refused come back to their places, whatever order they return in.
    for name in "vwxyz":
        q2.put(name, 1, "p" + name)
    (v, w), (x, _) = q2.get("g1", 2.0)[0].items, q2.get_nowait()  # type: ignore[misc]
    assert (v[0], w[0], x[0]) == ("v", "w", "x")
    q2.get("b2", 10.0)  # reserves y and z, waits for more
    assert q2.unget([x]) == []
    assert q2.unget([w, v]) == []  # out of order, and behind the reservation in time
    found, _ = q2.cancel("b2")
    assert found
    assert [q2.get_nowait()[0][0] for _ in range(5)] == ["v", "w", "x", "y", "z"]


def test_wire_keys_are_canonical() -> None:
    """Equal keys name one queue in every process, however they were built; str keys
    travel as they are; other keys come back as they were given."""
    a1, a2 = "".join(["a", "b"]), "".join(["a", "b"])  # equal, distinct objects
    assert a1 is not a2 and wire_key((a1, a1)) == wire_key((a1, a2))  # pickle would differ
    assert wire_key("plain") == "plain"
    for key in [("episode", 3, (1.5, None)), 7, None, b"raw", Color.RED]:
        assert key_from_wire(wire_key(key)) == key
    assert len({wire_key(1), wire_key(1.0), wire_key(True)}) == 3  # documented: three keys
    with pytest.raises(TypeError, match="hashable"):
        wire_key(["a", "list"])  # type: ignore[arg-type]


def test_queue_errors_are_asyncio_queue_errors() -> None:
    """RLinf code catches asyncio.QueueEmpty / asyncio.QueueFull."""
    assert issubclass(aiorl.QueueEmpty, asyncio.QueueEmpty)
    assert issubclass(aiorl.QueueFull, asyncio.QueueFull)
    assert issubclass(aiorl.QueueFull, aiorl.AiorlError)
