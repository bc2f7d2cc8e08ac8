"""Worker-to-worker point-to-point messages: ``send``/``recv`` and ``send_tensor``/``recv_tensor``.

One :class:`P2P` engine per process runtime (:func:`get_p2p`). Control goes
worker to worker over the runtime's ZMQ :class:`~aiorl.transport.endpoint.Endpoint`
(never through the registry); payloads take the fastest path that fits:

==========================  =================================================================
payload                     path
==========================  =================================================================
small object / tensor       inline: pickle (or raw tensor bytes) as one frame; small messages
                            sent to one peer in the same loop iteration are batched into one
                            ZMQ message (one dispatch per batch on each side)
``send_tensor`` >= 1 MiB,   the receiver pulls the bytes out of the sender's tensor with one
peer on the same node       ``process_vm_readv`` copy, straight into the waiting
                            ``recv_tensor`` buffer; the send completes when it says so
other CPU bytes             a pooled shared-memory segment (:mod:`aiorl.transport._shm`):
>= ``SHM_MIN``, same node   the sender copies in, the control message names the segment and
                            offsets; ``recv`` hands out tensors that *view* the segment (no
                            copy; the segment returns to the sender's pool when they are
                            garbage-collected), ``recv_tensor`` copies straight into the
                            caller's buffer and returns the segment at once
CPU bytes, other node       ~1 MiB zero-copy frames of the control message (one huge frame
(or none of the above)      costs page faults in libzmq, see ``shared/PERF-NOTES.md``); the
                            send completes when ZMQ has released them
CUDA, different GPUs        NCCL, one lazily created group per *ordered* pair
CUDA, same physical GPU     CUDA IPC handles in the control message
==========================  =================================================================

Ordering (see ``docs/ordering.md``): every message of a (sender, receiver) pair
is announced by one control message on the sender's single DEALER connection to
the receiver, in call order, whatever its kind or path, and after its payload
has been placed (shared memory written) or queued behind it on the same
connection (frames) or on the pair's single NCCL issuing thread (CUDA). The
receiver matches control messages to posted receives first-in first-out per
sender, buffering whichever side comes first.

Threads: every public method may be called from the event loop (no thread
hop) or from another thread such as a worker's method thread. Validation and
pickling happen at call time on the caller's thread, so errors (non-contiguous
tensors, unpicklable objects) are raised synchronously; the rest runs on the loop.
"""

from __future__ import annotations

import asyncio
import copyreg
import ctypes
import errno
import io
import itertools
import logging
import os
import pickle
import queue
import sys
import threading
import uuid
import weakref
from collections import ChainMap, deque
from collections.abc import Callable, Sequence
from typing import Any

from aiorl.actors.async_work import AsyncCollWork, AsyncWork
from aiorl.errors import PeerLostError, ProtocolError, RegistryUnavailable
from aiorl.names import WorkerAddress
from aiorl.transport import _shm
from aiorl.transport.serialization import SerializationError

__all__ = ["P2P", "get_p2p"]

log = logging.getLogger("aiorl.p2p")

OP_DATA = "p2p.data"  # sender -> receiver, one-way: one message (control + inline payload)
OP_BATCH = "p2p.batch"  # sender -> receiver, one-way: several small messages, in order
OP_ACK = "p2p.ack"  # receiver -> sender, one-way: a shared segment is free again
OP_DROP = "p2p.drop"  # sender -> receiver, one-way: forget a segment (the sender closed it)
OP_HELLO = "p2p.hello"  # sender -> receiver, request: can you map my segments? your GPUs?
OP_DONE = "p2p.done"  # receiver -> sender, one-way: a CUDA IPC copy finished (or failed)

#: Pickled buffers smaller than this stay inside the pickle stream (one copy beats one frame).
INBAND_MAX = 64 * 1024
#: Messages whose out-of-band CPU bytes reach this go through shared memory on one node.
SHM_MIN = 256 * 1024
#: ``send_tensor`` payloads from this size are pulled by the receiver with one copy (CMA).
#: ``AIORL_P2P_CMA=0`` turns that path off (shared memory is used instead).
CMA_MIN = 1 << 20
_CMA_ENABLED = os.environ.get("AIORL_P2P_CMA", "1") != "0"
#: Bulk bytes travel as frames of at most this size when they go through ZMQ.
CHUNK = 1 << 20
#: Small messages sent in the same loop iteration travel together, up to this many ...
BATCH_MAX_MSGS = 256
#: ... or this many bytes (each message is one frame smaller than ``_TRACK_MIN``).
BATCH_MAX_BYTES = 256 * 1024
#: pyzmq copies frames smaller than this anyway, so only larger ones need a tracker.
_TRACK_MIN = 64 * 1024
#: How long one registry lookup of a peer waits before it is retried (it waits for ever).
_RESOLVE_RETRY_S = 30.0

K_OBJ, K_CPU, K_CUDA = 0, 1, 2  # message kinds: pickled object, one CPU tensor, one CUDA tensor
_FRAMES, _SHM, _CMA = 0, 1, 2  # where CPU bytes travel
_NCCL, _IPC, _NOTHING = 0, 1, 2  # how CUDA tensors travel (_NOTHING: all are empty)


# =============================================================================== encoding
class _Out:
    """An outgoing message, encoded on the caller's thread."""

    __slots__ = ("kind", "head", "pickle", "bufs", "nbytes", "cuda", "event", "raw")

    def __init__(
        self, kind: int, head: Any, pickle_frame: Any, bufs: list[memoryview], cuda: list[Any]
    ) -> None:
        self.kind = kind
        self.head = head  # K_CPU/K_CUDA: [dtype, shape, requires_grad]
        self.pickle = pickle_frame
        self.bufs = bufs  # raw CPU bytes that travel out of band (shared memory or frames)
        self.nbytes = sum(b.nbytes for b in bufs) if bufs else 0
        self.cuda = cuda  # CUDA tensors, in placeholder order
        self.event: Any = None  # CUDA event recorded on the caller's stream at call time
        self.raw = False  # from send_tensor: the receiver most likely fills its own buffer


_tls = threading.local()  # .enc_cuda while pickling, .dec_cuda while unpickling
_DTYPES: dict[str, Any] = {}


def _dtype_name(dtype: Any) -> str:
    return str(dtype)[6:]  # "torch.float32" -> "float32"


def _dtype(name: str) -> Any:
    dt = _DTYPES.get(name)
    if dt is None:
        import torch

        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            raise ProtocolError(f"unknown tensor dtype {name!r} in a p2p message")
        _DTYPES[name] = dt
    return dt


def _not_contiguous(t: Any) -> ValueError:
    return ValueError(
        f"cannot send a non-contiguous tensor (shape {tuple(t.shape)}, "
        f"stride {tuple(t.stride())}); "
        "call .contiguous() first"
    )


class _NotContiguous(ValueError):
    """Raised from inside pickling so that the cloudpickle fallback does not swallow it."""


def _byte_view(t: Any) -> Any:
    """The bytes of a contiguous CPU tensor as a flat uint8 numpy array (no copy)."""
    import torch

    flat = t.detach() if t.requires_grad else t
    if flat.is_conj() or flat.is_neg():  # lazy conjugate/negative views: materialize
        flat = flat.resolve_conj().resolve_neg()
    if flat.dim() != 1:
        flat = flat.view(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


def _reduce_tensor(t: Any) -> Any:
    """Pickle reducer for tensors inside objects (see :func:`_encode`)."""
    import torch

    if t.layout != torch.strided or t.is_quantized or t.device.type not in ("cpu", "cuda"):
        return t.__reduce_ex__(5)  # torch's own format; rare kinds
    if not t.is_contiguous():
        raise _NotContiguous(str(_not_contiguous(t)))
    if t.device.type == "cuda":
        cuda = _tls.enc_cuda
        cuda.append(t)
        return _cuda_placeholder, (len(cuda) - 1,)
    param = isinstance(t, torch.nn.Parameter)
    return _rebuild_cpu, (
        t.dtype,
        tuple(t.shape),
        t.requires_grad,
        pickle.PickleBuffer(_byte_view(t)),
        param,
    )


def _rebuild_cpu(
    dtype: Any, shape: Sequence[int], requires_grad: bool, data: Any, param: bool = False
) -> Any:
    """Receiver side of :func:`_reduce_tensor`: a tensor over ``data`` (no copy when writable)."""
    import numpy as np
    import torch

    if isinstance(data, np.ndarray) and data.flags.writeable:
        t = torch.from_numpy(data)
    else:
        mv = memoryview(data)
        if mv.readonly:
            mv = memoryview(bytearray(mv))  # torch tensors must be writable
        t = (
            torch.frombuffer(mv, dtype=torch.uint8)
            if mv.nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
    if dtype != torch.uint8:
        t = t.view(dtype)
    t = t.reshape(shape)
    if param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _cuda_placeholder(index: int) -> Any:
    """Receiver side of a CUDA tensor inside an object: the tensor being received into."""
    return _tls.dec_cuda[index]


_PICKLERS: tuple[type, type] | None = None


def _picklers() -> tuple[type, type]:
    """Pickler classes whose dispatch table knows tensors (the C pickler reads it at init)."""
    global _PICKLERS
    if _PICKLERS is None:
        import cloudpickle

        table: dict[Any, Any] = dict(copyreg.dispatch_table)
        torch = sys.modules.get("torch")
        if torch is not None:
            table[torch.Tensor] = _reduce_tensor
            table[torch.nn.Parameter] = _reduce_tensor

        class Fast(pickle.Pickler):
            dispatch_table = table

        class Cloud(cloudpickle.CloudPickler):
            dispatch_table = ChainMap(table, cloudpickle.CloudPickler.dispatch_table)

        _PICKLERS = (Fast, Cloud)
    return _PICKLERS


class _Encoder:
    """A pickler kept per thread: building one costs more than pickling a small object."""

    __slots__ = ("stream", "pickler", "bufs", "busy")

    def __init__(self, pickler_cls: type) -> None:
        self.stream = io.BytesIO()
        self.bufs: list[memoryview] = []
        self.busy = False
        self.pickler = pickler_cls(self.stream, 5, buffer_callback=self._out_of_band)

    def _out_of_band(self, pb: pickle.PickleBuffer) -> bool:
        raw = pb.raw()
        if raw.nbytes < INBAND_MAX:
            return True  # serialize in band
        self.bufs.append(raw)
        return False

    def dump(self, obj: Any) -> tuple[bytes, list[memoryview]]:
        """The pickle of ``obj`` and its out-of-band buffers; the pickler is reset either way."""
        self.bufs = []
        try:
            self.pickler.dump(obj)
            return self.stream.getvalue(), self.bufs
        finally:
            self.pickler.clear_memo()
            self.stream.seek(0)
            self.stream.truncate()


def _encode(obj: Any) -> _Out:
    """Encode ``obj`` for :meth:`P2P.send` on the caller's thread; raises on bad input."""
    torch = sys.modules.get("torch")
    if torch is not None and type(obj) is torch.Tensor and obj.layout == torch.strided:
        return _encode_tensor(obj)
    fast, cloud = _picklers()
    enc: _Encoder | None = getattr(_tls, "encoder", None)
    if enc is None or enc.busy:  # first use on this thread, or re-entered from a __reduce__
        enc = _Encoder(fast)
        if getattr(_tls, "encoder", None) is None:
            _tls.encoder = enc
    cuda: list[Any] = []
    _tls.enc_cuda = cuda
    enc.busy = True
    try:
        try:
            data, bufs = enc.dump(obj)
        except _NotContiguous as exc:
            raise ValueError(str(exc)) from None
        except Exception:
            # Lambdas, local classes, closures: cloudpickle can do what pickle cannot.
            _tls.encoder = None  # a failed dump may leave the pickler in any state
            cuda.clear()
            try:
                data, bufs = _Encoder(cloud).dump(obj)
            except _NotContiguous as exc:
                raise ValueError(str(exc)) from None
            except Exception as exc:
                raise SerializationError(
                    f"cannot send object of type {type(obj).__qualname__}: it cannot be pickled "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
    finally:
        enc.busy = False
        _tls.enc_cuda = None
    out = _Out(K_OBJ, None, data, bufs, cuda)
    if cuda:
        from aiorl.actors._p2p_cuda import record_event

        out.event = record_event()
    return out


def _encode_tensor(t: Any) -> _Out:
    """One tensor, no pickle: dtype and shape in the header, its bytes as the payload."""
    if not t.is_contiguous():
        raise _not_contiguous(t)
    head = [_dtype_name(t.dtype), list(t.shape), bool(t.requires_grad)]
    if t.device.type == "cuda":
        from aiorl.actors._p2p_cuda import record_event

        out = _Out(K_CUDA, head, None, [], [t])
        out.event = record_event()
        return out
    if t.device.type != "cpu":
        raise TypeError(f"cannot send a tensor on device {t.device} (only CPU and CUDA)")
    return _Out(K_CPU, head, None, [memoryview(_byte_view(t))], [])


def _check_buffer(buf: Any) -> None:
    import torch

    if not isinstance(buf, torch.Tensor):
        raise TypeError(
            f"recv_tensor needs a preallocated torch.Tensor, got {type(buf).__qualname__}"
        )
    if buf.layout != torch.strided or not buf.is_contiguous():
        raise ValueError("recv_tensor needs a contiguous (strided) buffer tensor")
    if buf.is_conj() or buf.is_neg():
        raise ValueError("recv_tensor needs a plain buffer (resolve its conj/neg bit first)")
    if buf.device.type not in ("cpu", "cuda"):
        raise TypeError(f"recv_tensor buffer on unsupported device {buf.device}")


def _worker_name(group: str, rank: int | Sequence[int]) -> str:
    if type(rank) is int and rank >= 0 and type(group) is str and group and ":" not in group:
        return f"{group}:{rank}"
    return WorkerAddress(group, rank).get_name()


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _spec_nbytes(spec: Sequence[Any]) -> int:
    dtype, shape = spec
    n = _dtype(dtype).itemsize
    for d in shape:
        n *= d
    return n


def _flat_u8(t: Any) -> Any:
    """A contiguous tensor's bytes as a flat uint8 tensor (NCCL then only has to match bytes)."""
    import torch

    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


# =============================================================================== state
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


def _lost_copy(exc: BaseException | None, what: str) -> PeerLostError:
    return PeerLostError(f"{what}: {exc}" if exc is not None else what)


# =============================================================================== engine
class P2P:
    """The point-to-point engine of one process. Obtain it with :func:`get_p2p`."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.loop: asyncio.AbstractEventLoop = runtime.loop
        self.endpoint = runtime.endpoint
        self.name: str = runtime.name
        self.pid = os.getpid()
        self._node_id: str | None = None
        self._dests: dict[str, _Dest] = {}
        self._inboxes: dict[str, _Inbox] = {}
        self._dest_by_addr: dict[str, _Dest] = {}
        self._inbox_by_addr: dict[str, _Inbox] = {}
        # Sends that complete when the receiver says so (CUDA IPC, CMA): token -> (future,
        # what must stay alive until then, destination).
        self._acks: dict[int, tuple[asyncio.Future[None], Any, _Dest]] = {}
        self._tokens = itertools.count(1)
        self._uuids: list[str] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._trackers = _TrackerWaiter(self.loop)
        self.closed = False
        ep = self.endpoint
        ep.handle(OP_DATA, self._on_data)
        ep.handle(OP_BATCH, self._on_batch)
        ep.handle(OP_ACK, self._on_ack)
        ep.handle(OP_DROP, self._on_drop)
        ep.handle(OP_HELLO, self._on_hello)
        ep.handle(OP_DONE, self._on_done)
        ep.on_peer_lost(self._on_peer_lost)

    # ------------------------------------------------------------------ public API
    def send(self, obj: Any, dst_group_name: str, dst_rank: int | Sequence[int]) -> AsyncWork[None]:
        """Send ``obj`` to worker ``dst_group_name:dst_rank``; done when ``obj`` may be reused.

        Raises at once :class:`ValueError` for a non-contiguous tensor and
        :class:`~aiorl.transport.serialization.SerializationError` (a TypeError)
        for an object that cannot be pickled.
        """
        name = _worker_name(dst_group_name, dst_rank)
        out = _encode(obj)
        return self._start_send(name, out)

    def send_tensor(
        self, tensor: Any, dst_group_name: str, dst_rank: int | Sequence[int]
    ) -> AsyncWork[None]:
        """Send one contiguous tensor into the receiver's preallocated buffer (``recv_tensor``)."""
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(
                f"send_tensor needs a dense torch.Tensor, got {type(tensor).__qualname__}"
            )
        name = _worker_name(dst_group_name, dst_rank)
        out = _encode_tensor(tensor)
        out.raw = True
        return self._start_send(name, out)

    def recv(self, src_group_name: str, src_rank: int | Sequence[int]) -> AsyncWork[Any]:
        """Receive the next message from ``src_group_name:src_rank`` (whatever was sent)."""
        return self._start_recv(_worker_name(src_group_name, src_rank), None)

    def recv_tensor(
        self, buf: Any, src_group_name: str, src_rank: int | Sequence[int]
    ) -> AsyncWork[Any]:
        """Fill ``buf`` with the next message from the source; the work's result is ``buf``.

        The message must carry as many bytes as ``buf`` holds (a ``send_tensor``
        of a tensor of the same size, or a ``send`` of one); its bytes are taken
        as ``buf``'s dtype and shape.
        """
        _check_buffer(buf)
        return self._start_recv(_worker_name(src_group_name, src_rank), buf)

    # ------------------------------------------------------------------ threads
    def _on_loop(self) -> bool:
        return asyncio._get_running_loop() is self.loop

    def _start_send(self, name: str, out: _Out) -> AsyncWork[None]:
        work: AsyncWork[None] = AsyncWork(self.loop)
        if self._on_loop():
            self._submit(name, out, work)
        else:
            self.loop.call_soon_threadsafe(self._submit, name, out, work)
        return work

    def _start_recv(self, name: str, buf: Any) -> AsyncWork[Any]:
        event = None
        if buf is not None and buf.device.type == "cuda":
            from aiorl.actors._p2p_cuda import record_event

            event = record_event()  # the caller's stream may still use the buffer
        work: AsyncWork[Any] = AsyncWork(self.loop)
        r = _Recv(work, buf, event)
        if self._on_loop():
            self._post(name, r)
        else:
            self.loop.call_soon_threadsafe(self._post, name, r)
        return work

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def node_id(self) -> str | None:
        if self._node_id is None:
            from aiorl.actors import worker as worker_mod

            ctx = worker_mod._context
            if ctx is not None and ctx.runtime is self.runtime:
                self._node_id = ctx.info.node_id or None
        return self._node_id

    # ================================================================== sender side
    def _submit(self, name: str, out: _Out, work: AsyncWork[None]) -> None:
        d = self._dests.get(name)
        if d is None:
            d = self._new_dest(name)
        if d.lost is not None:
            work._set_exception(_lost_copy(d.lost, f"cannot send to {name}"))
            return
        if d.ready and not d.backlog and not self._needs_hello(d, out):
            self._emit(d, out, work)
            return
        d.backlog.append((out, work))
        if not d.pumping:
            d.pumping = True
            self._spawn(self._pump(d))

    def _new_dest(self, name: str) -> _Dest:
        d = _Dest(name, self.loop)
        self._dests[name] = d
        self._spawn(self._resolve_dest(d))
        return d

    async def _resolve_dest(self, d: _Dest) -> None:
        info = await self._resolve(d.name)
        if isinstance(info, BaseException):
            self._dest_lost(d, info)
            return
        d.address = info["endpoint"]
        peer_node = info.get("node_id") or None
        d.same_node = peer_node is not None and peer_node == self.node_id
        self._dest_by_addr[d.address] = d
        if self.endpoint.is_lost(d.address):
            self._dest_lost(d, PeerLostError(f"worker {d.name} is gone"))
            return
        d.ready = True
        _resolve(d.resolved, None)

    async def _resolve(self, name: str) -> dict[str, Any] | BaseException:
        """The peer's registry info once it is ready (waits for ever), or the PeerLostError."""
        while True:
            try:
                return await self.runtime.resolve_worker(name, timeout=_RESOLVE_RETRY_S)
            except TimeoutError:
                log.info("%s: still waiting for worker %s to be ready", self.name, name)
            except RegistryUnavailable:
                await asyncio.sleep(1.0)
            except PeerLostError as exc:
                return exc

    def _needs_hello(self, d: _Dest, out: _Out) -> bool:
        if not d.same_node:
            return False
        if out.raw and out.nbytes >= CMA_MIN and d.cma_ok is None:
            return True
        if out.nbytes >= SHM_MIN and d.shm_ok is None:
            return True
        return bool(out.cuda) and d.cuda_info is None

    async def _pump(self, d: _Dest) -> None:
        """Send the backlog in order once the destination is known and set up."""
        try:
            if not d.ready:
                await d.resolved
            while d.backlog:
                out, work = d.backlog[0]
                if work.done():  # cancelled before it left: withdraw it
                    d.backlog.popleft()
                    continue
                if self._needs_hello(d, out):
                    await self._hello(d, out)
                    continue  # re-check: the loss of the peer may have emptied the backlog
                d.backlog.popleft()
                self._emit(d, out, work)
        except PeerLostError as exc:
            self._dest_lost(d, exc)
        except Exception as exc:  # noqa: BLE001 - a bug here must fail the sends, not hang them
            log.exception("%s: sending to %s failed", self.name, d.name)
            while d.backlog:
                d.backlog.popleft()[1]._set_exception(exc)
        finally:
            d.pumping = False

    async def _hello(self, d: _Dest, out: _Out) -> None:
        """Ask a same-node receiver whether it can map our segments and which GPU it uses."""
        want_shm = d.shm_ok is None and out.nbytes >= SHM_MIN
        want_cma = d.cma_ok is None and out.raw and out.nbytes >= CMA_MIN
        if want_cma and not _CMA_ENABLED:
            d.cma_ok = want_cma = False
        want_cuda = bool(out.cuda) and d.cuda_info is None
        meta: dict[str, Any] = {"src": self.name, "addr": self.endpoint.address, "pid": self.pid}
        probe = None
        if want_shm:
            try:
                probe = _shm.probe_segment()
                meta["probe"] = [probe.fd, probe.size]
            except _shm.ShmUnavailable as exc:
                log.info("%s: no shared memory (%s); bulk data goes through ZMQ", self.name, exc)
                d.shm_ok = False
                want_shm = False
        cma_probe = None
        if want_cma:
            cma_probe = _shm.cma_probe_buffer()  # must stay alive until the reply
            meta["cma"] = ctypes.addressof(cma_probe)
        if want_cuda:
            meta["cuda"] = True
        reply: dict[str, Any] = {}
        try:
            assert d.address is not None
            reply, _ = await self.endpoint.request(d.address, OP_HELLO, meta, timeout=30.0)
        except PeerLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - degrade to the paths that need no set-up
            log.warning(
                "%s: p2p set-up with %s failed (%s); using ZMQ/NCCL", self.name, d.name, exc
            )
        finally:
            if probe is not None:
                probe.close()
        if want_shm:
            d.shm_ok = bool(reply.get("shm"))
            if d.shm_ok:
                d.pool = _shm.SegmentPool()
            else:
                log.info(
                    "%s: %s cannot map our shared memory; bulk data goes through ZMQ",
                    self.name,
                    d.name,
                )
        if want_cma:
            d.cma_ok = bool(reply.get("cma"))
            del cma_probe
        if want_cuda:
            d.cuda_info = reply.get("cuda") or {"current": -1, "uuids": []}

    def _emit(self, d: _Dest, out: _Out, work: AsyncWork[None]) -> None:
        """Place the payload, then send the control message (loop thread, in order).

        Small messages (one frame under 64 KiB, nothing else) are queued and sent
        together at the end of the loop iteration (or when the batch is full): one
        ZMQ message and one dispatch on each side for many sends. Anything else
        first flushes that queue, so the order is the call order either way.
        """
        if not out.cuda:
            if out.kind == K_OBJ and not out.bufs and len(out.pickle) < _TRACK_MIN:
                self._enqueue(d, [K_OBJ, None, None], out.pickle, work)
                return
            if out.kind == K_CPU and out.nbytes < _TRACK_MIN:
                desc = [_FRAMES, [out.nbytes], [1]]
                self._enqueue(d, [K_CPU, out.head, desc], out.bufs[0], work)
                return
        if d.outbox:
            self._flush(d)
        frames: list[Any] = []
        if out.kind == K_OBJ:
            frames.append(out.pickle)
        bufdesc: Any = None
        seg: _shm.Segment | None = None
        trackers: list[Any] = []
        cudadesc: Any = None
        after_cuda: Callable[[], asyncio.Future[None]] | None = None
        cma_wait: asyncio.Future[None] | None = None
        try:
            if out.bufs:
                if out.raw and d.cma_ok and out.nbytes >= CMA_MIN:
                    bufdesc, cma_wait = self._place_cma(d, out)
                elif d.shm_ok and out.nbytes >= SHM_MIN:
                    seg, bufdesc = self._place_shm(d, out)
                if bufdesc is None:
                    bufdesc = self._place_frames(out.bufs, frames, trackers)
            if out.cuda:
                cudadesc, after_cuda = self._cuda_prepare(d, out, frames)
            assert d.address is not None
            self.endpoint.send_oneway(
                d.address, OP_DATA, [self.name, out.kind, out.head, bufdesc, cudadesc], frames
            )
        except BaseException as exc:  # noqa: BLE001 - nothing went out: the send fails, not hangs
            if seg is not None and d.pool is not None:
                d.pool.release(seg.seg_id)
            for token in [t for t, entry in self._acks.items() if entry[0] is cma_wait]:
                del self._acks[token]
            if not isinstance(exc, PeerLostError):
                log.exception("%s: sending to %s failed", self.name, d.name)
            work._set_exception(exc)
            if isinstance(exc, PeerLostError):
                self._dest_lost(d, exc)
            return
        waits: list[asyncio.Future[None]] = []
        if cma_wait is not None:
            waits.append(cma_wait)
        if trackers:
            waits.append(self._trackers.add(trackers))
        if after_cuda is not None:
            waits.append(after_cuda())
        if not waits:
            work._set_result(None)
            return
        d.pending.add(work)
        remaining = [len(waits)]

        def one_done(f: asyncio.Future[None]) -> None:
            if work.done():
                return
            if f.cancelled() or f.exception() is not None:
                d.pending.discard(work)
                work._set_exception(
                    f.exception()
                    if not f.cancelled()
                    else ProtocolError("a p2p transfer was cancelled")
                )  # type: ignore[arg-type]
                return
            remaining[0] -= 1
            if remaining[0] == 0:
                d.pending.discard(work)
                work._set_result(None)

        for f in waits:
            f.add_done_callback(one_done)

    def _enqueue(self, d: _Dest, meta: list[Any], frame: Any, work: AsyncWork[None]) -> None:
        d.outbox.append((meta, frame, work))
        d.outbox_bytes += len(frame) if isinstance(frame, bytes) else frame.nbytes
        if len(d.outbox) >= BATCH_MAX_MSGS or d.outbox_bytes >= BATCH_MAX_BYTES:
            self._flush(d)
        elif not d.flush_scheduled:
            d.flush_scheduled = True
            self.loop.call_soon(self._flush, d)

    def _flush(self, d: _Dest) -> None:
        """Send the queued small messages as one ZMQ message; complete their sends."""
        d.flush_scheduled = False
        batch, d.outbox, d.outbox_bytes = d.outbox, [], 0
        if not batch:
            return
        try:
            assert d.address is not None
            if len(batch) == 1:
                meta, frame, _w = batch[0]
                self.endpoint.send_oneway(d.address, OP_DATA, [self.name, *meta, None], [frame])
            else:
                self.endpoint.send_oneway(
                    d.address,
                    OP_BATCH,
                    [self.name, [m for m, _f, _w in batch]],
                    [f for _m, f, _w in batch],
                )
        except BaseException as exc:  # noqa: BLE001 - the sends fail, they do not hang
            for _m, _f, w in batch:
                w._set_exception(exc)
            if isinstance(exc, PeerLostError):
                self._dest_lost(d, exc)
            else:
                log.exception("%s: sending to %s failed", self.name, d.name)
            return
        for _m, _f, w in batch:
            w._set_result(None)

    def _place_cma(self, d: _Dest, out: _Out) -> tuple[Any, asyncio.Future[None]]:
        """Let the receiver pull the tensor's bytes straight from our memory (one copy).

        The send completes when the receiver says it has read them; until then the
        tensor is kept alive here (and must not be modified by the caller).
        """
        token = next(self._tokens)
        fut: asyncio.Future[None] = self.loop.create_future()
        self._acks[token] = (fut, out, d)
        addr = out.bufs[0].obj.ctypes.data  # the numpy view of the tensor (see _byte_view)
        return [_CMA, token, self.pid, addr, out.nbytes, self.endpoint.address], fut

    def _place_shm(self, d: _Dest, out: _Out) -> tuple[_shm.Segment | None, Any]:
        import numpy as np

        assert d.pool is not None
        offsets: list[int] = []
        total = 0
        for b in out.bufs:
            offsets.append(total)
            total = _shm.align(total + b.nbytes)
        try:
            seg, evicted = d.pool.acquire(total)
        except _shm.PoolFull as exc:
            # The receiver is behind (or keeps what it got): don't grow, use ZMQ this time.
            log.debug("%s: shared memory toward %s is full (%s); using ZMQ", self.name, d.name, exc)
            return None, None
        except _shm.ShmUnavailable as exc:
            log.warning(
                "%s: shared memory for %d bytes to %s unavailable (%s); using ZMQ",
                self.name,
                total,
                d.name,
                exc,
            )
            return None, None
        for seg_id in evicted:
            assert d.address is not None
            self.endpoint.send_oneway(d.address, OP_DROP, [self.name, seg_id])
        if seg.arr is None:
            seg.arr = np.frombuffer(seg.mm, dtype=np.uint8)
        arr = seg.arr
        for b, off in zip(out.bufs, offsets, strict=True):
            _shm.copy_into(arr[off : off + b.nbytes], b)
        new = None
        if not seg.announced:
            seg.announced = True
            new = [self.pid, seg.fd, seg.size, self.endpoint.address]
        return seg, [_SHM, seg.seg_id, new, offsets, [b.nbytes for b in out.bufs]]

    @staticmethod
    def _place_frames(bufs: list[memoryview], frames: list[Any], trackers: list[Any]) -> Any:
        import zmq

        sizes, counts = [], []
        for b in bufs:
            n = b.nbytes
            count = 0
            for off in range(0, max(n, 1), CHUNK):
                piece = b[off : off + CHUNK]
                if piece.nbytes >= _TRACK_MIN:
                    # Zero-copy: the send is complete only when ZMQ lets go of the memory.
                    frame = zmq.Frame(piece, track=True)
                    trackers.append(frame.tracker)
                    frames.append(frame)
                else:
                    frames.append(piece)  # pyzmq copies small frames at send time
                count += 1
            sizes.append(n)
            counts.append(count)
        return [_FRAMES, sizes, counts]

    # ------------------------------------------------------------------ sender: CUDA
    def _cuda_prepare(
        self, d: _Dest, out: _Out, frames: list[Any]
    ) -> tuple[Any, Callable[[], Any] | None]:
        from aiorl.actors import _p2p_cuda as pc

        specs = [[_dtype_name(t.dtype), list(t.shape)] for t in out.cuda]
        # Empty tensors need no transfer (and NCCL/IPC handle zero bytes badly): both
        # sides skip them, so the transfers still pair up one to one.
        live = [t for t in out.cuda if t.numel()]
        if not live:
            return [_NOTHING, specs], None
        info = d.cuda_info or {}
        uuids, cur = info.get("uuids") or [], info.get("current", -1)
        peer_uuid = uuids[cur] if d.same_node and 0 <= cur < len(uuids) else None
        if peer_uuid is not None and all(pc.device_uuid(t.device.index) == peer_uuid for t in live):
            return self._ipc_prepare(d, out, live, frames, specs)
        pair = d.cuda
        store = None
        if pair is None:
            gid = f"aiorl-p2p/{self.name}->{d.name}/{uuid.uuid4().hex[:8]}"
            pair = pc.CudaPair(gid, 0, live[0].device.index)
            host = self.endpoint.address.rsplit(":", 1)[0].replace("tcp://", "")
            store = list(pair.open_master_store(host))
            d.cuda = pair
        desc = [_NCCL, pair.gid, store, specs]

        def after() -> asyncio.Future[None]:
            return self._coll_future(
                pair.submit([_flat_u8(t) for t in live], out.event, send=True), None
            )

        return desc, after

    def _ipc_prepare(
        self, d: _Dest, out: _Out, live: list[Any], frames: list[Any], specs: list[Any]
    ) -> tuple[Any, Any]:
        import torch

        from aiorl.actors import _p2p_cuda as pc

        if out.event is not None:
            # The IPC handle's event is recorded on this thread's stream: order it after
            # the caller's stream.
            torch.cuda.current_stream(live[0].device).wait_event(out.event)
        frames.append(pc.ipc_reduce(live))
        token = next(self._tokens)
        fut: asyncio.Future[None] = self.loop.create_future()
        self._acks[token] = (fut, live, d)  # keeps the tensors alive until the copy
        desc = [_IPC, token, self.endpoint.address, specs, pc.device_uuid(live[0].device.index)]
        return desc, lambda: fut

    def _coll_future(self, cf: Any, result: Any) -> asyncio.Future[Any]:
        """An asyncio future for NCCL work issued on a pair thread (done when the GPU is)."""
        fut: asyncio.Future[Any] = self.loop.create_future()

        def issued(cf: Any) -> None:  # pair thread
            try:
                self.loop.call_soon_threadsafe(on_issued, cf)
            except RuntimeError:
                pass

        def on_issued(cf: Any) -> None:  # loop
            if cf.cancelled():
                _fail(
                    fut,
                    PeerLostError("the CUDA transfer was abandoned (peer lost or engine closed)"),
                )
                return
            exc = cf.exception()
            if exc is not None:
                _fail(fut, exc)
                return
            works, done = cf.result()
            # The works already made the pair's side stream wait, and ``done`` was recorded
            # after that; waiting on the works again here would make this helper thread's
            # (default) stream wait for NCCL too. ``works`` stay referenced until done.
            coll: AsyncCollWork[Any] = AsyncCollWork(
                self.loop, (), result, [done], on_done=lambda: (works, result)[1]
            )
            coll._fut.add_done_callback(
                lambda f: (
                    _fail(fut, f.exception())
                    if f.exception() is not None  # type: ignore[arg-type]
                    else _resolve(fut, f.result())
                )
            )

        cf.add_done_callback(issued)
        return fut

    def _on_done(self, msg: Any) -> None:
        """A receiver finished (or failed) reading a payload it pulled: CUDA IPC or CMA."""
        _, token, err = msg.meta
        entry = self._acks.pop(token, None)
        if entry is None:
            return
        fut, keep, _d = entry
        if err:
            _fail(fut, ProtocolError(f"the receiver could not read the payload: {err}"))
        else:
            _resolve(fut, None)
        if isinstance(keep, list):  # CUDA tensors: free blocks whose remote user let go
            try:
                import torch

                torch.cuda.ipc_collect()
            except Exception:  # noqa: BLE001 - best effort
                pass

    # ------------------------------------------------------------------ sender: acks
    def _on_ack(self, msg: Any) -> None:
        name, seg_id = msg.meta
        d = self._dests.get(name)
        if d is not None and d.pool is not None:
            d.pool.release(seg_id)

    def _dest_lost(self, d: _Dest, exc: BaseException) -> None:
        if d.lost is None:
            d.lost = exc
        _fail(d.resolved, _lost_copy(exc, f"worker {d.name} is gone"))
        d.resolved.exception()  # retrieved: nobody else may await it
        while d.backlog:
            d.backlog.popleft()[1]._set_exception(_lost_copy(exc, f"cannot send to {d.name}"))
        batch, d.outbox = d.outbox, []
        for _m, _f, w in batch:
            w._set_exception(_lost_copy(exc, f"cannot send to {d.name}"))
        for work in list(d.pending):
            work._set_exception(_lost_copy(exc, f"send to {d.name} did not complete"))
        d.pending.clear()
        for token, (fut, _t, owner) in list(self._acks.items()):
            if owner is d:
                del self._acks[token]
                _fail(fut, _lost_copy(exc, f"send to {d.name} did not complete"))
        if d.pool is not None:
            d.pool.close()
        if d.cuda is not None:
            d.cuda.close()
            d.cuda = None

    # ================================================================== receiver side
    def _inbox(self, name: str) -> _Inbox:
        ib = self._inboxes.get(name)
        if ib is None:
            ib = _Inbox(name)
            self._inboxes[name] = ib
            self._spawn(self._watch_source(ib))
        return ib

    async def _watch_source(self, ib: _Inbox) -> None:
        """Resolve the sender through the registry so that its death fails our receives."""
        info = await self._resolve(ib.name)
        if isinstance(info, BaseException):
            self._source_lost(ib, info)
            return
        ib.address = info["endpoint"]
        self._inbox_by_addr[ib.address] = ib
        if self.endpoint.is_lost(ib.address):
            self._source_lost(ib, PeerLostError(f"worker {ib.name} is gone"))

    def _post(self, name: str, r: _Recv) -> None:
        if r.work.done():
            return  # cancelled before it was posted
        ib = self._inbox(name)
        if ib.arrived:
            self._deliver(r, ib.arrived.popleft())
        elif ib.lost is not None:
            r.work._set_exception(_lost_copy(ib.lost, f"cannot receive from {name}"))
        else:
            ib.posted.append(r)

    def _next_posted(self, ib: _Inbox) -> _Recv | None:
        while ib.posted and ib.posted[0].work.done():
            ib.posted.popleft()  # cancelled: it no longer takes a message
        return ib.posted[0] if ib.posted else None

    def _on_data(self, msg: Any) -> None:
        m = msg.meta
        self._handle(m[0], m[1], m[2], m[3], m[4], msg.frames)

    def _on_batch(self, msg: Any) -> None:
        src, metas = msg.meta
        frames = msg.frames
        if len(frames) != len(metas):
            log.error("%s: dropped a malformed batch from %s", self.name, src)
            return
        handle = self._handle
        for (kind, head, bufdesc), frame in zip(metas, frames, strict=True):
            handle(src, kind, head, bufdesc, None, [frame])

    def _handle(
        self, src: str, kind: int, head: Any, bufdesc: Any, cudadesc: Any, frames: list[Any]
    ) -> None:
        """One arrived message: hand it to the oldest waiting receive, or keep it."""
        ib = self._inboxes.get(src) or self._inbox(src)
        r = self._next_posted(ib)
        if (
            r is not None
            and r.buf is None
            and kind == K_OBJ
            and bufdesc is None
            and cudadesc is None
        ):
            # Fast path: a small object for a waiting recv().
            ib.posted.popleft()
            try:
                value = pickle.loads(frames[0])
            except Exception as exc:  # noqa: BLE001 - e.g. a class missing here
                r.work._set_exception(exc)
                return
            r.work._set_result(value)
            return
        inc = _In(kind, head)
        try:
            self._parse(ib, inc, bufdesc, cudadesc, frames, r)
        except Exception as exc:  # noqa: BLE001 - a broken message fails its receive, not the loop
            if not isinstance(exc, (ProtocolError, PeerLostError)):
                exc = ProtocolError(f"malformed or undeliverable p2p message from {src}: {exc!r}")
            inc.error = exc
        if r is not None:
            ib.posted.popleft()
            self._deliver(r, inc)
        else:
            ib.arrived.append(inc)

    def _parse(
        self,
        ib: _Inbox,
        inc: _In,
        bufdesc: Any,
        cudadesc: Any,
        frames: list[Any],
        r: _Recv | None,
    ) -> None:
        i = 0
        if inc.kind == K_OBJ:
            inc.pickle = frames[0]
            i = 1
        if bufdesc is not None:
            if bufdesc[0] == _CMA:
                self._pull_cma(ib, inc, bufdesc, r)
            elif bufdesc[0] == _FRAMES:
                for n, count in zip(bufdesc[1], bufdesc[2], strict=True):
                    chunks = frames[i : i + count]
                    if len(chunks) != count or sum(len(c) for c in chunks) != n:
                        raise ProtocolError(f"p2p message from {ib.name} lost payload frames")
                    inc.sources.append((n, chunks))
                    i += count
            else:
                _, seg_id, new, offsets, sizes = bufdesc
                if new is not None:
                    pid, fd, size, address = new
                    ib.reply_address = address
                    try:
                        mm = ib.segs.open(seg_id, pid, fd, size)
                    except _shm.ShmUnavailable as exc:
                        self._send_ack(address, seg_id)
                        raise ProtocolError(
                            f"cannot read the shared memory of {ib.name}: {exc}"
                        ) from exc
                else:
                    mm = ib.segs.maps.get(seg_id)
                    if mm is None or ib.reply_address is None:
                        raise ProtocolError(
                            f"p2p message from {ib.name} names unknown segment {seg_id}"
                        )
                inc.shm = _ShmRef(self, mm, seg_id, ib.reply_address)
                inc.sources = list(zip(sizes, offsets, strict=True))
        if cudadesc is not None:
            self._cuda_receive(ib, inc, cudadesc, frames, r)

    # ------------------------------------------------------------------ receiver: CPU bytes
    def _pull_cma(self, ib: _Inbox, inc: _In, desc: list[Any], r: _Recv | None) -> None:
        """Read a ``send_tensor`` payload out of the sender's memory, now, and tell it.

        Straight into the waiting ``recv_tensor`` buffer when there is one, else
        into a private array (so the sender never waits for us to post a receive).
        """
        import numpy as np

        _, token, pid, addr, n, address = desc
        buf = r.buf if r is not None else None
        if buf is not None and buf.device.type == "cpu" and _nbytes(buf) == n:
            dst = _byte_view(buf)
            inc.direct = buf
        else:
            dst = np.empty(n, dtype=np.uint8)
            inc.sources = [(n, [dst])]
        err = None
        try:
            _shm.cma_read(pid, addr, dst.ctypes.data, n)
        except OSError as exc:
            err = exc
        if not self.endpoint.is_lost(address):
            try:
                self.endpoint.send_oneway(
                    address, OP_DONE, [self.name, token, repr(err) if err else None]
                )
            except PeerLostError:
                pass
        if err is not None:
            inc.direct = None
            if err.errno == errno.ESRCH:
                raise PeerLostError(f"worker {ib.name} exited before its tensor was read") from err
            raise ProtocolError(f"cannot read the tensor sent by {ib.name}: {err}") from err

    def _view(self, inc: _In, k: int) -> Any:
        """Buffer ``k`` as a flat uint8 numpy array to read from (no copy where possible)."""
        import numpy as np

        n, where = inc.sources[k]
        if inc.shm is not None:
            return np.frombuffer(inc.shm.mm, dtype=np.uint8, count=n, offset=where)
        if len(where) == 1:
            return np.frombuffer(where[0], dtype=np.uint8)
        out = np.empty(n, dtype=np.uint8)
        self._copy_chunks(where, out)
        return out

    @staticmethod
    def _copy_chunks(chunks: list[Any], dst: Any) -> None:
        import numpy as np

        off = 0
        for c in chunks:
            m = len(c)
            np.copyto(dst[off : off + m], np.frombuffer(c, dtype=np.uint8))
            off += m

    def _copy_into(self, inc: _In, k: int, dst: Any) -> None:
        """Copy buffer ``k`` into the flat uint8 numpy array ``dst`` (one copy)."""
        n, where = inc.sources[k]
        if inc.shm is None:
            self._copy_chunks(where, dst)
        else:
            _shm.copy_into(dst, self._view(inc, k))

    def _user_buffers(self, inc: _In) -> list[Any]:
        """Writable buffers for the user's objects; shared-memory ones are leased (no copy)."""
        import numpy as np

        out: list[Any] = []
        ref = inc.shm
        if ref is None:
            for n, chunks in inc.sources:
                if len(chunks) == 1 and isinstance(chunks[0], np.ndarray):
                    out.append(chunks[0])  # already private and writable (pulled by CMA)
                elif len(chunks) == 1:
                    out.append(bytearray(chunks[0]))
                else:
                    arr = np.empty(n, dtype=np.uint8)
                    self._copy_chunks(chunks, arr)
                    out.append(arr)
            return out
        inc.shm = None  # the arrays own the segment from here on
        for k, (n, offset) in enumerate(inc.sources):
            arr = np.frombuffer(ref.mm, dtype=np.uint8, count=n, offset=offset)
            if k:
                with ref.lock:
                    ref.count += 1
            f = weakref.finalize(arr, ref.release)
            f.atexit = False
            out.append(arr)
        if not inc.sources:
            ref.release()
        return out

    def _release(self, inc: _In) -> None:
        if inc.shm is not None:
            ref, inc.shm = inc.shm, None
            ref.release()

    def _ack_threadsafe(self, address: str, seg_id: int) -> None:
        if self._on_loop():
            self.loop.call_soon(self._send_ack, address, seg_id)
        else:
            try:
                self.loop.call_soon_threadsafe(self._send_ack, address, seg_id)
            except RuntimeError:
                pass  # loop closed: the process is exiting

    def _send_ack(self, address: str, seg_id: int) -> None:
        if self.closed or self.endpoint.is_lost(address):
            return
        try:
            self.endpoint.send_oneway(address, OP_ACK, [self.name, seg_id])
        except Exception:  # noqa: BLE001 - the sender is gone; nothing to give back
            log.debug(
                "%s: could not return segment %s to %s", self.name, seg_id, address, exc_info=True
            )

    def _on_drop(self, msg: Any) -> None:
        src, seg_id = msg.meta
        ib = self._inboxes.get(src)
        if ib is not None:
            ib.segs.drop(seg_id)

    def _on_hello(self, msg: Any) -> None:
        meta = msg.meta
        ib = self._inbox(meta["src"])
        ib.reply_address = meta["addr"]
        reply: dict[str, Any] = {}
        if "probe" in meta:
            fd, size = meta["probe"]
            reply["shm"] = _shm.check_probe(int(meta["pid"]), int(fd), int(size))
        if "cma" in meta:
            reply["cma"] = _shm.check_cma(int(meta["pid"]), int(meta["cma"]))
        if meta.get("cuda"):
            from aiorl.actors import _p2p_cuda as pc

            reply["cuda"] = pc.local_cuda_info()
        msg.reply(reply)

    # ------------------------------------------------------------------ receiver: delivery
    def _deliver(self, r: _Recv, inc: _In) -> None:
        if inc.error is not None:
            self._release(inc)
            r.work._set_exception(inc.error)
            return
        try:
            if r.buf is None:
                self._deliver_object(r, inc)
            else:
                self._deliver_into(r, inc)
        except BaseException as exc:  # noqa: BLE001 - the receive fails, the loop goes on
            self._release(inc)
            r.work._set_exception(exc)

    def _decode(self, inc: _In) -> Any:
        """The received value (its CUDA tensors may still be filling: see ``cuda_fut``)."""
        if inc.kind == K_CPU:
            dtype, shape, rg = inc.head
            return _rebuild_cpu(_dtype(dtype), shape, rg, self._user_buffers(inc)[0])
        if inc.kind == K_CUDA:
            value = inc.cuda[0]
            if inc.head[2]:
                value.requires_grad_(True)
            return value
        bufs = self._user_buffers(inc)
        _tls.dec_cuda = inc.cuda
        try:
            return pickle.loads(inc.pickle, buffers=bufs)
        finally:
            _tls.dec_cuda = None

    def _deliver_object(self, r: _Recv, inc: _In) -> None:
        value = self._decode(inc)
        self._complete_after_cuda(r.work, inc, lambda: value)

    def _deliver_into(self, r: _Recv, inc: _In) -> None:
        buf = r.buf
        if inc.direct is buf:
            r.work._set_result(buf)
            return
        if inc.kind == K_CPU:
            n = inc.sources[0][0]
            if n != _nbytes(buf):
                raise ValueError(
                    f"recv_tensor buffer holds {_nbytes(buf)} bytes but the message carries {n}"
                )
            if buf.device.type == "cpu":
                self._copy_into(inc, 0, _byte_view(buf))
            else:
                import torch

                from aiorl.actors._p2p_cuda import reinterpret

                src = torch.from_numpy(self._view(inc, 0))
                buf.copy_(reinterpret(src, buf))  # synchronous host-to-device copy
            self._release(inc)
            r.work._set_result(buf)
            return
        if inc.kind == K_CUDA:
            src = inc.cuda[0]
            if src is buf:
                self._complete_after_cuda(r.work, inc, lambda: buf)
                return
            if _nbytes(src) != _nbytes(buf):
                raise ValueError(
                    f"recv_tensor buffer holds {_nbytes(buf)} bytes but the message "
                    f"carries {_nbytes(src)}"
                )
            self._complete_after_cuda(r.work, inc, lambda: self._copy_tensor(buf, src))
            return
        # A message sent with send(): fine when it holds exactly one tensor of the right size.
        import torch

        value = self._decode(inc)

        def finish() -> Any:
            if not isinstance(value, torch.Tensor) or _nbytes(value) != _nbytes(buf):
                raise TypeError(
                    f"recv_tensor got a message holding {type(value).__qualname__}, "
                    f"not a tensor of {_nbytes(buf)} bytes"
                )
            return self._copy_tensor(buf, value.detach().contiguous())

        self._complete_after_cuda(r.work, inc, finish)

    @staticmethod
    def _copy_tensor(buf: Any, src: Any) -> Any:
        from aiorl.actors._p2p_cuda import reinterpret

        buf.copy_(reinterpret(src, buf))
        if buf.device.type == "cuda" or src.device.type == "cuda":
            import torch

            torch.cuda.current_stream(
                buf.device if buf.device.type == "cuda" else src.device
            ).synchronize()
        return buf

    def _complete_after_cuda(self, work: Any, inc: _In, value: Callable[[], Any]) -> None:
        """Complete ``work`` with ``value()`` once the message's CUDA payload (if any) landed."""
        fut = inc.cuda_fut

        def finish(f: asyncio.Future[Any] | None) -> None:
            if f is not None and (f.cancelled() or f.exception() is not None):
                work._set_exception(
                    f.exception()
                    if not f.cancelled()  # type: ignore[arg-type]
                    else PeerLostError("the CUDA transfer was abandoned")
                )
                return
            try:
                work._set_result(value())
            except BaseException as exc:  # noqa: BLE001
                work._set_exception(exc)

        if fut is None:
            finish(None)
        elif fut.done():
            finish(fut)
        else:
            fut.add_done_callback(finish)

    # ------------------------------------------------------------------ receiver: CUDA
    def _cuda_receive(
        self, ib: _Inbox, inc: _In, desc: list[Any], frames: list[Any], r: _Recv | None
    ) -> None:
        """Start receiving a message's CUDA tensors now, in arrival order (NCCL matches by order).

        A ``recv_tensor`` already waiting with a CUDA buffer of the right size
        receives in place; otherwise fresh tensors are allocated on this
        thread's current device.
        """
        import torch

        from aiorl.actors import _p2p_cuda as pc

        specs = desc[-1]
        user = r.buf if r is not None and inc.kind == K_CUDA else None
        if user is not None and (
            user.device.type != "cuda" or _nbytes(user) != _spec_nbytes(specs[0])
        ):
            user = None  # copied at delivery instead (or rejected there)
        if user is not None:
            dev = user.device.index
            targets = [user]
            wait_event = r.event if r is not None else None
        else:
            dev = torch.cuda.current_device()
            targets = [
                torch.empty(shape, dtype=_dtype(dtype), device=dev) for dtype, shape in specs
            ]
            # Allocated on this thread's stream; the pair's side stream writes after it.
            wait_event = pc.record_event()
        inc.cuda = targets
        live = [t for t in targets if t.numel()]  # the sender skipped empty ones too
        if desc[0] == _NOTHING:
            return
        if ib.cuda is None:
            ib.cuda = pc.CudaPair("", 1, dev)
        pair = ib.cuda
        if desc[0] == _NCCL:
            _, gid, store, _specs = desc
            if store is not None:
                pair.gid = gid
                pair.set_store_address(store[0], int(store[1]))
            cf = pair.submit([_flat_u8(t) for t in live], wait_event, send=False)
            inc.cuda_fut = self._coll_future(cf, None)
            self._track_inflight(ib, inc)
            return
        _, token, address, _specs, peer_uuid = desc
        ipc_dev = self._local_device_of(peer_uuid)
        cf = pair.ipc_copy(frames[-1], live, wait_event, ipc_dev)
        fut: asyncio.Future[Any] = self.loop.create_future()
        inc.cuda_fut = fut
        self._track_inflight(ib, inc)

        def copied(cf: Any) -> None:  # pair thread
            try:
                self.loop.call_soon_threadsafe(on_copied, cf)
            except RuntimeError:
                pass

        def on_copied(cf: Any) -> None:  # loop
            err = None
            if cf.cancelled():
                err = "cancelled"
            elif cf.exception() is not None:
                err = repr(cf.exception())
            if not self.endpoint.is_lost(address):
                try:
                    self.endpoint.send_oneway(address, OP_DONE, [self.name, token, err])
                except PeerLostError:
                    pass
            if err is None:
                _resolve(fut, None)
            else:
                _fail(fut, ProtocolError(f"CUDA IPC receive from {ib.name} failed: {err}"))

        cf.add_done_callback(copied)

    @staticmethod
    def _track_inflight(ib: _Inbox, inc: _In) -> None:
        """Remember a CUDA payload in flight so that the sender's loss fails it."""
        assert inc.cuda_fut is not None
        ib.inflight.add(inc)
        inc.cuda_fut.add_done_callback(lambda _f: ib.inflight.discard(inc))

    def _local_device_of(self, uuid_: str) -> int:
        """Our index of the GPU with ``uuid_`` (the sender chose IPC: it is one of ours)."""
        from aiorl.actors import _p2p_cuda as pc

        if self._uuids is None:
            self._uuids = pc.local_cuda_info()["uuids"]
        try:
            return self._uuids.index(uuid_)
        except ValueError:
            raise ProtocolError(f"CUDA IPC from a GPU this worker cannot see ({uuid_})") from None

    # ------------------------------------------------------------------ failure
    def _on_peer_lost(self, address: str, exc: BaseException) -> None:
        d = self._dest_by_addr.get(address)
        if d is not None:
            self._dest_lost(d, exc)
        ib = self._inbox_by_addr.get(address)
        if ib is not None:
            self._source_lost(ib, exc)

    def _source_lost(self, ib: _Inbox, exc: BaseException) -> None:
        """Fail what waits on a dead sender. Messages that fully arrived stay receivable."""
        if ib.lost is None:
            ib.lost = exc
        while ib.posted:
            ib.posted.popleft().work._set_exception(
                _lost_copy(exc, f"cannot receive from {ib.name}")
            )
        for inc in [*ib.arrived, *ib.inflight]:
            if inc.cuda_fut is not None and not inc.cuda_fut.done():
                _fail(inc.cuda_fut, _lost_copy(exc, f"CUDA payload from {ib.name} lost"))
        if ib.cuda is not None:
            ib.cuda.close()
            ib.cuda = None
        ib.segs.clear()

    def stats(self) -> dict[str, Any]:
        """Counters for tests and debugging: per destination and per source."""
        dests = {}
        for name, d in self._dests.items():
            pool = d.pool
            dests[name] = {
                "same_node": d.same_node,
                "shm": d.shm_ok,
                "cma": d.cma_ok,
                "segments": len(pool.segments) if pool is not None else 0,
                "shm_bytes": pool.total_bytes if pool is not None else 0,
                "busy": pool.busy if pool is not None else 0,
                "backlog": len(d.backlog),
                "pending": len(d.pending),
                "lost": d.lost is not None,
            }
        sources = {
            name: {
                "arrived": len(ib.arrived),
                "posted": len(ib.posted),
                "mapped": len(ib.segs.maps),
                "lost": ib.lost is not None,
            }
            for name, ib in self._inboxes.items()
        }
        return {"dests": dests, "sources": sources}

    def close(self) -> None:
        """Release shared memory and CUDA resources (the process is shutting down)."""
        if self.closed:
            return
        self.closed = True
        for d in self._dests.values():
            if d.pool is not None:
                d.pool.close()
            if d.cuda is not None:
                d.cuda.close()
        for ib in self._inboxes.values():
            if ib.cuda is not None:
                ib.cuda.close()
            ib.segs.clear()
        for task in list(self._tasks):
            task.cancel()
        self._trackers.close()


_engines: weakref.WeakKeyDictionary[Any, P2P] = weakref.WeakKeyDictionary()
_engines_lock = threading.Lock()


def get_p2p(runtime: Any) -> P2P:
    """The point-to-point engine of ``runtime``, created (and its handlers registered) once.

    Worker processes create it when they start, so a worker that never calls a
    p2p method still accepts messages sent to it.
    """
    eng = _engines.get(runtime)
    if eng is None:
        with _engines_lock:
            eng = _engines.get(runtime)
            if eng is None:
                eng = P2P(runtime)
                _engines[runtime] = eng
    return eng
