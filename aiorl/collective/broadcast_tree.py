"""Sending a broadcast down its relay tree (`aiorl.collective.broadcast_plan.relay_tree`).

The source sends the members of its node one small message each, its buffers written once
into a shared segment they all map (frames when shared memory is unavailable), and each
other node one message with the buffers as frames, to the node's relay (its lowest-ranked
member). A relay writes the frames it received once into a segment of its own and passes the
message on to the other members of its node with that segment's descriptor. CUDA tensors
take ``aiorl.collective.nccl_broadcast``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiorl.collective.broadcast_plan import BroadcastPlan, relay_tree
from aiorl.collective.members import MemberWatch
from aiorl.collective.nccl_broadcast import CudaBroadcast
from aiorl.collective.payload import SharedSegments, chunks
from aiorl.p2p.message import InMessage, OutMessage
from aiorl.p2p.settings import SHM_MIN
from aiorl.protocol.broadcast import BroadcastData, Buffers, FramedBuffers
from aiorl.protocol.ops import BroadcastOp
from aiorl.protocol.p2p import K_OBJ
from aiorl.transport.endpoint import Endpoint

__all__ = ["TreeSender"]


class TreeSender:
    """What this process sends down relay trees: as a source, and as its node's relay."""

    def __init__(self, endpoint: Endpoint, name: str, node_id: str | None, members: MemberWatch,
                 segments: SharedSegments, cuda: CudaBroadcast) -> None:
        self.endpoint = endpoint
        self.name = name
        self.address = endpoint.address
        self.node_id = node_id
        self.members = members
        self.segments = segments
        self.cuda = cuda
        self.relayed = 0  # broadcasts this process passed on to the other members of its node
        self.frame_bytes = 0  # payload bytes sent as ZMQ frames, summed over destinations

    async def send(self, set_id: str, seq: int, plan: BroadcastPlan, out: OutMessage,
                   infos: dict[str, dict[str, Any]]) -> None:
        """Source: send broadcast ``seq`` of ``set_id`` (the encoded ``out``) to every other
        member (``infos``: their registry info)."""
        others = list(infos)
        node_of = {n: infos[n].get("node_id") or None for n in others}
        node_of[self.name] = self.node_id
        tree = relay_tree(plan.src, plan.members, node_of)
        cudadesc = await self.cuda.plan(plan, out, infos) if out.cuda else None
        pickle_frames = [out.pickle] if out.kind == K_OBJ else []

        def data(buffers: Buffers | None, children: Sequence[str] = ()) -> list[Any]:
            return BroadcastData(set_id, seq, self.name, self.address, out.kind, out.head,
                                 buffers, cudadesc, tuple(children)).to_wire()

        framed: tuple[FramedBuffers, list[Any]] | None = None
        if tree.local:
            shm = None
            if out.bufs and out.nbytes >= SHM_MIN:
                shm = self.segments.write([[b] for b in out.bufs], tree.local)
            if shm is not None:
                self._send_all(tree.local, infos, data(shm), pickle_frames)
            else:
                framed = chunks(out.bufs) if out.bufs else None
                self._send_all(tree.local, infos, data(framed[0] if framed else None),
                               pickle_frames + (framed[1] if framed else []))
                self.frame_bytes += out.nbytes * len(tree.local)
        for relay, children in tree.relays.items():
            if framed is None and out.bufs:
                framed = chunks(out.bufs)
            self._send_all([relay], infos, data(framed[0] if framed else None, children),
                           pickle_frames + (framed[1] if framed else []))
            self.frame_bytes += out.nbytes
        if cudadesc is not None:
            self.cuda.send(set_id, seq, out, cudadesc)

    async def pass_on(self, data: BroadcastData, inc: InMessage, frames: list[Any],
                      pickle_frames: list[Any]) -> None:
        """Relay: pass broadcast ``data`` on to ``data.children``, the other members of this
        node. Its bytes, which arrived as frames, are written once into a segment of ours
        that they (and we) map."""
        children = data.children
        infos = await self.members.resolve_all(children)
        self.relayed += 1
        buffers, payload = data.buffers, frames[len(pickle_frames):]
        total = sum(n for n, _ in inc.sources)
        if total >= SHM_MIN:
            shm = self.segments.write([pieces for _, pieces in inc.sources],
                                      [*children, self.name])
            if shm is not None:
                buffers, payload = shm, []
                inc.sources = []
                self.segments.map(inc, shm)  # read our own copy, as the others do
        if payload:
            self.frame_bytes += total * len(children)
        passed = BroadcastData(data.set_id, data.seq, data.src, data.src_address, data.kind,
                               data.head, buffers, data.cuda, ())
        self._send_all(children, infos, passed.to_wire(), pickle_frames + payload)

    def _send_all(self, names: Sequence[str], infos: dict[str, dict[str, Any]],
                  meta: list[Any], frames: list[Any]) -> None:
        for name in names:
            self.endpoint.send_oneway(infos[name]["endpoint"], BroadcastOp.BCAST, meta, frames)
