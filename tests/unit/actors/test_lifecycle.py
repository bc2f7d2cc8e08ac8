"""The PollingWorker lifecycle table (aiorl/actors/lifecycle.py), alone and against the old worker.

Two parts:

* pure tests of :func:`transition`, pair by pair, like the ``WeightedQueue`` tests;
* a differential test: ``SixBooleans`` below is the lifecycle logic of ``PollingWorker``
  as it was before the table (six booleans plus the configure future), copied from
  ``git show d5ebfbd:aiorl/actors/polling.py`` with only the parts that decide nothing
  left out (stats counters, clock, sinks, poll thread). Both it and the real
  :class:`~aiorl.PollingWorker` are driven through the same control calls, hook
  outcomes and cancellations on one event loop, and compared after every step: the
  state, ``is_configured``/``is_running``/``is_exiting``, whether resources were
  released, and whether each call was accepted or refused (and with which error).
  Every sequence of up to 6 steps is covered (breadth first, pruning sequences that
  lead to a pair of states already seen); hypothesis samples longer ones.

One difference is deliberate and shown by its own test: a ``start()`` that failed
because its ``configure()`` failed no longer counts as "started", so a later
successful ``configure()`` reads ``configured`` (the documented "configured, never
started"), not ``paused``. The differential test compares against the old logic with
exactly that one line added (``SixBooleans.forget_failed_start``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiorl.actors.lifecycle import (
    TRANSITIONS,
    Action,
    Event,
    IllegalTransition,
    Lifecycle,
    Transition,
    transition,
)
from aiorl.actors.polling import PollingWorker, PollResult, _common_settings
from tests._paths import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

S, E, A = Lifecycle, Event, Action
DOCS = REPO_ROOT / "docs" / "lifecycle.md"


def _run(state: Lifecycle, *events: Event) -> Lifecycle:
    for event in events:
        state = transition(state, event).state
    return state


# ---------------------------------------------------------------------- pure table
def test_labels_are_the_documented_state_names() -> None:
    assert {s.label for s in Lifecycle} == {
        "unconfigured", "configuring", "configured", "running", "paused", "exiting", "exited"}
    assert S.START_PENDING.label == S.PAUSE_PENDING.label == "configuring"
    assert [s for s in Lifecycle if s.is_exiting] == [S.EXITING, S.EXITED]


def test_happy_path_and_pause_resume() -> None:
    assert transition(S.UNCONFIGURED, E.CONFIGURE) == Transition(S.CONFIGURING)
    assert _run(S.UNCONFIGURED, E.CONFIGURE, E.CONFIGURE_OK) is S.CONFIGURED
    assert _run(S.CONFIGURED, E.START) is S.RUNNING
    assert _run(S.RUNNING, E.PAUSE) is S.PAUSED
    assert _run(S.PAUSED, E.START, E.START) is S.RUNNING
    assert _run(S.PAUSED, E.PAUSE) is S.PAUSED


def test_calls_sent_while_configuring_apply_in_order() -> None:
    pending = _run(S.UNCONFIGURED, E.CONFIGURE, E.START)
    assert transition(S.CONFIGURING, E.START) == Transition(S.START_PENDING, A.AWAIT_CONFIGURE)
    assert pending is S.START_PENDING and _run(pending, E.CONFIGURE_OK) is S.RUNNING
    assert _run(pending, E.PAUSE, E.CONFIGURE_OK) is S.PAUSED  # start, pause: paused
    assert _run(pending, E.PAUSE, E.START, E.CONFIGURE_OK) is S.RUNNING
    assert _run(S.CONFIGURING, E.PAUSE, E.CONFIGURE_OK) is S.CONFIGURED  # never started


def test_failed_configure_leaves_unconfigured_and_not_started() -> None:
    for state in (S.CONFIGURING, S.START_PENDING, S.PAUSE_PENDING):
        assert transition(state, E.CONFIGURE_FAILED) == Transition(S.UNCONFIGURED)
    # A start() that failed with its configure does not count: the next success is "configured".
    assert _run(S.START_PENDING, E.CONFIGURE_FAILED, E.CONFIGURE, E.CONFIGURE_OK) is S.CONFIGURED


def test_refusals_keep_the_state() -> None:
    expected = {
        (S.UNCONFIGURED, E.START): A.REJECT_UNCONFIGURED,
        **{(s, E.CONFIGURE): A.REJECT_CONFIGURED
           for s in (S.CONFIGURING, S.START_PENDING, S.PAUSE_PENDING, S.CONFIGURED, S.RUNNING,
                     S.PAUSED)},
        **{(s, e): A.REJECT_EXITING for s in (S.EXITING, S.EXITED) for e in (E.CONFIGURE, E.START)},
    }
    refused = {pair: t.action for pair, t in TRANSITIONS.items() if t.action.rejects}
    assert refused == expected
    assert all(TRANSITIONS[pair].state is pair[0] for pair in refused)


def test_exit_is_final_and_releases_once_no_run_is_left() -> None:
    for state in Lifecycle:
        assert transition(state, E.EXIT).state.is_exiting
    for (state, event), t in TRANSITIONS.items():
        if state.is_exiting:
            assert t.state.is_exiting, (state, event)
    assert transition(S.EXITING, E.RUN_ENDED) == Transition(S.EXITED, A.RELEASE)
    # A configure() sent before exit() that finishes after it: its sinks must be closed.
    assert transition(S.EXITED, E.CONFIGURE_OK) == Transition(S.EXITED, A.RELEASE)
    assert transition(S.EXITING, E.CONFIGURE_OK) == Transition(S.EXITING)  # run() will
    releases = {pair for pair, t in TRANSITIONS.items() if t.action is A.RELEASE}
    assert {t.state for pair, t in TRANSITIONS.items() if pair in releases} == {S.EXITED}


def test_poll_failure_pauses() -> None:
    assert transition(S.RUNNING, E.POLL_FAILED) == Transition(S.PAUSED)
    assert transition(S.PAUSED, E.POLL_FAILED) == Transition(S.PAUSED)
    assert transition(S.EXITING, E.POLL_FAILED) == Transition(S.EXITING)


def test_impossible_pairs_raise() -> None:
    # A configure outcome with no configure in flight, a poll failure where no poll runs.
    impossible = {
        *((s, e) for s in (S.UNCONFIGURED, S.CONFIGURED, S.RUNNING, S.PAUSED)
          for e in (E.CONFIGURE_OK, E.CONFIGURE_FAILED)),
        *((s, E.POLL_FAILED) for s in (S.UNCONFIGURED, S.CONFIGURING, S.START_PENDING,
                                       S.PAUSE_PENDING, S.CONFIGURED, S.EXITED)),
    }
    every = set(itertools.product(Lifecycle, Event))
    assert set(TRANSITIONS) == every - impossible
    for state, event in impossible:
        with pytest.raises(IllegalTransition, match=f"{event.name} cannot happen in state {state.name}"):
            transition(state, event)


def test_every_state_is_reachable_and_wakes_run_means_work() -> None:
    seen, todo = {S.UNCONFIGURED}, [S.UNCONFIGURED]
    while todo:
        state = todo.pop()
        for event in Event:
            nxt = TRANSITIONS.get((state, event))
            if nxt is not None and nxt.state not in seen:
                seen.add(nxt.state)
                todo.append(nxt.state)
    assert seen == set(Lifecycle)
    # run() is woken to poll, to wait for a configure it must follow, or to return.
    assert {s for s in Lifecycle if s.wakes_run} == {
        S.START_PENDING, S.RUNNING, S.EXITING, S.EXITED}


def _table_markdown() -> str:
    """The transition table as docs/lifecycle.md shows it (kept true by the test below)."""
    events = list(Event)
    lines = ["| state | " + " | ".join(f"`{e.value}`" for e in events) + " |",
             "|---" * (len(events) + 1) + "|"]
    for state in Lifecycle:
        cells = []
        for event in events:
            t = TRANSITIONS.get((state, event))
            if t is None:
                cells.append("·")
                continue
            target = "=" if t.state is state else t.state.name
            cells.append(target if t.action is A.NONE else f"{target}, {t.action.name.lower()}")
        lines.append(f"| {state.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_docs_show_the_table_as_it_is() -> None:
    assert _table_markdown() in DOCS.read_text(), (
        "docs/lifecycle.md: replace the transition table with\n" + _table_markdown())


# ---------------------------------------------------------------------- both workers
class _Gates:
    """Test-controlled outcomes of ``_configure`` and ``_poll``: each waits for the test."""

    def __init__(self) -> None:
        self.waiting: dict[str, asyncio.Future[None]] = {}

    async def wait(self, hook: str) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.waiting[hook] = fut
        try:
            await fut
        finally:
            if self.waiting.get(hook) is fut:
                del self.waiting[hook]

    def finish(self, hook: str, error: BaseException | None) -> None:
        fut = self.waiting.pop(hook, None)
        if fut is None or fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)


class SixBooleans:
    """The pre-table ``PollingWorker`` lifecycle: its decision logic, copied unchanged.

    Left out, as they decide nothing: stats counters and rates, the running clock,
    stats sinks and the poll thread (hooks here are ``async def``), logging; what
    ``_release`` releases is replaced by a flag saying that it ran. The one added
    line is behind ``forget_failed_start`` (see the module docstring).
    """

    forget_failed_start = False

    def __init__(self, gates: _Gates) -> None:
        self.gates = gates
        self._configure_fut: asyncio.Future[None] | None = None
        self._configured = False
        self._running = False
        self._exiting = False
        self._ever_started = False
        self._wake = asyncio.Event()  # set while running or exiting
        self._run_active = False
        self.released = False  # _release() ran since the last successful _configure

    def _release(self) -> None:
        self.released = True

    async def _configure(self, config: Any) -> None:
        await self.gates.wait("configure")
        self.released = False

    async def _poll(self) -> PollResult:
        await self.gates.wait("poll")
        return PollResult()

    def _display_name(self) -> str:
        return type(self).__name__

    @property
    def is_configured(self) -> bool:
        return self._configured

    @property
    def is_running(self) -> bool:
        return self.is_configured and self._running and not self._exiting

    @property
    def is_exiting(self) -> bool:
        return self._exiting

    @property
    def lifecycle_state(self) -> str:
        if self._exiting:
            return "exiting" if self._run_active else "exited"
        if not self._configured:
            pending = self._configure_fut is not None and not self._configure_fut.done()
            return "configuring" if pending else "unconfigured"
        if self._running:
            return "running"
        return "paused" if self._ever_started else "configured"

    async def configure(self, config: Any = None) -> None:
        if self._exiting:
            raise RuntimeError(f"{self._display_name()} is exiting; it cannot be configured")
        prev = self._configure_fut
        if prev is not None and not (prev.done() and (prev.cancelled() or prev.exception())):
            raise RuntimeError(
                f"{self._display_name()} is already configured (configure() runs once)")
        _common_settings(config)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._configure_fut = fut
        try:
            await self._configure(config)
        except asyncio.CancelledError:
            fut.cancel()
            self._forget_failed_start()
            raise
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()
            self._forget_failed_start()
            raise
        self._configured = True
        fut.set_result(None)
        if self._exiting and not self._run_active:
            self._release()

    def _forget_failed_start(self) -> None:
        if self.forget_failed_start:
            self._ever_started = False

    async def start(self) -> None:
        if self._exiting:
            raise RuntimeError(f"{self._display_name()} is exiting; it cannot be started")
        fut = self._configure_fut
        if fut is None:
            raise RuntimeError(f"{self._display_name()} must be configured before start()")
        _raise_if_failed(fut, self._display_name())
        if not self._running:
            self._running = True
            self._ever_started = True
            self._wake.set()
        if not fut.done():
            await asyncio.wait([fut])
            if fut is self._configure_fut and (fut.cancelled() or fut.exception() is not None):
                self._stop_running()
            _raise_if_failed(fut, self._display_name())

    async def pause(self, wait: bool = False) -> None:
        self._stop_running()

    async def exit(self) -> None:
        if self._exiting:
            return
        self._exiting = True
        self._wake.set()
        if not self._run_active:
            self._release()

    async def run(self) -> dict[str, Any]:
        if self._run_active:
            raise RuntimeError(f"{self._display_name()}.run() is already in progress")
        self._run_active = True
        try:
            while not self._exiting:
                if not self.is_running:
                    await self._wake.wait()
                    if not (self.is_running or self._exiting):
                        await self._wait_configured()
                    continue
                try:
                    await self._poll()
                except asyncio.CancelledError:
                    raise
                except BaseException:
                    self._stop_running()
                    raise
            self._run_active = False
            return {"state": self.lifecycle_state}
        finally:
            self._run_active = False
            if self._exiting:
                self._release()

    def _stop_running(self) -> None:
        if self._running:
            self._running = False
            if not self._exiting:
                self._wake.clear()

    async def _wait_configured(self) -> None:
        fut = self._configure_fut
        if fut is None:
            return
        await asyncio.wait([fut])
        if fut.cancelled() or fut.exception() is not None:
            self._running = False
            if not self._exiting:
                self._wake.clear()


class SixBooleansFixed(SixBooleans):
    """The old logic with the one deliberate change: a failed configure forgets its start()."""

    forget_failed_start = True


def _raise_if_failed(fut: asyncio.Future[None], name: str) -> None:
    if not fut.done():
        return
    if fut.cancelled():
        raise RuntimeError(f"configure() of {name} was cancelled; configure it again")
    exc = fut.exception()
    if exc is not None:
        raise RuntimeError(f"configure() of {name} failed ({type(exc).__name__}: {exc}); "
                           "configure it again") from exc


class TableWorker(PollingWorker):
    """The real worker with test-controlled hooks (no __init__ call to the base: not needed)."""

    released = False  # as SixBooleans.released

    def __init__(self, gates: _Gates) -> None:
        self.gates = gates

    def _release(self) -> None:
        super()._release()
        self.released = True

    async def _configure(self, config: Any) -> None:
        await self.gates.wait("configure")
        self.released = False

    async def _poll(self) -> PollResult:
        await self.gates.wait("poll")
        return PollResult()


# ---------------------------------------------------------------------- differential test
class _ConfigureError(Exception):
    pass


class _PollError(Exception):
    pass


_OK_CONFIG = {"stats_interval": 60}
_BAD_CONFIG = {"stats_interval": -1}  # refused by the settings check, before _configure

#: What the test does at one step: a control call (a task on the loop), a hook outcome, or a
#: cancellation of the newest configure()/run() call still in progress.
STEPS: dict[str, Callable[[Any, _Gates, dict[str, asyncio.Task[Any]]], asyncio.Task[Any] | None]]
STEPS = {
    "configure": lambda w, g, t: asyncio.create_task(w.configure(_OK_CONFIG)),
    "configure_bad": lambda w, g, t: asyncio.create_task(w.configure(_BAD_CONFIG)),
    "start": lambda w, g, t: asyncio.create_task(w.start()),
    "pause": lambda w, g, t: asyncio.create_task(w.pause()),
    "exit": lambda w, g, t: asyncio.create_task(w.exit()),
    "run": lambda w, g, t: asyncio.create_task(w.run()),
    "configure_ok": lambda w, g, t: g.finish("configure", None),
    "configure_fails": lambda w, g, t: g.finish("configure", _ConfigureError("bad config")),
    "configure_cancelled": lambda w, g, t: _cancel(t.get("configure")),
    "poll_ok": lambda w, g, t: g.finish("poll", None),
    "poll_fails": lambda w, g, t: g.finish("poll", _PollError("poll failed")),
    "run_cancelled": lambda w, g, t: _cancel(t.get("run")),
}


def _cancel(task: asyncio.Task[Any] | None) -> None:
    if task is not None:
        task.cancel()


class _Driven:
    """One worker under test: its gates, its calls in flight, and what has been observed."""

    def __init__(self, make: Callable[[_Gates], Any]) -> None:
        self.gates = _Gates()
        self.worker = make(self.gates)
        self.calls: list[tuple[int, str, asyncio.Task[Any]]] = []
        self.newest: dict[str, asyncio.Task[Any]] = {}

    def step(self, index: int, name: str) -> None:
        task = STEPS[name](self.worker, self.gates, self.newest)
        if task is not None:
            self.calls.append((index, name, task))
            self.newest[name] = task

    def observe(self) -> tuple[Any, ...]:
        """The state, and each call that finished since the last look: accepted or how refused."""
        w = self.worker
        finished = []
        for index, name, task in [c for c in self.calls if c[2].done()]:
            self.calls.remove((index, name, task))
            finished.append((index, name, self._outcome(task)))
        return (w.lifecycle_state, w.is_configured, w.is_running, w.is_exiting, w.released,
                finished)

    def _outcome(self, task: asyncio.Task[Any]) -> str:
        if task.cancelled():
            return "cancelled"
        exc = task.exception()
        if exc is None:
            return "ok"
        return f"{type(exc).__name__}: {str(exc).replace(type(self.worker).__name__, '<w>')}"

    async def close(self) -> None:
        for _, _, task in self.calls:
            task.cancel()
        await asyncio.gather(*(t for _, _, t in self.calls), return_exceptions=True)


async def _settle() -> None:
    # Enough loop turns for every chain an outcome starts (configure -> start -> run) to finish.
    for _ in range(30):
        await asyncio.sleep(0)


def _where(task: asyncio.Task[Any]) -> tuple[tuple[str, int], ...]:
    """Where a pending call is suspended: each coroutine in its await chain, by name and line."""
    frames = []
    coro: Any = task.get_coro()
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        frames.append((coro.cr_frame.f_code.co_name, coro.cr_frame.f_lineno))
        coro = coro.cr_await
    return tuple(frames)


def _future_status(fut: asyncio.Future[None] | None) -> str:
    if fut is None or not fut.done():
        return "none" if fut is None else "pending"
    return "cancelled" if fut.cancelled() else ("failed" if fut.exception() else "ok")


#: The attributes that hold each side's lifecycle (the rest is counters, clocks, resources).
_STATE_ATTRIBUTES = {
    SixBooleans: ("_configured", "_running", "_exiting", "_ever_started", "_run_active",
                  "released"),
    TableWorker: ("_lifecycle", "_run_active", "_inflight", "released"),
}


def _fingerprint(driven: _Driven) -> tuple[Any, ...]:
    """Everything that decides what ``driven`` does next: two equal ones behave alike."""
    w = driven.worker
    kind = TableWorker if isinstance(w, TableWorker) else SixBooleans
    wake = vars(w).get("_wake")
    return (
        tuple(getattr(w, name) for name in _STATE_ATTRIBUTES[kind]),
        _future_status(w._configure_fut),
        wake is not None and wake.is_set(),
        tuple(sorted(driven.gates.waiting)),
        tuple(sorted((name, _where(task)) for _, name, task in driven.calls)),
    )


def _trace(reference: type[SixBooleans], names: list[str]) -> tuple[list[Any], list[Any], Any]:
    """Drive the reference and the real worker through ``names``.

    Returns what was observed of each after every step, and the fingerprint of both at the end.
    """

    async def main() -> tuple[list[Any], list[Any], Any]:
        old, new = _Driven(reference), _Driven(TableWorker)
        seen_old, seen_new = [old.observe()], [new.observe()]
        try:
            for index, name in enumerate(names):
                old.step(index, name)
                new.step(index, name)
                await _settle()
                seen_old.append(old.observe())
                seen_new.append(new.observe())
            return seen_old, seen_new, (_fingerprint(old), _fingerprint(new))
        finally:
            await old.close()
            await new.close()

    return asyncio.run(main())


@pytest.fixture(autouse=True, scope="module")
def _quiet_worker_logs() -> Iterator[None]:
    """run() logs each poll failure with its traceback; thousands of them are only noise."""
    logger = logging.getLogger(f"aiorl.worker.{TableWorker.__name__}")
    was = logger.disabled
    logger.disabled = True
    yield
    logger.disabled = was


def _assert_same(names: list[str], seen_old: list[Any], seen_new: list[Any]) -> None:
    for step, (old, new) in enumerate(zip(seen_old, seen_new, strict=True)):
        assert new == old, f"after {names[:step]}: old {old}, new {new}"


def test_every_sequence_up_to_six_steps() -> None:
    """Breadth first over all step sequences, up to 6 long, compared step by step.

    A sequence is extended only if it leads somewhere new (by the fingerprint of
    both workers: their state, pending hooks, and where each call in flight is
    suspended); any other one behaves like one already extended. So this covers
    every sequence of up to 6 steps (12**6 of them) by replaying a few thousand.
    """
    seen = set()
    frontier: list[list[str]] = [[]]
    for _ in range(6):
        extended = []
        for prefix in frontier:
            for name in STEPS:
                names = [*prefix, name]
                seen_old, seen_new, fingerprint = _trace(SixBooleansFixed, names)
                _assert_same(names, seen_old, seen_new)
                if fingerprint not in seen:
                    seen.add(fingerprint)
                    extended.append(names)
        frontier = extended
    assert len(seen) > 50  # the walk did reach the configure/start/pause/exit interleavings


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(sorted(STEPS)), max_size=12))
def test_longer_random_sequences(names: list[str]) -> None:
    """Beyond 6 steps, a sample (and a check that the fingerprint pruning misses nothing)."""
    seen_old, seen_new, _ = _trace(SixBooleansFixed, names)
    _assert_same(names, seen_old, seen_new)


def test_the_one_deliberate_difference() -> None:
    """A start() that failed with its configure() no longer makes the worker "paused" later."""
    names = ["run", "configure", "start", "configure_fails", "configure", "configure_ok"]
    seen_old, seen_new, _ = _trace(SixBooleans, names)
    assert seen_old[-1][0] == "paused"  # never ran, start() raised: yet "paused"
    assert seen_new[-1][0] == "configured"
    assert seen_new[:-1] == seen_old[:-1]
    assert _trace(SixBooleansFixed, names)[0] == seen_new
    # The start() of that sequence was refused with configure's error, in both.
    assert (2, "start", "RuntimeError: configure() of <w> failed (_ConfigureError: bad config);"
            " configure it again") in seen_new[4][-1]
