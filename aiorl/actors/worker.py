"""``aiorl.Worker``: the base class of every remote actor.

Subclass it, then ``MyWorker.create_group(*args).launch(cluster, name="g")``.
In the worker process, ``async def`` methods run concurrently on the worker's
event loop; plain methods run one at a time, in arrival order, on the worker's
method thread, so they may block (and may call ``.wait()`` on aiorl works).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from aiorl.names import WorkerAddress, WorkerInfo
from aiorl.p2p import P2PEngine, get_p2p

if TYPE_CHECKING:
    from aiorl.group import WorkerGroup, WorkerGroupBuilder
    from aiorl.runtime.runtime import Runtime
    from aiorl.runtime.work import AsyncWork

__all__ = ["Worker", "WorkerContext"]

_W = TypeVar("_W", bound="Worker")


class WorkerContext:
    """What a worker process knows about itself; set before the user's ``__init__`` runs."""

    def __init__(self, runtime: Runtime, info: WorkerInfo) -> None:
        self.runtime = runtime
        self.info = info
        self.logger = logging.getLogger(f"aiorl.worker.{info.name}")


_context: WorkerContext | None = None


def _set_context(ctx: WorkerContext | None) -> None:
    global _context
    _context = ctx


class _AnyPublicMethod(type):
    """Metaclass of ``_AnyWorker``: every public attribute is a method."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def remote_method(*args: Any, **kwargs: Any) -> Any:
            raise TypeError(f"{name} runs in the worker; call it through a WorkerGroup")

        remote_method.__name__ = remote_method.__qualname__ = name
        return remote_method


class _AnyWorker(metaclass=_AnyPublicMethod):
    """Stands for a group's worker class where the caller does not have it
    (:meth:`Worker.group` without ``worker_cls``): any public method name is sent."""


class Worker:
    """Base class of aiorl workers. See the module docstring."""

    _aiorl_ctx: WorkerContext | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Worker:
        self = super().__new__(cls)
        # Set here, not in __init__, so the context exists even before (or without)
        # the subclass calling super().__init__().
        self._aiorl_ctx = _context
        return self

    def __init__(self) -> None:
        pass

    # ------------------------------------------------------------------ identity
    @property
    def worker_info(self) -> WorkerInfo:
        return self._ctx().info

    @property
    def worker_address(self) -> WorkerAddress:
        return self._ctx().info.address

    @property
    def worker_name(self) -> str:
        return self._ctx().info.name

    @property
    def rank(self) -> int:
        return self._ctx().info.rank

    @property
    def world_size(self) -> int:
        return self._ctx().info.group_world_size

    @property
    def worker_group_name(self) -> str:
        return self._ctx().info.address.root_group_name

    def _ctx(self) -> WorkerContext:
        if self._aiorl_ctx is None:
            raise RuntimeError(
                f"{type(self).__name__} is not running as an aiorl worker; create it with "
                f"{type(self).__name__}.create_group(...).launch(cluster)"
            )
        return self._aiorl_ctx

    @property
    def _runtime(self) -> Runtime:
        return self._ctx().runtime

    # ------------------------------------------------------------------ logging
    def _log(self, level: int, msg: str, *args: Any) -> None:
        ctx = self._aiorl_ctx
        logger = ctx.logger if ctx is not None else logging.getLogger(f"aiorl.worker.{os.getpid()}")
        logger.log(level, msg, *args, stacklevel=3)

    def log_debug(self, msg: str, *args: Any) -> None:
        self._log(logging.DEBUG, msg, *args)

    def log_info(self, msg: str, *args: Any) -> None:
        self._log(logging.INFO, msg, *args)

    def log_warning(self, msg: str, *args: Any) -> None:
        self._log(logging.WARNING, msg, *args)

    def log_error(self, msg: str, *args: Any) -> None:
        self._log(logging.ERROR, msg, *args)

    # ------------------------------------------------------------------ point-to-point
    # Implemented in aiorl.p2p; see API.md section 4 and docs/ordering.md.
    def send(self, obj: Any, dst_group_name: str, dst_rank: int | Sequence[int]) -> AsyncWork[None]:
        """Send ``obj`` (any picklable object, tensors, containers of tensors) to a worker."""
        return self._p2p().send(obj, dst_group_name, dst_rank)

    def recv(self, src_group_name: str, src_rank: int | Sequence[int]) -> AsyncWork[Any]:
        """Receive the next object sent to this worker by ``src_group_name:src_rank``."""
        return self._p2p().recv(src_group_name, src_rank)

    def send_tensor(self, tensor: Any, dst_group_name: str, dst_rank: int | Sequence[int]) -> AsyncWork[None]:
        """Send one tensor into a receiver's preallocated buffer, with no metadata exchange."""
        return self._p2p().send_tensor(tensor, dst_group_name, dst_rank)

    def recv_tensor(self, tensor: Any, src_group_name: str, src_rank: int | Sequence[int]) -> AsyncWork[Any]:
        """Fill the preallocated ``tensor`` with the next ``send_tensor`` from the source."""
        return self._p2p().recv_tensor(tensor, src_group_name, src_rank)

    def _p2p(self) -> P2PEngine:
        return get_p2p(self._runtime)

    # ------------------------------------------------------------------ channels
    # Implemented in aiorl.channels; see API.md section 5.
    def create_channel(
        self,
        name: str,
        group_affinity: str | None = None,
        group_rank_affinity: int | None = None,
        maxsize: int = 0,
    ) -> Any:
        """Create (or connect to, if it exists) the channel ``name``, hosted near the affine worker."""
        from aiorl.channels import create_channel_from_worker

        return create_channel_from_worker(self._runtime, self.worker_info, name, group_affinity,
                                          group_rank_affinity, maxsize)

    def connect_channel(self, name: str) -> Any:
        """Connect to the existing channel ``name``."""
        from aiorl.channels import connect_channel_from_worker

        return connect_channel_from_worker(self._runtime, name)

    # ------------------------------------------------------------------ groups
    @classmethod
    def create_group(cls: type[_W], *args: Any, **kwargs: Any) -> WorkerGroupBuilder[_W]:
        """Describe a group of this worker class, built with ``cls(*args, **kwargs)`` on each rank.

        Raises :class:`ValueError` if a public method of the class would be
        hidden by a :class:`~aiorl.WorkerGroup` attribute of the same name.
        """
        from aiorl.group import WorkerGroupBuilder

        return WorkerGroupBuilder(cls, args, kwargs, base=Worker)

    def group(self, name: str, worker_cls: type | None = None) -> WorkerGroup[Any]:
        """A handle on another running group, to call its workers from this one.

        Call it from ``__init__`` or a plain method (it waits for the registry); from an
        ``async def`` method use ``await self.async_group(name)``. Handles are cached per
        name. ``worker_cls`` checks method names here; without it any public name is
        sent, and a misspelt one fails in the worker with ``AttributeError``.

        Example::

            class Rollout(aiorl.Worker):
                def __init__(self):
                    super().__init__()
                    self.reward = self.group("reward")

                async def step(self, batch):
                    scores = await self.reward.execute_on(self.rank % 2).score(batch)
                    return scores[0]

        Raises:
            GroupNotFoundError: no live group has this name (a ``LookupError``).
            RuntimeError: called on the worker's event loop (use :meth:`async_group`).
        """
        runtime = self._runtime
        if runtime.on_loop_thread():
            raise RuntimeError(
                f"self.group({name!r}) waits for the registry and cannot run on the worker's "
                f"event loop (an async def method): use `await self.async_group({name!r})`, "
                "or take the handle in __init__")
        return runtime.run_sync(self.async_group(name, worker_cls), timeout=30)

    async def async_group(self, name: str, worker_cls: type | None = None) -> WorkerGroup[Any]:
        """:meth:`group` for ``async def`` methods: ``await self.async_group("reward")``."""
        from aiorl.group import WorkerGroup
        from aiorl.runtime.session import WorkerSession

        cache: dict[str, WorkerGroup[Any]] = self.__dict__.setdefault("_aiorl_groups", {})
        handle = cache.get(name)
        if handle is None or handle._core.closed:
            handle = await WorkerGroup.from_group_name_async(
                WorkerSession.current(), worker_cls or _AnyWorker, name)
            cache[name] = handle
        return handle

