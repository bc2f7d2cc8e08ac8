"""Handles that arrived in this process: a `WorkerGroup` sent as an argument (or result)
becomes the receiving worker's own handle on the same group, one `SharedGroup` per runtime
and group name, found again by the next handle on that group that arrives.

Each entry asks the registry about its group once: it watches the group (its workers' news
moves the handle's calls, as it does a launcher's) and, unless the watch's snapshot shows a
live worker of it, looks it up. A group the registry still does not know after
`ARRIVAL_WAIT_S` (a launch or a restore that has not reached it yet is waited for) fails
every call through the handle with [`GroupNotFoundError`][aiorl.GroupNotFoundError]; a
registry that does not answer fails them with its error. Calls made meanwhile are queued.

The entries are bounded by what is in use: an entry goes, with its registry watch, when its
group closes (for good, or unknown, or unreachable), or when the last handle on it is
collected: neither the registry client nor the runtime holds it strongly, and a finalizer
drops its watch on the loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

from aiorl.errors import GroupNotFoundError
from aiorl.group.shared import SharedGroup
from aiorl.registry.client import WorkerEvent
from aiorl.runtime import Runtime, Session

__all__ = ["ARRIVAL_WAIT_S", "LOOKUP_TIMEOUT_S", "arrive", "arrived", "held"]

log = logging.getLogger("aiorl.group")

#: How long a handle that arrived waits for the registry to know its group (a launch or a
#: registry restore on its way) before its calls fail with GroupNotFoundError.
ARRIVAL_WAIT_S = 3.0
#: The bound on each registry look-up of such a group.
LOOKUP_TIMEOUT_S = 5.0
#: Pauses between look-ups of a group the registry does not know yet (doubling).
_FIRST_PAUSE_S = 0.05
_LONGEST_PAUSE_S = 0.5

#: Groups whose handles arrived here, by (runtime, group name): held weakly.
_arrived: weakref.WeakValueDictionary[tuple[int, str], SharedGroup] = (
    weakref.WeakValueDictionary())


def arrived(runtime: Runtime, name: str) -> SharedGroup | None:
    """The group ``name`` whose handle arrived earlier on ``runtime``, while it is not over."""
    shared = _arrived.get((id(runtime), name))
    if shared is None or shared.closed or shared.runtime is not runtime:
        return None
    return shared


def arrive(session: Session, cls: type, name: str, world_size: int) -> SharedGroup:
    """A new entry for a handle on group ``name`` that arrived (any thread): kept weakly,
    until its group is over or its last handle is collected, and looked up on the loop."""
    runtime = session.runtime
    shared = SharedGroup(session, cls, name, world_size, held_weakly=True)
    key = (id(runtime), name)
    _arrived[key] = shared
    shared.on_end = functools.partial(_forget, key, weakref.ref(shared))
    finalizer = weakref.finalize(shared, _collected, runtime, name, shared.on_news, shared.closer)
    finalizer.atexit = False
    runtime.loop.call_soon_threadsafe(_start, shared)
    return shared


def held(runtime: Runtime) -> list[str]:
    """The groups whose handles arrived on ``runtime`` and are held now, by name, sorted
    (inspection: one entry, and one registry watch, per group in use)."""
    return sorted(name for (rid, name), shared in list(_arrived.items())
                  if rid == id(runtime) and shared.runtime is runtime)


def _start(shared: SharedGroup) -> None:
    task = shared.runtime.loop.create_task(_find(shared))
    shared.tasks.add(task)
    task.add_done_callback(shared.tasks.discard)


async def _find(shared: SharedGroup) -> None:
    """Watch the group; fail its handle's calls if the registry does not know it."""
    registry = shared.runtime.registry
    loop = shared.runtime.loop
    try:
        snapshot = await shared.watch()
        if any(not record.state.is_final for record in snapshot.values()):
            return  # a live worker: the group exists, and the watch tells the rest
        deadline = loop.time() + ARRIVAL_WAIT_S
        pause = _FIRST_PAUSE_S
        while not shared.closed:  # closed meanwhile: by the watch's news, or the runtime
            try:
                await registry.lookup_group(shared.name, timeout=LOOKUP_TIMEOUT_S)
                return
            except GroupNotFoundError:
                left = deadline - loop.time()
                if left <= 0:
                    break
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, _LONGEST_PAUSE_S)
        else:
            return
        message = (
            f"no worker group named {shared.name!r} exists: a handle on it arrived in "
            f"{shared.runtime.name}, and the registry did not know the group within "
            f"{ARRIVAL_WAIT_S:g} s (it was closed, or never launched). Pass a group's handle "
            f"while the group runs, or look it up by name, self.group({shared.name!r}), "
            "once it does")
        shared.mark_closed(message, GroupNotFoundError.from_message(message))
    except Exception as exc:  # noqa: BLE001 - RegistryUnavailable, ProtocolError: calls learn it
        if not shared.closed:
            shared.mark_closed(f"a handle on worker group {shared.name} that arrived in "
                               f"{shared.runtime.name} cannot reach the registry: {exc}", exc)


def _forget(key: tuple[int, str], ref: weakref.ReferenceType[SharedGroup]) -> None:
    """The group is over: its entry goes (a later handle on the name looks it up again)."""
    shared = ref()
    if shared is not None and _arrived.get(key) is shared:
        del _arrived[key]


def _collected(runtime: Runtime, name: str, on_news: WorkerEvent,
               closer: Callable[[], None]) -> None:
    """The last handle on an entry was collected (any thread, at any point of it): its watch
    and closer go, on the loop."""
    try:
        runtime.loop.call_soon_threadsafe(_release, runtime, name, on_news, closer)
    except Exception:  # noqa: BLE001 - the loop is closed: the process is ending
        pass


def _release(runtime: Runtime, name: str, on_news: WorkerEvent, closer: Callable[[], Any]) -> None:
    runtime.discard_closer(closer)
    if runtime.closed_reason is None:
        runtime.registry.drop_watch(name, on_news)
