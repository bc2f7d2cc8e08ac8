"""The client side of channels: the :class:`Channel` handle and its per-process engine.

Threads
    A handle can be used from any thread of a process that has an aiorl runtime
    (the driver's threads, a worker's method thread, a worker's event loop). The
    payload is pickled in the calling thread; everything else happens on the
    runtime loop. From the loop thread an operation is queued directly (the fast
    path); from other threads it goes through one locked inbox and at most one
    loop wake-up per burst of calls.

Batching
    Operations issued to one channel during one turn of the loop leave as one
    ZMQ message, and the channel worker answers everything that arrived together
    in one message too (see :mod:`aiorl.channels._protocol`). Many puts or gets
    in flight therefore cost a few messages, not a round trip each.

Ordering
    One process sends everything for one channel through one outbox, in call
    order, over one connection; so puts from one process enter their queue in
    the order they were made, and requests that observe the queue (``qsize``)
    see the puts issued before them.

Failure
    The process watches the channel worker through the registry
    (:meth:`~aiorl.runtime.Runtime.resolve_worker`); when it dies the
    endpoint marks it lost and every pending operation fails with
    :class:`~aiorl.errors.PeerLostError`.

Cancellation
    Cancelling a pending put or get (``work.cancel()``, ``wait(timeout)``
    expiring, a cancelled task) withdraws it at the channel worker. If the item
    was already on its way, the handle sends it back, and it returns to its
    place in its queue, so a cancelled get never loses or reorders an item.
"""

from __future__ import annotations

import asyncio
import functools
import io
import itertools
import logging
import pickle
import sys
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from aiorl.runtime.work import AsyncChannelWork
from aiorl.runtime.runtime import Runtime, current_runtime
from aiorl.channels import _protocol as P
from aiorl.channels._queue import QueueStats
from aiorl.channels._server import ChannelWorker, group_name_for
from aiorl.errors import PeerLostError, QueueEmpty, QueueFull, RemoteError, WorkerInitError
from aiorl.transport import serialization

if TYPE_CHECKING:
    from aiorl.actors.worker import Worker

__all__ = ["Channel", "connect_channel_from_worker", "create_channel_from_worker"]

log = logging.getLogger("aiorl.channels")

#: How long connecting waits for a channel to exist and be ready, by default.
DEFAULT_CONNECT_TIMEOUT = 60.0

_PARKABLE = frozenset((P.PUT, P.GET, P.GET_BATCH))  # kinds the channel worker may hold back


class _Op(asyncio.Future):  # type: ignore[type-arg]
    """One operation: the future its :class:`~aiorl.AsyncChannelWork` wraps, and its wire data.

    Being the future itself (rather than an object holding one) saves an
    allocation per operation, and overriding ``cancel`` catches every way a work
    gets cancelled (``work.cancel()``, ``wait(timeout)`` expiring, a task
    cancelled while awaiting it) without a done callback per operation.
    Operations that nobody awaits (``CANCEL``, ``UNGET``) are never completed.
    """

    __slots__ = ("core", "state", "kind", "queue", "number", "payload", "frames", "token",
                 "address")

    def __init__(self, core: _ClientCore, state: _ChannelState, kind: int, queue: str,
                 number: Any, payload: Any, frames: Sequence[Any]) -> None:
        super().__init__(loop=core.loop)
        self.core = core
        self.state = state
        self.kind = kind
        self.queue = queue
        self.number = number
        self.payload = payload  # inline pickle bytes, or the number of frames in ``frames``
        self.frames = frames
        self.token = 0
        self.address: str | None = None  # set once it is handed to an outbox

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg=msg):
            return False
        if self.kind in _PARKABLE:
            self.core._on_cancel(self)
        return True


class _Outbox:
    __slots__ = ("meta", "frames", "ops", "nbytes", "inline")

    def __init__(self) -> None:
        self.meta: list[Any] = []
        self.frames: list[Any] = []
        self.ops: list[_Op] = []
        self.nbytes = 0
        self.inline = 0


class _ChannelState:
    """What one process knows about one channel, shared by all its handles to it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.group = group_name_for(name)
        self.address: str | None = None  # the channel worker's endpoint, once resolved
        self.backlog: list[_Op] = []  # operations issued before the address was known
        self.task: asyncio.Task[str] | None = None  # the resolution whose outcome counts
        self.ready_waiters: list[AsyncChannelWork[Any]] = []


class _ItemPickler(pickle.Pickler):
    """Pickle protocol 5 with aiorl's tensor reduction (see :mod:`aiorl.transport.serialization`).

    :func:`serialization.dumps` builds its dispatch table on every call; items
    are pickled once per put, so this class keeps one (rebuilt when torch is
    first imported, since the table reduces tensors only once torch exists).
    """

    _table_for: tuple[bool, Any] = (False, None)  # (built, the torch module it was built with)


def _item_dispatch_table() -> None:
    torch = sys.modules.get("torch")
    if _ItemPickler._table_for != (True, torch):
        _ItemPickler.dispatch_table = serialization._dispatch_table()  # type: ignore[misc]
        _ItemPickler._table_for = (True, torch)


def encode_item(item: Any) -> tuple[Any, list[Any]]:
    """``(payload, frames)`` for an item: a small pickle inline, else ``(n, its n frames)``.

    Same format as :func:`aiorl.transport.serialization.dumps` (buffers of at
    least ``OOB_THRESHOLD`` bytes, e.g. tensor data, become zero-copy frames);
    anything plain pickle refuses goes through ``serialization.dumps`` (cloudpickle).
    """
    _item_dispatch_table()
    buffers: list[Any] = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        if buf.raw().nbytes < serialization.OOB_THRESHOLD:
            return True  # in-band: cheaper than a frame of its own
        buffers.append(buf.raw())
        return False

    stream = io.BytesIO()
    try:
        _ItemPickler(stream, 5, buffer_callback=out_of_band).dump(item)
    except Exception:
        frames = serialization.dumps(item)  # cloudpickle fallback; raises SerializationError
        if len(frames) == 1 and len(frames[0]) <= P.INLINE_MAX:
            return bytes(frames[0]), []
        return len(frames), frames
    if not buffers and stream.tell() <= P.INLINE_MAX:
        return stream.getvalue(), []
    return 1 + len(buffers), [stream.getbuffer(), *buffers]


def decode_item(payload: Any, frames: Sequence[Any]) -> Any:
    return serialization.loads(frames if payload.__class__ is int else [payload])


class _ClientCore:
    """The per-process engine behind every :class:`Channel` handle (one per runtime)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.loop = runtime.loop
        self.endpoint = runtime.endpoint
        self._states: dict[str, _ChannelState] = {}
        self._states_lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._pending: dict[int, _Op] = {}
        self._outboxes: dict[str, _Outbox] = {}
        self._flush_scheduled = False
        self._inbox: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._inbox_lock = threading.Lock()
        self._inbox_scheduled = False
        # Before any operation can be posted (call_soon keeps FIFO order).
        runtime.call_soon(self._install)

    def _install(self) -> None:
        self.endpoint.on_event(P.DONE, self._on_done)
        self.endpoint.on_peer_lost(self._on_lost)

    def state(self, name: str) -> _ChannelState:
        with self._states_lock:
            st = self._states.get(name)
            if st is None:
                st = self._states[name] = _ChannelState(name)
            return st

    # ------------------------------------------------------------------ any thread
    def on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop: now on the loop thread, else batched via the inbox."""
        if _running_loop() is self.loop:
            fn(*args)
            return
        with self._inbox_lock:
            self._inbox.append((fn, args))
            if self._inbox_scheduled:
                return
            self._inbox_scheduled = True
        self.loop.call_soon_threadsafe(self._drain_inbox)

    def submit(self, state: _ChannelState, kind: int, queue: str, number: Any, payload: Any = 0,
               frames: Sequence[Any] = ()) -> AsyncChannelWork[Any]:
        op = _Op(self, state, kind, queue, number, payload, frames)
        work: AsyncChannelWork[Any] = AsyncChannelWork(self.loop, op)
        if _running_loop() is self.loop:
            self._accept(op)
        else:
            self.on_loop(self._accept_from_thread, op, work)
        return work

    # ------------------------------------------------------------------ loop thread
    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            batch, self._inbox = self._inbox, []
            self._inbox_scheduled = False
        for fn, args in batch:
            try:
                fn(*args)
            except Exception:
                log.exception("channel operation failed on the loop")

    def _accept_from_thread(self, op: _Op, work: AsyncChannelWork[Any]) -> None:
        work._concurrent()  # link the thread-side mirror now: wait() then needs no extra hop
        self._accept(op)

    def _accept(self, op: _Op) -> None:
        if op.done():  # cancelled before it could leave
            return
        op.token = token = next(self._tokens)
        self._pending[token] = op
        st = op.state
        if st.address is not None:
            self._enqueue(st.address, op)
        else:
            st.backlog.append(op)
            self._ensure_resolving(st)

    def _enqueue(self, address: str, op: _Op) -> None:
        op.address = address
        box = self._outboxes.get(address)
        if box is None:
            box = self._outboxes[address] = _Outbox()
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self.loop.call_soon(self._flush)
        payload = op.payload
        box.meta.append((op.kind, op.token, op.queue, op.number, payload))
        box.ops.append(op)
        if op.frames:
            box.frames.extend(op.frames)
            box.nbytes += sum(len(f) for f in op.frames)
        elif payload.__class__ is not int:
            box.inline += len(payload)
        if (len(box.ops) >= P.MAX_BATCH_OPS or box.inline >= P.MAX_INLINE_BYTES
                or box.nbytes >= P.MAX_BATCH_BYTES):
            self._send(address, self._outboxes.pop(address))

    def _flush(self) -> None:
        self._flush_scheduled = False
        boxes, self._outboxes = self._outboxes, {}
        for address, box in boxes.items():
            self._send(address, box)

    def _send(self, address: str, box: _Outbox) -> None:
        try:
            self.endpoint.send_oneway(address, P.OPS, box.meta, box.frames)
        except Exception as exc:  # PeerLostError for a dead channel; anything else is ours
            for op in box.ops:
                self._fail(op, exc if isinstance(exc, PeerLostError) else PeerLostError(
                    f"channel {op.state.name!r}: could not send to {address}: {exc}"))

    def _fail(self, op: _Op, exc: BaseException) -> None:
        if self._pending.pop(op.token, None) is not None and not op.done():
            op.set_exception(exc)

    def _on_cancel(self, op: _Op) -> None:
        """A parkable operation was cancelled locally: withdraw it at the channel worker."""
        if op.token not in self._pending:
            return  # not accepted yet (``_accept`` drops it) or already answered
        if op.address is None:  # still in the backlog: it never left
            del self._pending[op.token]
            if op in op.state.backlog:
                op.state.backlog.remove(op)
            return
        # The answer (CANCELLED, or the result if it was already sent) clears _pending.
        cancel = _Op(self, op.state, P.CANCEL, op.queue, 0, 0, ())
        cancel.token = op.token
        self._enqueue(op.address, cancel)

    def _on_done(self, peer: str, meta: Any, frames: list[Any]) -> None:
        pos = 0
        pending = self._pending
        for token, status, info in meta:
            op = pending.pop(token, None)
            if status == P.ITEMS:
                items = []
                for payload, weight, seq in info:
                    if payload.__class__ is int:
                        items.append((payload, (weight, seq), frames[pos:pos + payload]))
                        pos += payload
                    else:
                        items.append((payload, (weight, seq), ()))
                if op is None or op.done():
                    self._refused(peer, op, token, items)
                    continue
                try:
                    if op.kind == P.GET_BATCH:
                        value: Any = [decode_item(p, f) for p, _, f in items]
                    else:
                        p, _, f = items[0]
                        value = decode_item(p, f)
                except BaseException as exc:  # noqa: BLE001 - the consumer learns why
                    op.set_exception(exc)
                    continue
                op.set_result(value)
                continue
            if op is None or op.done():
                continue  # CANCELLED after a local cancel, or a late answer nobody awaits
            if status == P.OK:
                if op.kind == P.STATS:
                    op.set_result({
                        q: QueueStats(int(v[0]), float(v[1]), int(v[2]), int(v[3]), int(v[4]),
                                      int(v[5]))
                        for q, v in info.items()
                    })
                elif op.kind == P.INFO:
                    op.set_result((int(info[0]), int(info[1])))
                else:
                    op.set_result(None)
            elif status == P.FULL:
                op.set_exception(QueueFull(
                    f"queue {op.queue!r} of channel {op.state.name!r} is full"))
            elif status == P.EMPTY:
                op.set_exception(QueueEmpty(
                    f"queue {op.queue!r} of channel {op.state.name!r} is empty"))
            else:
                op.set_exception(RemoteError(
                    f"{op.state.group}:0", 0, "ChannelError", str(info), ""))

    def _refused(self, peer: str, op: _Op | None, token: int,
                 items: list[tuple[Any, Any, Sequence[Any]]]) -> None:
        """Items arrived for a get nobody waits for (it was cancelled): send them back."""
        if op is None:
            log.error("channel answer for unknown operation %s: %d item(s) dropped",
                      token, len(items))
            return
        frames = [f for _, _, fs in items for f in fs]
        unget = _Op(self, op.state, P.UNGET, op.queue, [place for _, place, _ in items],
                    [p for p, _, _ in items], frames)
        if not self.endpoint.is_lost(peer):
            self._enqueue(peer, unget)

    def _on_lost(self, address: str, exc: BaseException) -> None:
        self._outboxes.pop(address, None)
        with self._states_lock:
            states = list(self._states.values())
        for st in states:
            if st.address == address:
                # Resolve again on the next operation: that fails with PeerLostError while
                # the channel is dead, and finds a channel re-created under the same name.
                st.address = None
        for op in [op for op in self._pending.values() if op.address == address]:
            self._fail(op, PeerLostError(
                f"channel {op.state.name!r} is gone (its worker {op.state.group}:0 was lost): "
                f"{exc}"))

    # ------------------------------------------------------------------ resolution (loop)
    def _ensure_resolving(self, st: _ChannelState) -> None:
        if st.address is None and st.task is None:
            self._start(st, self._connect(st, DEFAULT_CONNECT_TIMEOUT))

    def _start(self, st: _ChannelState, coro: Coroutine[Any, Any, str]) -> None:
        task = self.loop.create_task(coro)
        st.task = task
        task.add_done_callback(functools.partial(self._resolved, st))

    def _resolved(self, st: _ChannelState, task: asyncio.Task[str]) -> None:
        exc = task.exception() if not task.cancelled() else PeerLostError("resolution cancelled")
        if exc is None:
            if st.address is None:
                st.address = task.result()
            if st.task is task:
                st.task = None
            backlog, st.backlog = st.backlog, []
            for op in backlog:
                self._enqueue(st.address, op)
            waiters, st.ready_waiters = st.ready_waiters, []
            for w in waiters:
                w._set_result(None)
            return
        if st.task is not task or st.address is not None:
            return  # a newer attempt decides (or another attempt already succeeded)
        st.task = None
        backlog, st.backlog = st.backlog, []
        for op in backlog:
            self._fail(op, exc)
        waiters, st.ready_waiters = st.ready_waiters, []
        for w in waiters:
            w._set_exception(exc)

    def ready(self, st: _ChannelState) -> AsyncChannelWork[None]:
        """A work done once ``st`` is resolved (starting a connect if nothing is under way)."""
        work: AsyncChannelWork[None] = AsyncChannelWork(self.loop)

        def check() -> None:
            if st.address is not None:
                work._set_result(None)
                return
            st.ready_waiters.append(work)
            self._ensure_resolving(st)

        self.on_loop(check)
        return work

    async def _connect(self, st: _ChannelState, timeout: float, launched: bool = False) -> str:
        name = f"{st.group}:0"
        try:
            # Also makes this runtime watch the channel worker: when it dies, the endpoint
            # marks it lost and _on_lost fails what waits on it.
            info = await self.runtime.resolve_worker(name, timeout, wait_for_group=True)
        except PeerLostError:
            # This process may remember an earlier channel worker of this name that died
            # (the channel was destroyed and created again): ask the registry, which knows
            # the newest one; after our own launch, wait for it.
            info = await self._lookup_ready(name, timeout if launched else 0.0)
            if info is None or self.endpoint.is_lost(str(info["endpoint"])):
                raise
        return str(info["endpoint"])

    async def _lookup_ready(self, name: str, wait: float) -> dict[str, Any] | None:
        """The registry's info on worker ``name`` once ready (None if not within ``wait`` s).

        Raises :class:`~aiorl.WorkerInitError` if it failed to start.
        """
        deadline = self.loop.time() + wait
        delay = 0.01
        while True:
            try:
                reply = await self.runtime.registry.request("lookup", {"name": name})
            except RemoteError:
                reply = {}  # not registered (yet)
            state = reply.get("state")
            if state == "ready":
                return dict(reply["info"])
            if state == "failed":
                d = reply.get("detail") or {}
                raise WorkerInitError(name, 0, str(d.get("type", "Exception")),
                                      str(d.get("message", "")), str(d.get("traceback", "")))
            if self.loop.time() + delay > deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def _create(self, st: _ChannelState, cluster: Any, maxsize: int,
                      where: Callable[[], Coroutine[Any, Any, int]], timeout: float) -> str:
        launched = False
        if not await self._group_exists(st.group):
            node_rank = await where()
            if hasattr(cluster, "refresh"):  # a ClusterView: its node list must be current
                await cluster.refresh()
            from aiorl.placement import NodePlacementStrategy

            builder = ChannelWorker.create_group(st.name, maxsize)
            launch = functools.partial(builder.launch, cluster, NodePlacementStrategy([node_rank]),
                                       st.group)
            try:
                # launch() blocks on the loop via run_sync, so it runs on a helper thread.
                await self.loop.run_in_executor(None, launch)
                launched = True
            except RemoteError as exc:
                if "already exists" not in str(exc.message):
                    raise
                # Another creator won the race: connect to its channel.
        return await self._connect(st, timeout, launched)

    async def _group_exists(self, group: str) -> bool:
        try:
            await self.runtime.registry.request("lookup_group", {"group": group})
        except RemoteError as exc:
            if exc.exc_type.endswith("KeyError"):
                return False
            raise
        return True


_running_loop = asyncio._get_running_loop  # C-level and cheap (the hot path asks every call)
_cores: weakref.WeakKeyDictionary[Runtime, _ClientCore] = weakref.WeakKeyDictionary()
_cores_lock = threading.Lock()


def _core_for(runtime: Runtime) -> _ClientCore:
    with _cores_lock:
        core = _cores.get(runtime)
        if core is None:
            core = _cores[runtime] = _ClientCore(runtime)
        return core


# ---------------------------------------------------------------------- placement of new channels
def _affinity_node(runtime: Runtime, group: str | None, rank: int | None, default: int,
                   own: tuple[str, int] | None,
                   timeout: float) -> Callable[[], Coroutine[Any, Any, int]]:
    """A coroutine function giving the node rank a new channel should live on."""

    async def where() -> int:
        if group is None:
            return default
        name = f"{group}:{rank or 0}"
        if own is not None and name == own[0]:
            return own[1]  # ourselves: possibly still in __init__, so not yet registered
        try:
            reply = await runtime.registry.request("lookup", {"name": name})
            return int(reply["info"]["node_rank"])
        except (RemoteError, KeyError, TypeError, ValueError):
            pass  # not registered yet: wait until it is ready
        info = await runtime.resolve_worker(name, timeout, wait_for_group=True)
        return int(info["node_rank"])

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
class Channel:
    """A handle on a named, distributed set of weighted FIFO queues.

    Get one with :meth:`Channel.create` / :meth:`Channel.connect` (driver) or
    ``self.create_channel`` / ``self.connect_channel`` (inside a worker). A handle
    is cheap, thread-safe and picklable: pass it to worker methods and use it
    there (it binds to the receiving process's runtime).

    Every queue of the channel is created on first use with the channel's
    ``maxsize`` (0 = unbounded). ``put``/``get``/``get_batch``/``statistics``
    return an :class:`~aiorl.AsyncChannelWork` (``await`` it, or ``.wait()`` from
    synchronous code). ``put_nowait``, ``get_nowait``, ``qsize``, ``empty`` and
    ``full`` return plain values when called from synchronous code; see each
    method for the event-loop thread. See ``docs/channels.md``.
    """

    def __init__(self, name: str, runtime: Runtime | None = None) -> None:
        group_name_for(name)  # validates the name
        self._name = name
        self._runtime = runtime
        self._core: _ClientCore | None = None
        self._state: _ChannelState | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        cluster: Any,
        name: str,
        maxsize: int = 0,
        *,
        group_affinity: str | None = None,
        group_rank_affinity: int | None = None,
        node_rank: int | None = None,
        timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> Channel:
        """Create channel ``name`` (or connect to it if it already exists) from the driver.

        The channel worker runs on the node of worker ``group_affinity:group_rank_affinity``
        when given, else on ``node_rank`` (default 0). ``maxsize`` bounds every
        queue of the channel (0 = unbounded); when the channel exists already, its
        own ``maxsize`` stays. Blocks until the channel is ready (from the runtime
        loop's thread it returns at once; operations then wait for readiness).

        Raises :class:`~aiorl.PlacementError` for a node outside the cluster,
        :class:`~aiorl.WorkerInitError` if the channel worker cannot start and
        :class:`TimeoutError` if it is not ready within ``timeout`` seconds.
        """
        ch = cls(name, cluster.runtime)
        maxsize = _check_maxsize(maxsize)
        where = _affinity_node(cluster.runtime, group_affinity, group_rank_affinity,
                               0 if node_rank is None else int(node_rank), None, timeout)
        ch._start_create(cluster, maxsize, where, timeout)
        return ch._settle()

    @classmethod
    def connect(cls, cluster: Any, name: str, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> Channel:
        """Connect to channel ``name`` from the driver.

        Waits up to ``timeout`` seconds for the channel to exist and be ready (so
        a consumer may connect before its producer created the channel), then
        raises :class:`TimeoutError`.
        """
        ch = cls(name, cluster.runtime)
        ch._start_connect(timeout)
        return ch._settle()

    def _bind(self) -> tuple[_ClientCore, _ChannelState]:
        core = self._core
        if core is None:
            runtime = self._runtime or current_runtime()
            if runtime is None:
                raise RuntimeError(
                    f"channel {self._name!r} is used in a process without an aiorl runtime; "
                    "use it in a driver that created a Cluster, or inside a worker")
            core = _core_for(runtime)
            self._state = core.state(self._name)
            self._core = core
        assert self._state is not None
        return core, self._state

    def _start_create(self, cluster: Any, maxsize: int,
                      where: Callable[[], Coroutine[Any, Any, int]], timeout: float) -> None:
        core, st = self._bind()

        def start() -> None:
            if st.address is None:
                core._start(st, core._create(st, cluster, maxsize, where, timeout))

        core.on_loop(start)

    def _start_connect(self, timeout: float) -> None:
        core, st = self._bind()

        def start() -> None:
            if st.address is None and st.task is None:
                core._start(st, core._connect(st, timeout))

        core.on_loop(start)

    def _settle(self) -> Channel:
        core, _ = self._bind()
        if not core.runtime.on_loop_thread():
            self.wait_ready().wait()
        return self

    def wait_ready(self) -> AsyncChannelWork[None]:
        """A work that completes once the channel worker is ready (fails if it cannot be).

        ``await channel`` does the same and gives the channel back, so
        ``ch = await self.create_channel("x")`` works in ``async`` worker methods.
        """
        core, st = self._bind()
        return core.ready(st)

    def __await__(self) -> Any:
        yield from self.wait_ready().__await__()
        return self

    # ------------------------------------------------------------------ identity
    @property
    def name(self) -> str:
        return self._name

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle_channel, (self._name,))

    def __repr__(self) -> str:
        address = self._state.address if self._state is not None else None
        return f"<Channel {self._name!r}{' at ' + address if address else ''}>"

    # ------------------------------------------------------------------ operations
    def put(self, item: Any, weight: float = 0, queue_name: str = "default") -> AsyncChannelWork[None]:
        """Put ``item`` into queue ``queue_name``; the work completes once the item is accepted.

        On a full queue the work waits (backpressure) until a get makes room;
        puts from one process enter the queue in call order. ``item`` is pickled
        now (tensors travel zero-copy: do not modify one until its put is done).

        Raises :class:`~aiorl.transport.serialization.SerializationError` at once
        for an item that cannot be pickled; the work fails with
        :class:`~aiorl.PeerLostError` if the channel worker dies.
        """
        core, st = self._bind()
        payload, frames = encode_item(item)
        return core.submit(st, P.PUT, _check_queue(queue_name), _check_weight(weight, "weight"),
                           payload, frames)

    def put_nowait(self, item: Any, weight: float = 0, queue_name: str = "default") -> Any:
        """Put ``item`` only if its queue has room, else raise :class:`~aiorl.QueueFull`.

        From synchronous code this blocks for one round trip and returns None.
        On the runtime loop's thread (``async`` worker methods) it returns an
        :class:`~aiorl.AsyncChannelWork` to await, which raises ``QueueFull``.
        """
        core, st = self._bind()
        payload, frames = encode_item(item)
        work = core.submit(st, P.PUT_NOWAIT, _check_queue(queue_name),
                           _check_weight(weight, "weight"), payload, frames)
        return work if core.runtime.on_loop_thread() else work.wait()

    def get(self, queue_name: str = "default") -> AsyncChannelWork[Any]:
        """Take the first item of ``queue_name``, waiting while the queue is empty.

        Waiting getters are served in the order their requests reached the channel.
        """
        core, st = self._bind()
        return core.submit(st, P.GET, _check_queue(queue_name), 0)

    def get_nowait(self, queue_name: str = "default") -> Any:
        """Take the first item at once, or raise :class:`~aiorl.QueueEmpty`.

        From synchronous code this blocks for one round trip and returns the
        item; on the runtime loop's thread it returns an
        :class:`~aiorl.AsyncChannelWork` to await.
        """
        core, st = self._bind()
        work = core.submit(st, P.GET_NOWAIT, _check_queue(queue_name), 0)
        return work if core.runtime.on_loop_thread() else work.wait()

    def get_batch(self, batch_weight: float, queue_name: str = "default") -> AsyncChannelWork[list[Any]]:
        """Take items in FIFO order until their summed weight reaches or exceeds ``batch_weight``.

        The work completes with the list of items as soon as the sum reaches
        ``batch_weight`` and waits for more items while it is below (weights
        1, 2, 3 and ``batch_weight=3`` give the first two; one item heavier than
        ``batch_weight`` comes alone). Items of weight 0 never complete a batch.
        Raises :class:`ValueError` unless ``batch_weight > 0``.
        """
        w = _check_weight(batch_weight, "batch_weight")
        if not w > 0:
            raise ValueError(f"batch_weight must be > 0, got {batch_weight!r}")
        core, st = self._bind()
        return core.submit(st, P.GET_BATCH, _check_queue(queue_name), w)

    def statistics(self) -> AsyncChannelWork[dict[str, QueueStats]]:
        """Per-queue counters: ``{queue_name: QueueStats(qsize, weight, maxsize,
        waiting_putters, waiting_getters, reserved)}`` for every queue used so far."""
        core, st = self._bind()
        return core.submit(st, P.STATS, "", 0)

    def _info(self, queue_name: str, what: str) -> tuple[int, int]:
        core, st = self._bind()
        if core.runtime.on_loop_thread():
            raise RuntimeError(
                f"Channel.{what}() blocks and cannot run on the aiorl event loop's thread; "
                "in async code use 'stats = await channel.statistics()'")
        return core.submit(st, P.INFO, _check_queue(queue_name), 0).wait()

    def qsize(self, queue_name: str = "default") -> int:
        """Items in ``queue_name`` now (0 for a queue never used). Synchronous code only."""
        return self._info(queue_name, "qsize")[0]

    def empty(self, queue_name: str = "default") -> bool:
        """Whether ``queue_name`` holds no item. Synchronous code only."""
        return self._info(queue_name, "empty")[0] == 0

    def full(self, queue_name: str = "default") -> bool:
        """Whether a put to ``queue_name`` would wait now. Synchronous code only."""
        qsize, maxsize = self._info(queue_name, "full")
        return maxsize > 0 and qsize >= maxsize

    def destroy(self) -> AsyncChannelWork[None]:
        """Stop the channel worker: pending and later operations, everywhere, fail with
        :class:`~aiorl.PeerLostError`. Items still queued are dropped."""
        core, st = self._bind()
        work: AsyncChannelWork[None] = AsyncChannelWork(core.loop)

        async def destroy() -> None:
            try:
                await core.runtime.registry.request("close_group", {"group": st.group})
            except RemoteError as exc:
                if not exc.exc_type.endswith("KeyError"):
                    raise
            if st.address is not None:
                core.endpoint.mark_peer_lost(st.address, f"channel {st.name!r} was destroyed")

        def start() -> None:
            task = core.loop.create_task(destroy())
            task.add_done_callback(work._complete_from)

        core.on_loop(start)
        return work


def _check_queue(queue_name: Any) -> str:
    if not isinstance(queue_name, str):
        raise TypeError(f"queue_name must be a str, got {type(queue_name).__name__}")
    return queue_name


def _check_maxsize(maxsize: Any) -> int:
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
        raise ValueError(f"maxsize must be an int >= 0 (0 = unbounded), got {maxsize!r}")
    return maxsize


def _unpickle_channel(name: str) -> Channel:
    ch = Channel(name)
    if current_runtime() is not None:
        ch._start_connect(DEFAULT_CONNECT_TIMEOUT)  # resolve early; operations wait for it
    return ch


# ---------------------------------------------------------------------- inside workers
def create_channel_from_worker(
    worker: Worker,
    name: str,
    group_affinity: str | None = None,
    group_rank_affinity: int | None = None,
    maxsize: int = 0,
) -> Channel:
    """``Worker.create_channel``: create (or connect to) channel ``name`` from inside a worker.

    The channel worker runs on the node of ``group_affinity:group_rank_affinity``
    (rank 0 if only the group is given, this worker's group if only the rank is),
    by default on this worker's node. From a plain method (the method thread)
    this blocks until the channel is ready and raises creation errors; from an
    ``async`` method (the event loop) it returns the handle at once, its
    operations wait for readiness, and ``await`` on the handle waits explicitly.
    """
    from aiorl.cluster import current_cluster_view

    runtime = worker._runtime
    maxsize = _check_maxsize(maxsize)
    view = current_cluster_view()
    if group_affinity is None and group_rank_affinity is not None:
        group_affinity = worker.worker_group_name
    info = worker.worker_info
    where = _affinity_node(runtime, group_affinity, group_rank_affinity, int(info.node_rank),
                           (worker.worker_name, int(info.node_rank)), DEFAULT_CONNECT_TIMEOUT)
    ch = Channel(name, runtime)
    ch._start_create(view, maxsize, where, DEFAULT_CONNECT_TIMEOUT)
    return ch._settle()


def connect_channel_from_worker(worker: Worker, name: str) -> Channel:
    """``Worker.connect_channel``: connect to channel ``name`` from inside a worker.

    Waits (up to 60 s) for the channel to exist and be ready: blocking from a
    plain method, lazily (operations wait) from an ``async`` method.
    """
    ch = Channel(name, worker._runtime)
    ch._start_connect(DEFAULT_CONNECT_TIMEOUT)
    return ch._settle()
