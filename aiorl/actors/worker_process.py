"""What runs inside a worker process, from fork to exit.

1. Start a uvloop loop, bind the worker's endpoint, connect to the registry.
2. Load the worker class (shipped by value or by reference) and build the
   instance on the method thread, so a slow or blocking ``__init__`` leaves the
   loop free.
3. Tell the registry ``ready`` (or ``failed`` with the traceback).
4. Serve ``call`` requests until SIGTERM.

Calls to ``async def`` methods become tasks on the loop; calls to plain
methods go, in arrival order, to the single method thread. Exceptions go back
as [`RemoteError`][aiorl.RemoteError] with this worker's name and rank.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import inspect
import logging
import os
import signal
import sys
import time
from typing import Any

import setproctitle

from aiorl.actors import worker as worker_mod
from aiorl.actors.inspection import serve_inspection, traced_execution
from aiorl.collective import get_broadcaster
from aiorl.errors import RegistryUnavailable, to_wire
from aiorl.group.per_rank import resolve_per_rank
from aiorl.names import WorkerInfo
from aiorl.p2p import get_p2p
from aiorl.protocol.ops import AgentOp, WorkerOp, WorkerState
from aiorl.protocol.spawn import WorkerSpawn
from aiorl.registry.client import RESUBSCRIBE_PATIENCE_S, RegistryClient
from aiorl.runtime import Runtime, set_current_runtime
from aiorl.runtime.loop import LoopThread
from aiorl.runtime.work import UnawaitedWorkError
from aiorl.trace import recorder as _trace
from aiorl.transport import security, serialization
from aiorl.transport.code import loads_with_sources
from aiorl.transport.endpoint import Endpoint, Incoming
from aiorl.transport.security import ClusterKeys
from aiorl.util.collector import tune_collector
from aiorl.util.cuda_device import note_thread_device
from aiorl.util.method_thread import MethodThread

__all__ = ["WorkerServer", "run"]

log = logging.getLogger("aiorl.worker")


class WorkerServer:
    """Serves ``call`` requests on an instance."""

    def __init__(self, runtime: Runtime, info: WorkerInfo, method_thread: MethodThread):
        self.runtime = runtime
        self.info = info
        self.instance: Any = None
        self.method_thread = method_thread
        self._methods: dict[str, tuple[Any, bool]] = {}
        #: Running async methods and the call each answers.
        self._tasks: dict[asyncio.Task[Any], Incoming] = {}
        runtime.endpoint.handle(WorkerOp.CALL, self._on_call)

    def _lookup(self, name: str) -> tuple[Any, bool]:
        entry = self._methods.get(name)
        if entry is None:
            if not isinstance(name, str) or name.startswith("_"):
                raise AttributeError(f"{name!r} is private and cannot be called remotely")
            fn = getattr(self.instance, name, None)
            if fn is None or not callable(fn):
                raise AttributeError(f"{type(self.instance).__name__} has no method {name!r}")
            entry = (fn, inspect.iscoroutinefunction(fn))
            self._methods[name] = entry
        return entry

    def _on_call(self, msg: Incoming) -> None:
        try:
            # A method called before is one look-up (no call of `_lookup`): every call pays it.
            fn, is_async = self._methods.get(msg.meta) or self._lookup(msg.meta)
            args, kwargs = serialization.loads(msg.frames) if msg.frames else ((), {})
        except BaseException as exc:  # noqa: BLE001 - goes back to the caller
            self._reply_error(msg, exc)
            return
        if _trace.ON:
            fn = traced_execution(fn, is_async, msg, self.info)
        if is_async:
            self._start_async(msg, fn(*args, **kwargs))
        else:
            # The method thread serializes and sends the reply itself: one thread hop less.
            self.method_thread.run(self._run_plain, msg, fn, args, kwargs)

    def _run_plain(self, msg: Incoming, fn: Any, args: Any, kwargs: Any) -> None:
        """Runs on the method thread: call ``fn`` and answer from this thread."""
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - goes back to the caller
            self._reply_error(msg, exc)
            return
        if result is None:  # nothing to serialize
            msg.reply()
        else:
            self._reply_value(msg, result)

    def _start_async(self, msg: Incoming, coro: Any) -> None:
        """Run an ``async def`` method as a task and answer when it ends.

        The method's own coroutine is the task (no wrapper coroutine), and its done-callback
        answers: one frame less per call. On Python 3.12+ the task starts eagerly: a method
        that finishes without awaiting is answered in this loop turn. Its first step runs
        inside the task either way, so ``asyncio.timeout()``, ``current_task()`` and
        ``wait_for`` work before the first ``await`` too (they raise outside a task).
        """
        if _EAGER_TASKS:
            task = asyncio.Task(coro, loop=self.runtime.loop,
                                eager_start=True)  # type: ignore[call-arg]  # 3.12+ only
        else:
            task = self.runtime.loop.create_task(coro)
        if task.done():
            self._answer(msg, task)
        else:
            self._tasks[task] = msg  # a pending task needs a strong reference
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        msg = self._tasks.pop(task, None)
        if msg is not None:
            self._answer(msg, task)

    def _answer(self, msg: Incoming, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            self._reply_error(msg, asyncio.CancelledError(f"{msg.meta} was cancelled in the worker"))
        elif (exc := task.exception()) is not None:
            self._reply_error(msg, exc)
        else:
            self._reply_value(msg, task.result())

    def _reply_value(self, msg: Incoming, result: Any) -> None:
        try:
            frames = [] if result is None else serialization.dumps(result)
        except Exception as ser_exc:
            _drop_unawaited_work(ser_exc)
            self._reply_error(msg, ser_exc)
            return
        msg.reply(None, frames)

    def _reply_error(self, msg: Incoming, exc: BaseException) -> None:
        msg.reply_error(exc, error="RemoteError", worker=self.info.name, rank=self.info.rank)


async def _report_ready(registry: RegistryClient, info: WorkerInfo) -> None:
    """Tell the registry this worker is ready, through a registry that is restarting (or
    answers with another mechanism for a moment): a transient refusal must not end a worker
    that callers already reach (seen under load). Tried for RESUBSCRIBE_PATIENCE_S, then the
    error ends the worker as before."""
    deadline = time.monotonic() + RESUBSCRIBE_PATIENCE_S
    delay = 0.2
    while True:
        try:
            await registry.report_state(info, WorkerState.READY)
            return
        except RegistryUnavailable as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("reporting ready to the registry: %s; trying again", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


def _drop_unawaited_work(exc: BaseException | None) -> None:
    """A method returned an AsyncWork it forgot to await (``return self.recv(...)``): the
    caller gets the error, and the work is cancelled, so that a receive it stands for does not
    stay posted and silently consume the next message (pickling stops at the first one)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, UnawaitedWorkError):
            exc.work.cancel()
            return
        exc = exc.__cause__ or exc.__context__


#: ``asyncio.Task(..., eager_start=True)`` exists from Python 3.12 on.
_EAGER_TASKS = sys.version_info >= (3, 12)


def _configure_logging(name: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, force=True,
        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s",
    )


def _register_ext_modules() -> None:
    """``AIORL_EXT_MODULE`` (RLinf's ``RLINF_EXT_MODULE``): import each named module
    (comma-separated) and call its ``register()``, once per worker process, before the
    worker class is loaded, so custom environments and models exist when it is built."""
    for name in filter(None, (n.strip() for n in os.environ.get("AIORL_EXT_MODULE", "").split(","))):
        register = getattr(importlib.import_module(name), "register", None)
        if not callable(register):
            raise AttributeError(f"AIORL_EXT_MODULE module {name!r} has no register() function")
        register()


def _load_class(spec: WorkerSpawn) -> tuple[type, tuple[Any, ...], dict[str, Any]]:
    """The worker class and its arguments, after the ``AIORL_EXT_MODULE`` registrations.

    The driver's ``sys.path`` entries go *after* the worker's own (its interpreter's:
    ``PYTHONPATH``, the standard library, site-packages, then the directory it started in,
    put last by `aiorl.node.zygote.working_directory_last`): a module beside the
    driver's script or in its working directory is found when nothing installed has its
    name, and never shadows an installed one."""
    for p in spec.launch.sys_path:
        if p not in sys.path:
            sys.path.append(p)
    _register_ext_modules()
    return loads_with_sources(spec.payload)  # type: ignore[no-any-return]


def _name_process(name: str) -> None:
    """Show the worker's name in ``ps`` and ``top`` (``aiorl::rollout:3``, as Ray shows
    ``ray::Rollout``), followed by how it started (forked by the zygote, or exec'd), which
    the command line said until now. The short name (``comm``, 15 characters) changes too."""
    argv = sys.orig_argv[1:]
    if "-m" in argv:  # from the module on: the interpreter's own options (-P, or the -c code
        argv = argv[argv.index("-m"):]  # that stands for it) say nothing about the worker
    started = " ".join(["python", *argv])
    # SPT_NOENV: the title stays within the original command line's room instead of taking
    # the environment's: /proc/<pid>/environ stays whole (Slurm's process tracking and tools
    # that find a job's processes by it read it); the title is cut short if it must be.
    os.environ["SPT_NOENV"] = "1"
    try:
        setproctitle.setproctitle(f"aiorl::{name} ({started})")
    finally:
        os.environ.pop("SPT_NOENV", None)


async def _main(spec: WorkerSpawn, listen: str) -> int:
    loop = asyncio.get_running_loop()
    name, rank = spec.name, spec.launch.rank
    _name_process(name)
    _configure_logging(name, spec.launch.log_level)
    _trace.set_process_name(name)
    _trace.enable_from_environment()  # AIORL_TRACE from the spawn (a traced driver's)
    endpoint = Endpoint(name, host=listen, lane=True)
    registry = RegistryClient(endpoint, spec.registry)
    runtime = Runtime(LoopThread.adopt_running(), endpoint, registry, name)
    # p2p handlers exist before any peer can send to us; relayed ones go through our agent
    get_p2p(runtime, spec.node.node_id, spec.node.endpoint)
    get_broadcaster(runtime, spec.node.node_id)  # and broadcast handlers
    set_current_runtime(runtime)
    info = spec.worker_info(endpoint.address)
    method_thread = MethodThread(f"aiorl-{name}")
    server = WorkerServer(runtime, info, method_thread)
    serve_inspection(runtime, server._tasks, lambda: server.instance)  # doctor, trace pulls
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    worker_mod._set_context(worker_mod.WorkerContext(runtime, info))

    def construct() -> Any:
        cls, args, kwargs = _load_class(spec)
        args, kwargs = resolve_per_rank(args, kwargs, rank)  # PerRank: this rank's value
        instance = cls(*args, **kwargs)
        note_thread_device()  # a torch.cuda.set_device in __init__ holds for every thread
        return instance

    try:
        server.instance = await loop.run_in_executor(method_thread, construct)
    except BaseException as exc:  # noqa: BLE001 - reported as WorkerInitError to the owner
        log.error("initialisation failed", exc_info=exc)
        await registry.report_state(info, WorkerState.FAILED, to_wire(exc, worker=name, rank=rank))
        runtime.stop()  # P2P engine, channel clients: released at this exit too
        return 1
    # The agent keeps our info so it can report us again if the registry restarts, and
    # forwards relayed messages and calls only to the endpoints its workers reported: it
    # hears first, so a peer that learned our endpoint from the registry finds it known.
    endpoint.send_oneway(spec.node.endpoint, AgentOp.WORKER_READY, {"info": info.to_wire()})
    await _report_ready(registry, info)
    def on_registry_restarted(_msg: Incoming) -> None:
        loop.create_task(registry.resubscribe_patiently())

    endpoint.handle(WorkerOp.REGISTRY_RESTARTED, on_registry_restarted)
    await stop.wait()
    method_thread.shutdown(wait=False, cancel_futures=True)
    runtime.stop()  # closes the services (P2P engine, channel clients), registry client, endpoint
    return 0


def tune_process() -> None:
    """Process settings for a worker that moves data (measured in benchmarks/bench_channels.py).

    * The garbage collector (`aiorl.util.collector.tune_collector`): a worker
      inherits ~200k objects from the zygote's imports (torch), frozen, and creates
      short-lived ones per message; without the freeze every full collection walks all
      of them (~30 % of a busy channel worker's time), and with Python's young threshold
      collections walk the calls in flight (~0.6 µs per call with 1,000 in flight).
    * glibc ``mallopt``: large messages arrive as fresh 1 MiB+ buffers, which glibc
      serves with mmap or trims after they are freed, so each costs ~256 page faults
      per MiB; keeping such buffers on the heap reuses the same pages.
    """
    tune_collector(collect_first=False)
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)  # the largest value glibc accepts on 64-bit
    mallopt(m_trim_threshold, 256 << 20)


def run(spec: WorkerSpawn, *, keys: ClusterKeys | None, listen: str) -> int:
    """Entry point in a freshly forked worker process; returns the exit code.

    ``keys`` (None: insecure) and ``listen`` (the node's IP, or ``ipc://DIR``) come from
    the node agent over the zygote's private channel: the worker's environment never
    holds the secret, and every endpoint opened in this process uses these keys."""
    import uvloop

    security.set_process_keys(keys)
    security.scrub_key_variables()
    tune_process()

    return uvloop.run(_main(spec, listen))
