"""Receiver side of the p2p engine: inboxes, matching, parsing, delivery.

Mixed into :class:`~aiorl.actors.p2p.P2P`. Arrived control messages and posted
receives are matched first-in first-out per sender (``docs/ordering.md``).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Callable
from typing import Any

from aiorl.actors._p2p_codec import _byte_view, _dtype, _nbytes, _rebuild_cpu, _tls
from aiorl.actors._p2p_proto import _CMA, _FRAMES, K_CPU, K_CUDA, K_OBJ
from aiorl.actors._p2p_state import _EngineBase, _fail, _In, _Inbox, _lost_copy, _Recv, _ShmRef
from aiorl.errors import PeerLostError, ProtocolError
from aiorl.transport import _shm

log = logging.getLogger("aiorl.p2p")


class _RecvSide(_EngineBase):
    """Receiver-side methods of :class:`~aiorl.actors.p2p.P2P` (loop thread only)."""

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

    # ------------------------------------------------------------------ failure
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

