"""``PollingWorker``: a worker whose life is a controller-driven poll loop.

A controller (the driver, through a :class:`~aiorl.WorkerGroup`) drives it::

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

State machine, timing guarantees and cancellation: ``docs/lifecycle.md``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from aiorl.actors.worker import Worker

__all__ = ["PollResult", "PollingWorker"]

T = TypeVar("T")

_CONTROL_METHODS = ("configure", "start", "pause", "exit", "run", "stats")

#: Seconds between two periodic stats reports when the config does not say.
DEFAULT_STATS_INTERVAL = 10.0


@dataclass(frozen=True)
class PollResult:
    """What one ``_poll()`` did: samples produced/consumed and batches completed."""

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

    Subclasses implement :meth:`_configure`, :meth:`_poll` and optionally
    :meth:`_stats`. Config keys read by the base class (all optional):

    * ``log_level``: level name or number for this process's ``aiorl`` loggers
      (the worker's own logger included);
    * ``stats_interval``: seconds between periodic stats reports (default 10);
    * ``wandb``: true, or a mapping of ``wandb.init`` keyword arguments, to also
      log stats to Weights & Biases (when ``wandb`` is installed);
    * ``tensorboard``: true, or ``{"log_dir": ...}``, to also write them as
      TensorBoard scalars (when ``tensorboard`` is installed).
    """

    def __init__(self) -> None:
        super().__init__()
        self._lc_init()

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

    def _lc_init(self) -> None:
        # Called from __init__ and, lazily, by _lc() for subclasses that forget
        # super().__init__(): the lifecycle must work either way.
        self._lc_ready = True
        self._configure_fut: asyncio.Future[None] | None = None
        self._configured = False
        self._running = False
        self._exiting = False
        self._ever_started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None  # set while running or exiting
        self._idle: asyncio.Event | None = None  # set while no poll is in flight
        self._run_active = False
        self._inflight = 0  # polls started and not finished
        self._poll_thread: _PollThread | None = None
        self._stats_interval = DEFAULT_STATS_INTERVAL
        self._sinks: _Sinks | None = None
        self._polls = 0
        self._samples = 0
        self._batches = 0
        self._running_s = 0.0  # time spent in the running state, summed over runs
        self._running_since: float | None = None
        self._last_report: tuple[float, int, int, int, float] | None = None  # t, counts, running_s
        self._next_report = 0.0

    def _lc(self) -> None:
        if not getattr(self, "_lc_ready", False):
            self._lc_init()
        if self._wake is None:
            self._loop = asyncio.get_running_loop()
            # Created on first use, on the loop thread: asyncio primitives bind to the running loop.
            self._wake = asyncio.Event()
            self._idle = asyncio.Event()
            self._idle.set()
            if self._running or self._exiting:
                self._wake.set()

    # ------------------------------------------------------------------ subclass hooks
    def _configure(self, config: Any) -> None:
        """Parse ``config``, allocate resources, start threads. Plain or ``async def``."""

    def _poll(self) -> PollResult:
        """Do one unit of work and say how much. Plain (poll thread) or ``async def`` (loop)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _poll()")

    def _stats(self) -> dict[str, Any]:
        """Extra stats for reports and :meth:`stats` (called on the event loop thread)."""
        return {}

    # ------------------------------------------------------------------ state (in the worker)
    @property
    def is_configured(self) -> bool:
        """``configure`` finished successfully."""
        return getattr(self, "_configured", False)

    @property
    def is_running(self) -> bool:
        """Configured, started and neither paused nor exiting: ``run()`` polls."""
        return self.is_configured and self._running and not self._exiting

    @property
    def is_exiting(self) -> bool:
        """``exit()`` was called: ``run()`` returns (or has returned)."""
        return getattr(self, "_exiting", False)

    @property
    def lifecycle_state(self) -> str:
        """One of ``unconfigured``, ``configuring``, ``configured`` (never started),
        ``running``, ``paused``, ``exiting`` (run() still finishing) or ``exited``."""
        if not getattr(self, "_lc_ready", False):
            return "unconfigured"
        if self._exiting:
            return "exiting" if self._run_active else "exited"
        if not self._configured:
            pending = self._configure_fut is not None and not self._configure_fut.done()
            return "configuring" if pending else "unconfigured"
        if self._running:
            return "running"
        return "paused" if self._ever_started else "configured"

    # ------------------------------------------------------------------ control (event loop)
    async def configure(self, config: Any = None) -> None:
        """Run ``_configure(config)``, then the common configuration (log level, stats sinks).

        May be called once; again only after a failed attempt. Raises
        :class:`RuntimeError` after ``exit()`` and :class:`ValueError` for a bad
        ``log_level`` or ``stats_interval`` (checked before ``_configure`` runs).
        """
        self._lc()
        if self._exiting:
            raise RuntimeError(f"{self._display_name()} is exiting; it cannot be configured")
        prev = self._configure_fut
        if prev is not None and not (prev.done() and (prev.cancelled() or prev.exception())):
            raise RuntimeError(
                f"{self._display_name()} is already configured (configure() runs once)")
        level, interval = _common_settings(config)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._configure_fut = fut
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
            raise
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: configure's caller gets it, start() re-reads it
            raise
        if level is not None:
            logging.getLogger("aiorl").setLevel(level)
        self._stats_interval = interval
        self._sinks = _Sinks(config, self._display_name(), self._group_name(), self._logger())
        self._configured = True
        fut.set_result(None)
        if self._exiting and not self._run_active:
            self._release()  # exit() came while configuring: nothing will close the sinks later
        if self._running and not self._exiting:
            self._set_running_clock(True)
        self.log_debug("configured")

    async def start(self) -> None:
        """Start (or resume) polling. Returns once the worker is configured and running.

        The state changes when the call arrives, so control calls from one caller
        take effect in the order sent, even while ``configure`` is still running.
        Raises :class:`RuntimeError` before ``configure()`` or after ``exit()``,
        and ``configure``'s own error if it failed.
        """
        self._lc()
        if self._exiting:
            raise RuntimeError(f"{self._display_name()} is exiting; it cannot be started")
        fut = self._configure_fut
        if fut is None:
            raise RuntimeError(f"{self._display_name()} must be configured before start()")
        _raise_if_failed(fut, self._display_name())
        if not self._running:
            self._running = True
            self._ever_started = True
            assert self._wake is not None
            self._wake.set()
            if self._configured:
                self._set_running_clock(True)
        if not fut.done():
            await asyncio.wait([fut])
            if fut is self._configure_fut and (fut.cancelled() or fut.exception() is not None):
                # Not left "wanting to run": a later successful configure must not start polling.
                self._stop_running()
            _raise_if_failed(fut, self._display_name())

    async def pause(self, wait: bool = False) -> None:
        """Stop polling; ``run()`` idles on an event until ``start()`` or ``exit()``.

        Returns at once: a poll already in progress finishes (and is counted)
        in the background. With ``wait=True``, returns only when no poll is in
        progress, e.g. before updating weights the poll uses.
        """
        self._lc()
        self._stop_running()
        if wait:
            assert self._idle is not None
            await self._idle.wait()

    async def exit(self) -> None:
        """Make ``run()`` return (after a poll in progress finishes); final.

        Returns at once. Without a ``run()`` in progress the worker releases its
        poll thread and stats sinks here.
        """
        self._lc()
        if self._exiting:
            return
        self._set_running_clock(False)
        self._exiting = True
        assert self._wake is not None
        self._wake.set()
        if not self._run_active:
            self._release()

    async def stats(self) -> dict[str, Any]:
        """Current counters, lifetime rates, state, and ``_stats()`` once configured.

        Keys: ``state``, ``configured``, ``running``, ``exiting``, ``in_poll``,
        ``polls``, ``samples``, ``batches``, ``running_s`` and ``polls_per_s``,
        ``samples_per_s``, ``batches_per_s`` (averages over the time spent
        running). ``_stats()`` keys are merged in; the built-in keys win a clash.
        """
        self._lc()
        return await self._snapshot(lifetime=True)

    async def run(self) -> dict[str, Any]:
        """Poll while running, idle while paused or unconfigured, return when exiting.

        Returns the final :meth:`stats`. An exception from ``_poll`` (or
        ``_stats``) pauses the worker and is raised from ``run()``; a new
        ``run()`` and ``start()`` may follow. Raises :class:`RuntimeError` if a
        ``run()`` is already in progress.
        """
        self._lc()
        if self._run_active:
            raise RuntimeError(f"{self._display_name()}.run() is already in progress")
        assert self._wake is not None
        self._run_active = True
        poll_is_async = inspect.iscoroutinefunction(self._poll)
        try:
            while not self._exiting:
                if not self.is_running:
                    # Idle without spinning: start() and exit() set the event.
                    await self._wake.wait()
                    if not (self.is_running or self._exiting):
                        # Woken by start() before configure finished: wait for configure.
                        await self._wait_configured()
                    continue
                try:
                    self._account(await self._poll_once(poll_is_async))
                    if time.monotonic() >= self._next_report:
                        await self._report()
                except asyncio.CancelledError:
                    raise
                except BaseException:
                    self._logger().error("run() failed; %s is paused", self._display_name(),
                                         exc_info=True)
                    self._stop_running()
                    raise
            self._run_active = False  # so the final state reads "exited"
            final = await self._snapshot(lifetime=True)
            self._logger().info("exit: %s", _format(final))
            return final
        finally:
            self._run_active = False
            if self._exiting:
                self._release()

    # ------------------------------------------------------------------ internals
    def _stop_running(self) -> None:
        if self._running:
            self._running = False
            assert self._wake is not None
            if not self._exiting:
                self._wake.clear()
            self._set_running_clock(False)

    async def _wait_configured(self) -> None:
        fut = self._configure_fut
        if fut is None:
            return
        # asyncio.wait neither raises configure's error nor cancels it if run() is cancelled.
        await asyncio.wait([fut])
        if fut.cancelled() or fut.exception() is not None:
            # configure failed and its caller has the error: idle until configured again.
            self._running = False
            if not self._exiting:
                assert self._wake is not None
                self._wake.clear()

    async def _poll_once(self, poll_is_async: bool) -> PollResult | None:
        self._poll_begun()
        if poll_is_async:
            try:
                return await self._poll()  # type: ignore[misc]
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
                cf.add_done_callback(self._late_poll_done)
            raise
        finally:
            if not late:
                self._poll_ended()

    def _poll_begun(self) -> None:
        assert self._idle is not None
        self._inflight += 1
        self._idle.clear()

    def _poll_ended(self) -> None:
        assert self._idle is not None
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    def _late_poll_done(self, cf: concurrent.futures.Future[Any]) -> None:
        """Done callback (poll thread) of a poll whose run() was cancelled."""

        def finish() -> None:
            try:
                if cf.cancelled():
                    return
                exc = cf.exception()
                if exc is not None:
                    self._logger().error("_poll raised after run() was cancelled", exc_info=exc)
                else:
                    self._account(cf.result())
            except Exception:
                self._logger().error("_poll returned a bad result", exc_info=True)
            finally:
                self._poll_ended()

        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(finish)

    def _account(self, result: PollResult | None) -> None:
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
        if not self._configured:
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


def _raise_if_failed(fut: asyncio.Future[None], name: str) -> None:
    """Raise ``configure``'s error if the configuration ``fut`` stands for failed."""
    if not fut.done():
        return
    if fut.cancelled():
        raise RuntimeError(f"configure() of {name} was cancelled; configure it again")
    exc = fut.exception()
    if exc is not None:
        raise RuntimeError(f"configure() of {name} failed ({type(exc).__name__}: {exc}); "
                           "configure it again") from exc


def _format(stats: Mapping[str, Any]) -> str:
    """``k=v`` pairs, floats to 4 significant digits, for one readable log line."""
    parts = []
    for k, v in stats.items():
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)
