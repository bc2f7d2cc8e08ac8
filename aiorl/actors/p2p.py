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

Layout: this module holds the engine and its public entry; the rest lives in
private modules: ``_p2p_proto`` (op names, kinds, thresholds), ``_p2p_codec``
(encoding/decoding), ``_p2p_state`` (per-peer bookkeeping), ``_p2p_send`` and
``_p2p_recv`` (the two sides), ``_p2p_cpu_paths`` and ``_p2p_cuda_paths`` (how
payload bytes travel), ``_p2p_cuda`` (NCCL/IPC primitives).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from aiorl.actors._p2p_codec import _check_buffer, _encode, _encode_tensor, _Out
from aiorl.actors._p2p_cpu_paths import _CpuPaths
from aiorl.actors._p2p_cuda_paths import _CudaPaths
from aiorl.actors._p2p_proto import (
    _RESOLVE_RETRY_S,
    OP_ACK,
    OP_BATCH,
    OP_DATA,
    OP_DONE,
    OP_DROP,
    OP_HELLO,
)
from aiorl.actors._p2p_recv import _RecvSide
from aiorl.actors._p2p_send import _SendSide
from aiorl.actors._p2p_state import _Dest, _Inbox, _Recv, _TrackerWaiter
from aiorl.runtime.work import AsyncWork
from aiorl.errors import PeerLostError, RegistryUnavailable
from aiorl.names import WorkerAddress

__all__ = ["P2P", "get_p2p"]

log = logging.getLogger("aiorl.p2p")


def _worker_name(group: str, rank: int | Sequence[int]) -> str:
    if type(rank) is int and rank >= 0 and type(group) is str and group and ":" not in group:
        return f"{group}:{rank}"
    return WorkerAddress(group, rank).get_name()


# =============================================================================== engine
class P2P(_SendSide, _RecvSide, _CpuPaths, _CudaPaths):
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

    async def _resolve(self, name: str) -> dict[str, Any] | BaseException:
        """The peer's registry info once it is ready (waits for ever), or the PeerLostError."""
        while True:
            try:
                return await self.runtime.resolve_worker(name, timeout=_RESOLVE_RETRY_S)
            except TimeoutError:
                log.info("%s: still waiting for worker %s to be ready", self.name, name)
            except RegistryUnavailable:
                await asyncio.sleep(1.0)
            except (PeerLostError, LookupError) as exc:
                return exc  # LookupError: no such group or rank; the operations fail with it

    # ------------------------------------------------------------------ failure
    def _on_peer_lost(self, address: str, exc: BaseException) -> None:
        d = self._dest_by_addr.get(address)
        if d is not None:
            self._dest_lost(d, exc)
        ib = self._inbox_by_addr.get(address)
        if ib is not None:
            self._source_lost(ib, exc)

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
