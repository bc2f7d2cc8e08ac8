"""The CUDA part of a broadcast: NCCL across GPUs, CUDA IPC between members on one GPU.

NCCL refuses two ranks on one device, so the members are grouped by GPU (node and device
UUID): one *representative* per GPU joins an NCCL communicator and runs
``ProcessGroupNCCL.broadcast``; every other member on that GPU (a *follower*) copies the
representative's result through CUDA IPC handles (``coll.ipc``). The source is always the
representative of its GPU, so the communicator is keyed by the representatives (in address
order: their NCCL ranks), created lazily on first use: the source that first needs it opens a
``TCPStore`` whose address travels in the broadcast's descriptor, and every representative joins.
Representatives issue their NCCL calls on the communicator's own thread and stream in broadcast
order (the broadcaster lands broadcasts of a set in number order), which is what NCCL needs to
pair them up.

Importable without CUDA: torch is imported inside functions; nothing here runs unless a CUDA
tensor is broadcast. Completion of a transfer is a CUDA event polled by the runtime's waiter.

The source's decision travels in each broadcast message as its
`aiorl.protocol.broadcast.CudaPlan`.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import importlib
import logging
import math
import pickle
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from aiorl.collective.oneway import read_oneway
from aiorl.cuda.completion import after_work_thread, gpu_done, settle_future
from aiorl.cuda.devices import device_uuid
from aiorl.cuda.events import wait_events
from aiorl.cuda.nccl import abort_in_background, new_nccl_group
from aiorl.cuda.tensors import allocate, flat_u8
from aiorl.cuda.work_thread import CudaWorkThread
from aiorl.errors import PeerLostError, ProtocolError
from aiorl.names import WorkerAddress
from aiorl.p2p.message import InMessage, OutMessage, dtype_name, dtype_of
from aiorl.protocol.broadcast import CudaPlan, GpuInfo, IpcHandles
from aiorl.protocol.ops import BroadcastOp
from aiorl.runtime.waiter import BlockingWaiter
from aiorl.transport.endpoint import Endpoint, Incoming
from aiorl.util.cuda_device import selected_device

if TYPE_CHECKING:
    from aiorl.collective.broadcast_plan import BroadcastPlan

__all__ = ["CudaBroadcast", "NcclCommunicator"]

log = logging.getLogger("aiorl.collective")

#: How long NCCL set-up waits for the other representatives before failing.
RENDEZVOUS_TIMEOUT_S = 120.0


class CudaHost(Protocol):
    """What the CUDA part uses of its broadcaster."""

    loop: asyncio.AbstractEventLoop
    endpoint: Endpoint
    name: str
    node_id: str | None
    waiter: BlockingWaiter

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None: ...

    def address_of(self, member: str) -> str | None:
        """The endpoint of a member this process resolved (None if it did not)."""
        ...


def _torch(module: str) -> Any:
    """A torch module as ``Any`` (its stubs leave Event, Stream, TCPStore and IPC untyped)."""
    return importlib.import_module(module)


def _current_gpu(index: int | None = None) -> dict[str, Any]:
    """CUDA device ``index`` (default: this process's selected one, aiorl.util.cuda_device):
    its index and node-unique UUID (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {"index": -1, "uuid": None}
    if index is None:
        index = selected_device()
    return {"index": index, "uuid": device_uuid(index)}


class _Communicator:
    """One NCCL communicator over some representatives, with its own `CudaWorkThread` (a
    daemon thread and side stream): issued in broadcast order, never on the event loop."""

    def __init__(self, key: str, rank: int, world: int, device: int) -> None:
        self.key, self.rank, self.world, self.device = key, rank, world, device
        self.store: Any = None
        self.store_address: tuple[str, int] | None = None
        self.pg: Any = None
        self.aborted = False
        self.work_thread = CudaWorkThread(f"aiorl-bcast-{key[:8]}")

    def open_store(self, host: str) -> list[Any]:
        """Source that creates the communicator: host the rendezvous store (NCCL rank 0 need
        not be the source: the store is only where the ranks meet)."""
        dist = _torch("torch.distributed")
        self.store = dist.TCPStore(host, 0, self.world, True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        self.store_address = (host, int(self.store.port))
        return list(self.store_address)

    def _group(self) -> Any:
        # Work thread only: joins every representative (non-blocking NCCL set-up, abortable).
        if self.pg is None:
            dist = _torch("torch.distributed")
            timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
            if self.store is None:
                if self.store_address is None:
                    raise ProtocolError(f"no rendezvous address for communicator {self.key}")
                host, port = self.store_address
                self.store = dist.TCPStore(host, port, self.world, False, timeout=timeout)
            prefix = dist.PrefixStore(f"aiorl-bcast/{self.key}", self.store)
            pg = new_nccl_group(prefix, self.rank, self.world, self.device,
                                RENDEZVOUS_TIMEOUT_S)
            if self.aborted:  # aborted while we were setting up: nobody else aborts this one
                abort_in_background(pg, self.key)
                raise PeerLostError(f"communicator {self.key} was aborted")
            self.pg = pg
        return self.pg

    def broadcast(self, tensors: list[Any], root: int,
                  events: Mapping[int, Any] | None) -> tuple[Any, list[Any], list[Any]]:
        """Work thread: one NCCL broadcast per tensor after ``events`` on the work thread's
        stream; returns ``(done event, works, tensors)``."""
        cuda = _torch("torch.cuda")
        dist = _torch("torch.distributed")
        pg = self._group()
        stream = self.work_thread.stream(self.device)
        works = []
        with cuda.device(self.device), cuda.stream(stream):
            wait_events(stream, events)
            for t in tensors:
                opts = dist.BroadcastOptions()
                opts.rootRank = root
                work = pg.broadcast([t], opts)
                work.wait()  # our stream waits for NCCL's (no CPU block: BLOCKING_WAIT=0)
                works.append(work)
            done = cuda.Event()
            done.record(stream)
        return done, works, tensors

    def receive(self, inc: InMessage, specs: Sequence[Any],
                root: int) -> tuple[Any, list[Any], list[Any]]:
        """Work thread: allocate the tensors of ``inc`` on the work thread's stream, then
        broadcast into them (a representative's receive)."""
        stream = self.work_thread.stream(self.device)
        inc.cuda = allocate([(dtype_of(dt), shape) for dt, shape in specs], self.device, stream)
        return self.broadcast([flat_u8(t) for t in inc.cuda if t.numel()], root, None)

    def abort(self) -> None:
        """A representative died: NCCL calls would wait for it for ever. Aborted off the
        loop; the work thread (maybe stuck in NCCL) is abandoned."""
        self.aborted = True
        self.work_thread.close()
        abort_in_background(self.pg, self.key)
        self.pg = None


#: The communicator with its work thread, for the layers above that run NCCL broadcasts of their own
#: (``aiorl.weights.nccl``: a publisher's version rounds).
NcclCommunicator = _Communicator


class CudaBroadcast:
    """The CUDA part of one process's broadcasts (loop thread, except what runs on work threads)."""

    def __init__(self, host: CudaHost) -> None:
        self.host = host
        self._gpus: dict[str, dict[str, Any]] = {}  # member -> its current GPU (asked once)
        self._comms: dict[str, _Communicator] = {}
        self._members_of: dict[str, tuple[str, ...]] = {}  # communicator key -> representatives
        # (set id, seq) -> IPC handles that arrived, or the future of a follower waiting for them.
        self._ipc: dict[tuple[str, int], Any] = {}
        self._copier: CudaWorkThread | None = None
        self._serve_stream: Any = None  # the loop thread's stream for IPC exports
        host.endpoint.handle(BroadcastOp.GPU, self._on_gpu)
        host.endpoint.handle(BroadcastOp.IPC, self._on_ipc)

    # ------------------------------------------------------------------ source
    async def plan(self, plan: BroadcastPlan, out: OutMessage,
                   infos: Mapping[str, Mapping[str, Any]]) -> CudaPlan:
        """Source: who joins NCCL and who copies by IPC, and the communicator to use."""
        others = [n for n in plan.members if n != self.host.name]
        missing = [n for n in others if n not in self._gpus]
        replies = await asyncio.gather(*(
            self.host.endpoint.request(infos[n]["endpoint"], BroadcastOp.GPU, None)
            for n in missing))
        for name, (meta, _frames) in zip(missing, replies, strict=True):
            self._gpus[name] = {**GpuInfo.from_wire(meta).to_wire(),
                                "node": infos[name].get("node_id")}
        live = [t for t in out.cuda if t.numel()]
        device = live[0].device.index if live else None
        mine = {**_current_gpu(device), "node": self.host.node_id}
        gpus = {**{n: self._gpus[n] for n in others}, self.host.name: mine}
        for name, gpu in gpus.items():
            if gpu["uuid"] is None:
                raise ProtocolError(f"worker {name} has no CUDA device for a CUDA broadcast")
        order = sorted(plan.members, key=WorkerAddress.from_name)
        rep_of: dict[tuple[Any, Any], str] = {(mine["node"], mine["uuid"]): self.host.name}
        for name in order:
            rep_of.setdefault((gpus[name]["node"], gpus[name]["uuid"]), name)
        reps = sorted(set(rep_of.values()), key=WorkerAddress.from_name)
        followers = {n: rep_of[(gpus[n]["node"], gpus[n]["uuid"])] for n in order
                     if n not in reps}
        key = hashlib.blake2b("\0".join(reps).encode(), digest_size=10).hexdigest()
        store = None
        if len(reps) > 1 and key not in self._comms:
            comm = self._communicator(key, reps, int(mine["index"]))
            comm.open_store(self.host.endpoint.ip)
            store = comm.store_address
        specs = tuple((dtype_name(t.dtype), tuple(t.shape)) for t in out.cuda)
        return CudaPlan(key, store, tuple(reps), reps.index(self.host.name), followers, specs)

    def send(self, set_id: str, seq: int, out: OutMessage, desc: CudaPlan) -> None:
        """Source, after the control messages left: issue NCCL, hand its own GPU's followers
        IPC handles. The source's tensors stay alive (its round keeps them) until done."""
        key, reps, root, followers = desc.key, desc.reps, desc.root, desc.followers
        live = [t for t in out.cuda if t.numel()]
        if len(reps) > 1 and live:
            comm = self._comms[key]
            comm.work_thread.run(comm.broadcast, [flat_u8(t) for t in live], root, out.event)
        mine = [n for n, rep in followers.items() if rep == self.host.name]
        if mine and live:  # (followers of an all-empty payload allocate it: `receive`)
            self._serve(set_id, seq, mine, live, out.event)

    # ------------------------------------------------------------------ members
    def receive(self, set_id: str, seq: int, inc: InMessage,
                desc: CudaPlan) -> asyncio.Future[None]:
        """Member: land the CUDA tensors of ``inc`` on this process's selected device (NCCL
        as a representative, IPC as a follower), allocated off the loop; the future
        completes when they are on the GPU."""
        key, store, reps, root = desc.key, desc.store, desc.reps, desc.root
        followers, specs = desc.followers, desc.specs
        device = selected_device()
        fut: asyncio.Future[None] = self.host.loop.create_future()
        if all(not math.prod(shape) for _dt, shape in specs):
            import torch

            inc.cuda = [torch.empty(shape, dtype=dtype_of(dt), device=device)
                        for dt, shape in specs]
            fut.set_result(None)
            return fut
        if self.host.name in followers:
            self._await_ipc((set_id, seq), inc, specs, device, fut)
            return fut
        comm = self._comms.get(key) or self._communicator(key, reps, device)
        if store is not None:
            comm.store_address = (store[0], int(store[1]))
        mine = [n for n, rep in followers.items() if rep == self.host.name]
        host = self.host

        def landed(issued: tuple[Any, list[Any], list[Any]]) -> asyncio.Future[None]:
            done, works, keep = issued
            return gpu_done(host, done, works, comm.pg, keep)

        gpu = after_work_thread(host, comm.work_thread.run(comm.receive, inc, specs, root), landed)

        def finished(f: asyncio.Future[None]) -> None:  # loop
            error = f.exception() if not f.cancelled() else PeerLostError("abandoned")
            if error is None and mine:
                self._serve(set_id, seq, mine, [t for t in inc.cuda if t.numel()], None)
            settle_future(fut, error)

        gpu.add_done_callback(finished)
        return fut

    def _communicator(self, key: str, reps: Sequence[str], device: int) -> _Communicator:
        comm = self._comms[key] = _Communicator(key, list(reps).index(self.host.name),
                                                len(reps), device)
        self._members_of[key] = tuple(reps)
        return comm

    # ------------------------------------------------------------------ IPC
    def _serve(self, set_id: str, seq: int, followers: Sequence[str],
               tensors: Sequence[Any], events: Mapping[int, Any] | None) -> None:
        """Give ``followers`` (members on our GPU) the CUDA IPC handles of ``tensors``.

        Torch's export records the IPC event on the current stream of the tensor's device:
        a side stream of this thread that first waited for ``events`` (the caller's), so
        no default stream is made to wait. ``tensors`` are the payload's non-empty ones:
        there must be one (a follower lands an all-empty payload without handles, and the
        device is taken from the first)."""
        if not tensors:
            raise ValueError("no CUDA tensor to export: an all-empty payload needs no IPC")
        reductions = _torch("torch.multiprocessing.reductions")
        cuda = _torch("torch.cuda")
        if self._serve_stream is None:
            self._serve_stream = cuda.Stream(tensors[0].device)
        stream = self._serve_stream
        wait_events(stream, events)
        with cuda.device(tensors[0].device), cuda.stream(stream):
            handles = pickle.dumps([reductions.reduce_tensor(t.detach())[1] for t in tensors], 5)
        endpoint = self.host.endpoint
        for name in followers:
            address = self.host.address_of(name)
            if address is not None:
                try:
                    endpoint.send_oneway(address, BroadcastOp.IPC,
                                         IpcHandles(set_id, seq).to_wire(), [handles])
                except PeerLostError:
                    pass  # its death fails the broadcast

    def _on_ipc(self, msg: Incoming) -> None:
        ipc = read_oneway(IpcHandles, msg, self.host.name)
        if ipc is None:
            return
        key = (ipc.set_id, ipc.seq)
        waiting = self._ipc.pop(key, None)
        if waiting is None:
            self._ipc[key] = msg.frames[0]
        else:
            waiting(msg.frames[0])

    def _await_ipc(self, key: tuple[str, int], inc: InMessage, specs: Sequence[Any], device: int,
                   fut: asyncio.Future[None]) -> None:
        """Follower: once the representative's handles arrive, copy from them on the copier
        thread (allocation included); completion is an event polled by the waiter."""
        host = self.host

        def copy(handles: Any) -> None:  # loop
            if self._copier is None or self._copier.closed:
                self._copier = CudaWorkThread("aiorl-bcast-ipc")
            work_thread = self._copier
            gpu = after_work_thread(
                host, work_thread.run(_ipc_copy, work_thread, bytes(handles), inc, specs, device),
                lambda issued: gpu_done(host, issued[0], keep=issued[1]))
            gpu.add_done_callback(lambda f: settle_future(
                fut, f.exception() if not f.cancelled() else PeerLostError("closed")))

        handles = self._ipc.pop(key, None)
        if handles is None:
            self._ipc[key] = copy
        else:
            copy(handles)

    def _on_gpu(self, msg: Incoming) -> None:
        msg.reply(GpuInfo(**_current_gpu()).to_wire())

    # ------------------------------------------------------------------ loss
    def lost(self, name: str) -> None:
        """Member ``name`` is gone: abort the communicators it belongs to."""
        for key, reps in list(self._members_of.items()):
            if name in reps:
                comm = self._comms.pop(key, None)
                del self._members_of[key]
                if comm is not None:
                    comm.abort()

    def close(self) -> None:
        for comm in self._comms.values():
            comm.abort()
        self._comms.clear()
        self._members_of.clear()
        self._ipc.clear()
        if self._copier is not None:
            self._copier.close()


def _ipc_copy(work_thread: CudaWorkThread, handles: bytes, inc: InMessage, specs: Sequence[Any],
              device: int) -> tuple[Any, list[Any]]:
    """Copier thread: allocate ``inc``'s tensors on ``device``, open the representative's CUDA
    IPC handles (torch makes our stream wait for its event) and copy on the work thread's stream;
    returns ``(done event, what must stay alive until it completed)``."""
    cuda = _torch("torch.cuda")
    reductions = _torch("torch.multiprocessing.reductions")
    stream = work_thread.stream(device)
    inc.cuda = allocate([(dtype_of(dt), shape) for dt, shape in specs], device, stream)
    targets = [t for t in inc.cuda if t.numel()]
    sources = []
    with cuda.device(device), cuda.stream(stream):
        for args, target in zip(pickle.loads(handles), targets, strict=True):
            args = list(args)
            # The handle's GPU as this process numbers it: the plan grouped the follower
            # with its representative by device UUID, and the follower uses its selected one.
            args[6] = device
            src = reductions.rebuild_cuda_tensor(*args)
            flat_u8(target).copy_(flat_u8(src), non_blocking=True)
            sources.append(src)
        done = cuda.Event()
        done.record(stream)
    return done, [sources, targets]

