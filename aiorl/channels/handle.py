"""The [`Channel`][aiorl.Channel] handle: what users call.

Every handle of a process forwards to that process's engine, `aiorl.channels.engine`
(one per runtime); see its docstring for threads, batching, pipelining, ordering,
failure and cancellation, and docs/ordering.md for the contract.
"""

# HOT PATH: Channel.put/get run per item.

from __future__ import annotations

import logging
import os
import reprlib
from collections.abc import Generator, Hashable, Sequence
from typing import Any, Literal, NamedTuple, overload

from aiorl.channels.client_state import USER_GET, ChannelState
from aiorl.channels.engine import ClientEngine, engine_for
from aiorl.channels.host import ChannelHost, group_name_for
from aiorl.channels.items import encode_item, key_from_wire, wire_key
from aiorl.channels.resolution import DEFAULT_CONNECT_TIMEOUT, NodeChoice, warn_exists
from aiorl.channels.routing import Combine
from aiorl.channels.weighted_queue import QueuedItem, QueueStats
from aiorl.errors import (
    AiorlError,
    GroupNotFoundError,
    NotFoundError,
)
from aiorl.group import WorkerGroup
from aiorl.names import WorkerInfo
from aiorl.protocol import channels as chan
from aiorl.protocol.channels import QueueKey
from aiorl.runtime import AsyncChannelWork, Runtime, Session, WorkerSession, current_runtime
from aiorl.runtime.promise import (
    settle_from,
    trace_until_settled,
)
from aiorl.trace import recorder as _trace

__all__ = [
    "DEFAULT_KEY",
    "Channel",
    "ReplicaStatistics",
    "connect_channel_from_worker",
    "create_channel_from_worker",
]

log = logging.getLogger("aiorl.channels")

#: The queue of operations that name no key (RLinf's is ``"default_queue"``).
DEFAULT_KEY = "default"
#: How many items of each queue ``str(channel)`` shows.
STR_ITEMS_PER_QUEUE = 8
#: How long ``str(channel)`` waits for the channel to answer.
STR_TIMEOUT = 10.0

#: Operations recorded as spans while tracing is on, and their span names.
_TRACED_KINDS = {chan.PUT: "put", chan.PUT_NOWAIT: "put_nowait", USER_GET: "get",
                 chan.GET_NOWAIT: "get_nowait", chan.GET_BATCH: "get_batch"}


# ---------------------------------------------------------------------- placement of new channels
def _affinity_node(runtime: Runtime, group: str | None, rank: int | None, default: int,
                   own: tuple[str, int] | None, timeout: float) -> NodeChoice:
    """Where a new plain channel lives: the affine worker's node, else ``default``."""

    async def where(session: Session) -> list[int]:
        if group is None:
            return [default]
        name = f"{group}:{rank or 0}"
        if own is not None and name == own[0]:
            return [own[1]]  # ourselves: possibly still in __init__, so not yet registered
        try:
            return [int((await runtime.registry.lookup(name)).info.node_rank)]
        except NotFoundError:
            pass  # not registered yet: wait until it is ready
        info = await runtime.resolve_worker(name, timeout, wait_for_group=True)
        return [int(info["node_rank"])]

    return where


def _replica_nodes(node_ranks: Sequence[int] | None) -> NodeChoice:
    """Where the replicas of a new distributed channel live: ``node_ranks``, else every node."""
    if node_ranks is not None:
        nodes = [int(n) for n in node_ranks]
        if not nodes or len(set(nodes)) != len(nodes):
            raise ValueError(f"node_ranks must name distinct nodes, one per replica, "
                             f"got {list(node_ranks)!r}")

    async def where(session: Session) -> list[int]:
        return nodes if node_ranks is not None else list(range(session.spec.num_nodes))

    return where


def _check_weight(weight: Any, what: str) -> float:
    try:
        value = float(weight)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {type(weight).__name__}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{what} must be a finite number >= 0, got {weight!r}")
    return value


# ---------------------------------------------------------------------- the handle
class ReplicaStatistics(NamedTuple):
    """What [`Channel.replica_statistics`][aiorl.Channel.replica_statistics] reports for one channel
    worker."""

    rank: int  #: the replica (0 for a plain channel)
    node_rank: int  #: the node it runs on
    queues: dict[Any, QueueStats]  #: the queues of the keys it holds, as ``statistics()``


class Channel:
    """A handle on a named, distributed set of weighted FIFO queues.

    Get one with [`Channel.create`][aiorl.Channel.create] /
    [`Channel.connect`][aiorl.Channel.connect] (driver) or ``self.create_channel`` /
    ``self.connect_channel`` (inside a worker). A handle is cheap, thread-safe and picklable: pass
    it to worker methods and use it there (it binds to the receiving process's runtime).

    Every queue of the channel is named by a *key* (any hashable; ``"default"``
    when none is given; ``queue_name=`` is an alias of ``key=``) and created on
    first use with the channel's ``maxsize`` (0 = unbounded). ``put``/``get``/
    ``get_batch``/``statistics`` return an [`AsyncChannelWork`][aiorl.AsyncChannelWork]
    (``await`` it, or ``.wait()`` from synchronous code); with ``async_op=False``
    ``put``/``get``/``get_batch`` wait and return the result, as in RLinf.
    ``put_nowait``, ``get_nowait``, ``qsize``, ``empty``, ``full`` and
    ``peek_all`` return plain values when called from synchronous code; see each
    method for the event-loop thread. See ``docs/channels.md``.

    Example:
        ```python
        channel = aiorl.Channel.create(cluster, "trajectories", maxsize=32)   # driver

        class Trainer(aiorl.Worker):
            def __init__(self):
                super().__init__()
                self.channel = self.connect_channel("trajectories")

            async def step(self):
                batch = await self.channel.get_batch(4096)   # items until weights >= 4096
        ```
    """

    def __init__(self, name: str, runtime: Runtime | None = None,
                 session: Session | None = None) -> None:
        group_name_for(name)  # validates the name
        self._name = name
        self._runtime = runtime
        self._session = session  # the cluster it was created or connected through, if any
        self._group: WorkerGroup[ChannelHost] | None = None  # worker_group, once asked for
        self._engine: ClientEngine | None = None
        self._state: ChannelState | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        cluster: Any,
        name: str,
        maxsize: int = 0,
        distributed: bool = False,
        node_rank: int | None = None,
        *,
        node_ranks: Sequence[int] | None = None,
        group_affinity: str | None = None,
        group_rank_affinity: int | None = None,
        timeout: float = DEFAULT_CONNECT_TIMEOUT,
        restart: str = "never",
        max_restarts: int = 3,
        backoff: float = 0.5,
    ) -> Channel:
        """Create channel ``name`` (or connect to it, with a warning, if it already exists)
        from the driver.

        ``restart="on_failure"`` starts an **empty** replacement under the same name when
        a channel worker dies (at most ``max_restarts`` times, after ``backoff`` seconds
        doubling, as [`WorkerGroupBuilder.launch`][aiorl.group.WorkerGroupBuilder.launch]): every
        item queued in it then (up to ``maxsize`` per queue, plus prefetched ones) is lost. Each
        client's operations pending on the dead worker fail with
        [`PeerLostError`][aiorl.PeerLostError] naming the channel; later ones reach the replacement
        once it is ready (docs/failures.md).

        A plain channel's worker runs on the node of worker
        ``group_affinity:group_rank_affinity`` when given, else on ``node_rank``
        (default 0). A ``distributed`` channel runs one worker (replica) on each node
        of ``node_ranks`` (default: every node); each key lives on one replica, the
        one on the node of the first process that uses it (replica 0 if that node has
        none), so producers and consumers on that node stay local. ``node_rank`` and
        the affinities do not apply to it. ``maxsize`` bounds every queue (0 =
        unbounded); when the channel exists already, its own ``maxsize`` and replicas
        stay. Blocks until the channel is ready (from the runtime loop's thread it
        returns at once; operations then wait for readiness).

        Raises [`PlacementError`][aiorl.PlacementError] for a node outside the cluster,
        `ValueError` for repeated ``node_ranks``,
        [`WorkerInitError`][aiorl.WorkerInitError] if a channel worker cannot start and
        `TimeoutError` if it is not ready within ``timeout`` seconds.
        """
        ch = cls(name, cluster.runtime, cluster)
        maxsize = _check_maxsize(maxsize)
        where = _replica_nodes(node_ranks) if distributed else _affinity_node(
            cluster.runtime, group_affinity, group_rank_affinity,
            0 if node_rank is None else int(node_rank), None, timeout)
        ch._start_create(cluster, maxsize, where, distributed, timeout,
                         {"restart": restart, "max_restarts": max_restarts, "backoff": backoff})
        return ch._settle()

    @classmethod
    def connect(cls, cluster: Any, name: str, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> Channel:
        """Connect to channel ``name`` (plain or distributed) from the driver.

        Waits up to ``timeout`` seconds for the channel to exist and be ready (so
        a consumer may connect before its producer created the channel), then
        raises `TimeoutError`.
        """
        ch = cls(name, cluster.runtime, cluster)
        ch._start_connect(timeout)
        return ch._settle()

    def _bind(self) -> tuple[ClientEngine, ChannelState]:
        engine = self._engine
        if engine is None:
            runtime = self._runtime or current_runtime()
            if runtime is None:
                raise RuntimeError(
                    f"channel {self._name!r} is used in a process without an aiorl runtime; "
                    "use it in a driver that created a Cluster, or inside a worker")
            engine = engine_for(runtime)
            self._state = engine.state(self._name)
            self._engine = engine
        assert self._state is not None
        return engine, self._state

    def _start_create(self, session: Session, maxsize: int, where: NodeChoice,
                      distributed: bool, timeout: float,
                      policy: dict[str, Any] | None = None) -> None:
        """Create from a driver or a worker; ``policy``: the channel group's supervision
        (``restart``, ``max_restarts``, ``backoff`` of ``launch``)."""
        engine, st = self._bind()

        def start() -> None:
            if st.address is None:
                resolver = engine.resolver
                resolver.start(st, resolver.create(st, session, maxsize, where, distributed,
                                                   timeout, policy))
            else:
                warn_exists(st.name)

        engine.runtime.submit(start)

    def _start_connect(self, timeout: float) -> None:
        engine, st = self._bind()

        def start() -> None:
            if st.address is None and st.task is None:
                engine.resolver.start(st, engine.resolver.connect(st, timeout))

        engine.runtime.submit(start)

    def _settle(self) -> Channel:
        engine, _ = self._bind()
        if not engine.runtime.on_loop_thread():
            self.wait_ready().wait()
        return self

    def wait_ready(self) -> AsyncChannelWork[None]:
        """A work that completes once the channel worker is ready (fails if it cannot be).

        ``await channel`` does the same and gives the channel back, so
        ``ch = await self.create_channel("x")`` works in ``async`` worker methods.
        """
        engine, st = self._bind()
        return engine.resolver.ready(st)

    def __await__(self) -> Generator[Any, None, Channel]:
        yield from self.wait_ready().__await__()
        return self

    # ------------------------------------------------------------------ identity
    @property
    def name(self) -> str:
        """The channel's name."""
        return self._name

    @property
    def worker_group(self) -> WorkerGroup[ChannelHost]:
        """The channel's worker group (``channel.<name>``; one rank per replica), for
        ``world_size``, ``close()`` and the like. Blocks: synchronous code only.

        Raises `RuntimeError` for a handle that came to the driver as an
        argument or result (it knows no cluster there: use ``Channel.connect``).
        """
        if self._group is None:
            _, st = self._bind()
            session = self._session
            if session is None:
                if "AIORL_WORKER_NAME" not in os.environ:
                    raise RuntimeError(
                        f"channel {self._name!r} was not created or connected through a "
                        "cluster in this process; use Channel.connect(cluster, name).worker_group")
                session = WorkerSession.current()
            self._group = WorkerGroup.from_group_name(session, ChannelHost, st.group)
        return self._group

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle_channel, (self._name,))

    def __repr__(self) -> str:
        st = self._state
        address = st.address if st is not None else None
        replicas = f" x{st.world_size}" if st is not None and (st.world_size or 1) > 1 else ""
        return f"<Channel {self._name!r}{replicas}{' at ' + address if address else ''}>"

    def __str__(self) -> str:
        """A readable snapshot of what is queued (counts, weights, the first items of every
        queue), taken without removing anything. On the runtime loop's thread, where
        nothing may block, and if the channel cannot answer, it is ``repr(channel)``."""
        engine, _ = self._bind()
        if engine.runtime.on_loop_thread():
            return repr(self)
        try:
            replicas = self.replica_statistics().wait(STR_TIMEOUT)
            peeks = {key: self._peek(_queue_key(key, None), STR_ITEMS_PER_QUEUE)
                     for replica in replicas for key in replica.queues}
            shown = {key: work.wait(STR_TIMEOUT) for key, work in peeks.items()}
        except (AiorlError, TimeoutError) as exc:
            return f"{self!r} (no snapshot: {exc})"
        return _describe(self._name, replicas, shown)

    # ------------------------------------------------------------------ operations
    def _submit(self, kind: int, key: QueueKey, number: Any, payload: Any = 0,
                frames: Sequence[Any] = ()) -> AsyncChannelWork[Any]:
        """Submit an operation on queue ``key`` to the replica that holds it."""
        engine, st = self._bind()
        if st.world_size == 1:  # a plain channel: everything goes to its one worker
            work = engine.submit(st, kind, key, number, payload, frames)
        elif (rank := st.key_ranks.get(key) if st.world_size is not None else None) is None:
            work = engine.router.submit_routed(st, kind, key, number, payload, frames)
        else:
            work = engine.submit(st.replicas[rank], kind, key, number, payload, frames)
        if _trace.ON and kind in _TRACED_KINDS:
            span = _trace.begin("channel", f"{_TRACED_KINDS[kind]} {self._name}",
                                f"channel {self._name}", queue=key_from_wire(key))
            span.nbytes = len(payload) if payload.__class__ is bytes else _trace.payload_bytes(
                frames)
            trace_until_settled(work, span)
        return work

    def _everywhere(self, kind: int, combine: Combine) -> AsyncChannelWork[Any]:
        """``kind`` (``STATS``, ``FLUSH``) at every replica, answers combined by ``combine``;
        a plain channel's one answer as it is."""
        engine, st = self._bind()
        if st.world_size == 1:
            return engine.submit(st, kind, "", 0)
        return engine.router.fan_out(st, kind, combine)

    @overload
    def put(self, item: Any, weight: float = 0, key: Hashable = DEFAULT_KEY,
            async_op: Literal[True] = True, *,
            queue_name: Hashable | None = None) -> AsyncChannelWork[None]: ...

    @overload
    def put(self, item: Any, weight: float, key: Hashable, async_op: Literal[False], *,
            queue_name: Hashable | None = None) -> None: ...

    @overload
    def put(self, item: Any, weight: float = 0, key: Hashable = DEFAULT_KEY, *,
            async_op: Literal[False], queue_name: Hashable | None = None) -> None: ...

    @overload
    def put(self, item: Any, weight: float = 0, key: Hashable = DEFAULT_KEY,
            async_op: bool = True, *,
            queue_name: Hashable | None = None) -> AsyncChannelWork[None] | None: ...

    def put(self, item: Any, weight: float = 0, key: Hashable = DEFAULT_KEY,
            async_op: bool = True, *,
            queue_name: Hashable | None = None) -> AsyncChannelWork[None] | None:
        """Put ``item`` into queue ``key``; the work completes once the item is in the queue.

        While this process holds a *credit* for the queue (room the channel worker
        promised; granted for free room only) the put leaves at once, without
        waiting for the puts before it, so many puts in flight cost a few messages;
        without one (a full queue) it waits at the channel worker (backpressure)
        until a get makes room. Either way the work completes when the channel
        worker has the item: a put that returned is in the channel, seen by every
        process, and stays if this process dies. Puts from one process enter the
        queue in call order.
        ``item`` is pickled now; an item with out-of-band buffers (a tensor of
        64 KiB or more, sent zero-copy) always waits for the channel worker's
        answer, so it may be modified once its put is done. With
        ``async_op=False`` this waits for the work and returns None (RLinf's
        default; synchronous code only).

        Raises `SerializationError` at once
        for an item that cannot be pickled; the work fails with
        [`PeerLostError`][aiorl.PeerLostError] if the channel worker dies before it has
        the item. Cancelling a put that already left only stops waiting for it.
        """
        payload, frames = encode_item(item)
        work = self._submit(chan.PUT, _queue_key(key, queue_name), _check_weight(weight, "weight"),
                            payload, frames)
        return work if async_op else work.wait()

    def put_nowait(self, item: Any, weight: float = 0, key: Hashable = DEFAULT_KEY, *,
                   queue_name: Hashable | None = None) -> Any:
        """Put ``item`` only if its queue has room, else raise [`QueueFull`][aiorl.QueueFull].

        From synchronous code this blocks for one round trip, until the item is in the
        queue (see [`put`][aiorl.Channel.put]), and returns None.
        On the runtime loop's thread (``async`` worker methods) it returns an
        [`AsyncChannelWork`][aiorl.AsyncChannelWork] to await, which raises ``QueueFull``.
        """
        engine, _ = self._bind()
        payload, frames = encode_item(item)
        work = self._submit(chan.PUT_NOWAIT, _queue_key(key, queue_name),
                            _check_weight(weight, "weight"), payload, frames)
        return work if engine.runtime.on_loop_thread() else work.wait()

    @overload
    def get(self, key: Hashable = DEFAULT_KEY, async_op: Literal[True] = True, *,
            queue_name: Hashable | None = None) -> AsyncChannelWork[Any]: ...

    @overload
    def get(self, key: Hashable, async_op: Literal[False], *,
            queue_name: Hashable | None = None) -> Any: ...

    @overload
    def get(self, key: Hashable = DEFAULT_KEY, *, async_op: Literal[False],
            queue_name: Hashable | None = None) -> Any: ...

    @overload
    def get(self, key: Hashable = DEFAULT_KEY, async_op: bool = True, *,
            queue_name: Hashable | None = None) -> Any: ...

    def get(self, key: Hashable = DEFAULT_KEY, async_op: bool = True, *,
            queue_name: Hashable | None = None) -> Any:
        """Take the first item of queue ``key``, waiting while the queue is empty.

        Returns an [`AsyncChannelWork`][aiorl.AsyncChannelWork] of the item; with
        ``async_op=False`` it waits and returns the item itself (synchronous code).
        Waiting getters are served in the order their requests reached the channel.
        Gets that follow each other closely prefetch items already queued, so a
        loop of ``await ch.get()`` streams without a round trip per item while this process
        is the queue's one consumer; with several, each get is one request, and every
        consumer receives each producer's items in put order (docs/ordering.md).
        """
        work = self._submit(USER_GET, _queue_key(key, queue_name), 0)
        return work if async_op else work.wait()

    def flush(self) -> AsyncChannelWork[None]:
        """A work that completes once every put this process issued to the channel before
        it is in its queue (every put's own work says so too; this waits for all at once)."""
        return self._everywhere(chan.FLUSH, lambda _replicas, _answers: None)

    def get_nowait(self, key: Hashable = DEFAULT_KEY, *,
                   queue_name: Hashable | None = None) -> Any:
        """Take the first item at once, or raise [`QueueEmpty`][aiorl.QueueEmpty].

        From synchronous code this blocks for one round trip and returns the
        item; on the runtime loop's thread it returns an
        [`AsyncChannelWork`][aiorl.AsyncChannelWork] to await.
        """
        engine, _ = self._bind()
        work = self._submit(chan.GET_NOWAIT, _queue_key(key, queue_name), 0)
        return work if engine.runtime.on_loop_thread() else work.wait()

    @overload
    def get_batch(self, batch_weight: float | None = None, key: Hashable = DEFAULT_KEY,
                  async_op: Literal[True] = True, *, target_weight: float | None = None,
                  queue_name: Hashable | None = None) -> AsyncChannelWork[list[Any]]: ...

    @overload
    def get_batch(self, batch_weight: float | None, key: Hashable, async_op: Literal[False], *,
                  target_weight: float | None = None,
                  queue_name: Hashable | None = None) -> list[Any]: ...

    @overload
    def get_batch(self, batch_weight: float | None = None, key: Hashable = DEFAULT_KEY, *,
                  async_op: Literal[False], target_weight: float | None = None,
                  queue_name: Hashable | None = None) -> list[Any]: ...

    @overload
    def get_batch(self, batch_weight: float | None = None, key: Hashable = DEFAULT_KEY,
                  async_op: bool = True, *, target_weight: float | None = None,
                  queue_name: Hashable | None = None
                  ) -> AsyncChannelWork[list[Any]] | list[Any]: ...

    def get_batch(self, batch_weight: float | None = None, key: Hashable = DEFAULT_KEY,
                  async_op: bool = True, *, target_weight: float | None = None,
                  queue_name: Hashable | None = None) -> Any:
        """Take items in FIFO order until their summed weight reaches or exceeds ``batch_weight``.

        The work completes with the list of items as soon as the sum reaches
        ``batch_weight`` and waits for more items while it is below (weights
        1, 2, 3 and ``batch_weight=3`` give the first two; one item heavier than
        ``batch_weight`` comes alone). Items of weight 0 never complete a batch.
        ``target_weight`` is RLinf's name of ``batch_weight``; ``async_op=False``
        waits and returns the list. Raises `ValueError` unless the weight
        is > 0, and `TypeError` if neither or both names are given.
        """
        if (batch_weight is None) == (target_weight is None):
            raise TypeError("get_batch() takes batch_weight (or its alias target_weight), "
                            "exactly one of them")
        w = _check_weight(batch_weight if batch_weight is not None else target_weight,
                          "batch_weight")
        if not w > 0:
            raise ValueError(f"batch_weight must be > 0, got {w!r}")
        work = self._submit(chan.GET_BATCH, _queue_key(key, queue_name), w)
        return work if async_op else work.wait()

    def statistics(self) -> AsyncChannelWork[dict[Any, QueueStats]]:
        """Per-queue counters: ``{key: QueueStats(qsize, weight, maxsize, waiting_putters,
        waiting_getters, reserved)}`` for every queue used so far (of every replica)."""
        return self._everywhere(chan.STATS, lambda _replicas, answers: {
            key: s for answer in answers for key, s in answer.items()})

    def replica_statistics(self) -> AsyncChannelWork[list[ReplicaStatistics]]:
        """[`statistics`][aiorl.Channel.statistics] per channel worker, in replica order, with the
        node each runs on: where the keys of a distributed channel live (one entry when plain)."""
        engine, st = self._bind()
        return engine.router.fan_out(st, chan.STATS, lambda replicas, answers: [
            ReplicaStatistics(replica.rank, replica.node_rank or 0, answer)
            for replica, answer in zip(replicas, answers, strict=True)])

    def peek_all(self, key: Hashable = DEFAULT_KEY, *, queue_name: Hashable | None = None,
                 limit: int | None = None) -> Any:
        """The items queued in ``key`` now, oldest first, each as ``QueuedItem(item,
        weight)``, without taking them (the first ``limit`` only, when given).

        Items a waiting ``get_batch`` has reserved are not shown (nor counted by
        [`qsize`][aiorl.Channel.qsize]). Each item is copied and unpickled here, so keep ``limit``
        small for large queues. From synchronous code this blocks for one round trip
        and returns the list; on the runtime loop's thread it returns an
        [`AsyncChannelWork`][aiorl.AsyncChannelWork] to await.
        """
        engine, _ = self._bind()
        work = self._peek(_queue_key(key, queue_name), -1 if limit is None else max(0, int(limit)))
        return work if engine.runtime.on_loop_thread() else work.wait()

    def _peek(self, key: QueueKey, limit: int) -> AsyncChannelWork[list[QueuedItem]]:
        return self._submit(chan.PEEK, key, limit)

    def _info(self, key: Hashable, queue_name: Hashable | None, what: str) -> tuple[int, int]:
        engine, _ = self._bind()
        if engine.runtime.on_loop_thread():
            raise RuntimeError(
                f"Channel.{what}() blocks and cannot run on the aiorl event loop's thread; "
                "in async code use 'stats = await channel.statistics()'")
        qsize, maxsize = self._submit(chan.INFO, _queue_key(key, queue_name), 0).wait()
        return int(qsize), int(maxsize)

    def qsize(self, key: Hashable = DEFAULT_KEY, *, queue_name: Hashable | None = None) -> int:
        """Items in queue ``key`` now (0 for a queue never used). Synchronous code only."""
        return self._info(key, queue_name, "qsize")[0]

    def empty(self, key: Hashable = DEFAULT_KEY, *, queue_name: Hashable | None = None) -> bool:
        """Whether queue ``key`` holds no item. Synchronous code only."""
        return self._info(key, queue_name, "empty")[0] == 0

    def full(self, key: Hashable = DEFAULT_KEY, *, queue_name: Hashable | None = None) -> bool:
        """Whether a put to queue ``key`` would wait now. Synchronous code only."""
        qsize, maxsize = self._info(key, queue_name, "full")
        return maxsize > 0 and qsize >= maxsize

    def destroy(self) -> AsyncChannelWork[None]:
        """Stop the channel's workers: pending and later operations, everywhere, fail with
        [`PeerLostError`][aiorl.PeerLostError]. Items still queued are dropped."""
        engine, st = self._bind()
        work: AsyncChannelWork[None] = AsyncChannelWork(engine.loop)

        async def destroy() -> None:
            try:
                await engine.runtime.registry.close_group(st.group)
            except GroupNotFoundError:
                pass  # destroyed already
            for replica in st.replicas:
                if replica.address is not None:
                    engine.endpoint.mark_peer_lost(replica.address,
                                                 f"channel {st.name!r} was destroyed")

        def start() -> None:
            task = engine.loop.create_task(destroy())
            task.add_done_callback(lambda t: settle_from(work, t))

        engine.runtime.submit(start)
        return work


def _queue_key(key: Hashable, queue_name: Hashable | None) -> QueueKey:
    """The wire form of the queue an operation names (``queue_name`` is ``key``'s alias)."""
    if queue_name is not None:
        if key is not DEFAULT_KEY and key != DEFAULT_KEY:
            raise TypeError("give the queue as key= or as its alias queue_name=, not both")
        key = queue_name
    return key if isinstance(key, str) and key.__class__ is str else wire_key(key)


def _check_maxsize(maxsize: Any) -> int:
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
        raise ValueError(f"maxsize must be an int >= 0 (0 = unbounded), got {maxsize!r}")
    return maxsize


def _unpickle_channel(name: str) -> Channel:
    ch = Channel(name)
    if current_runtime() is not None:
        ch._start_connect(DEFAULT_CONNECT_TIMEOUT)  # resolve early; operations wait for it
    return ch


def _short_reprs() -> reprlib.Repr:
    """A ``reprlib.Repr`` whose reprs fit on one line of ``str(channel)``."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 48
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 4
    short.maxlevel = 2
    return short


_SHORT = _short_reprs()


def _short_repr(item: Any) -> str:
    """One line about ``item``: shape and dtype for a tensor or array, else a short repr."""
    shape, dtype = getattr(item, "shape", None), getattr(item, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(item).__name__}(shape={tuple(shape)}, dtype={dtype})"
    return _SHORT.repr(item)


def _describe(name: str, replicas: list[ReplicaStatistics],
              shown: dict[Any, list[QueuedItem]]) -> str:
    """The text of ``str(channel)``."""
    distributed = len(replicas) > 1
    queues = sum(len(r.queues) for r in replicas)
    head = f"Channel {name!r}: {queues} queue{'s' if queues != 1 else ''}"
    lines = [head + (f" on {len(replicas)} replicas" if distributed else "")]
    for replica in replicas:
        where = f" (replica {replica.rank}, node {replica.node_rank})" if distributed else ""
        for key, s in replica.queues.items():
            bound = f"/{s.maxsize}" if s.maxsize else ""
            waiting = "".join([f", {s.waiting_putters} put(s) waiting" if s.waiting_putters else "",
                               f", {s.waiting_getters} get(s) waiting" if s.waiting_getters else "",
                               f", {s.reserved} reserved" if s.reserved else ""])
            lines.append(f"  {key!r}{where}: {s.qsize}{bound} item(s), weight {s.weight:g}"
                         f"{waiting}")
            items = shown.get(key, [])
            lines.extend(f"    [{i}] weight {q.weight:g}: {_short_repr(q.item)}"
                         for i, q in enumerate(items))
            if s.qsize > len(items):
                lines.append(f"    ... {s.qsize - len(items)} more")
    return "\n".join(lines)


# ---------------------------------------------------------------------- inside workers
def create_channel_from_worker(
    runtime: Runtime,
    info: WorkerInfo,
    name: str,
    group_affinity: str | None = None,
    group_rank_affinity: int | None = None,
    maxsize: int = 0,
    distributed: bool = False,
    node_rank: int | None = None,
    node_ranks: Sequence[int] | None = None,
) -> Channel:
    """``Worker.create_channel``: create (or connect to) channel ``name`` from inside a worker.

    ``runtime`` and ``info`` are the calling worker's. A plain channel's worker
    runs on the node of ``group_affinity:group_rank_affinity`` (rank 0 if only the
    group is given, this worker's group if only the rank is), else on ``node_rank``,
    by default on this worker's node; a ``distributed`` one runs a replica on each
    node of ``node_ranks`` (default: every node), see [`Channel.create`][aiorl.Channel.create]. From
    a plain method (the method thread) this blocks until the channel is ready and
    raises creation errors; from an ``async`` method (the event loop) it returns
    the handle at once, its operations wait for readiness, and ``await`` on the
    handle waits explicitly.
    """
    if isinstance(group_affinity, int) and not isinstance(group_affinity, bool):
        raise TypeError("create_channel(name, group_affinity, group_rank_affinity, maxsize): "
                        "the second argument is a group name; pass maxsize by keyword "
                        "(RLinf's create_channel takes maxsize second)")
    maxsize = _check_maxsize(maxsize)
    session = WorkerSession.current()
    if group_affinity is None and group_rank_affinity is not None:
        group_affinity = info.address.root_group_name
    where = _replica_nodes(node_ranks) if distributed else _affinity_node(
        runtime, group_affinity, group_rank_affinity,
        int(info.node_rank) if node_rank is None else int(node_rank),
        (info.name, int(info.node_rank)), DEFAULT_CONNECT_TIMEOUT)
    ch = Channel(name, runtime, session)
    ch._start_create(session, maxsize, where, distributed, DEFAULT_CONNECT_TIMEOUT)
    return ch._settle()


def connect_channel_from_worker(runtime: Runtime, name: str) -> Channel:
    """``Worker.connect_channel``: connect to channel ``name`` from inside a worker.

    Waits (up to 60 s) for the channel to exist and be ready: blocking from a
    plain method, lazily (operations wait) from an ``async`` method.
    """
    ch = Channel(name, runtime, WorkerSession.current())
    ch._start_connect(DEFAULT_CONNECT_TIMEOUT)
    return ch._settle()
