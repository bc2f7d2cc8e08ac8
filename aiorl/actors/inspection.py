"""What a process tells ``aiorl doctor`` and ``aiorl trace``: the ``inspect`` operation.

Every worker process (and every driver's ``Cluster``) serves ``WorkerOp.INSPECT``
(`aiorl.protocol.ops.WorkerOp`) on its endpoint. One request answers one action:

* ``snapshot``: this process's pending operations, thread stacks, asyncio tasks and what
  each awaits (at most `MAX_TASKS` described, the rest counted by coroutine), the
  channels it hosts (sizes, waiting getters and putters, producers, consumers), and
  CPU/RSS. Pending operations are read from the services' own tables (the endpoint's
  unanswered requests, the P2P inboxes' posted receives and senders' unacknowledged sends,
  the channel client's parked operations, the weight subscribers' waits for a version and
  pulls, the broadcasts called and not complete), so they cost nothing while nobody asks; with
  tracing on, the open spans add each operation's age.
* ``trace_page``: the trace ring buffer, drained a page at a time
  (`aiorl.trace.recorder.drain_page`: ``first`` starts a pull, ``max_spans`` bounds a page);
  ``trace_pull``: all of it in one answer (`aiorl.trace.recorder.drain`).
* ``trace_start`` / ``trace_stop``: switch tracing in this process.
* ``metrics``: CPU, RSS, pending operations by kind, hosted channel depths and, while
  tracing is on, operations, errors and bytes per second (``aiorl status --watch`` and
  the registry's Prometheus endpoint).

The answer is built on the event loop, which reads the services' private state without
locks (they are mutated only there). A blocked loop does not answer: the collector reports
the process as unresponsive, which is itself the diagnosis.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import os
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from aiorl.channels import ChannelHost, channel_waits, held_channels
from aiorl.collective import Broadcaster
from aiorl.names import WorkerInfo
from aiorl.p2p import P2PEngine
from aiorl.protocol.inspect import encode_answer
from aiorl.protocol.ops import WorkerOp
from aiorl.runtime import Runtime
from aiorl.trace import recorder as _trace
from aiorl.transport.endpoint import Incoming
from aiorl.weights import weight_publications, weight_waits

__all__ = ["serve_inspection", "snapshot", "traced_execution"]

#: Frames of a stack kept per thread or task (the innermost ones).
STACK_LIMIT = 40
#: Asyncio tasks a snapshot describes; the rest are counted, by coroutine (see ``_tasks``).
MAX_TASKS = 200
#: Coroutines named in the count of the tasks left out (the most common ones).
MAX_TASK_KINDS = 20
#: Seconds between counter samples while tracing is on.
SAMPLE_INTERVAL = 0.1


def caller_name(identity: bytes) -> str:
    """The process name in an endpoint routing id (``name/pid/nonce``)."""
    return identity.split(b"/", 1)[0].decode(errors="replace")


class _Caller(_trace.CompactShape):
    """Tracing: what the records of one caller's calls of one method share: the method,
    the caller's name, the flow pair of its calls to us, and the loop thread (where calls
    arrive)."""

    __slots__ = ("method", "name", "pair", "tid")

    #: ``(key, start time, request id)``: an ``async def`` execution's start.
    layout = struct.Struct("<qqq")

    def __init__(self, identity: bytes, method: str, me: WorkerInfo) -> None:
        super().__init__()
        self.method = method
        self.name = caller_name(identity)
        self.pair = f"{self.name}>{me.name}/call"
        self.tid = threading.get_ident()

    def expand(self, fields: tuple[int, ...]) -> tuple[Any, ...]:
        _, t, rid = fields
        return ("exec", self.method, t, t, self.tid, self.tid, self.name, 0, True, None, None,
                (self.pair, rid), None, False)


_pack_start = _Caller.layout.pack
#: Tracing: each caller's routing id -> method -> its shape.
_callers: dict[bytes, dict[str, _Caller]] = {}


def traced_execution(fn: Callable[..., Any], is_async: bool, msg: Incoming,
                     me: WorkerInfo) -> Callable[..., Any]:
    """Record a call's execution, the end of its flow from the caller (on the loop).

    The flow is named by the caller's name and the request id in the call's header (the
    caller names its end the same way), so nothing is counted per call here.
    A plain method is wrapped: its run on the method thread becomes a nested slice of that
    thread. An ``async def`` method is not wrapped (a wrapper coroutine per call measured
    ~10 % of in-flight throughput on no-op calls): its start is recorded as an instant
    with the flow arrow (a compact record, `_Caller`); its duration is the caller's
    call span (or the user's own ``aiorl.span`` inside it).
    """
    methods = _callers.get(msg.identity)
    if methods is None:
        methods = _callers[msg.identity] = {}
    method = msg.meta
    caller = methods.get(method)
    if caller is None:
        caller = methods[method] = _Caller(msg.identity, method, me)
    if is_async:
        _trace.append(_pack_start(caller.key, _trace.now(), msg.request_id))
        return fn
    return _traced_plain(fn, method, caller.name, (caller.pair, msg.request_id))


def _traced_plain(fn: Callable[..., Any], method: str, caller: str,
                  flow: tuple[str, int]) -> Callable[..., Any]:
    """A plain method's run on the method thread, recorded as a nested slice of that thread.

    Its own function, not a closure inside `traced_execution`: the variables a nested
    function captures become cell objects made at every entry of the enclosing function,
    which the hotter ``async def`` path would pay for (about 6 % of a traced worker's profile
    samples on no-op calls)."""
    record = _trace.record

    def run_plain(*args: Any, **kwargs: Any) -> Any:
        t0 = _trace.now()
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            record("exec", method, t0, caller, 0, False, _trace.error_text(exc), None, flow,
                   False)
            raise
        record("exec", method, t0, caller, 0, True, None, None, flow, False)
        return result

    return run_plain


def serve_inspection(runtime: Runtime, calls: Mapping[asyncio.Task[Any], Incoming] | None = None,
                     instance: Callable[[], Any] | None = None) -> None:
    """Serve ``inspect`` on ``runtime``'s endpoint (any thread; registered on the loop).

    ``calls`` maps the running ``async def`` method tasks of a worker to the call each
    answers; ``instance`` returns the worker's instance (a channel host reports its queues).
    """

    sampler = _CounterSampler(runtime, instance)

    def answer(meta: dict[str, Any]) -> Any:
        action = meta.get("action")
        if action == "snapshot":
            return snapshot(runtime, calls, instance() if instance else None)
        if action == "metrics":
            return metrics(runtime, instance() if instance else None,
                           float(meta.get("window", 10.0)))
        if action == "trace_page":  # a pull in bounded pieces (cluster/doctor.py dump_trace)
            return _trace.drain_page(meta.get("first") is True, int(meta.get("max_spans", 0)))
        if action == "trace_pull":
            return _trace.drain()
        if action == "trace_start":
            _trace.enable()
            sampler.start()
            return {"on": True}
        if action == "trace_stop":
            _trace.disable()
            return {"on": False}
        raise ValueError(f"unknown inspect action {action!r}")

    def on_inspect(msg: Incoming) -> None:
        msg.reply(None, encode_answer(answer(msg.meta or {})))

    def install() -> None:
        runtime.endpoint.handle(WorkerOp.INSPECT, on_inspect)
        if _trace.ON:
            sampler.start()

    runtime.submit(install)


class _CounterSampler:
    """While tracing is on: queue depths and pending operations as counter samples, every
    `SAMPLE_INTERVAL` seconds, on the loop (so recording adds nothing per operation)."""

    def __init__(self, runtime: Runtime, instance: Callable[[], Any] | None) -> None:
        self.runtime = runtime
        self.instance = instance
        self.running = False

    def start(self) -> None:
        if not self.running:
            self.running = True
            self.runtime.loop.call_soon(self.sample)

    def sample(self) -> None:
        if not _trace.ON or self.runtime.endpoint.closed:
            self.running = False
            return
        requests = len(self.runtime.endpoint.pending_requests())
        _trace.counter("pending operations", requests + len(_trace.open_spans))
        engine = self.runtime.services.get(P2PEngine)
        if isinstance(engine, P2PEngine):
            _trace.counter("p2p messages not yet received", engine.arrived())
        for q in _hosted_channels(self.instance() if self.instance else None):
            _trace.counter(f"channel {q['channel']} {q['queue']} depth", q["size"])
        self.runtime.loop.call_later(SAMPLE_INTERVAL, self.sample)


def metrics(runtime: Runtime, instance: Any, window_s: float) -> dict[str, Any]:
    """The live numbers of this process (``aiorl status --watch``, Prometheus): cheap to
    build (no stacks), rates from the trace buffer while tracing is on."""
    pending: dict[str, int] = {}
    for e in _pending(runtime, None, _trace._now()):
        if e["kind"] != "span":
            pending[e["kind"]] = pending.get(e["kind"], 0) + 1
    return {"process": runtime.name, "pid": os.getpid(), "tracing": _trace.ON,
            "resources": _resources(), "pending": pending,
            "channels": _hosted_channels(instance),
            "rates": _trace.recent(window_s) if _trace.ON else {}}


# ---------------------------------------------------------------------- the snapshot
def snapshot(runtime: Runtime, calls: Mapping[asyncio.Task[Any], Incoming] | None = None,
             instance: Any = None) -> dict[str, Any]:
    """This process's state for the doctor (runtime loop only)."""
    now = _trace._now()
    tasks, left_out = _tasks(runtime.loop, itertools.islice(calls or (), MAX_TASKS))
    return {
        "process": runtime.name, "pid": os.getpid(), "hostname": socket.gethostname(),
        "endpoint": runtime.endpoint.address, "time": time.time(),
        "tracing": _trace.ON, "resources": _resources(),
        "pending": _pending(runtime, calls, now),
        "threads": _thread_stacks(),
        "tasks": tasks, "tasks_left_out": left_out,
        "channels": _hosted_channels(instance),
        # Who can end whose wait, for the doctor's one graph: the channels this process may
        # put into, and the weight names it publishes.
        "holds_channels": held_channels(runtime),
        "publishes_weights": weight_publications(runtime),
    }


def _pending(runtime: Runtime, calls: Mapping[asyncio.Task[Any], Incoming] | None,
             now: int) -> list[dict[str, Any]]:
    """Every operation this process waits for, with its peer (by name where known)."""
    out: list[dict[str, Any]] = []
    names = runtime.peer_names()
    for address, settle in runtime.endpoint.pending_requests():
        # A group call's rank: the endpoint settles it with ``partial(call.settle, i)``.
        # Other requests (the registry's, this doctor's own) are not waits on a peer.
        if not isinstance(settle, functools.partial):
            continue
        call = getattr(settle.func, "__self__", None)
        if call is not None and hasattr(call, "remaining") and hasattr(call, "results"):
            t0 = getattr(call, "t0", None)  # traced calls know when they started
            out.append({"kind": "call", "peer": names.get(address), "address": address,
                        "call": id(call), "index": settle.args[0],
                        "call_size": len(call.results), "call_remaining": call.remaining,
                        "age_s": None if t0 is None else round((now - t0) / 1e9, 6)})
    engine = runtime.services.get(P2PEngine)
    if isinstance(engine, P2PEngine):
        out += engine.waits()
    for wait in channel_waits(runtime):
        entry = {"kind": f"channel.{wait['kind']}", "channel": wait["channel"],
                 "queue": wait["queue"], "peer": wait["peer"]}
        if wait["unresolved"]:
            entry["unresolved"] = True
        out.append(entry)
    broadcaster = runtime.services.get(Broadcaster)
    if isinstance(broadcaster, Broadcaster):
        for wait in broadcaster.waits():
            out.append({**wait, "age_s": round(max(0.0, time.time() - wait["since"]), 6)})
    for wait in weight_waits(runtime):
        out.append({**wait, "age_s": round(max(0.0, time.time() - wait["since"]), 6)})
    for task, msg in (calls or {}).items():
        out.append({"kind": "executing", "method": msg.meta, "peer": caller_name(msg.identity),
                    "task": task.get_name()})
    for thread, msg in _plain_calls():
        out.append({"kind": "executing", "method": msg.meta, "peer": caller_name(msg.identity),
                    "thread": thread})
    for s in list(_trace.open_spans):
        out.append({"kind": "span", "cat": s.cat, "name": s.name, "peer": s.peer,
                    "age_s": round(s.age_s(now), 6), "tags": s.tags})
    return out


def _plain_calls() -> list[tuple[str, Incoming]]:
    """The calls plain methods are running: read from the method thread's own frames (the
    ``msg`` of ``WorkerServer._run_plain``), so serving a call records nothing."""
    names = {t.ident: t.name for t in threading.enumerate()}
    found = []
    for ident, frame in sys._current_frames().items():
        f: Any = frame
        while f is not None:
            if f.f_code.co_name == "_run_plain" and isinstance(f.f_locals.get("msg"), Incoming):
                found.append((names.get(ident, str(ident)), f.f_locals["msg"]))
                break
            f = f.f_back
    return found


def _thread_stacks() -> list[dict[str, Any]]:
    names = {t.ident: t.name for t in threading.enumerate()}
    current = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        stack = traceback.format_stack(frame, limit=STACK_LIMIT)
        out.append({"thread": names.get(ident, f"thread-{ident}"), "ident": ident,
                    "inspecting": ident == current, "stack": "".join(stack)})
    return out


def _tasks(loop: asyncio.AbstractEventLoop,
           first: Iterable[asyncio.Task[Any]] = ()) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """At most `MAX_TASKS` tasks described (``first`` ones first: the calls being
    served), and what was left out: how many, and the most common coroutines among them.

    Describing a task (its stack, formatted) costs ~10 µs on the loop, which serves no call
    meanwhile: a worker with 100,000 tasks stopped for seconds per snapshot and answered
    with tens of megabytes. Counting the rest by coroutine costs well under a microsecond
    each."""
    every = asyncio.all_tasks(loop)
    chosen: dict[asyncio.Task[Any], None] = {}
    for task in itertools.chain(first, every):
        if len(chosen) >= MAX_TASKS:
            break
        if task in every:
            chosen[task] = None
    out = [_describe_task(task) for task in chosen]
    left = len(every) - len(chosen)
    kinds: collections.Counter[str] = collections.Counter()
    if left:
        for task in every:
            if task not in chosen:
                kinds[getattr(task.get_coro(), "__qualname__", "?")] += 1
        common = ", ".join(f"{name} x{n}" for name, n in kinds.most_common(MAX_TASK_KINDS))
        others = len(kinds) - MAX_TASK_KINDS
        more = f", {others} other coroutines" if others > 0 else ""
        # An entry in the list as well, so every reader of "tasks" (the doctor) says so.
        out.append({"name": f"({left} more tasks not described)", "coro": common + more,
                    "where": "", "awaits": None, "stack": "", "left_out": left})
    return out, {"count": left, "by_coroutine": dict(kinds.most_common(MAX_TASK_KINDS))}


def _describe_task(task: asyncio.Task[Any]) -> dict[str, Any]:
    frames = task.get_stack(limit=STACK_LIMIT)
    where = ""
    if frames:
        f = frames[-1]
        where = f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"
    waiter = getattr(task, "_fut_waiter", None)
    return {"name": task.get_name(), "coro": getattr(task.get_coro(), "__qualname__", "?"),
            "where": where, "awaits": repr(waiter)[:200] if waiter is not None else None,
            "stack": "".join(traceback.format_list(
                traceback.extract_stack(frames[-1]) if frames else []))}


def _hosted_channels(instance: Any) -> list[dict[str, Any]]:
    """The queues of a channel this process hosts: sizes, waiters, producers, consumers."""
    server = instance.server if isinstance(instance, ChannelHost) else None
    if server is None:
        return []
    out = []
    for q in server.snapshot():
        queue = q["queue"]
        out.append({"channel": server.name, "queue": queue if isinstance(queue, str) else
                    repr(queue), "size": q["size"], "weight": q["weight"],
                    "maxsize": q["maxsize"], "waiting_getters": q["waiting_getters"],
                    "waiting_putters": q["waiting_putters"],
                    "parked_clients": sorted({caller_name(i) for i in q["getters"]}),
                    "producers": sorted({caller_name(i) for i in q["producers"]}),
                    "consumers": sorted({caller_name(i) for i in q["consumers"]})})
    return out


def _resources() -> dict[str, float]:
    times = os.times()
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu_s": times.user + times.system, "rss_bytes": rss}
