"""Bookkeeping of the p2p engine: posted receives, arrived messages, per-peer state.

Plain data holders (no I/O): :class:`_Dest` is the sender's view of one
receiver, :class:`_Inbox` the receiver's view of one sender; :class:`_Recv`
and :class:`_In` are the two sides that an inbox matches first-in first-out.
:class:`_EngineBase` declares the engine attributes the ``_p2p_*`` mixins share.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from aiorl.runtime.work import AsyncWork
from aiorl.errors import PeerLostError
from aiorl.transport import _shm

if TYPE_CHECKING:
    from aiorl.actors._p2p_codec import _Out
    from aiorl.actors.p2p import P2P


class _Recv:
    """A posted receive: ``buf`` is None for ``recv``, the destination for ``recv_tensor``."""

    __slots__ = ("work", "buf", "event")

    def __init__(self, work: AsyncWork[Any], buf: Any, event: Any) -> None:
        self.work = work
        self.buf = buf
        self.event = event


class _In:
    """A message that arrived, kept until a receive takes it."""

    __slots__ = ("kind", "head", "pickle", "sources", "shm", "cuda", "cuda_fut", "error", "direct")

    def __init__(self, kind: int, head: Any) -> None:
        self.kind = kind
        self.head = head
        self.pickle: Any = None
        # Per CPU buffer: (nbytes, [chunk frames]) or (nbytes, offset in the segment).
        self.sources: list[tuple[int, Any]] = []
        self.shm: _ShmRef | None = None
        self.cuda: list[Any] = []
        self.cuda_fut: asyncio.Future[Any] | None = None
        self.error: BaseException | None = None
        self.direct: Any = None  # the recv_tensor buffer the payload was already written into


class _ShmRef:
    """The segment a message's bytes lie in, and where to acknowledge it (exactly once)."""

    __slots__ = ("engine", "mm", "seg_id", "address", "count", "lock")

    def __init__(self, engine: P2P, mm: Any, seg_id: int, address: str) -> None:
        self.engine = engine
        self.mm = mm
        self.seg_id = seg_id
        self.address = address
        self.count = 1  # holders; the segment goes back to the sender when it drops to 0
        self.lock = threading.Lock()

    def release(self) -> None:
        """Drop one holder (any thread; finalizers of received arrays call this)."""
        with self.lock:
            self.count -= 1
            last = self.count == 0
        if last:
            self.mm = None
            self.engine._ack_threadsafe(self.address, self.seg_id)


class _Inbox:
    """Receiver-side state for one sender."""

    __slots__ = (
        "name",
        "address",
        "reply_address",
        "arrived",
        "posted",
        "lost",
        "segs",
        "cuda",
        "inflight",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.address: str | None = None  # from the registry watch (for loss detection)
        self.reply_address: str | None = None  # the sender's endpoint, as it told us
        self.arrived: deque[_In] = deque()
        self.posted: deque[_Recv] = deque()
        self.lost: BaseException | None = None
        self.segs = _shm.SegmentMap()
        self.cuda: Any = None  # CudaPair (rank 1) once a CUDA payload came
        self.inflight: set[_In] = set()  # messages whose CUDA payload is still landing


class _Dest:
    """Sender-side state for one receiver."""

    __slots__ = (
        "name",
        "address",
        "ready",
        "resolved",
        "same_node",
        "backlog",
        "pumping",
        "lost",
        "shm_ok",
        "cma_ok",
        "pool",
        "cuda_info",
        "cuda",
        "pending",
        "outbox",
        "outbox_bytes",
        "flush_scheduled",
    )

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self.name = name
        self.address: str | None = None
        self.ready = False
        self.resolved: asyncio.Future[None] = loop.create_future()
        self.same_node = False
        self.backlog: deque[tuple[_Out, AsyncWork[None]]] = deque()
        self.pumping = False
        self.lost: BaseException | None = None
        self.shm_ok: bool | None = None  # None: not asked yet
        self.cma_ok: bool | None = None  # may the receiver read our memory? None: not asked
        self.pool: _shm.SegmentPool | None = None
        self.cuda_info: dict[str, Any] | None = None
        self.cuda: Any = None  # CudaPair (rank 0) once NCCL was needed
        self.pending: set[AsyncWork[None]] = set()  # sends out but not complete yet
        # Small messages waiting for the end of this loop iteration: (meta, frame, work).
        self.outbox: list[tuple[list[Any], Any, AsyncWork[None]]] = []
        self.outbox_bytes = 0
        self.flush_scheduled = False


class _TrackerWaiter:
    """One thread that waits for ZMQ to release zero-copy frames, then completes futures."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def add(self, trackers: list[Any]) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self.loop.create_future()
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="aiorl-p2p-track", daemon=True)
            self.thread.start()
        self.q.put((trackers, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            trackers, fut = item
            for t in trackers:
                t.wait()
            try:
                self.loop.call_soon_threadsafe(_resolve, fut, None)
            except RuntimeError:
                return  # the loop is closed: the process is going away

    def close(self) -> None:
        if self.thread is not None:
            self.q.put(None)


def _resolve(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _lost_copy(exc: BaseException | None, what: str) -> PeerLostError | LookupError:
    if isinstance(exc, LookupError):  # the peer never existed: say so, as that type
        return LookupError(f"{what}: {exc}")
    return PeerLostError(f"{what}: {exc}" if exc is not None else what)



class _EngineBase:
    """Attributes of :class:`~aiorl.actors.p2p.P2P` used by its mixins (set in its ``__init__``)."""

    runtime: Any
    loop: asyncio.AbstractEventLoop
    endpoint: Any
    name: str
    pid: int
    closed: bool
    _dests: dict[str, _Dest]
    _inboxes: dict[str, _Inbox]
    _dest_by_addr: dict[str, _Dest]
    _inbox_by_addr: dict[str, _Inbox]
    # Sends that complete when the receiver says so (CUDA IPC, CMA): token -> (future,
    # what must stay alive until then, destination).
    _acks: dict[int, tuple[asyncio.Future[None], Any, _Dest]]
    _tokens: itertools.count[int]
    _uuids: list[str] | None
    _tasks: set[asyncio.Task[Any]]
    _trackers: _TrackerWaiter
