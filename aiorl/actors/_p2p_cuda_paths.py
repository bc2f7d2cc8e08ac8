"""CUDA payload paths of the p2p engine, both ends: NCCL pairs and CUDA IPC.

Mixed into :class:`~aiorl.actors.p2p.P2P`; the low-level pieces (pair threads,
NCCL groups, IPC handles) are in :mod:`aiorl.actors._p2p_cuda`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from aiorl.actors._p2p_codec import _dtype, _dtype_name, _flat_u8, _nbytes, _Out, _spec_nbytes
from aiorl.actors._p2p_proto import _IPC, _NCCL, _NOTHING, K_CUDA, OP_DONE
from aiorl.actors._p2p_state import _Dest, _EngineBase, _fail, _In, _Inbox, _Recv, _resolve
from aiorl.runtime.work import AsyncCollWork
from aiorl.errors import PeerLostError, ProtocolError


class _CudaPaths(_EngineBase):
    """NCCL / CUDA IPC transfer methods of :class:`~aiorl.actors.p2p.P2P`."""

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

    # ------------------------------------------------------------------ receiver side
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

