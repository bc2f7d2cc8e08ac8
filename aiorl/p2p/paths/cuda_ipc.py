"""Payload path: CUDA tensors by CUDA IPC handles, between workers sharing a physical GPU.

NCCL refuses two ranks on one GPU, so two workers on the same device (same node,
same device UUID) exchange CUDA IPC handles instead (``torch.multiprocessing.reductions``),
inside the control message. The receiver opens them, copies into its own tensors on
its lane, waits for the copy and acknowledges (``p2p.done``); the sender keeps the
tensors alive and the send incomplete until then. Set-up: the first CUDA message to a
same-node receiver asks which GPUs it sees and which one it uses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import pickle
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from aiorl.errors import PeerLostError, ProtocolError
from aiorl.p2p.message import InMessage, OutMessage, PostedRecv, cuda_specs
from aiorl.p2p.paths.base import (
    AckedSends,
    Destination,
    PathHost,
    PathSpec,
    PathStatistics,
    Placed,
    fail,
    resolve,
)
from aiorl.p2p.paths.cuda_common import (
    CudaLane,
    device_uuid,
    local_cuda_info,
    receive_targets,
    reinterpret,
    untyped,
)
from aiorl.p2p.proto import IPC, OP_DONE


def ipc_reduce(tensors: Sequence[Any]) -> bytes:
    """The CUDA IPC handles of ``tensors`` as one pickle (the sender keeps the tensors alive)."""
    reductions = untyped("torch.multiprocessing.reductions")
    return pickle.dumps([reductions.reduce_tensor(t.detach())[1] for t in tensors], protocol=5)


def ipc_copy(
    lane: CudaLane, handles: bytes, targets: list[Any], wait_event: Any, device: int
) -> None:
    """Lane thread: open CUDA IPC ``handles`` and copy into ``targets``; returns when the GPU
    is done (so the sender may reuse its tensors as soon as it hears back)."""
    import torch

    rebuild_cuda_tensor = untyped("torch.multiprocessing.reductions").rebuild_cuda_tensor
    stream = lane.side_stream()
    with torch.cuda.stream(stream):
        if wait_event is not None:
            stream.wait_event(wait_event)
        sources = []
        for args, target in zip(pickle.loads(handles), targets, strict=True):
            args = list(args)
            args[6] = device  # the sender's index of this GPU may differ from ours
            # Opening waits (on the current stream) for the sender's producing stream.
            src = rebuild_cuda_tensor(*args)
            target.copy_(reinterpret(src, target), non_blocking=True)
            sources.append(src)
        done = untyped("torch.cuda").Event()
        done.record(stream)
    done.synchronize()
    del sources  # releases the sender's blocks (torch's IPC reference counters)


@functools.cache
def _local_uuids() -> list[str]:
    uuids: list[str] = local_cuda_info()["uuids"]
    return uuids


class IpcSend:
    """IPC toward one same-node destination: its GPUs, and the sends it has yet to copy."""

    acks: ClassVar[str | None] = OP_DONE

    def __init__(self, host: PathHost, dest: Destination) -> None:
        self.host = host
        self.dest = dest
        self.settled = False
        self.peer_uuid: str | None = None  # the GPU the receiver uses, once asked
        # The tensors being read stay alive until the receiver's ack.
        self.waiting = AckedSends(host.loop)

    @classmethod
    def create(cls, host: PathHost, dest: Destination) -> IpcSend | None:
        return cls(host, dest) if dest.same_node else None

    def wants(self, msg: OutMessage) -> bool:
        return not self.settled and bool(msg.cuda)

    def ask(self, msg: OutMessage) -> dict[str, Any] | None:
        return {"cuda": True}

    def on_hello(self, reply: Mapping[str, Any]) -> None:
        info = reply.get("cuda") or {"current": -1, "uuids": []}
        uuids, cur = info.get("uuids") or [], info.get("current", -1)
        self.peer_uuid = uuids[cur] if 0 <= cur < len(uuids) else None
        self.settled = True

    def fits(self, msg: OutMessage) -> bool:
        peer = self.peer_uuid
        if peer is None:
            return False
        live = [t for t in msg.cuda if t.numel()]
        return all(device_uuid(t.device.index) == peer for t in live)

    def place(self, msg: OutMessage, frames: list[Any]) -> Placed:
        import torch

        specs, live = cuda_specs(msg)
        if msg.event is not None:
            # The IPC handle's event is recorded on this thread's stream: order it after
            # the caller's stream.
            torch.cuda.current_stream(live[0].device).wait_event(msg.event)
        frames.append(ipc_reduce(live))
        token = self.dest.next_token()
        fut, undo = self.waiting.park(token, live)
        desc = [IPC, token, self.host.endpoint.address, specs, device_uuid(live[0].device.index)]
        return Placed(desc, fut, undo=undo)

    def on_ack(self, meta: Sequence[Any]) -> bool:
        if not self.waiting.on_ack(meta):
            return False
        try:  # free blocks whose remote user let go
            untyped("torch.cuda").ipc_collect()
        except Exception:  # noqa: BLE001 - best effort
            pass
        return True

    def lost(self, exc: PeerLostError | LookupError) -> None:
        self.waiting.fail_all(exc, self.dest.name)

    def close(self) -> None:
        self.waiting.clear()

    def statistics(self) -> PathStatistics:
        return PathStatistics(
            self.peer_uuid is not None if self.settled else None, in_use=len(self.waiting)
        )


class IpcRecv:
    """IPC copies from one source, on its own lane, acknowledged when the GPU is done."""

    control: ClassVar[str | None] = None

    def __init__(self, host: PathHost, source: str) -> None:
        self.host = host
        self.source = source
        self.lane: CudaLane | None = None

    @classmethod
    def create(cls, host: PathHost, source: str) -> IpcRecv:
        return cls(host, source)

    def answer(self, ask: Mapping[str, Any], reply: dict[str, Any]) -> None:
        if ask.get("cuda"):
            reply["cuda"] = local_cuda_info()

    def accept(
        self,
        msg: InMessage,
        desc: Sequence[Any],
        frames: Sequence[Any],
        start: int,
        posted: PostedRecv | None,
    ) -> None:
        _, token, address, specs, peer_uuid = desc
        _targets, live, dev, wait_event = receive_targets(msg, specs, posted)
        try:
            ipc_dev = _local_uuids().index(peer_uuid)
        except ValueError:
            raise ProtocolError(
                f"CUDA IPC from a GPU this worker cannot see ({peer_uuid})"
            ) from None
        if self.lane is None:
            self.lane = CudaLane(dev)
        cf = self.lane.run(ipc_copy, self.lane, frames[-1], live, wait_event, ipc_dev)
        host = self.host
        fut: asyncio.Future[None] = host.loop.create_future()
        msg.cuda_fut = fut

        def on_copied(cf: concurrent.futures.Future[None]) -> None:  # loop
            err = None
            if cf.cancelled():
                err = "cancelled"
            elif cf.exception() is not None:
                err = repr(cf.exception())
            endpoint = host.endpoint
            if not endpoint.is_lost(address):
                try:
                    endpoint.send_oneway(address, OP_DONE, [host.name, token, err])
                except PeerLostError:
                    pass
            if err is None:
                resolve(fut, None)
            else:
                fail(fut, ProtocolError(f"CUDA IPC receive from {self.source} failed: {err}"))

        def copied(cf: concurrent.futures.Future[None]) -> None:  # lane thread
            host.call_soon_threadsafe(on_copied, cf)

        cf.add_done_callback(copied)

    def on_control(self, meta: Sequence[Any]) -> None:
        pass

    def lost(self, exc: PeerLostError | LookupError) -> None:
        self.close()

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
            self.lane = None

    def statistics(self) -> PathStatistics:
        return PathStatistics(usable=True, resources=int(self.lane is not None))


PATH = PathSpec("cuda_ipc", IPC, True, IpcSend.create, IpcRecv.create)
