"""The [`PollingWorker`][aiorl.PollingWorker] lifecycle as data: states, events, one pure table.

The worker keeps its whole lifecycle in one `Lifecycle` value and changes
it only through `transition`, which maps ``(state, event)`` to the next
state and the `Action` the worker must take. The table does no I/O and
knows nothing of asyncio, so every rule of ``docs/lifecycle.md`` can be read
here, tested pair by pair, and drawn as the diagram in that document.

What stays beside the state, in the worker, is what is not lifecycle: whether a
``run()`` is in progress, how many polls are in flight, and the last
``configure()`` future (its error is what ``start()`` re-raises).

Why two "pending" states: control calls take effect in the order sent, also
while ``configure()`` is still running. ``configure; start`` must end up
running and ``configure; start; pause`` paused once the configuration is done,
so the state remembers the last of those calls (``START_PENDING``,
``PAUSE_PENDING``); both read as ``configuring`` until then.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Final

from aiorl.errors import AiorlError

__all__ = [
    "Action",
    "Event",
    "IllegalTransition",
    "Lifecycle",
    "TRANSITIONS",
    "Transition",
    "transition",
]


class Lifecycle(Enum):
    """Where a polling worker is in its life; `label` is ``stats()["state"]``."""

    UNCONFIGURED = "unconfigured"  #: no configure() succeeded or is in progress
    CONFIGURING = "configuring"  #: configure() in progress, not started
    START_PENDING = "start_pending"  #: configure() in progress; start() came: run once done
    PAUSE_PENDING = "pause_pending"  #: configure() in progress; start(), then pause() came
    CONFIGURED = "configured"  #: configured, never started
    RUNNING = "running"  #: configured and started: run() polls
    PAUSED = "paused"  #: started once, now paused: run() idles
    EXITING = "exiting"  #: exit() called while a run() is still finishing
    EXITED = "exited"  #: exit() called and no run() in progress: final

    @property
    def label(self) -> str:
        """The public state name (``stats()["state"]``, ``lifecycle_state``)."""
        return _LABELS.get(self, self.value)

    @property
    def is_exiting(self) -> bool:
        """``exit()`` was called (final): ``start()`` and ``configure()`` are refused."""
        return self in (Lifecycle.EXITING, Lifecycle.EXITED)

    @property
    def wakes_run(self) -> bool:
        """``run()`` has something to do but idle: poll, wait for configure, or return."""
        return self in _WAKES_RUN


_LABELS: Final[Mapping[Lifecycle, str]] = MappingProxyType({
    Lifecycle.START_PENDING: "configuring",
    Lifecycle.PAUSE_PENDING: "configuring",
})

_WAKES_RUN: Final = frozenset({
    Lifecycle.START_PENDING, Lifecycle.RUNNING, Lifecycle.EXITING, Lifecycle.EXITED,
})


class Event(Enum):
    """What happened to the worker: a control call arrived, or its own work ended."""

    CONFIGURE = "configure"  #: configure() called
    CONFIGURE_OK = "configure_ok"  #: _configure and the common configuration succeeded
    CONFIGURE_FAILED = "configure_failed"  #: configure() raised or was cancelled
    START = "start"  #: start() called
    PAUSE = "pause"  #: pause() called
    EXIT = "exit"  #: exit() called
    POLL_FAILED = "poll_failed"  #: _poll, its result or a stats report raised inside run()
    RUN_ENDED = "run_ended"  #: no run() is in progress any more (also: exit() found none)


class Action(Enum):
    """What the worker must do besides entering the next state."""

    NONE = "none"
    AWAIT_CONFIGURE = "await_configure"  #: start() replies once configure() is done
    RELEASE = "release"  #: release the poll thread and the stats sinks
    REJECT_EXITING = "reject_exiting"  #: refuse the call: exit() came first
    REJECT_CONFIGURED = "reject_configured"  #: refuse configure(): done or in progress
    REJECT_UNCONFIGURED = "reject_unconfigured"  #: refuse start(): no configure() to follow

    @property
    def rejects(self) -> bool:
        """The call is refused and the state does not change."""
        return self in (Action.REJECT_EXITING, Action.REJECT_CONFIGURED,
                        Action.REJECT_UNCONFIGURED)


@dataclass(frozen=True)
class Transition:
    """The next state and what the worker must do on the way."""

    state: Lifecycle
    action: Action = Action.NONE


class IllegalTransition(AiorlError, RuntimeError):
    """An event that cannot happen in that state: a bug in the worker, not a user error."""


def _build_table() -> Mapping[tuple[Lifecycle, Event], Transition]:
    s, e, a = Lifecycle, Event, Action
    table: dict[tuple[Lifecycle, Event], Transition] = {}
    for state in Lifecycle:
        # Calls valid in every state. pause() is never refused (after exit() it is a no-op);
        # a run() ending outside exit leaves the state as it is.
        table[state, e.PAUSE] = Transition(state)
        table[state, e.RUN_ENDED] = Transition(state)
        if state.is_exiting:
            table[state, e.EXIT] = Transition(state)
            table[state, e.CONFIGURE] = Transition(state, a.REJECT_EXITING)
            table[state, e.START] = Transition(state, a.REJECT_EXITING)
            # A configure() sent before exit() may still finish; exit is final either way.
            table[state, e.CONFIGURE_OK] = Transition(state)
            table[state, e.CONFIGURE_FAILED] = Transition(state)
        else:
            table[state, e.EXIT] = Transition(s.EXITING)
            table[state, e.CONFIGURE] = Transition(state, a.REJECT_CONFIGURED)
    pending = (s.CONFIGURING, s.START_PENDING, s.PAUSE_PENDING)
    for state in pending:
        table[state, e.START] = Transition(s.START_PENDING, a.AWAIT_CONFIGURE)
        table[state, e.CONFIGURE_FAILED] = Transition(s.UNCONFIGURED)
    table.update({
        (s.UNCONFIGURED, e.CONFIGURE): Transition(s.CONFIGURING),
        (s.UNCONFIGURED, e.START): Transition(s.UNCONFIGURED, a.REJECT_UNCONFIGURED),
        (s.CONFIGURING, e.CONFIGURE_OK): Transition(s.CONFIGURED),
        (s.START_PENDING, e.CONFIGURE_OK): Transition(s.RUNNING),
        (s.START_PENDING, e.PAUSE): Transition(s.PAUSE_PENDING),
        (s.PAUSE_PENDING, e.CONFIGURE_OK): Transition(s.PAUSED),
        (s.CONFIGURED, e.START): Transition(s.RUNNING),
        (s.RUNNING, e.START): Transition(s.RUNNING),
        (s.RUNNING, e.PAUSE): Transition(s.PAUSED),
        (s.RUNNING, e.POLL_FAILED): Transition(s.PAUSED),
        (s.PAUSED, e.START): Transition(s.RUNNING),
        # pause() lets the poll in flight finish; if it fails, the worker stays paused.
        (s.PAUSED, e.POLL_FAILED): Transition(s.PAUSED),
        (s.EXITING, e.POLL_FAILED): Transition(s.EXITING),
        # Whoever ends the last run() after exit() (run() itself, or exit() finding none)
        # releases; so does a configure() finishing after that, as nothing would close
        # what it opened.
        (s.EXITING, e.RUN_ENDED): Transition(s.EXITED, a.RELEASE),
        (s.EXITED, e.RUN_ENDED): Transition(s.EXITED, a.RELEASE),
        (s.EXITED, e.CONFIGURE_OK): Transition(s.EXITED, a.RELEASE),
    })
    return MappingProxyType(table)


#: Every legal ``(state, event)`` pair. A missing pair cannot happen: a configure
#: outcome outside the configure states, or a poll failure when no poll can run.
TRANSITIONS: Final[Mapping[tuple[Lifecycle, Event], Transition]] = _build_table()


def transition(state: Lifecycle, event: Event) -> Transition:
    """The next state and action for ``event`` in ``state``.

    Raises `IllegalTransition` for a pair that cannot happen.
    """
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise IllegalTransition(f"{event.name} cannot happen in state {state.name}") from None
