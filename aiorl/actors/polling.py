"""``PollingWorker``: a worker whose life is a controller-driven poll loop.

A controller (the driver, through a [`WorkerGroup`][aiorl.WorkerGroup]) drives it::

    group = MyPoller.create_group().launch(cluster, name="rollout")
    group.configure(cfg).wait()   # _configure(cfg), then logging level and stats sinks
    work = group.run()            # returns at once; run() loops until exit()
    group.start().wait()          # poll
    group.pause().wait()          # idle (no CPU), run() keeps going
    group.start().wait()          # poll again
    group.exit().wait()           # run() returns its final stats
    final = work.wait()

Subclasses implement ``_configure(config)``, ``_poll() -> PollResult`` and
optionally ``_stats() -> dict``. Each may be a plain or an ``async def``
function:

* a plain ``_configure``/``_poll`` runs on the worker's **poll thread**, one
  dedicated daemon thread that lives as long as the worker, so the event loop
  stays free to serve control calls while a poll blocks, and thread-local state
  set in ``_configure`` (``torch.cuda.set_device``, CUDA streams) holds in every
  ``_poll``;
* an ``async def`` one is awaited on the event loop; it must ``await`` often
  (control calls are served only while it is suspended).

``configure``, ``start``, ``pause``, ``exit``, ``run`` and ``stats`` are
``async def`` so that the worker process runs them as concurrent tasks on its
event loop; a plain method would wait behind ``run()`` on the single method
thread. Subclasses that override them must keep them ``async def`` and await
the base method (enforced when the subclass is defined).

The lifecycle is one `Lifecycle` value, changed only
through the pure transition table in ``aiorl/actors/lifecycle.py``. State machine,
timing guarantees and cancellation: ``docs/lifecycle.md``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from aiorl.actors.lifecycle import Action, Event, Lifecycle, Transition, transition
from aiorl.actors.worker import Worker
from aiorl.errors import ClusterClosedError

__all__ = ["PollResult", "PollingWorker"]

T = TypeVar("T")

_CONTROL_METHODS = ("configure", "start", "pause", "exit", "run", "stats")

#: Seconds between two periodic stats reports when the config does not say.
DEFAULT_STATS_INTERVAL = 10.0


@dataclass(frozen=True)
class PollResult:
    """What one ``_poll()`` did: samples produced/consumed and batches completed.

    Example:
        ```python
        def _poll(self):
            batch = self.env.step()
            return aiorl.PollResult(sample_count=len(batch), batch_count=1)
        ```
    """

    sample_count: int = 0
    batch_count: int = 0


_Job = tuple[concurrent.futures.Future[Any], Callable[[], Any]]


class _PollThread:
    """One daemon thread running submitted functions in order.

    Not a ``ThreadPoolExecutor``: its workers are joined at interpreter exit,
    so a ``_poll`` stuck in a C call would keep the worker process alive after
    SIGTERM. A daemon thread does not.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fut, fn))
        return fut

    def shutdown(self) -> None:
        """Let the thread end after the jobs already submitted."""
        self._jobs.put(None)

    def _main(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting coroutine
                fut.set_exception(exc)


def _cfg_get(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` for mappings (dict, omegaconf DictConfig), ``config.key`` otherwise."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None else value


def _common_settings(config: Any) -> tuple[int | None, float]:
    """The validated ``log_level`` (None: leave as is) and ``stats_interval`` of ``config``."""
    raw = _cfg_get(config, "log_level")
    level: int | None = None
    if raw is not None:
        level = raw if isinstance(raw, int) else logging.getLevelName(str(raw).upper())
        if not isinstance(level, int):
            raise ValueError(f"log_level {raw!r} is not a logging level name or number")
    interval = float(_cfg_get(config, "stats_interval", DEFAULT_STATS_INTERVAL))
    if not interval >= 0:
        raise ValueError(f"stats_interval must be >= 0 seconds, got {interval}")
    return level, interval


def _plain(value: Any) -> Any:
    """An omegaconf node as plain Python containers (anything else unchanged)."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return value
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


class _Sinks:
    """Optional wandb / TensorBoard outputs for the periodic stats.

    A sink whose package is not installed is skipped with a debug message; one
    that fails to start or to write is reported once as a warning and disabled,
    so a monitoring problem never stops the poll loop.
    """

    def __init__(self, config: Any, worker_name: str, group_name: str,
                 logger: logging.Logger) -> None:
        self._log = logger
        self._prefix = worker_name
        self._wandb: Any = None
        self._wandb_owned = False
        self._tb: Any = None
        wandb_cfg = _plain(_cfg_get(config, "wandb", False))
        if wandb_cfg:
            self._start_wandb(wandb_cfg, worker_name, group_name)
        tb_cfg = _plain(_cfg_get(config, "tensorboard", False))
        if tb_cfg:
            self._start_tensorboard(tb_cfg, worker_name)

    def _start_wandb(self, cfg: Any, worker_name: str, group_name: str) -> None:
        try:
            import wandb
        except ImportError:
            self._log.debug("wandb is not installed; the wandb stats sink is off")
            return
        kwargs = dict(cfg) if isinstance(cfg, Mapping) else {}
        kwargs.setdefault("name", worker_name)
        kwargs.setdefault("group", group_name)
        try:
            if wandb.run is None:
                wandb.init(**kwargs)
                self._wandb_owned = True
            self._wandb = wandb
        except Exception:
            self._log.warning("wandb stats sink could not start; it is off", exc_info=True)

    def _start_tensorboard(self, cfg: Any, worker_name: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self._log.debug("tensorboard is not installed; the TensorBoard stats sink is off")
            return
        log_dir = "runs/aiorl"
        if isinstance(cfg, Mapping):
            log_dir = str(cfg.get("log_dir") or log_dir)
        try:
            # ':' is not portable in paths; one sub-directory per worker keeps event files apart.
            self._tb = SummaryWriter(log_dir=os.path.join(log_dir, worker_name.replace(":", "_")))
        except Exception:
            self._log.warning("TensorBoard stats sink could not start; it is off", exc_info=True)

    def write(self, stats: Mapping[str, Any], step: int) -> None:
        numbers = {k: float(v) for k, v in stats.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if self._wandb is not None:
            try:
                self._wandb.log({f"{self._prefix}/{k}": v for k, v in numbers.items()})
            except Exception:
                self._log.warning("wandb stats sink failed; it is off", exc_info=True)
                self._wandb = None
        if self._tb is not None:
            try:
                for k, v in numbers.items():
                    self._tb.add_scalar(k, v, global_step=step)
            except Exception:
                self._log.warning("TensorBoard stats sink failed; it is off", exc_info=True)
                self._tb = None

    def close(self) -> None:
        if self._tb is not None:
            try:
                self._tb.close()
            except Exception:
                self._log.warning("closing the TensorBoard writer failed", exc_info=True)
            self._tb = None
        if self._wandb is not None and self._wandb_owned:
            try:
                self._wandb.finish()
            except Exception:
                self._log.warning("wandb.finish() failed", exc_info=True)
        self._wandb = None


class PollingWorker(Worker):
    """A worker with a ``configure`` / ``start`` / ``pause`` / ``exit`` / ``run`` lifecycle.

    Subclasses implement `_configure`, `_poll` and optionally
    `_stats`. Config keys read by the base class (all optional):

    * ``log_level``: level name or number for this process's ``aiorl`` loggers
      (the worker's own logger included);
    * ``stats_interval``: seconds between periodic stats reports (default 10);
    * ``wandb``: true, or a mapping of ``wandb.init`` keyword arguments, to also
      log stats to Weights & Biases (when ``wandb`` is installed);
    * ``tensorboard``: true, or ``{"log_dir": ...}``, to also write them as
      TensorBoard scalars (when ``tensorboard`` is installed).

    Example:
        ```python
        class Actor(aiorl.PollingWorker):
            def _configure(self, config):
                self.env = make_env(config["env"])

            def _poll(self):
                self.env.step()
                return aiorl.PollResult(sample_count=1)

        actors = Actor.create_group().launch(cluster, num_workers=4, name="actor")
        actors.configure({"env": "CartPole"}).wait()
        running = actors.run()               # polls while running; returns after exit()
        actors.start().wait()
        ...
        actors.exit().wait()
        running.wait()
        ```
    """

    # Class-level defaults: the lifecycle works also in a subclass whose __init__
    # forgets super().__init__(). Assignments shadow them per instance.
    _lifecycle: Lifecycle = Lifecycle.UNCONFIGURED  # changed only by _apply()
    # Not lifecycle state: the last configure() attempt (start() re-raises its error),
    # whether a run() is in progress, and polls started and not finished.
    _configure_fut: asyncio.Future[None] | None = None
    _run_active: bool = False
    _inflight: int = 0
    _poll_thread: _PollThread | None = None
    _stats_interval: float = DEFAULT_STATS_INTERVAL
    _sinks: _Sinks | None = None
    _polls: int = 0
    _samples: int = 0
    _batches: int = 0
    _running_s: float = 0.0  # time spent in the running state, summed over runs
    _running_since: float | None = None
    _last_report: tuple[float, int, int, int, float] | None = None  # t, counts, running_s
    _next_report: float = 0.0
    #: A rank restarted by its group (launch(restart="on_failure")) gets the last
    #: configure() again before any other call (aiorl.group.calls.REPLAY_ATTRIBUTE).
    _aiorl_replay_on_restart = ("configure",)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _CONTROL_METHODS:
            fn = cls.__dict__.get(name)
            if fn is not None and not inspect.iscoroutinefunction(fn):
                # A plain override would run on the method thread, behind run(), and
                # return an un-awaited coroutine from super(): fail at definition instead.
                raise TypeError(
                    f"{cls.__name__}.{name} overrides PollingWorker.{name} and must be "
                    f"'async def' (and await super().{name}(...))"
                )

    @functools.cached_property
    def _wake(self) -> asyncio.Event:
        """Set while the state gives ``run()`` something to do (`Lifecycle.wakes_run`).

        Per instance, made on first use (an asyncio event binds to the loop that
        first waits on it); `_apply` keeps it in step with the state.
        """
        wake = asyncio.Event()
        if self._lifecycle.wakes_run:
            wake.set()
        return wake

    @functools.cached_property
    def _idle(self) -> asyncio.Event:
        """Set while no poll is in flight (``pause(wait=True)`` waits on it)."""
        idle = asyncio.Event()
        if self._inflight == 0:
            idle.set()
        return idle

    # ------------------------------------------------------------------ subclass hooks
    def _configure(self, config: Any) -> Awaitable[None] | None:
        """Parse ``config``, allocate resources, start threads. Plain or ``async def``."""

    def _poll(self) -> PollResult | None | Awaitable[PollResult | None]:
        """Do one unit of work and say how much. Plain (poll thread) or ``async def`` (loop)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _poll()")

    def _stats(self) -> dict[str, Any]:
        """Extra stats for reports and [`stats`][aiorl.PollingWorker.stats] (called on the event
        loop thread)."""
        return {}

    # ------------------------------------------------------------------ state (in the worker)
    @property
    def is_configured(self) -> bool:
        """``configure`` finished successfully."""
        return _succeeded(self._configure_fut)

    @property
    def is_running(self) -> bool:
        """Configured, started and neither paused nor exiting: ``run()`` polls."""
        return self._lifecycle is Lifecycle.RUNNING

    @property
    def is_exiting(self) -> bool:
        """``exit()`` was called: ``run()`` returns (or has returned)."""
        return self._lifecycle.is_exiting

    @property
    def lifecycle_state(self) -> str:
        """One of ``unconfigured``, ``configuring``, ``configured`` (never started),
        ``running``, ``paused``, ``exiting`` (run() still finishing) or ``exited``."""
        return self._lifecycle.label

    # ------------------------------------------------------------------ control (event loop)
    async def configure(self, config: Any = None) -> None:
        """Run ``_configure(config)``, then the common configuration (log level, stats sinks).

        May be called once; again only after a failed attempt. Raises
        `RuntimeError` after ``exit()`` and `ValueError` for a bad
        ``log_level`` or ``stats_interval`` (checked before ``_configure`` runs).
        """
        step = transition(self._lifecycle, Event.CONFIGURE)
        if step.action is Action.REJECT_EXITING:
            raise RuntimeError(f"{self._display_name()} is exiting; it cannot be configured")
        if step.action is Action.REJECT_CONFIGURED:
            raise RuntimeError(
                f"{self._display_name()} is already configured (configure() runs once)")
        level, interval = _common_settings(config)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._configure_fut = fut
        self._apply(step)
        try:
            if inspect.iscoroutinefunction(self._configure):
                await self._configure(config)
            else:
                # On the poll thread: a slow setup leaves the loop free, and thread-local
                # state it sets (e.g. the CUDA device) is what _poll will see.
                await asyncio.wrap_future(self._get_poll_thread().submit(
                    lambda: self._configure(config)))
        except asyncio.CancelledError:
            fut.cancel()
            self._fire(Event.CONFIGURE_FAILED)
            raise
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: configure's caller gets it, start() re-reads it
            self._fire(Event.CONFIGURE_FAILED)
            raise
        if level is not None:
            logging.getLogger("aiorl").setLevel(level)
        self._stats_interval = interval
        self._sinks = _Sinks(config, self._display_name(), self._group_name(), self._logger())
        fut.set_result(None)
        self._fire(Event.CONFIGURE_OK)
        self.log_debug("configured")

    async def start(self) -> None:
        """Start (or resume) polling. Returns once the worker is configured and running.

        The state changes when the call arrives, so control calls from one caller
        take effect in the order sent, even while ``configure`` is still running.
        Raises `RuntimeError` before ``configure()`` or after ``exit()``,
        and ``configure``'s own error if it failed.
        """
        step = transition(self._lifecycle, Event.START)
        fut = self._configure_fut
        if step.action is Action.REJECT_EXITING:
            raise RuntimeError(f"{self._display_name()} is exiting; it cannot be started")
        if step.action is Action.REJECT_UNCONFIGURED:
            # Unconfigured: never configured, or the last attempt failed.
            raise _configure_error(fut, self._display_name()) or RuntimeError(
                f"{self._display_name()} must be configured before start()")
        self._apply(step)
        if step.action is Action.AWAIT_CONFIGURE and fut is not None:
            # asyncio.wait neither raises configure's error nor cancels configure.
            await asyncio.wait([fut])
            error = _configure_error(fut, self._display_name())
            if error is not None:
                raise error

    async def pause(self, wait: bool = False) -> None:
        """Stop polling; ``run()`` idles on an event until ``start()`` or ``exit()``.

        Returns at once: a poll already in progress finishes (and is counted)
        in the background. With ``wait=True``, returns only when no poll is in
        progress, e.g. before updating weights the poll uses.
        """
        self._fire(Event.PAUSE)
        if wait:
            await self._idle.wait()

    async def exit(self) -> None:
        """Make ``run()`` return (after a poll in progress finishes); final.

        Returns at once. Without a ``run()`` in progress the worker releases its
        poll thread and stats sinks here.
        """
        self._fire(Event.EXIT)
        if self._lifecycle is Lifecycle.EXITING and not self._run_active:
            self._fire(Event.RUN_ENDED)  # no run() to wait for

    async def stats(self) -> dict[str, Any]:
        """Current counters, lifetime rates, state, and ``_stats()`` once configured.

        Keys: ``state``, ``configured``, ``running``, ``exiting``, ``in_poll``,
        ``polls``, ``samples``, ``batches``, ``running_s`` and ``polls_per_s``,
        ``samples_per_s``, ``batches_per_s`` (averages over the time spent
        running). ``_stats()`` keys are merged in; the built-in keys win a clash.
        """
        return await self._snapshot(lifetime=True)

    async def run(self) -> dict[str, Any]:
        """Poll while running, idle while paused or unconfigured, return when exiting.

        Returns the final [`stats`][aiorl.PollingWorker.stats]. An exception from ``_poll`` (or
        ``_stats``) pauses the worker and is raised from ``run()``; a new
        ``run()`` and ``start()`` may follow. Raises `RuntimeError` if a
        ``run()`` is already in progress.
        """
        if self._run_active:
            raise RuntimeError(f"{self._display_name()}.run() is already in progress")
        self._run_active = True
        try:
            await self._poll_until_exit(inspect.iscoroutinefunction(self._poll))
        finally:
            self._run_active = False
            self._fire(Event.RUN_ENDED)  # exiting: "exited" from here on, resources released
        final = await self._snapshot(lifetime=True)
        self._logger().info("exit: %s", _format(final))
        return final

    # ------------------------------------------------------------------ internals
    def _fire(self, event: Event) -> None:
        """Apply ``event``'s transition (for events the table never refuses)."""
        self._apply(transition(self._lifecycle, event))

    def _apply(self, step: Transition) -> None:
        """Enter ``step.state``, keep the wake event and the running clock in step, act."""
        self._lifecycle = step.state
        if step.state.wakes_run:
            self._wake.set()
        else:
            self._wake.clear()
        self._set_running_clock(step.state is Lifecycle.RUNNING)
        if step.action is Action.RELEASE:
            self._release()

    async def _poll_until_exit(self, poll_is_async: bool) -> None:
        while not self.is_exiting:
            if not self.is_running:
                # Idle without spinning: start() and exit() set the event.
                await self._wake.wait()
                if not (self.is_running or self.is_exiting):
                    # Woken by start() before configure finished: wait for configure.
                    await self._wait_configured()
                continue
            try:
                self._account(await self._poll_once(poll_is_async))
                if time.monotonic() >= self._next_report:
                    await self._report()
            except asyncio.CancelledError:
                raise
            except ClusterClosedError:
                # This process's own runtime is stopping (its group is being closed) while
                # a poll was under way: the end of the worker, not a failure of run().
                self._logger().info("%s stopped during run()", self._display_name())
                return
            except BaseException:
                self._logger().error("run() failed; %s is paused", self._display_name(),
                                     exc_info=True)
                self._fire(Event.POLL_FAILED)
                raise

    async def _wait_configured(self) -> None:
        fut = self._configure_fut
        if fut is not None:
            # asyncio.wait neither raises configure's error nor cancels it if run() is cancelled;
            # a failure has already made the worker unconfigured (and run() idles again).
            await asyncio.wait([fut])

    async def _poll_once(self, poll_is_async: bool) -> object:
        """Run one ``_poll``; what it returned (checked by `_account`)."""
        self._poll_begun()
        if poll_is_async:
            try:
                return await cast(Awaitable[object], self._poll())
            finally:
                self._poll_ended()
        cf = self._get_poll_thread().submit(self._poll)
        late = False
        try:
            return await asyncio.wrap_future(cf)
        except asyncio.CancelledError:
            if not cf.done():
                # run() was cancelled mid-poll and a thread cannot be interrupted: the poll
                # stays "in progress" (pause(wait=True) waits for it) and is counted when done.
                late = True
                loop = asyncio.get_running_loop()
                cf.add_done_callback(lambda done: self._late_poll_done(loop, done))
            raise
        finally:
            if not late:
                self._poll_ended()

    def _poll_begun(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _poll_ended(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    def _late_poll_done(self, loop: asyncio.AbstractEventLoop,
                        cf: concurrent.futures.Future[Any]) -> None:
        """Done callback (poll thread) of a poll whose run() was cancelled."""

        def finish() -> None:
            try:
                if cf.cancelled():
                    return
                exc = cf.exception()
                if isinstance(exc, ClusterClosedError):
                    # As in run(): this process's runtime is stopping, not a failing poll.
                    self._logger().info("%s: a poll ended by the runtime stopping after run() "
                                        "was cancelled", self._display_name())
                elif exc is not None:
                    self._logger().error("_poll raised after run() was cancelled", exc_info=exc)
                else:
                    self._account(cf.result())
            except Exception:
                self._logger().error("_poll returned a bad result", exc_info=True)
            finally:
                self._poll_ended()

        if not loop.is_closed():
            loop.call_soon_threadsafe(finish)

    def _account(self, result: object) -> None:
        if result is None:
            result = PollResult()
        elif not isinstance(result, PollResult):
            raise TypeError(
                f"_poll() must return aiorl.PollResult (or None), got {type(result).__name__}")
        self._polls += 1
        self._samples += int(result.sample_count)
        self._batches += int(result.batch_count)

    def _set_running_clock(self, running: bool) -> None:
        now = time.monotonic()
        if running and self._running_since is None:
            self._running_since = now
            # Report soon after (re)starting, then at most once per interval.
            self._next_report = 0.0
        elif not running and self._running_since is not None:
            self._running_s += now - self._running_since
            self._running_since = None

    def _running_seconds(self) -> float:
        extra = time.monotonic() - self._running_since if self._running_since is not None else 0.0
        return self._running_s + extra

    async def _user_stats(self) -> dict[str, Any]:
        if not self.is_configured:
            return {}  # _stats typically reads what _configure created
        extra = self._stats()
        if inspect.isawaitable(extra):
            extra = await extra
        if extra is None:
            return {}
        if not isinstance(extra, Mapping):
            raise TypeError(f"_stats() must return a dict, got {type(extra).__name__}")
        return dict(extra)

    async def _snapshot(self, lifetime: bool) -> dict[str, Any]:
        running_s = self._running_seconds()
        if lifetime:
            span, polls, samples, batches = running_s, self._polls, self._samples, self._batches
        else:
            last = self._last_report or (0.0, 0, 0, 0, 0.0)
            span = running_s - last[4]
            polls, samples, batches = (self._polls - last[1], self._samples - last[2],
                                       self._batches - last[3])

        def rate(n: int) -> float:
            return n / span if span > 0 else 0.0

        base = {
            "state": self.lifecycle_state,
            "configured": self.is_configured,
            "running": self.is_running,
            "exiting": self.is_exiting,
            "in_poll": self._inflight > 0,
            "polls": self._polls,
            "samples": self._samples,
            "batches": self._batches,
            "running_s": running_s,
            "polls_per_s": rate(polls),
            "samples_per_s": rate(samples),
            "batches_per_s": rate(batches),
        }
        return {**await self._user_stats(), **base}

    async def _report(self) -> None:
        """Log (and send to sinks) the stats, rates over the window since the last report."""
        snap = await self._snapshot(lifetime=False)
        now = time.monotonic()
        self._last_report = (now, self._polls, self._samples, self._batches, snap["running_s"])
        self._next_report = now + self._stats_interval
        self._logger().info("stats: %s", _format(snap))
        if self._sinks is not None:
            self._sinks.write(snap, self._polls)

    def _get_poll_thread(self) -> _PollThread:
        if self._poll_thread is None:
            self._poll_thread = _PollThread(f"aiorl-poll-{self._display_name()}")
        return self._poll_thread

    def _release(self) -> None:
        if self._poll_thread is not None:
            self._poll_thread.shutdown()
            self._poll_thread = None
        if self._sinks is not None:
            self._sinks.close()
            self._sinks = None

    def _display_name(self) -> str:
        ctx = self._aiorl_ctx
        return ctx.info.name if ctx is not None else type(self).__name__

    def _group_name(self) -> str:
        ctx = self._aiorl_ctx
        return ctx.info.address.root_group_name if ctx is not None else type(self).__name__

    def _logger(self) -> logging.Logger:
        ctx = self._aiorl_ctx
        if ctx is not None:
            return ctx.logger
        return logging.getLogger(f"aiorl.worker.{type(self).__name__}")


def _succeeded(fut: asyncio.Future[None] | None) -> bool:
    """Whether the configuration ``fut`` stands for has finished successfully."""
    return fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None


def _configure_error(fut: asyncio.Future[None] | None, name: str) -> RuntimeError | None:
    """The error ``start()`` raises if the configuration ``fut`` stands for failed, else None."""
    if fut is None or not fut.done():
        return None
    if fut.cancelled():
        return RuntimeError(f"configure() of {name} was cancelled; configure it again")
    exc = fut.exception()
    if exc is None:
        return None
    error = RuntimeError(f"configure() of {name} failed ({type(exc).__name__}: {exc}); "
                         "configure it again")
    error.__cause__ = exc  # as "raise error from exc" would
    return error


def _format(stats: Mapping[str, Any]) -> str:
    """``k=v`` pairs, floats to 4 significant digits, for one readable log line."""
    parts = []
    for k, v in stats.items():
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)
