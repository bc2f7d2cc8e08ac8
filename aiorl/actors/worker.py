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
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from aiorl.actors.timing import Timing
from aiorl.names import WorkerAddress, WorkerInfo
from aiorl.p2p import P2PEngine, get_p2p

if TYPE_CHECKING:
    from aiorl.group import WorkerGroup, WorkerGroupBuilder
    from aiorl.runtime.runtime import Runtime
    from aiorl.runtime.work import AsyncWork
    from aiorl.weights import WeightPublisher, WeightSubscriber

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


class Worker(Timing):
    """Base class of aiorl workers: subclass it, then ``create_group(...).launch(cluster)``.

    In the worker process, ``async def`` methods run concurrently on the worker's event loop;
    plain methods run one at a time, in arrival order, on the worker's method thread (so they
    may block, and may ``.wait()`` on works). ``__init__`` runs on the method thread; call
    ``super().__init__()`` first. Identity (``rank``, ``world_size``, ``worker_name``, ...)
    is known from the start of ``__init__``.

    Example:
        ```python
        class Rollout(aiorl.Worker):
            def __init__(self, hidden):
                super().__init__()
                self.policy = torch.nn.Linear(hidden, 2)

            async def generate(self, n):      # concurrent, on the event loop
                return self.policy(torch.randn(n, self.policy.in_features))

            def where(self):                  # in order, on the method thread
                return f"{self.worker_name} on node {self.worker_info.node_rank}"

        group = Rollout.create_group(hidden=16).launch(cluster, num_workers=4, name="rollout")
        ```
    """

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
        """Where this worker runs: node, accelerators, pid, endpoint
        ([`WorkerInfo`][aiorl.WorkerInfo])."""
        return self._ctx().info

    @property
    def worker_address(self) -> WorkerAddress:
        """This worker's address (``WorkerAddress("rollout", 3)``)."""
        return self._ctx().info.address

    @property
    def worker_name(self) -> str:
        """This worker's name, ``"group:rank"`` (``"rollout:3"``)."""
        return self._ctx().info.name

    @property
    def rank(self) -> int:
        """This worker's rank in its group, ``0 .. world_size - 1``."""
        return self._ctx().info.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in this worker's group."""
        return self._ctx().info.group_world_size

    @property
    def worker_group_name(self) -> str:
        """The name of this worker's group (``"rollout"``)."""
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
        """Log at DEBUG; the line carries the worker's name (``self.log_info("step %d", i)``)."""
        self._log(logging.DEBUG, msg, *args)

    def log_info(self, msg: str, *args: Any) -> None:
        """Log at INFO, ``%``-style arguments; the line carries the worker's name."""
        self._log(logging.INFO, msg, *args)

    def log_warning(self, msg: str, *args: Any) -> None:
        """Log at WARNING; the line carries the worker's name."""
        self._log(logging.WARNING, msg, *args)

    def log_error(self, msg: str, *args: Any) -> None:
        """Log at ERROR; the line carries the worker's name."""
        self._log(logging.ERROR, msg, *args)

    # ------------------------------------------------------------------ point-to-point
    # Implemented in aiorl.p2p; see docs/reference/contract.md section 4 and docs/ordering.md.
    # ``async_op`` is RLinf's switch: True (aiorl's default) returns the AsyncWork;
    # False waits for it and returns its result (RLinf's default; not on the event loop).
    # Typed both ways: an AsyncWork by default, the plain result with RLinf's async_op=False.
    @overload
    def send(self, obj: Any, dst_group_name: str, dst_rank: int | Sequence[int],
             async_op: Literal[True] = ...) -> AsyncWork[None]: ...
    @overload
    def send(self, obj: Any, dst_group_name: str, dst_rank: int | Sequence[int],
             async_op: Literal[False]) -> None: ...
    def send(self, obj: Any, dst_group_name: str, dst_rank: int | Sequence[int],
             async_op: bool = True) -> Any:
        """Send ``obj`` (any picklable object, tensors, containers of tensors) to a worker."""
        return _sync_unless(async_op, self._p2p().send(obj, dst_group_name, dst_rank))

    @overload
    def recv(self, src_group_name: str, src_rank: int | Sequence[int],
             async_op: Literal[True] = ...) -> AsyncWork[Any]: ...
    @overload
    def recv(self, src_group_name: str, src_rank: int | Sequence[int],
             async_op: Literal[False]) -> Any: ...
    def recv(self, src_group_name: str, src_rank: int | Sequence[int],
             async_op: bool = True) -> Any:
        """Receive the next object sent to this worker by ``src_group_name:src_rank``."""
        return _sync_unless(async_op, self._p2p().recv(src_group_name, src_rank))

    @overload
    def send_tensor(self, tensor: Any, dst_group_name: str, dst_rank: int | Sequence[int],
                    async_op: Literal[True] = ...) -> AsyncWork[None]: ...
    @overload
    def send_tensor(self, tensor: Any, dst_group_name: str, dst_rank: int | Sequence[int],
                    async_op: Literal[False]) -> None: ...
    def send_tensor(self, tensor: Any, dst_group_name: str, dst_rank: int | Sequence[int],
                    async_op: bool = True) -> Any:
        """Send one tensor into a receiver's preallocated buffer, with no metadata exchange."""
        return _sync_unless(async_op, self._p2p().send_tensor(tensor, dst_group_name, dst_rank))

    @overload
    def recv_tensor(self, tensor: Any, src_group_name: str, src_rank: int | Sequence[int],
                    async_op: Literal[True] = ...) -> AsyncWork[Any]: ...
    @overload
    def recv_tensor(self, tensor: Any, src_group_name: str, src_rank: int | Sequence[int],
                    async_op: Literal[False]) -> Any: ...
    def recv_tensor(self, tensor: Any, src_group_name: str, src_rank: int | Sequence[int],
                    async_op: bool = True) -> Any:
        """Fill the preallocated ``tensor`` with the next ``send_tensor`` from the source."""
        return _sync_unless(async_op, self._p2p().recv_tensor(tensor, src_group_name, src_rank))

    # Implemented in aiorl.collective; see docs/reference/contract.md section 8 and docs/broadcast.md.
    def broadcast(self, obj: Any = None, groups: list[tuple[str, Any]] | None = None,
                  src: tuple[str, Any] | None = None, async_op: bool = False) -> Any:
        """Broadcast ``obj`` from ``src`` (default: the first worker ``groups`` names) to every
        worker of ``groups``; every member calls it with the same ``groups`` and ``src`` and gets
        the object (an AsyncWork of it with ``async_op=True``). RLinf's signature and errors."""
        from aiorl.collective import get_broadcaster

        work = get_broadcaster(self._runtime).broadcast(obj, groups, src, self.worker_address)
        return _sync_unless(async_op, work)

    def _p2p(self) -> P2PEngine:
        # Kept on the instance: four look-ups less on every send and receive.
        engine: P2PEngine | None = self.__dict__.get("_aiorl_p2p")
        if engine is None:
            engine = self.__dict__["_aiorl_p2p"] = get_p2p(self._runtime)
        return engine

    # ------------------------------------------------------------------ channels
    # Implemented in aiorl.channels; see docs/reference/contract.md section 5.
    def create_channel(
        self,
        name: str | None = None,
        group_affinity: str | None = None,
        group_rank_affinity: int | None = None,
        maxsize: int = 0,
        distributed: bool = False,
        node_rank: int | None = None,
        *,
        node_ranks: Sequence[int] | None = None,
        channel_name: str | None = None,
    ) -> Any:
        """Create (or connect to, with a warning, if it exists) the channel ``name``.

        A plain channel is hosted near the affine worker (``group_affinity:
        group_rank_affinity``), else on ``node_rank``, by default on this worker's
        node; a ``distributed`` one has a replica on each node of ``node_ranks``
        (default: every node) and keeps each key on the replica of the node that
        used it first. ``channel_name=`` is RLinf's name of ``name``. See ``Channel.create``.
        """
        from aiorl.channels import create_channel_from_worker

        return create_channel_from_worker(self._runtime, self.worker_info,
                                          _channel_name(name, channel_name), group_affinity,
                                          group_rank_affinity, maxsize, distributed, node_rank,
                                          node_ranks)

    def connect_channel(self, name: str | None = None, *, channel_name: str | None = None) -> Any:
        """Connect to the existing channel ``name`` (plain or distributed; ``channel_name=``
        is RLinf's name of ``name``)."""
        from aiorl.channels import connect_channel_from_worker

        return connect_channel_from_worker(self._runtime, _channel_name(name, channel_name))

    # ------------------------------------------------------------------ weights
    # Implemented in aiorl.weights; see docs/reference/contract.md section 8 and docs/weights.md.
    def weight_publisher(self, name: str, *, shard: int = 0, num_shards: int = 1,
                         bucket_mb: int = 256) -> WeightPublisher:
        """The publisher of weights ``name`` (shard ``shard`` of ``num_shards``) in this worker.

        Args:
            name: The weight name (``"policy"``); subscribers pull it by this name.
            shard: Which shard of the weights this worker publishes, ``0 .. num_shards - 1``.
            num_shards: How many shards make one version (one publisher each).
            bucket_mb: The size, in MiB, of the buckets a relay fetches a version in.

        Returns:
            This worker's [`WeightPublisher`][aiorl.weights.WeightPublisher] of the shard
                (the same object on every call).

        Raises:
            ValueError: ``shard`` is outside ``0 .. num_shards - 1``, or this worker already
                publishes the shard with another ``num_shards`` or ``bucket_mb``.

        Example:
            ```python
            pub = self.weight_publisher("policy")
            await pub.publish(self.model.state_dict(), version=step)
            ```
        """
        from aiorl.weights import weight_publisher

        return weight_publisher(self._runtime, self.worker_info, name, shard=shard,
                                num_shards=num_shards, bucket_bytes=bucket_mb << 20)

    def weight_subscriber(self, name: str) -> WeightSubscriber:
        """This worker's subscriber of weights ``name``: ``pull``, ``latest_version``, ``wait_for``.

        Args:
            name: The weight name the publishers publish (``"policy"``).

        Returns:
            This worker's [`WeightSubscriber`][aiorl.weights.WeightSubscriber] of ``name``
                (the same object on every call).

        Example:
            ```python
            sub = self.weight_subscriber("policy")
            version = await sub.pull(into=self.model.state_dict())
            ```
        """
        from aiorl.weights import weight_subscriber

        return weight_subscriber(self._runtime, self.worker_info, name)

    # ------------------------------------------------------------------ groups
    @classmethod
    def create_group(cls: type[_W], *args: Any, **kwargs: Any) -> WorkerGroupBuilder[_W]:
        """Describe a group of this worker class, built with ``cls(*args, **kwargs)`` on each rank.

        Nothing runs yet: the builder's [`launch`][aiorl.group.WorkerGroupBuilder.launch]
        starts the processes.

        Args:
            *args: Positional arguments of the worker's ``__init__`` on every rank.
            **kwargs: Keyword arguments of the worker's ``__init__`` on every rank.

        Returns:
            A [`WorkerGroupBuilder`][aiorl.group.WorkerGroupBuilder] of this class.

        Raises:
            ValueError: a public method of the class would be hidden by a
                [`WorkerGroup`][aiorl.WorkerGroup] attribute of the same name.

        Example:
            ```python
            trainer = Trainer.create_group(cfg).launch(cluster, "0-3", name="trainer")
            ```
        """
        from aiorl.group import WorkerGroupBuilder

        return WorkerGroupBuilder(cls, args, kwargs, base=Worker)

    @classmethod
    def remote(cls, *args: Any, **kwargs: Any) -> Any:
        """Ray's ``Actor.remote(...)``: refused with aiorl's spelling.

        A worker starts as a group, on the cluster the launch names; no cluster is implied.

        Raises:
            TypeError: always, saying ``create_group(...).launch(cluster, ...)``.

        Example:
            ```python
            rollout = Rollout.create_group(0).launch(cluster, num_workers=1, name="rollout")
            ```
        """
        shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        raise TypeError(
            f"{cls.__name__}.remote({shown}) is Ray's spelling: in aiorl, "
            f"{cls.__name__}.create_group({shown}).launch(cluster, num_workers=1, "
            f"name=...) starts it (a group of one; num_workers=N for N actors, and "
            f"aiorl.PerRank([...]) for an argument per rank)")

    def group(self, name: str, worker_cls: type | None = None) -> WorkerGroup[Any]:
        """A handle on another running group, to call its workers from this one.

        Call it from ``__init__`` or a plain method (it waits for the registry); from an
        ``async def`` method use ``await self.async_group(name)``. Handles are cached per
        name. ``worker_cls`` checks method names here; without it any public name is
        sent, and a misspelt one fails in the worker with ``AttributeError``.

        Example:
            ```python
            class Rollout(aiorl.Worker):
                def __init__(self):
                    super().__init__()
                    self.reward = self.group("reward")

                async def step(self, batch):
                    scores = await self.reward.execute_on(self.rank % 2).score(batch)
                    return scores[0]
            ```

        Raises:
            GroupNotFoundError: no live group has this name (a ``LookupError``).
            RuntimeError: called on the worker's event loop (use
                [`async_group`][aiorl.Worker.async_group]).
        """
        runtime = self._runtime
        if runtime.on_loop_thread():
            raise RuntimeError(
                f"self.group({name!r}) waits for the registry and cannot run on the worker's "
                f"event loop (an async def method): use `await self.async_group({name!r})`, "
                "or take the handle in __init__")
        return runtime.run_sync(self.async_group(name, worker_cls), timeout=30)

    async def async_group(self, name: str, worker_cls: type | None = None) -> WorkerGroup[Any]:
        """[`group`][aiorl.Worker.group] for ``async def`` methods: ``await
        self.async_group("reward")``."""
        from aiorl.group import WorkerGroup
        from aiorl.group.group import WorkerClassNotHere
        from aiorl.runtime.session import WorkerSession

        cache: dict[str, WorkerGroup[Any]] = self.__dict__.setdefault("_aiorl_groups", {})
        handle = cache.get(name)
        if handle is None or handle._shared.closed:
            handle = await WorkerGroup.from_group_name_async(
                WorkerSession.current(), worker_cls or WorkerClassNotHere, name)
            cache[name] = handle
        return handle


def _sync_unless(async_op: bool, work: AsyncWork[Any]) -> Any:
    """``work`` itself, or (``async_op=False``, RLinf's blocking call) its result."""
    return work if async_op else work.wait()


def _channel_name(name: str | None, channel_name: str | None) -> str:
    """The channel named as ``name`` or by RLinf's keyword ``channel_name`` (exactly one)."""
    if name is not None and channel_name is None:
        return name
    if channel_name is not None and name is None:
        return channel_name
    raise TypeError("name the channel once: name (or RLinf's channel_name=)")
