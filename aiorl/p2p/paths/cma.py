"""Payload path: the receiver pulls a ``send_tensor`` payload out of the sender's memory.

On one node, for ``send_tensor`` of at least ``CMA_MIN`` bytes: the control message
carries the tensor's address; at arrival the receiver copies the bytes with one
``process_vm_readv`` straight into the waiting ``recv_tensor`` buffer (or a private
array when none is posted yet, so the sender never waits for a receive to be posted),
then says so (``p2p.done``). The sender keeps the tensor alive and the send incomplete
until then. Set-up: one probe per pair (Yama ``ptrace_scope`` or seccomp may forbid
it); ``AIORL_P2P_CMA=0`` turns the path off.
"""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Sequence
from typing import Any

from aiorl.errors import PeerLostError, ProtocolError
from aiorl.p2p.message import InMessage, OutMessage, PostedRecv, nbytes_of
from aiorl.p2p.paths.base import (
    AckedSends,
    Destination,
    PathHost,
    PathSpec,
    PathStatistics,
    Placed,
    RecvPathBase,
    SendPathBase,
)
from aiorl.p2p.settings import CMA_ENABLED, CMA_MIN
from aiorl.protocol.ops import P2POp
from aiorl.protocol.p2p import CMA, CmaDesc, Hello, HelloReply, PathAck, TransferDone
from aiorl.transport import shared_memory
from aiorl.transport.serialization import byte_view

#: The op as a plain str (an enum member costs msgpack a slow path per message).
_DONE = P2POp.DONE.value


class CmaSend(SendPathBase):
    """Pulls by one same-node destination: the probe result and the sends it has yet to read."""

    acks = _DONE

    def __init__(self, host: PathHost, dest: Destination) -> None:
        super().__init__(host, dest)
        self.ok: bool | None = None if CMA_ENABLED else False
        self.settled = not CMA_ENABLED
        # The message whose memory is read stays alive until the receiver's ack.
        self.waiting = AckedSends(host.loop)
        self._probe: Any = None

    @classmethod
    def create(cls, host: PathHost, dest: Destination) -> CmaSend | None:
        return cls(host, dest) if dest.same_node else None

    def wants(self, msg: OutMessage) -> bool:
        return self.ok is None and msg.raw and msg.nbytes >= CMA_MIN

    def ask(self, msg: OutMessage) -> dict[str, Any] | None:
        self._probe = shared_memory.cma_probe_buffer()  # must stay alive until the reply
        return {"cma": ctypes.addressof(self._probe)}

    def on_hello(self, reply: HelloReply) -> None:
        self.ok, self.settled = bool(reply.cma), True
        self._probe = None

    def fits(self, msg: OutMessage) -> bool:
        return self.ok is True and msg.raw and msg.nbytes >= CMA_MIN

    def place(self, msg: OutMessage, frames: list[Any]) -> Placed:
        token = self.dest.next_token()
        fut, undo = self.waiting.park(token, msg)
        view: Any = msg.bufs[0].obj  # the numpy view of the tensor (see byte_view)
        addr = view.ctypes.data
        desc = CmaDesc(token, self.host.pid, addr, msg.nbytes, self.host.endpoint.address)
        return Placed(desc.to_wire(), fut, undo=undo)

    def on_ack(self, ack: PathAck) -> bool:
        return isinstance(ack, TransferDone) and self.waiting.on_ack(ack)

    def lost(self, exc: PeerLostError | LookupError) -> None:
        self.waiting.fail_all(exc, self.dest.name)

    def close(self) -> None:
        self.waiting.clear()

    def statistics(self) -> PathStatistics:
        return PathStatistics(self.ok, in_use=len(self.waiting))


class CmaRecv(RecvPathBase):
    """Pulls from one source, done at arrival (nothing outlives it)."""

    def answer(self, ask: Hello, reply: dict[str, Any]) -> None:
        if ask.cma is not None:
            reply["cma"] = shared_memory.check_cma(ask.pid, ask.cma)

    def accept(
        self,
        msg: InMessage,
        desc: Sequence[Any],
        frames: Sequence[Any],
        start: int,
        posted: PostedRecv | None,
    ) -> None:
        import numpy as np

        cma = CmaDesc.from_wire(desc)
        token, pid, addr, n, address = cma.token, cma.pid, cma.addr, cma.nbytes, cma.address
        buf = posted.buf if posted is not None else None
        if buf is not None and buf.device.type == "cpu" and nbytes_of(buf) == n:
            dst = byte_view(buf)
            msg.direct = buf
        else:
            dst = np.empty(n, dtype=np.uint8)
            msg.sources = [(n, [dst])]
        err = None
        try:
            shared_memory.cma_read(pid, addr, dst.ctypes.data, n)
        except OSError as exc:
            err = exc
        endpoint = self.host.endpoint
        if not endpoint.is_lost(address):
            try:
                done = TransferDone(self.host.name, token, repr(err) if err else None)
                endpoint.send_oneway(address, _DONE, done.to_wire())
            except PeerLostError:
                pass
        if err is not None:
            msg.direct = None
            if err.errno == errno.ESRCH:
                raise PeerLostError(
                    f"worker {self.source} exited before its tensor was read"
                ) from err
            raise ProtocolError(f"cannot read the tensor sent by {self.source}: {err}") from err


PATH = PathSpec("cma", CMA, False, CmaSend.create, CmaRecv.create)
