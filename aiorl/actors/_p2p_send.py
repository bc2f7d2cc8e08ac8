"""Sender side of the p2p engine: destinations, the ordered backlog, batching, emitting.

Mixed into :class:`~aiorl.actors.p2p.P2P`. A send becomes one control message on
the sender's single connection to the receiver, in call order (``docs/ordering.md``);
where its payload goes is decided by :mod:`._p2p_cpu_paths` / :mod:`._p2p_cuda_paths`.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable
from typing import Any

from aiorl.actors._p2p_codec import _Out
from aiorl.actors._p2p_proto import (
    _CMA_ENABLED,
    _FRAMES,
    _TRACK_MIN,
    BATCH_MAX_BYTES,
    BATCH_MAX_MSGS,
    CMA_MIN,
    K_CPU,
    K_OBJ,
    OP_BATCH,
    OP_DATA,
    OP_HELLO,
    SHM_MIN,
)
from aiorl.actors._p2p_state import _Dest, _EngineBase, _fail, _lost_copy, _resolve
from aiorl.runtime.work import AsyncWork
from aiorl.errors import PeerLostError, ProtocolError
from aiorl.transport import _shm

log = logging.getLogger("aiorl.p2p")


class _SendSide(_EngineBase):
    """Sender-side methods of :class:`~aiorl.actors.p2p.P2P` (loop thread only)."""

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

