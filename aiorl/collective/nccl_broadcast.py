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

``cudadesc``: ``[communicator key, store [host, port] or None, representatives, root index,
{follower: representative}, [[dtype, shape], ...]]``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import hashlib
import importlib
import logging
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from aiorl.collective.proto import OP_GPU, OP_IPC
from aiorl.errors import PeerLostError, ProtocolError
from aiorl.names import WorkerAddress
from aiorl.p2p.message import InMessage, OutMessage, dtype_name, dtype_of, record_event
from aiorl.runtime.waiter import BlockingWaiter, Job
from aiorl.transport.endpoint import Endpoint, Incoming

if TYPE_CHECKING:
    from aiorl.collective.plan import BroadcastPlan

__all__ = ["CudaBroadcast"]

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


def _flat_u8(t: Any) -> Any:
    import torch

    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _current_gpu(index: int | None = None) -> dict[str, Any]:
    """CUDA device ``index`` (default: this thread's current one): its index and node-unique
    UUID (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {"index": -1, "uuid": None}
    if index is None:
        index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    ident = str(uuid) if uuid is not None else f"pci:{getattr(props, 'pci_bus_id', index)}"
    return {"index": index, "uuid": ident}


class _Communicator:
    """One NCCL communicator over some representatives, with its own thread and stream."""

    def __init__(self, key: str, rank: int, world: int, device: int) -> None:
        self.key, self.rank, self.world, self.device = key, rank, world, device
        self.store: Any = None
        self.store_address: tuple[str, int] | None = None
        self.pg: Any = None
        self.stream: Any = None
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aiorl-bcast")

    def open_store(self, host: str) -> list[Any]:
        """Source that creates the communicator: host the rendezvous store (NCCL rank 0 need
        not be the source: the store is only where the ranks meet)."""
        dist = _torch("torch.distributed")
        self.store = dist.TCPStore(host, 0, self.world, True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        self.store_address = (host, int(self.store.port))
        return list(self.store_address)

    def _group(self) -> Any:
        # Communicator thread only: blocks until every representative joined.
        if self.pg is None:
            dist = _torch("torch.distributed")
            timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
            if self.store is None:
                if self.store_address is None:
                    raise ProtocolError(f"no rendezvous address for communicator {self.key}")
                host, port = self.store_address
                self.store = dist.TCPStore(host, port, self.world, False, timeout=timeout)
            opts = dist.ProcessGroupNCCL.Options()
            if hasattr(opts, "_timeout"):
                opts._timeout = timeout
            prefix = dist.PrefixStore(f"aiorl-bcast/{self.key}", self.store)
            self.pg = dist.ProcessGroupNCCL(prefix, self.rank, self.world, opts)
        return self.pg

    def broadcast(self, tensors: list[Any], root: int, wait_event: Any) -> Any:
        """Communicator thread: one NCCL broadcast per tensor after ``wait_event``; returns an
        event recorded after them on this communicator's stream."""
        cuda = _torch("torch.cuda")
        dist = _torch("torch.distributed")
        pg = self._group()
        if self.stream is None:
            cuda.set_device(self.device)
            self.stream = cuda.Stream(self.device)
        with cuda.stream(self.stream):
            if wait_event is not None:
                self.stream.wait_event(wait_event)
            for t in tensors:
                opts = dist.BroadcastOptions()
                opts.rootRank = root
                pg.broadcast([t], opts).wait()  # our stream waits for NCCL's (no CPU block)
            done = cuda.Event()
            done.record(self.stream)
        return done

    def abort(self) -> None:
        """A representative died: NCCL calls would wait for it for ever."""
        pg = self.pg
        abort = getattr(pg, "abort", None) or getattr(pg, "shutdown", None)
        if abort is not None:
            try:
                abort()
            except Exception:  # noqa: BLE001 - best effort: the process may be exiting
                log.debug("NCCL abort of %s failed", self.key, exc_info=True)
        self.thread.shutdown(wait=False, cancel_futures=True)


class CudaBroadcast:
    """The CUDA part of one process's broadcasts (loop thread, except what runs on lanes)."""

    def __init__(self, host: CudaHost) -> None:
        self.host = host
        self._gpus: dict[str, dict[str, Any]] = {}  # member -> its current GPU (asked once)
        self._comms: dict[str, _Communicator] = {}
        self._members_of: dict[str, tuple[str, ...]] = {}  # communicator key -> representatives
        # (set id, seq) -> IPC handles that arrived, or the future of a follower waiting for them.
        self._ipc: dict[tuple[str, int], Any] = {}
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        host.endpoint.handle(OP_GPU, self._on_gpu)
        host.endpoint.handle(OP_IPC, self._on_ipc)

    # ------------------------------------------------------------------ source
    async def plan(self, plan: BroadcastPlan, out: OutMessage,
                   infos: Mapping[str, Mapping[str, Any]]) -> list[Any]:
        """Source: who joins NCCL and who copies by IPC, and the communicator to use."""
        others = [n for n in plan.members if n != self.host.name]
        missing = [n for n in others if n not in self._gpus]
        replies = await asyncio.gather(*(
            self.host.endpoint.request(infos[n]["endpoint"], OP_GPU, None) for n in missing))
        for name, (meta, _frames) in zip(missing, replies, strict=True):
            self._gpus[name] = {**meta, "node": infos[name].get("node_id")}
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
            store = comm.open_store(self.host.endpoint.ip)
        specs = [[dtype_name(t.dtype), list(t.shape)] for t in out.cuda]
        return [key, store, reps, reps.index(self.host.name), followers, specs]

    def send(self, set_id: str, seq: int, out: OutMessage, desc: Sequence[Any]) -> None:
        """Source, after the control messages left: issue NCCL, hand its own GPU's followers
        IPC handles. The source's tensors stay alive (its round keeps them) until done."""
        key, _store, reps, root, followers, _specs = desc
        live = [t for t in out.cuda if t.numel()]
        if len(reps) > 1 and live:
            comm = self._comms[key]
            comm.thread.submit(comm.broadcast, [_flat_u8(t) for t in live], root, out.event)
        mine = [n for n, rep in followers.items() if rep == self.host.name]
        if mine:
            import torch

            if out.event is not None:
                torch.cuda.current_stream(live[0].device).wait_event(out.event)
            self._serve(set_id, seq, mine, live)

    # ------------------------------------------------------------------ members
    def receive(self, set_id: str, seq: int, inc: InMessage,
                desc: Sequence[Any]) -> asyncio.Future[None]:
        """Member: allocate the CUDA tensors of ``inc`` and land them (NCCL as a
        representative, IPC as a follower); the future completes when they are on the GPU."""
        import torch

        key, store, reps, root, followers, specs = desc
        device = torch.cuda.current_device()
        inc.cuda = [torch.empty(shape, dtype=dtype_of(dt), device=device) for dt, shape in specs]
        live = [t for t in inc.cuda if t.numel()]
        fut: asyncio.Future[None] = self.host.loop.create_future()
        if not live:
            fut.set_result(None)
            return fut
        event = record_event()  # the allocations above, on this thread's stream
        if self.host.name in followers:
            self._await_ipc((set_id, seq), live, event, fut)
            return fut
        comm = self._comms.get(key) or self._communicator(key, reps, device)
        if store is not None:
            comm.store_address = (store[0], int(store[1]))
        cf = comm.thread.submit(comm.broadcast, [_flat_u8(t) for t in live], root, event)
        mine = [n for n, rep in followers.items() if rep == self.host.name]

        def landed(error: BaseException | None) -> None:  # loop
            if error is None and mine:
                self._serve(set_id, seq, mine, live)
            _settle(fut, error)

        self._when_gpu_done(cf, landed)
        return fut

    def _communicator(self, key: str, reps: Sequence[str], device: int) -> _Communicator:
        comm = self._comms[key] = _Communicator(key, list(reps).index(self.host.name),
                                                len(reps), device)
        self._members_of[key] = tuple(reps)
        return comm

    def _when_gpu_done(self, cf: concurrent.futures.Future[Any],
                       then: Callable[[BaseException | None], None]) -> None:
        """``then(error)`` on the loop once the event ``cf`` yields has completed on the GPU."""
        host = self.host

        def issued(cf: concurrent.futures.Future[Any]) -> None:  # communicator thread
            if cf.cancelled():
                host.call_soon_threadsafe(then, PeerLostError("the NCCL broadcast was abandoned"))
                return
            exc = cf.exception()
            if exc is not None:
                host.call_soon_threadsafe(then, exc)
                return
            event = cf.result()
            host.waiter.watch(Job(event.query, lambda err: host.call_soon_threadsafe(then, err)))

        cf.add_done_callback(issued)

    # ------------------------------------------------------------------ IPC
    def _serve(self, set_id: str, seq: int, followers: Sequence[str],
               tensors: Sequence[Any]) -> None:
        """Give ``followers`` (members on our GPU) the CUDA IPC handles of ``tensors``."""
        reductions = _torch("torch.multiprocessing.reductions")
        handles = pickle.dumps([reductions.reduce_tensor(t.detach())[1] for t in tensors], 5)
        endpoint = self.host.endpoint
        for name in followers:
            address = self.host.address_of(name)
            if address is not None:
                try:
                    endpoint.send_oneway(address, OP_IPC, [set_id, seq], [handles])
                except PeerLostError:
                    pass  # its death fails the broadcast

    def _on_ipc(self, msg: Incoming) -> None:
        key = (msg.meta[0], msg.meta[1])
        waiting = self._ipc.pop(key, None)
        if waiting is None:
            self._ipc[key] = msg.frames[0]
        else:
            waiting(msg.frames[0])

    def _await_ipc(self, key: tuple[str, int], targets: list[Any], event: Any,
                   fut: asyncio.Future[None]) -> None:
        def copy(handles: Any) -> None:  # loop
            if self._copier is None:
                self._copier = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="aiorl-bcast-ipc")
            cf = self._copier.submit(_ipc_copy, bytes(handles), targets, event)
            cf.add_done_callback(lambda cf: self.host.call_soon_threadsafe(
                _settle, fut, cf.exception() if not cf.cancelled() else PeerLostError("closed")))

        handles = self._ipc.pop(key, None)
        if handles is None:
            self._ipc[key] = copy
        else:
            copy(handles)

    def _on_gpu(self, msg: Incoming) -> None:
        msg.reply(_current_gpu())

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
            self._copier.shutdown(wait=False, cancel_futures=True)


def _ipc_copy(handles: bytes, targets: list[Any], wait_event: Any) -> None:
    """Copier thread: open CUDA IPC ``handles`` and copy into ``targets``; returns when done."""
    import torch

    reductions = _torch("torch.multiprocessing.reductions")
    stream = _torch("torch.cuda").Stream(targets[0].device)
    with torch.cuda.stream(stream):
        if wait_event is not None:
            stream.wait_event(wait_event)
        sources = []
        for args, target in zip(pickle.loads(handles), targets, strict=True):
            args = list(args)
            args[6] = target.device.index  # the sender's index of this GPU may differ from ours
            src = reductions.rebuild_cuda_tensor(*args)
            target.reshape(-1).view(torch.uint8).copy_(_flat_u8(src), non_blocking=True)
            sources.append(src)
        stream.synchronize()
    del sources


def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
