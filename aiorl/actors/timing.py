"""RLinf's worker timers: ``@Worker.timer(tag)``, ``worker_timer``, ``pop_execution_times``.

A worker times its steps with ``@Worker.timer("generate")`` on a method (or ``with
self.worker_timer("generate"):`` around a block); the seconds add up per tag in the worker
until the driver collects them with ``group.pop_execution_times()``, which also resets them,
as RLinf's metrics loop expects. ``trace=True`` also records each timed run as a span of
aiorl's tracing (`aiorl.trace`), so it shows in the Perfetto trace of ``Cluster(trace=True)``
or ``cluster.tracer.enable`` beside the calls and messages that caused it; with tracing off
it costs nothing more.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from aiorl.trace import recorder as _trace

__all__ = ["Timing"]

_F = TypeVar("_F", bound=Callable[..., Any])


class Timing:
    """The timer methods of [`Worker`][aiorl.Worker] (a base class of it)."""

    def _timer_metrics(self) -> dict[str, float]:
        # Created on first use, per instance: a subclass that forgets super().__init__()
        # still times, and nothing is shared between instances.
        metrics: dict[str, float] | None = self.__dict__.get("_aiorl_timer_metrics")
        if metrics is None:
            metrics = self.__dict__["_aiorl_timer_metrics"] = {}
        return metrics

    @contextmanager
    def worker_timer(self, tag: str | None = None, trace: bool = False) -> Iterator[None]:
        """Add the enclosed block's duration to timer ``tag`` (the calling function's name by
        default); with ``trace=True`` also record it as a span named ``tag`` when tracing is
        on.

        Example:
            ```python
            class Rollout(aiorl.Worker):
                def step(self):
                    with self.worker_timer("generate", trace=True):
                        ...
            ```
        """
        if tag is None:
            caller = inspect.currentframe()
            caller = caller.f_back.f_back if caller and caller.f_back else None
            tag = caller.f_code.co_name if caller else "timer"
        metrics = self._timer_metrics()
        span = _trace.Span("user", tag, None, None) if trace and _trace.ON else None
        start = time.perf_counter()
        ok = False
        try:
            yield
            ok = True
        finally:
            metrics[tag] = metrics.get(tag, 0.0) + time.perf_counter() - start
            if span is not None:
                span.end(ok)

    @staticmethod
    def timer(tag: str | None = None, trace: bool = False) -> Callable[[_F], _F]:
        """Decorate a worker method to add each run's duration to timer ``tag`` (the method's
        name by default); ``trace=True`` also records each run as a span when tracing is on.

        Example:
            ```python
            class Actor(aiorl.Worker):
                @aiorl.Worker.timer("train_step", trace=True)
                def train_step(self, batch):
                    ...
            ```
        """
        if callable(tag):
            raise TypeError("Worker.timer takes a tag: write @Worker.timer() or "
                            "@Worker.timer('name'), not @Worker.timer")

        def decorate(func: _F) -> _F:
            name = tag or func.__name__
            if inspect.iscoroutinefunction(func):

                @functools.wraps(func)
                async def timed_async(self: Timing, *args: Any, **kwargs: Any) -> Any:
                    with self.worker_timer(name, trace):
                        return await func(self, *args, **kwargs)

                return timed_async  # type: ignore[return-value]

            @functools.wraps(func)
            def timed(self: Timing, *args: Any, **kwargs: Any) -> Any:
                with self.worker_timer(name, trace):
                    return func(self, *args, **kwargs)

            return timed  # type: ignore[return-value]

        return decorate

    def pop_execution_time(self, tag: str) -> float:
        """The seconds timed under ``tag`` since it was last popped, and reset it.

        Raises:
            ValueError: nothing was timed under ``tag`` (RLinf's behaviour).
        """
        metrics = self._timer_metrics()
        if tag not in metrics:
            raise ValueError(f"Timer '{tag}' has not been recorded. Timed so far: "
                             f"{sorted(metrics) or 'nothing'}")
        return metrics.pop(tag)

    def pop_execution_times(self) -> dict[str, float]:
        """Every timer's seconds since they were last popped, by tag; all are reset."""
        metrics = self._timer_metrics()
        popped = dict(metrics)
        metrics.clear()
        return popped
