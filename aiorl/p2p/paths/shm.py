"""Payload path: CPU bytes through a pooled shared-memory segment, on one node.

The sender copies the bytes into a segment of its pool toward that receiver *before*
the control message leaves; the control message names the segment (announcing its
fd the first time) and the offsets. The receiver maps it once and hands out tensors
that view it (``recv``) or copies out (``recv_tensor``); when the last view is gone it
gives the segment back (``p2p.ack``), so a later message never overwrites bytes still
being read. A full pool declines (the next path, frames, takes the message) rather
than growing. Set-up: one probe per pair (can the receiver open our memfds?).
"""

from __future__ import annotations

import functools
import logging
import mmap
from collections.abc import Sequence
from typing import Any

from aiorl.errors import PeerLostError, ProtocolError
from aiorl.p2p.message import InMessage, OutMessage, PostedRecv
from aiorl.p2p.paths.base import (
    Destination,
    PathHost,
    PathSpec,
    PathStatistics,
    Placed,
    RecvPathBase,
    SendPathBase,
)
from aiorl.p2p.settings import SHM_MIN
from aiorl.protocol.ops import P2POp
from aiorl.protocol.p2p import (
    SHM,
    Hello,
    HelloReply,
    NewSegment,
    PathAck,
    PathControl,
    SegmentAck,
    SegmentDrop,
    ShmDesc,
)
from aiorl.transport import shared_memory

log = logging.getLogger("aiorl.p2p")

#: The ops as plain strs (an enum member costs msgpack a slow path per message).
_ACK, _DROP = P2POp.ACK.value, P2POp.DROP.value


class ShmSend(SendPathBase):
    """The segment pool toward one same-node destination."""

    acks = _ACK

    def __init__(self, host: PathHost, dest: Destination, address: str) -> None:
        super().__init__(host, dest)
        self.address = address
        self.ok: bool | None = None  # may the receiver map our segments? None: not asked
        self.settled = False
        self.pool: shared_memory.SegmentPool | None = None
        self._probe: shared_memory.Segment | None = None

    @classmethod
    def create(cls, host: PathHost, dest: Destination) -> ShmSend | None:
        if not dest.same_node or dest.address is None:
            return None
        return cls(host, dest, dest.address)

    def wants(self, msg: OutMessage) -> bool:
        return self.ok is None and msg.nbytes >= SHM_MIN

    def ask(self, msg: OutMessage) -> dict[str, Any] | None:
        try:
            self._probe = shared_memory.probe_segment()
        except shared_memory.ShmUnavailable as exc:
            log.info("%s: no shared memory (%s); bulk data goes through ZMQ", self.host.name, exc)
            self.ok, self.settled = False, True
            return None
        return {"probe": (self._probe.fd, self._probe.size)}

    def on_hello(self, reply: HelloReply) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        self.ok, self.settled = bool(reply.shm), True
        if self.ok:
            self.pool = shared_memory.SegmentPool()
        else:
            log.info(
                "%s: %s cannot map our shared memory; bulk data goes through ZMQ",
                self.host.name,
                self.dest.name,
            )

    def fits(self, msg: OutMessage) -> bool:
        return self.pool is not None and msg.nbytes >= SHM_MIN

    def place(self, msg: OutMessage, frames: list[Any]) -> Placed | None:
        import numpy as np

        pool = self.pool
        assert pool is not None
        offsets: list[int] = []
        total = 0
        for b in msg.bufs:
            offsets.append(total)
            total = shared_memory.align(total + b.nbytes)
        try:
            seg, evicted = pool.acquire(total)
        except shared_memory.PoolFull as exc:
            # The receiver is behind (or keeps what it got): don't grow, use ZMQ this time.
            log.debug(
                "%s: shared memory toward %s is full (%s)", self.host.name, self.dest.name, exc
            )
            return None
        except shared_memory.ShmUnavailable as exc:
            log.warning(
                "%s: shared memory for %d bytes to %s unavailable (%s); using ZMQ",
                self.host.name,
                total,
                self.dest.name,
                exc,
            )
            return None
        for seg_id in evicted:
            self.host.endpoint.send_oneway(self.address, _DROP,
                                           SegmentDrop(self.host.name, seg_id).to_wire())
        if seg.arr is None:
            seg.arr = np.frombuffer(seg.mm, dtype=np.uint8)
        arr = seg.arr
        for b, off in zip(msg.bufs, offsets, strict=True):
            shared_memory.copy_into(arr[off : off + b.nbytes], b)
        new = None
        if not seg.announced:
            seg.announced = True
            new = NewSegment(self.host.pid, seg.fd, seg.size, self.host.endpoint.address)
        desc = ShmDesc(seg.seg_id, new, offsets, [b.nbytes for b in msg.bufs]).to_wire()
        # The bytes were copied: the send is complete at once.
        return Placed(desc, undo=lambda: pool.release(seg.seg_id))

    def on_ack(self, ack: PathAck) -> bool:
        if self.pool is not None and isinstance(ack, SegmentAck):
            self.pool.release(ack.seg_id)
        return True

    def lost(self, exc: PeerLostError | LookupError) -> None:
        self.close()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def statistics(self) -> PathStatistics:
        pool = self.pool
        if pool is None:
            return PathStatistics(usable=self.ok)
        return PathStatistics(self.ok, pool.busy, len(pool.segments), pool.total_bytes)


class ShmRecv(RecvPathBase):
    """One source's segments as this receiver mapped them."""

    control = _DROP

    def __init__(self, host: PathHost, source: str) -> None:
        super().__init__(host, source)
        self.segs = shared_memory.SegmentMap()
        self.reply_address: str | None = None  # the sender's endpoint, as it told us

    def answer(self, ask: Hello, reply: dict[str, Any]) -> None:
        self.reply_address = ask.addr
        if ask.probe is not None:
            fd, size = ask.probe
            reply["shm"] = shared_memory.check_probe(ask.pid, fd, size)

    def accept(
        self,
        msg: InMessage,
        desc: Sequence[Any],
        frames: Sequence[Any],
        start: int,
        posted: PostedRecv | None,
    ) -> None:
        shm = ShmDesc.from_wire(desc)
        seg_id, new, offsets, sizes = shm.seg_id, shm.new, shm.offsets, shm.sizes
        mm: mmap.mmap | None
        if new is not None:
            pid, fd, size = new.pid, new.fd, new.size
            self.reply_address = new.address
            try:
                mm = self.segs.open(seg_id, pid, fd, size)
            except shared_memory.ShmUnavailable as exc:
                self._send_ack(seg_id)
                raise ProtocolError(
                    f"cannot read the shared memory of {self.source}: {exc}"
                ) from exc
        else:
            mm = self.segs.maps.get(seg_id)
            if mm is None or self.reply_address is None:
                raise ProtocolError(
                    f"p2p message from {self.source} names unknown segment {seg_id}"
                )
        msg.lease = shared_memory.Lease(mm, functools.partial(self.give_back, seg_id))
        msg.sources = list(zip(sizes, offsets, strict=True))

    def give_back(self, seg_id: int) -> None:
        """Tell the sender segment ``seg_id`` is free (any thread; sent from the loop)."""
        host = self.host
        if host.on_loop():
            # Possibly from a finalizer in the middle of other work: send on the next turn.
            host.loop.call_soon(self._send_ack, seg_id)
        else:
            try:
                host.call_soon_threadsafe(self._send_ack, seg_id)
            except RuntimeError:
                pass  # loop closed: the process is exiting

    def _send_ack(self, seg_id: int) -> None:
        address = self.reply_address
        endpoint = self.host.endpoint
        if self.host.closed or address is None or endpoint.is_lost(address):
            return
        try:
            endpoint.send_oneway(address, _ACK, SegmentAck(self.host.name, seg_id).to_wire())
        except Exception:  # noqa: BLE001 - the sender is gone; nothing to give back
            log.debug(
                "%s: could not return segment %s to %s",
                self.host.name,
                seg_id,
                address,
                exc_info=True,
            )

    def on_control(self, message: PathControl) -> None:
        if isinstance(message, SegmentDrop):  # p2p.drop: the sender closed that segment
            self.segs.drop(message.seg_id)

    def lost(self, exc: PeerLostError | LookupError) -> None:
        self.segs.clear()

    def close(self) -> None:
        self.segs.clear()

    def statistics(self) -> PathStatistics:
        return PathStatistics(usable=True, resources=len(self.segs.maps))


PATH = PathSpec("shm", SHM, False, ShmSend.create, ShmRecv.create)
