"""CPU payload paths of the p2p engine, both ends: CMA, shared memory, ZMQ frames.

Mixed into :class:`~aiorl.actors.p2p.P2P`. The sender places bytes
(``_place_*``) before the control message leaves; the receiver reads them back
(``_pull_cma``, ``_view``, ``_copy_into``, ``_user_buffers``) and gives
shared-memory segments back (``p2p.ack``). ``_on_hello`` answers the one-time
same-node set-up probe.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import weakref
from typing import Any

from aiorl.actors._p2p_codec import _byte_view, _nbytes, _Out
from aiorl.actors._p2p_proto import _CMA, _FRAMES, _SHM, _TRACK_MIN, CHUNK, OP_ACK, OP_DONE, OP_DROP
from aiorl.actors._p2p_state import _Dest, _EngineBase, _In, _Inbox, _Recv
from aiorl.errors import PeerLostError, ProtocolError
from aiorl.transport import _shm

log = logging.getLogger("aiorl.p2p")


class _CpuPaths(_EngineBase):
    """Shared-memory / CMA / ZMQ-frame transfer methods of :class:`~aiorl.actors.p2p.P2P`."""

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

    # ------------------------------------------------------------------ receiver side
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

