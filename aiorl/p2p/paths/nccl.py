"""Payload path: CUDA tensors by NCCL, one communicator per *unordered* pair.

Used for CUDA tensors between different GPUs (same node or not). Both directions of a
pair share one two-rank communicator (`NcclPair`), created lazily by both sides
at the first transfer either way; its *leader* (the name that sorts first) is rank 0 and
hosts the rendezvous ``TCPStore``, whose address travels in its messages. Every NCCL
operation of the pair is issued on the pair's `CudaWorkThread`, in the
one order `aiorl.p2p.paths.nccl_order` defines: nothing is issued before the
receiver allocated, a receiver that cannot allocate refuses that message alone, and the
leader decides the order of both directions. Handshake messages ride ``p2p.done``
(receiver -> sender: ready, go, refuse) and ``p2p.cuda`` (sender -> receiver: go).

The tensors of one message travel as one NCCL operation each, except that several small
ones (together at most `PACK_MAX` bytes) are packed into one buffer: one operation
per message for the common "a few small tensors" case. A receiver lets at most
`aiorl.cuda.byte_window.CUDA_INFLIGHT_BYTES` per sender land at once (allocations included).
Peer loss fails every pending transfer at once with ``PeerLostError`` and aborts the
communicator off the loop; docs/gpu.md describes the settings and what has run on a GPU.
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiorl.cuda.byte_window import ByteWindow
from aiorl.cuda.completion import after_work_thread, gpu_done
from aiorl.cuda.events import wait_events
from aiorl.cuda.nccl import abort_in_background, new_nccl_group
from aiorl.cuda.tensors import allocate, flat_u8
from aiorl.cuda.untyped_torch import untyped
from aiorl.cuda.work_thread import CudaWorkThread
from aiorl.errors import PeerLostError, ProtocolError
from aiorl.p2p.message import InMessage, OutMessage, PostedRecv, cuda_specs, dtype_of, nbytes_of
from aiorl.p2p.paths.base import (
    PathHost,
    PathSpec,
    PathStatistics,
    Placed,
    RecvPathBase,
    SendPathBase,
    fail,
    lost_error,
    resolve,
)
from aiorl.p2p.paths.nccl_order import Do, PairOrder, Step, is_leader
from aiorl.protocol.ops import P2POp
from aiorl.protocol.p2p import (
    K_CUDA,
    NCCL,
    NcclDesc,
    NcclGo,
    NcclReply,
    PathAck,
    PathControl,
    TransferDone,
)
from aiorl.util.cuda_device import selected_device

__all__ = ["PACK_MAX", "NcclPair", "PATH", "pack_layout"]

#: How long NCCL set-up and one operation may wait for the other side before failing.
RENDEZVOUS_TIMEOUT_S = 120.0
#: Messages whose non-empty CUDA tensors are several and together at most this many
#: bytes travel packed in one buffer (one NCCL operation instead of one per tensor).
PACK_MAX = 4 << 20
#: Offsets inside a packed buffer are multiples of this (any dtype can view them).
PACK_ALIGN = 16
#: The ops as plain strs (an enum member costs msgpack a slow path per message).
_CUDA, _DONE = P2POp.CUDA.value, P2POp.DONE.value


def pack_layout(sizes: Sequence[int]) -> tuple[list[int], int] | None:
    """Offsets of the non-empty tensors of ``sizes`` (bytes) in one packed buffer and its
    size, or None when the message travels one operation per tensor. Both sides compute it
    from the message's specs, so they agree."""
    if len(sizes) < 2 or sum(sizes) > PACK_MAX:
        return None
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // PACK_ALIGN) * PACK_ALIGN
    return offsets, end


@dataclass
class _Send:
    token: int
    tensors: list[Any]
    events: Mapping[int, Any] | None
    fut: asyncio.Future[None]


@dataclass
class _Recv:
    token: int
    msg: InMessage
    specs: list[Any]
    posted: PostedRecv | None
    nbytes: int
    fut: asyncio.Future[None]
    buffers: list[Any] = field(default_factory=list)  # what NCCL writes (flat uint8)


_PAIRS: weakref.WeakKeyDictionary[Any, dict[str, NcclPair]] = weakref.WeakKeyDictionary()


def pair_for(host: PathHost, peer: str, gid: str | None = None) -> NcclPair:
    """This process's pair with ``peer``; a ``gid`` the leader chose anew replaces it."""
    pairs = _PAIRS.setdefault(host, {})
    pair = pairs.get(peer)
    if pair is not None and gid is not None and pair.gid is not None and pair.gid != gid:
        pair.fail(ProtocolError(f"the NCCL communicator with {peer} was re-created"))
        pair = None
    if pair is None or pair.broken is not None:
        pair = pairs[peer] = NcclPair(host, peer)
    if gid is not None and pair.gid is None:
        pair.gid = gid
    return pair


class NcclPair:
    """This side of the NCCL communicator shared with one peer, both directions (loop)."""

    def __init__(self, host: PathHost, peer: str) -> None:
        self.host = host
        self.peer = peer
        self.leader = is_leader(host.name, peer)
        self.rank = 0 if self.leader else 1
        self.order = PairOrder(self.leader)
        self.window = ByteWindow()
        self.work_thread = CudaWorkThread(f"aiorl-nccl-{peer}")
        self.device = selected_device()
        self.gid: str | None = None
        self.store: Any = None
        self.store_address: list[Any] | None = None
        self.pg: Any = None
        self.peer_address: str | None = None
        self.sends: dict[int, _Send] = {}
        self.recvs: dict[int, _Recv] = {}
        self.broken: BaseException | None = None

    # ------------------------------------------------------------------ rendezvous
    def leader_store(self) -> list[Any]:
        """Leader: the rendezvous store's address (opened on first use; binds a port only)."""
        if self.store_address is None:
            dist = untyped("torch.distributed")
            import datetime

            self.gid = self.gid or f"aiorl-p2p/{self.host.name}|{self.peer}/{uuid.uuid4().hex[:8]}"
            self.store = dist.TCPStore(
                self.host.endpoint.ip,
                0,
                2,
                True,
                timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
                wait_for_workers=False,
            )
            self.store_address = [self.host.endpoint.ip, int(self.store.port)]
        return self.store_address

    def follow(self, store: Sequence[Any] | None) -> None:
        """Follower: where the leader's store listens (joined on the work thread, at first
        issue)."""
        if store is not None and self.store_address is None:
            self.store_address = [store[0], int(store[1])]

    def _group(self) -> Any:
        """Work thread: the communicator, created (non-blocking set-up) at first issue."""
        if self.pg is None:
            import datetime

            dist = untyped("torch.distributed")
            if self.store is None:
                if self.store_address is None or self.gid is None:
                    raise ProtocolError(f"no rendezvous for the NCCL pair with {self.peer}")
                host, port = self.store_address
                self.store = dist.TCPStore(
                    host, port, 2, False, timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
                )
            prefix = dist.PrefixStore(self.gid, self.store)
            pg = new_nccl_group(prefix, self.rank, 2, self.device, RENDEZVOUS_TIMEOUT_S)
            if self.broken is not None:  # failed while we were setting up: nobody else aborts it
                abort_in_background(pg, self.gid or self.peer)
                raise PeerLostError(f"the NCCL pair with {self.peer} failed: {self.broken}")
            self.pg = pg
        return self.pg

    # ------------------------------------------------------------------ sending
    def send(
        self, token: int, tensors: list[Any], events: Mapping[int, Any] | None
    ) -> asyncio.Future[None]:
        """Our control message for ``token`` left: wait for the receiver (see nccl_order)."""
        fut: asyncio.Future[None] = self.host.loop.create_future()
        if self.broken is not None:
            fail(fut, lost_error(self.broken, f"NCCL send to {self.peer}"))
            return fut
        self.order.announced(token)
        self.sends[token] = _Send(token, tensors, events, fut)
        return fut

    def on_reply(self, token: int, reply: NcclReply) -> bool:
        """The receiver's handshake for our send ``token``; False if not one of ours."""
        if token not in self.sends:
            return False
        kind = reply.kind
        if kind == "ready":
            self._run(self.order.on_ready(token), sending=True)
        elif kind == "go":
            self.gid = self.gid or reply.gid
            self.follow(reply.store)
            self._run(self.order.on_go_send(token), sending=True)
        else:  # "refuse" (`NcclReply.from_wire` refuses any other kind)
            self._run(self.order.on_refused(token, reply.reason), sending=True)
        return True

    def _issue_send(self, entry: _Send) -> tuple[list[Any], Any, list[Any]]:
        """Work thread: the NCCL sends of one message, after the caller's events."""
        import torch

        pg = self._group()
        stream = self.work_thread.stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            wait_events(stream, entry.events)
            payload = [self._on_pair_device(t) for t in entry.tensors]
            layout = pack_layout([nbytes_of(t) for t in payload])
            if layout is not None:
                offsets, size = layout
                packed = torch.empty(size, dtype=torch.uint8, device=self.device)
                for off, t in zip(offsets, payload, strict=True):
                    packed[off : off + nbytes_of(t)].copy_(flat_u8(t))
                payload = [packed]
            else:
                payload = [flat_u8(t) for t in payload]
            works = [pg.send([t], 1 - self.rank, 0) for t in payload]
            for w in works:
                w.wait()  # our stream waits for NCCL's (TORCH_NCCL_BLOCKING_WAIT=0: no CPU wait)
            done = untyped("torch.cuda").Event()
            done.record(stream)
        return works, done, [*payload, *entry.tensors]

    def _on_pair_device(self, t: Any) -> Any:
        """``t``, copied to the communicator's device if it lives on another (on the work
        thread's stream)."""
        if t.device.index == self.device:
            return t.detach()
        staged = t.detach().to(self.device, non_blocking=True)
        return staged

    # ------------------------------------------------------------------ receiving
    def receive(
        self, token: int, msg: InMessage, specs: list[Any], posted: PostedRecv | None
    ) -> asyncio.Future[None]:
        """The peer announced ``token``: allocate within the window, then handshake."""
        fut: asyncio.Future[None] = self.host.loop.create_future()
        if self.broken is not None:
            fail(fut, lost_error(self.broken, f"NCCL receive from {self.peer}"))
            return fut
        nbytes = 0
        for dtype, shape in specs:
            n = int(dtype_of(dtype).itemsize)
            for d in shape:
                n *= int(d)
            nbytes += n
        entry = _Recv(token, msg, specs, posted, nbytes, fut)
        self.recvs[token] = entry
        if self.window.offer(entry, nbytes):
            self._allocate(entry)
        return fut

    def _allocate(self, entry: _Recv) -> None:
        cf = self.work_thread.run(self._allocate_on_work_thread, entry)

        def allocated(cf: Any) -> None:  # loop
            if self.broken is not None or entry.fut.done():
                return
            exc = cf.exception() if not cf.cancelled() else PeerLostError("abandoned")
            if exc is not None:
                reason = f"{type(exc).__name__}: {exc}"
                self._finish_recv(
                    entry,
                    ProtocolError(
                        f"could not allocate {entry.nbytes} bytes of CUDA memory to receive "
                        f"from {self.peer}: {reason}"
                    ),
                )
                self._run(self.order.allocation_failed(entry.token, reason), sending=False)
                return
            self._run(self.order.allocated(entry.token), sending=False)

        cf.add_done_callback(lambda cf: self.host.call_soon_threadsafe(allocated, cf))

    def _allocate_on_work_thread(self, entry: _Recv) -> None:
        """Work thread: the message's tensors on the pair's device (or the posted buffer itself)."""
        import torch

        specs = [(dtype_of(dtype), shape) for dtype, shape in entry.specs]
        stream = self.work_thread.stream(self.device)
        posted = entry.posted
        # A receive cancelled before its transfer is issued does not get its buffer written.
        user = posted.buf if posted is not None and not posted.work.done() else None
        if (
            user is not None
            and entry.msg.kind == K_CUDA
            and len(specs) == 1
            and user.device.type == "cuda"
            and user.device.index == self.device
            and nbytes_of(user) == entry.nbytes
        ):
            assert entry.posted is not None
            with torch.cuda.device(self.device):
                wait_events(stream, entry.posted.event)  # the caller may still use it
            targets = [user]
        else:
            targets = allocate(specs, self.device, stream)
        live = [t for t in targets if t.numel()]
        layout = pack_layout([nbytes_of(t) for t in live])
        if layout is None:
            entry.buffers = [flat_u8(t) for t in live]
        else:
            offsets, size = layout
            packed = allocate([(torch.uint8, (size,))], self.device, stream)[0]
            views = iter(
                packed[off : off + nbytes_of(t)].view(t.dtype).reshape(t.shape)
                for off, t in zip(offsets, live, strict=True)
            )
            targets = [next(views) if t.numel() else t for t in targets]
            entry.buffers = [packed]
        entry.msg.cuda = targets

    def _issue_recv(self, entry: _Recv) -> tuple[list[Any], Any, list[Any]]:
        """Work thread: the NCCL receives of one message."""
        import torch

        pg = self._group()
        stream = self.work_thread.stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            works = [pg.recv([b], 1 - self.rank, 0) for b in entry.buffers]
            for w in works:
                w.wait()
            done = untyped("torch.cuda").Event()
            done.record(stream)
        return works, done, entry.buffers

    def _finish_recv(self, entry: _Recv, error: BaseException | None) -> None:
        """A receive landed or failed: settle it, give its bytes back to the window."""
        if self.recvs.pop(entry.token, None) is None:
            return
        if error is None:
            resolve(entry.fut, None)
        else:
            fail(entry.fut, error)
        for waiting in self.window.release(entry.nbytes):
            self._allocate(waiting)

    # ------------------------------------------------------------------ carrying out steps
    def _run(self, steps: list[Step], sending: bool) -> None:
        for step in steps:
            do, token = step.do, step.token
            if do is Do.ISSUE_SEND:
                self._start_send(self.sends.pop(token))
            elif do is Do.ISSUE_RECV:
                self._start_recv(self.recvs[token])
            elif do is Do.TELL_GO:
                # The store first: opening it names the pair's group (gid) on first use.
                store = self.leader_store()
                if sending:
                    go = NcclGo(self.host.name, self.gid, store, token)
                    self._tell(_CUDA, go.to_wire())
                else:
                    reply = NcclReply("go", self.gid, store)
                    self._tell(_DONE, TransferDone(self.host.name, token, reply).to_wire())
            elif do is Do.TELL_READY:
                ready = NcclReply("ready")
                self._tell(_DONE, TransferDone(self.host.name, token, ready).to_wire())
            elif do is Do.TELL_REFUSE:
                refuse = NcclReply("refuse", reason=step.reason)
                self._tell(_DONE, TransferDone(self.host.name, token, refuse).to_wire())
            elif do is Do.FAIL_SEND:
                entry = self.sends.pop(token)
                fail(
                    entry.fut, ProtocolError(f"{self.peer} refused the CUDA payload: {step.reason}")
                )

    def _tell(self, op: str, meta: list[Any]) -> None:
        if self.peer_address is None:
            raise ProtocolError(f"no address for NCCL peer {self.peer}")
        self.host.endpoint.send_oneway(self.peer_address, op, meta)

    def _start_send(self, entry: _Send) -> None:
        host, pg_of = self.host, self

        def landed(issued: tuple[list[Any], Any, list[Any]]) -> asyncio.Future[None]:
            works, done, keep = issued
            return gpu_done(host, done, works, pg_of.pg, keep)

        fut = after_work_thread(host, self.work_thread.run(self._issue_send, entry), landed)
        fut.add_done_callback(lambda f: self._transfer_done(entry.fut, f))

    def _start_recv(self, entry: _Recv) -> None:
        host, pg_of = self.host, self

        def landed(issued: tuple[list[Any], Any, list[Any]]) -> asyncio.Future[None]:
            works, done, keep = issued
            return gpu_done(host, done, works, pg_of.pg, keep)

        fut = after_work_thread(host, self.work_thread.run(self._issue_recv, entry), landed)

        def finished(f: asyncio.Future[None]) -> None:
            error = f.exception() if not f.cancelled() else PeerLostError("abandoned")
            self._finish_recv(entry, error)
            if error is not None:
                self.fail(error)

        fut.add_done_callback(finished)

    def _transfer_done(self, target: asyncio.Future[None], f: asyncio.Future[None]) -> None:
        error = f.exception() if not f.cancelled() else PeerLostError("abandoned")
        if error is None:
            resolve(target, None)
        else:
            fail(target, error)
            self.fail(error)

    # ------------------------------------------------------------------ loss
    def fail(self, exc: BaseException) -> None:
        """The pair cannot go on (peer lost, engine closed, an NCCL error): fail everything
        pending at once, abort the communicator off the loop; the next transfer either way
        starts a new communicator."""
        if self.broken is not None:
            return
        self.broken = exc
        keep: list[Any] = []
        for s in self.sends.values():
            keep.extend(s.tensors)
            fail(s.fut, lost_error(exc, f"NCCL send to {self.peer} did not complete"))
        for r in self.recvs.values():
            keep.extend(r.buffers)
            fail(r.fut, lost_error(exc, f"NCCL receive from {self.peer} did not complete"))
        self.sends.clear()
        self.recvs.clear()
        self.window.clear()
        self.order.clear()
        self.work_thread.close()
        abort_in_background(self.pg, self.gid or self.peer, keep)
        self.pg = None
        self.store = None
        pairs = _PAIRS.get(self.host)
        if pairs is not None and pairs.get(self.peer) is self:
            del pairs[self.peer]

    def statistics(self) -> PathStatistics:
        return PathStatistics(
            usable=self.broken is None,
            in_use=len(self.sends) + len(self.recvs),
            resources=int(self.pg is not None),
            resource_bytes=self.window.in_flight,
        )


class _PairHalf:
    """What both halves toward one peer share: its `NcclPair` (both directions), whose
    loss, close and statistics are theirs."""

    host: PathHost

    @property
    @abstractmethod
    def peer(self) -> str:
        """The worker at the other end."""

    def _existing_pair(self) -> NcclPair | None:
        return _PAIRS.get(self.host, {}).get(self.peer)

    def lost(self, exc: PeerLostError | LookupError) -> None:
        pair = self._existing_pair()
        if pair is not None:
            pair.fail(exc)

    def close(self) -> None:
        self.lost(PeerLostError("the p2p engine is closed"))

    def statistics(self) -> PathStatistics:
        pair = self._existing_pair()
        return PathStatistics(usable=True) if pair is None else pair.statistics()


class NcclSend(_PairHalf, SendPathBase):
    """The sending half toward one destination: the pair's sends and their handshakes."""

    acks = _DONE

    @property
    def peer(self) -> str:
        return self.dest.name

    def _pair(self) -> NcclPair:
        pair = pair_for(self.host, self.peer)
        pair.peer_address = self.dest.address
        return pair

    def place(self, msg: OutMessage, frames: list[Any]) -> Placed:
        specs, live = cuda_specs(msg)
        pair = self._pair()
        token = self.dest.next_token()
        store = pair.leader_store() if pair.leader else None
        desc = NcclDesc(pair.gid, store, specs, token, self.host.endpoint.address)
        events = msg.event

        def issue() -> asyncio.Future[None]:
            return pair.send(token, live, events)

        return Placed(desc.to_wire(), after_send=issue)

    def on_ack(self, ack: PathAck) -> bool:
        if not isinstance(ack, TransferDone) or not isinstance(ack.reply, NcclReply):
            return False
        pair = self._existing_pair()
        return pair is not None and pair.on_reply(ack.token, ack.reply)


class NcclRecv(_PairHalf, RecvPathBase):
    """The receiving half from one source: allocation, window, handshakes."""

    control = _CUDA

    @property
    def peer(self) -> str:
        return self.source

    def accept(
        self,
        msg: InMessage,
        desc: Sequence[Any],
        frames: Sequence[Any],
        start: int,
        posted: PostedRecv | None,
    ) -> None:
        nccl = NcclDesc.from_wire(desc)
        gid, store, specs, token, address = (
            nccl.gid, nccl.store, nccl.specs, nccl.token, nccl.address)
        pair = pair_for(self.host, self.source, gid)
        pair.peer_address = address
        pair.follow(store)
        msg.cuda_fut = pair.receive(token, msg, list(specs), posted)

    def on_control(self, message: PathControl) -> None:
        if not isinstance(message, NcclGo):
            return  # another path's p2p.cuda message
        gid, store, token = message.gid, message.store, message.token
        pair = pair_for(self.host, self.source, gid)
        pair.follow(store)
        pair._run(pair.order.on_go_recv(token), sending=False)


PATH = PathSpec("nccl", NCCL, True, NcclSend.create, NcclRecv.create)
