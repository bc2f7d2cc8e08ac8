"""Payload path: CUDA tensors by NCCL, one process group per *ordered* pair.

Used for CUDA tensors between different GPUs (same node or not). The two directions
of a pair never share a communicator, so they cannot deadlock each other. The sender
is rank 0 and opens a ``TCPStore`` on a free port; the store address travels in the
first control message, and the receiver connects as rank 1. Each side issues its NCCL
operations for the pair on one :class:`~aiorl.p2p.paths.cuda_common.CudaLane`, in
control-message order (the receiver at arrival, in arrival order): NCCL matches
point-to-point operations of a communicator in issue order, so both sequences pair up.
Group creation blocks (store rendezvous, communicator set-up), a second reason it
happens on the lane and never on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from aiorl.errors import PeerLostError
from aiorl.p2p.message import InMessage, OutMessage, PostedRecv, cuda_specs
from aiorl.p2p.paths.base import Destination, PathHost, PathSpec, PathStatistics, Placed
from aiorl.p2p.paths.cuda_common import (
    CudaLane,
    flat_u8,
    gpu_done_future,
    receive_targets,
    untyped,
)
from aiorl.p2p.proto import NCCL

log = logging.getLogger("aiorl.p2p")

#: How long NCCL set-up waits for the other side before failing.
RENDEZVOUS_TIMEOUT_S = 120.0


class CudaPair(CudaLane):
    """One side of the NCCL link of an ordered pair, issued on its lane.

    Args:
        gid: the pair's group id (also the store prefix), chosen by the sender.
        rank: 0 on the sender, 1 on the receiver.
        device: the local CUDA device index this side uses.
    """

    def __init__(self, gid: str, rank: int, device: int) -> None:
        super().__init__(device)
        self.gid = gid
        self.rank = rank
        self.store: Any = None
        self.store_address: tuple[str, int] | None = None
        self.pg: Any = None

    def open_master_store(self, host: str) -> tuple[str, int]:
        """Sender: open the rendezvous store on a free port; returns its address."""
        dist = untyped("torch.distributed")
        self.store = dist.TCPStore(
            host,
            0,
            2,
            True,
            timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
            wait_for_workers=False,
        )
        self.store_address = (host, int(self.store.port))
        return self.store_address

    def set_store_address(self, host: str, port: int) -> None:
        """Receiver: where the sender's store listens (connected lazily on the lane)."""
        self.store_address = (host, port)

    def _ensure_group(self) -> Any:
        # Lane thread only. Blocks until the other side joins (store rendezvous).
        if self.pg is not None:
            return self.pg
        dist = untyped("torch.distributed")
        timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        if self.store is None:
            if self.store_address is None:
                raise RuntimeError(f"no rendezvous address for NCCL pair {self.gid!r}")
            host, port = self.store_address
            self.store = dist.TCPStore(host, port, 2, False, timeout=timeout)
        prefix = dist.PrefixStore(self.gid, self.store)
        opts = dist.ProcessGroupNCCL.Options()
        if hasattr(opts, "_timeout"):  # older torch: the default timeout applies
            opts._timeout = timeout
        self.pg = dist.ProcessGroupNCCL(prefix, self.rank, 2, opts)
        return self.pg

    def submit(
        self, tensors: Sequence[Any], wait_event: Any, send: bool
    ) -> concurrent.futures.Future[tuple[list[Any], Any]]:
        """Issue one NCCL send (rank 0) or receive (rank 1) per tensor, after ``wait_event``.

        Returns a future of ``(works, done_event)``; ``done_event`` completes when
        every transfer of the call has. Tensors must stay referenced until then.
        """
        return self.run(self._issue, list(tensors), wait_event, send)

    def _issue(self, tensors: list[Any], wait_event: Any, send: bool) -> tuple[list[Any], Any]:
        import torch

        if self.closed:
            raise RuntimeError(f"NCCL pair {self.gid} is closed")
        pg = self._ensure_group()
        stream = self.side_stream()
        with torch.cuda.stream(stream):
            if wait_event is not None:
                stream.wait_event(wait_event)
            # ProcessGroupNCCL orders its NCCL stream after the current (= our side) stream.
            works = [pg.send([t], 1, 0) if send else pg.recv([t], 0, 0) for t in tensors]
            for w in works:
                w.wait()  # our side stream waits for the NCCL stream (no CPU block)
            done = untyped("torch.cuda").Event()
            done.record(stream)
        return works, done

    def close(self) -> None:
        """Abort the communicator (a peer that died leaves NCCL operations hanging)."""
        pg = self.pg
        if pg is not None:
            abort = getattr(pg, "abort", None) or getattr(pg, "shutdown", None)
            if abort is not None:
                try:
                    abort()
                except Exception:  # noqa: BLE001 - best effort: the process may be exiting
                    log.debug("NCCL abort of %s failed", self.gid, exc_info=True)
        super().close()
        self.store = None


class NcclSend:
    """The NCCL pair toward one destination (rank 0), created with the first CUDA payload."""

    acks: ClassVar[str | None] = None

    def __init__(self, host: PathHost, dest: Destination) -> None:
        self.host = host
        self.dest = dest
        self.settled = True
        self.pair: CudaPair | None = None

    @classmethod
    def create(cls, host: PathHost, dest: Destination) -> NcclSend:
        return cls(host, dest)

    def wants(self, msg: OutMessage) -> bool:
        return False

    def ask(self, msg: OutMessage) -> dict[str, Any] | None:
        return None

    def on_hello(self, reply: Mapping[str, Any]) -> None:
        pass

    def fits(self, msg: OutMessage) -> bool:
        return True

    def place(self, msg: OutMessage, frames: list[Any]) -> Placed:
        specs, live = cuda_specs(msg)
        pair = self.pair
        store = None
        if pair is None:
            gid = f"aiorl-p2p/{self.host.name}->{self.dest.name}/{uuid.uuid4().hex[:8]}"
            pair = CudaPair(gid, 0, live[0].device.index)
            store = list(pair.open_master_store(self.host.endpoint.ip))
            self.pair = pair
        host = self.host

        def issue() -> asyncio.Future[None]:
            return gpu_done_future(host, pair.submit([flat_u8(t) for t in live], msg.event, True))

        return Placed([NCCL, pair.gid, store, specs], after_send=issue)

    def on_ack(self, meta: Sequence[Any]) -> bool:
        return False

    def lost(self, exc: PeerLostError | LookupError) -> None:
        self.close()  # pending transfers fail through their lane futures

    def close(self) -> None:
        if self.pair is not None:
            self.pair.close()
            self.pair = None

    def statistics(self) -> PathStatistics:
        return PathStatistics(usable=True, resources=int(self.pair is not None))


class NcclRecv:
    """The NCCL pair from one source (rank 1), joined with the first NCCL payload."""

    control: ClassVar[str | None] = None

    def __init__(self, host: PathHost, source: str) -> None:
        self.host = host
        self.source = source
        self.pair: CudaPair | None = None

    @classmethod
    def create(cls, host: PathHost, source: str) -> NcclRecv:
        return cls(host, source)

    def answer(self, ask: Mapping[str, Any], reply: dict[str, Any]) -> None:
        pass

    def accept(
        self,
        msg: InMessage,
        desc: Sequence[Any],
        frames: Sequence[Any],
        start: int,
        posted: PostedRecv | None,
    ) -> None:
        _, gid, store, specs = desc
        _targets, live, dev, wait_event = receive_targets(msg, specs, posted)
        if self.pair is None:
            self.pair = CudaPair("", 1, dev)
        pair = self.pair
        if store is not None:
            pair.gid = gid
            pair.set_store_address(store[0], int(store[1]))
        cf = pair.submit([flat_u8(t) for t in live], wait_event, False)
        msg.cuda_fut = gpu_done_future(self.host, cf)

    def on_control(self, meta: Sequence[Any]) -> None:
        pass

    def lost(self, exc: PeerLostError | LookupError) -> None:
        self.close()

    def close(self) -> None:
        if self.pair is not None:
            self.pair.close()
            self.pair = None

    def statistics(self) -> PathStatistics:
        return PathStatistics(usable=True, resources=int(self.pair is not None))


PATH = PathSpec("nccl", NCCL, True, NcclSend.create, NcclRecv.create)
