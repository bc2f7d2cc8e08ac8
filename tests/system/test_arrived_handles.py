"""Group handles that arrive in a worker (a `WorkerGroup` passed as an argument): a handle on a
group the registry does not know fails its calls with GroupNotFoundError within a bound, and
the worker keeps an entry (and a registry watch) only for the groups whose handles it uses.

Issue 51, case 3: 300 handles naming absent groups left 300 calls unanswered for ever, and
the worker kept every arrival and its registry watch.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import pytest

import aiorl
from aiorl.group.group import _group_arriving

#: What every call through a handle must end within (result or typed error).
BOUND_S = 10.0


class Echo(aiorl.Worker):
    def scale(self, x: int) -> int:
        return x * 2


class Holder(aiorl.Worker):
    """Receives handles, calls through them, and says what it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: Any = None

    async def call_each(self, handles: list[Any], bound: float) -> dict[str, Any]:
        """Call ``scale`` through every handle at once; each outcome, and how many calls had
        not ended within ``bound`` seconds."""
        start = time.monotonic()
        tasks = [asyncio.ensure_future(h.scale(1)) for h in handles]
        done, pending = await asyncio.wait(tasks, timeout=bound)
        for task in pending:
            task.cancel()
        outcomes: dict[str, int] = {}
        for task in done:
            exc = task.exception()
            kind = "answered" if exc is None else type(exc).__name__
            outcomes[kind] = outcomes.get(kind, 0) + 1
        sample = next((str(t.exception()) for t in done if t.exception() is not None), "")
        return {"outcomes": outcomes, "unanswered": len(pending), "sample": sample,
                "elapsed": time.monotonic() - start}

    def held(self) -> tuple[list[str], list[str]]:
        """The groups whose arrived handles this worker holds, and the names it watches."""
        from aiorl.group import arrivals
        from aiorl.runtime.session import WorkerSession

        runtime = WorkerSession.current().runtime
        return arrivals.held(runtime), sorted(runtime.registry.watches())

    def hold(self, handle: Any) -> None:
        self.kept = handle

    async def keep(self, handle: Any) -> list[int]:
        self.kept = handle
        return await handle.scale(3)

    async def until_closed(self) -> list[str]:
        """The kept handle's events until its group's end."""
        return [event.kind.name async for event in self.kept.events()]

    async def call_kept(self) -> list[int]:
        return await self.kept.scale(5)

    async def use_and_drop(self, handle: Any) -> list[str]:
        """Call through ``handle`` and let it go; the groups held while it was alive."""
        assert await handle.scale(1) == [2]
        return self.held()[0]

    async def collected(self, name: str, bound: float) -> tuple[list[str], list[str]]:
        """Collect garbage; what is held once the entry of ``name`` went (or ``bound`` s)."""
        deadline = time.monotonic() + bound
        while True:
            gc.collect()
            await asyncio.sleep(0)  # the finalizer's release runs on this loop
            held, watched = self.held()
            if (name not in held and name not in watched) or time.monotonic() > deadline:
                return held, watched
            await asyncio.sleep(0.05)


class Absent:
    """A handle on a group nobody launched, pickled as `WorkerGroup.__reduce__` pickles one."""

    def __init__(self, name: str, world_size: int = 1) -> None:
        self.name = name
        self.world_size = world_size

    def __reduce__(self) -> tuple[Any, ...]:
        return (_group_arriving, (self.name, Echo.__module__, Echo.__qualname__,
                                  self.world_size, None))


@pytest.fixture(scope="module")
def holder(cluster: aiorl.Cluster) -> Any:
    group = Holder.create_group().launch(cluster, num_workers=1, name="holder")
    group.wait_ready(60)
    yield group
    group.close()


@pytest.mark.timeout(120)
def test_handles_on_absent_groups_fail_with_group_not_found_and_are_not_kept(holder: Any) -> None:
    names = [f"absent-{i}" for i in range(300)]
    report = holder.call_each([Absent(n, world_size=1 + i % 3) for i, n in enumerate(names)],
                              BOUND_S).wait_one(BOUND_S + 30)
    assert report["unanswered"] == 0, report
    assert report["outcomes"] == {"GroupNotFoundError": 300}, report
    assert "no worker group named 'absent-" in report["sample"], report
    held, watched = holder.held().wait_one(10)
    assert not set(names) & set(held), held
    assert not set(names) & set(watched), watched


@pytest.mark.timeout(90)
def test_an_arrived_handle_goes_when_its_group_closes(cluster: aiorl.Cluster, holder: Any) -> None:
    group = Echo.create_group().launch(cluster, num_workers=2, name="closing")
    try:
        assert holder.keep(group).wait_one(60) == [6, 6]
        held, watched = holder.held().wait_one(10)
        assert "closing" in held and "closing" in watched
        ended = holder.until_closed()
    finally:
        group.close()
    assert ended.wait_one(BOUND_S)[-1] == "CLOSED"
    held, watched = holder.held().wait_one(10)
    assert "closing" not in held and "closing" not in watched, (held, watched)
    with pytest.raises(aiorl.RemoteError, match="PeerLostError.*group closing is closed"):
        holder.call_kept().wait_one(BOUND_S)


@pytest.mark.timeout(90)
def test_an_arrived_handle_goes_when_its_last_view_is_collected(cluster: aiorl.Cluster,
                                                                 holder: Any) -> None:
    group = Echo.create_group().launch(cluster, num_workers=1, name="dropped")
    try:
        assert "dropped" in holder.use_and_drop(group.execute_on(0)).wait_one(60)
        held, watched = holder.collected("dropped", BOUND_S).wait_one(BOUND_S + 10)
        assert "dropped" not in held and "dropped" not in watched, (held, watched)
        # Sent again, it arrives anew and works.
        assert holder.keep(group).wait_one(30) == [6]
    finally:
        group.close()


@pytest.mark.timeout(90)
def test_a_handle_on_a_group_launched_a_moment_later_works(cluster: aiorl.Cluster,
                                                          holder: Any) -> None:
    """The registry learns of a group a moment after its handle arrived (a launch or a
    restore on its way): the calls made meanwhile wait for it, within the bound."""
    holder.hold(Absent("late")).wait_one(10)  # arrived: its look-up has begun
    group = Echo.create_group().launch(cluster, num_workers=1, name="late")
    try:
        assert holder.call_kept().wait_one(60) == [10]
    finally:
        group.close()
