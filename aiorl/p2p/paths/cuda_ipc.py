"""Payload path: CUDA tensors by CUDA IPC, between workers sharing a physical GPU.

NCCL refuses two ranks on one GPU, so two workers on the same device (same machine, same
device UUID, possibly under two node agents) read each other's memory instead. Set-up:
the first CUDA message asks the receiver which machine it runs on and which GPUs it sees.

Per send, nothing is registered with torch's IPC machinery again:

* **Shares are cached per storage.** The first send of a storage toward a receiver
  exports it once (``_share_cuda_``: one IPC memory handle and one torch IPC event); later
  sends of the same live storage name the share by id. After each message at most
  `SHARES_PER_PEER` shares per receiver stay, or as many as that message used if it used
  more (a state dict of 1,000 tensors resent every step is exported once, not per step):
  the least recently used ones, and those whose storage died, are dropped (``p2p.cuda``
  ``ipc-drop``, one message listing them), and the receiver closes its mappings. A message
  carries at most `MAX_IPC_TENSORS` tensors by IPC.
* **Many tensors, few calls.** A message of `FLAT_MIN_TENSORS` tensors or more is
  received by a plan made once per layout (`ManyPlan`: the typed views of the sender's
  tensors in the mapped shares, where each lands in one block, grouped by dtype): per
  message one allocation and one fused copy per dtype (`aiorl.cuda.bulk_copy`), not an
  allocation and a ``copy_`` per tensor. A plan holds views of mappings, so it goes
  before a mapping it uses is released.
* **Ordering by our own interprocess events**, a bounded pool per receiver, each exported
  once: the sender records one on its side stream after the caller's events; the
  receiver's side stream waits for it, copies, and records a blocking-sync completion
  event, which the work thread's `EventWaiter` waits for (no polling); the receiver then
  acknowledges (``p2p.done``) and the sender may reuse the tensor and the event. No
  default stream waits or is waited on.
* **Copy speed.** A receive into a posted ``recv_tensor`` buffer allocates nothing; the
  mappings and the opened events are cached, so a message costs one side-stream wait,
  one copy and one event; the loop is woken once, when the bytes are there.
* **Mappings released on the work thread's stream.** torch's deleter of a mapped storage
  synchronises the releasing thread's *current* stream before it lets the sender reuse
  the block; a mapping is therefore dropped with the work thread's stream current (the copies
  that read it), never the default stream (the user's kernels) and never on the loop.
* **Reference-counter files.** Each export takes a slot in a ``/dev/shm/torch_<pid>_*``
  file that torch unlinks only in a static destructor, which a worker ending by
  ``os._exit`` (forked workers do) never runs; the engine's close unlinks the files this
  process exported through (`release_ref_counter_files`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiorl.cuda.bulk_copy import FLAT_MIN_TENSORS, FlatLayout, copy_grouped
from aiorl.cuda.byte_window import ByteWindow
from aiorl.cuda.devices import device_uuid, host_identity, local_cuda_info
from aiorl.cuda.events import blocking_event, wait_events
from aiorl.cuda.tensors import allocate, flat_u8, typed_view
from aiorl.cuda.untyped_torch import untyped
from aiorl.cuda.work_thread import CudaWorkThread
from aiorl.errors import PeerLostError, ProtocolError
from aiorl.p2p.message import InMessage, OutMessage, PostedRecv, cuda_specs, dtype_of, nbytes_of
from aiorl.p2p.paths.base import (
    AckedSends,
    Destination,
    PathHost,
    PathSpec,
    PathStatistics,
    Placed,
    RecvPathBase,
    SendPathBase,
    fail,
    resolve,
)
from aiorl.protocol.ops import P2POp
from aiorl.protocol.p2p import (
    IPC,
    K_CUDA,
    CudaInfo,
    Hello,
    HelloReply,
    IpcDesc,
    IpcDrop,
    IpcDropEvent,
    IpcPart,
    PathAck,
    PathControl,
    TransferDone,
)
from aiorl.util.cuda_device import selected_device

__all__ = [
    "MAX_IPC_TENSORS",
    "PATH",
    "SHARES_PER_PEER",
    "ShareCache",
    "note_ref_counter_file",
    "release_ref_counter_files",
]

log = logging.getLogger("aiorl.p2p")

#: The ops as plain strs (an enum member costs msgpack a slow path per message).
_CUDA, _DONE = P2POp.CUDA.value, P2POp.DONE.value

#: Storages a sender keeps exported toward one receiver (and the receiver keeps mapped)
#: between messages, unless the last message used more.
SHARES_PER_PEER = 64
#: Tensors one message may carry by IPC (a receiver refuses more as a hostile peer's).
MAX_IPC_TENSORS = 16384
#: Interprocess events a sender keeps toward one receiver once they are free again.
EVENTS_PER_PEER = 64
#: Receive plans of many-tensor layouts a receiver keeps per sender (least recently used
#: dropped first).
PLANS_PER_PEER = 4


#: The ``/dev/shm`` reference-counter files this process's exports used (torch names them
#: ``/torch_<pid>_<random>_<n>``): unlinked by `release_ref_counter_files` at close.
_REF_COUNTER_FILES: set[str] = set()


def note_ref_counter_file(name: Any) -> None:
    """Remember the reference-counter file an export of ours used (``_share_cuda_``'s
    fifth item, bytes). Only a file named for this process is kept: it is ours to unlink."""
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    if isinstance(name, str) and name.startswith(f"/torch_{os.getpid()}_") and "/" not in name[1:]:
        _REF_COUNTER_FILES.add(name)


def release_ref_counter_files(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the reference-counter files this process exported through (process end).

    torch unlinks them in a static destructor that ``os._exit`` skips. Only at the end:
    a receiver releasing a mapping opens the file by name to decrement its counter, and a
    missing file (which torch tolerates, "producer terminated") would leave that block
    held for ever in a process that goes on. Returns the paths unlinked.
    """
    gone = []
    for name in sorted(_REF_COUNTER_FILES):
        path = os.path.join(shm_dir, name.lstrip("/"))
        try:
            os.unlink(path)
            gone.append(path)
        except FileNotFoundError:
            pass  # torch released it already (every slot of a full file came back)
        except OSError as exc:
            log.debug("could not unlink %s: %s", path, exc)
    _REF_COUNTER_FILES.clear()
    return gone


@functools.cache
def _local_uuids() -> list[str]:
    uuids: list[str] = local_cuda_info()["uuids"]
    return uuids


class ShareCache:
    """Sender: the storages exported toward one receiver, least recently used first.

    Keyed by the storage's identity (``_cdata``), checked alive through torch's storage
    weak reference (which keeps the identity from being reused while held). Pure
    bookkeeping apart from the two callables, so its bounds are unit-tested on the CPU.
    """

    def __init__(self, limit: int = SHARES_PER_PEER) -> None:
        self.limit = limit
        self._next_id = 0
        # key -> (share id, weak reference or None, export args)
        self._entries: OrderedDict[int, tuple[int, Any, Any]] = OrderedDict()

    def lookup(self, key: int, alive: Any, export: Any) -> tuple[int, Any, list[int]]:
        """``(share id, export args or None when the receiver has them, ids to drop)``.

        ``alive(ref)`` tells whether a cached entry's storage still lives; ``export()``
        returns ``(weak ref, args)`` for a new share. Nothing else is evicted here: a
        message's lookups must not drop each other's shares; `trim` runs after them.
        """
        dropped: list[int] = []
        entry = self._entries.get(key)
        if entry is not None and alive(entry[1]):
            self._entries.move_to_end(key)
            return entry[0], None, dropped
        if entry is not None:  # same identity, storage gone: forget the stale share
            del self._entries[key]
            dropped.append(entry[0])
        ref, args = export()
        share_id = self._next_id
        self._next_id += 1
        self._entries[key] = (share_id, ref, args)
        return share_id, args, dropped

    def trim(self, alive: Any, used: int) -> list[int]:
        """After a message's lookups: the ids of the shares dropped, those whose storage
        died and the least recently used beyond ``max(limit, used)`` (``used``: the shares
        the message named, the most recently used ones, so none of them is dropped)."""
        dropped = [self._entries.pop(k)[0] for k, e in list(self._entries.items())
                   if not alive(e[1])]
        bound = max(self.limit, used)
        while len(self._entries) > bound:
            dropped.append(self._entries.popitem(last=False)[1][0])
        return dropped

    def forget(self, share_id: int) -> None:
        """Drop share ``share_id`` here only (the receiver never saw its export)."""
        for key, entry in list(self._entries.items()):
            if entry[0] == share_id:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


class ManyPlan:
    """Receiver: how one layout of many tensors is received, made once and kept.

    ``sources``: the sender's non-empty tensors, typed views of the mapped shares;
    ``layout``: where every tensor (empty ones too) lands in one block; ``live``: the
    indices of the non-empty ones; ``share_ids``: the shares the views keep mapped.
    """

    def __init__(self, specs: Sequence[tuple[Any, Sequence[int]]], sources: list[Any],
                 share_ids: set[int]) -> None:
        self.layout = FlatLayout(specs)
        self.live = [i for i, (_, shape) in enumerate(specs) if math.prod(shape)]
        self.sources = sources
        self.share_ids = share_ids
        position = {i: k for k, i in enumerate(self.live)}
        groups = ([position[i] for i in idx if i in position] for idx in self.layout.groups)
        self.groups = [g for g in groups if g]  # dtype groups, as positions among the live

    def receive(self, device: Any, default_stream: Any) -> list[Any]:
        """Allocate the block on the current stream, queue the copies into it; the
        received tensors in spec order."""
        block, targets = self.layout.allocate(device)
        block.record_stream(default_stream)
        live = [targets[i] for i in self.live]
        copy_grouped(live, self.sources, self.groups)
        return targets


@dataclass
class _IpcJob:
    """One IPC receive: what it lands, where from, and whom to tell."""

    msg: InMessage
    specs: list[Any]
    posted: PostedRecv | None
    ipc_device: int
    parts: list[Any]
    event_id: int
    handle: Any
    nbytes: int
    token: int
    address: str
    fut: asyncio.Future[None]


def _export(storage: Any) -> tuple[Any, Any]:
    """One IPC export of a CUDA storage (torch's handle, ref counter and event)."""
    reductions = untyped("torch.multiprocessing.reductions")
    args = tuple(storage._share_cuda_())
    note_ref_counter_file(args[4])
    return reductions.StorageWeakRef(storage), args


def _alive(ref: Any) -> bool:
    return ref is not None and not ref.expired()


class IpcSend(SendPathBase):
    """IPC toward one destination on this machine: its GPUs, shares, events, pending sends.

    Created toward every destination, not only those of the same node agent: two agents on
    one host share GPUs too. The set-up question tells (same machine, same device UUID).
    """

    acks = _DONE

    def __init__(self, host: PathHost, dest: Destination) -> None:
        super().__init__(host, dest)
        self.settled = False
        self.peer_uuid: str | None = None  # the GPU the receiver uses, once asked
        self.waiting = AckedSends(host.loop)
        self.shares = ShareCache()
        self.events: list[tuple[int, Any]] = []  # free (event id, event), exported already
        self._event_ids = 0
        self._streams: dict[int, Any] = {}
        # Drops were sent: the next ack collects the blocks whose mappings the receiver
        # has released since (torch keeps a freed shared block in limbo until then).
        self._collect = False

    def wants(self, msg: OutMessage) -> bool:
        # A staged message takes the inline road: no IPC set-up for it.
        return not self.settled and bool(msg.cuda) and msg.staged is None

    def ask(self, msg: OutMessage) -> dict[str, Any] | None:
        return {"cuda": True}

    def on_hello(self, reply: HelloReply) -> None:
        info = reply.cuda
        uuids, cur = (info.uuids, info.current) if info is not None else ((), -1)
        same_host = info is not None and info.host == host_identity()
        self.peer_uuid = uuids[cur] if same_host and 0 <= cur < len(uuids) else None
        self.settled = True

    def fits(self, msg: OutMessage) -> bool:
        peer = self.peer_uuid
        if peer is None or len(msg.cuda) > MAX_IPC_TENSORS:
            return False
        return all(device_uuid(t.device.index) == peer for t in msg.cuda if t.numel())

    def _stream(self, device: int) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = untyped("torch.cuda").Stream(device)
        return stream

    def _event(self, device: int) -> tuple[int, Any, Any]:
        """A free interprocess event: ``(id, event, handle or None if exported before)``."""
        if self.events:
            event_id, ev = self.events.pop()
            return event_id, ev, None
        ev = untyped("torch.cuda").Event(interprocess=True)
        ev.record(self._stream(device))  # an event must be recorded once to be exported
        event_id = self._event_ids
        self._event_ids += 1
        return event_id, ev, ev.ipc_handle()

    def place(self, msg: OutMessage, frames: list[Any]) -> Placed:
        import torch

        specs, live = cuda_specs(msg)
        device = live[0].device.index
        stream = self._stream(device)
        wait_events(stream, msg.event)
        parts: list[IpcPart] = []
        drops: list[int] = []
        exported = False
        for t in live:
            storage = t.untyped_storage()
            share_id, args, dropped = self.shares.lookup(
                storage._cdata, _alive, functools.partial(_export, storage)
            )
            drops.extend(dropped)
            exported = exported or args is not None
            parts.append(IpcPart(share_id, args, t.storage_offset() * t.element_size(),
                                 nbytes_of(t)))
        if exported or len(self.shares) > self.shares.limit:
            # A new share may push an old one out; a message of cached shares only cannot.
            drops.extend(self.shares.trim(_alive, len({p[0] for p in parts})))
        event_id, ev, handle = self._event(device)
        with torch.cuda.device(device):
            ev.record(stream)
        if drops:
            self.host.endpoint.send_oneway(
                self.dest.address or "", _CUDA, IpcDrop(self.host.name, drops).to_wire()
            )
            self._collect = True
        token = self.dest.next_token()
        fut, unpark = self.waiting.park(token, (live, ev))
        fut.add_done_callback(lambda _f: self._event_free(event_id, ev))
        new_shares = [p[0] for p in parts if p[1] is not None]

        def undo() -> None:  # the control message never left: the receiver saw none of it
            unpark()
            for share_id in new_shares:
                self.shares.forget(share_id)

        desc = IpcDesc(
            token,
            self.host.endpoint.address,
            specs,
            device_uuid(device),
            parts,
            event_id,
            handle,
        )
        return Placed(desc.to_wire(), fut, undo=undo)

    def _event_free(self, event_id: int, ev: Any) -> None:
        """A send's event is free again: pooled, or (pool full) forgotten on both sides."""
        if len(self.events) < EVENTS_PER_PEER:
            self.events.append((event_id, ev))
        elif self.dest.address is not None:
            try:
                self.host.endpoint.send_oneway(
                    self.dest.address, _CUDA, IpcDropEvent(self.host.name, event_id).to_wire()
                )
            except PeerLostError:
                pass

    def on_ack(self, ack: PathAck) -> bool:
        if not isinstance(ack, TransferDone) or not self.waiting.on_ack(ack):
            return False
        if self._collect:  # only after drops: a collect per message costs the fixed cost
            self._collect = False
            try:  # free blocks whose remote user let go (torch's IPC reference counters)
                untyped("torch.cuda").ipc_collect()
            except Exception:  # noqa: BLE001 - best effort
                pass
        return True

    def lost(self, exc: PeerLostError | LookupError) -> None:
        self.waiting.fail_all(exc, self.dest.name)
        self.close()

    def close(self) -> None:
        self.waiting.clear()
        self.shares.clear()
        self.events.clear()
        try:
            if self._streams:
                untyped("torch.cuda").ipc_collect()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass

    def statistics(self) -> PathStatistics:
        return PathStatistics(
            self.peer_uuid is not None if self.settled else None,
            in_use=len(self.waiting),
            resources=len(self.shares),
        )


class IpcRecv(RecvPathBase):
    """IPC copies from one source: its mapped shares and events, window, work thread."""

    control = _CUDA

    def __init__(self, host: PathHost, source: str) -> None:
        super().__init__(host, source)
        self.work_thread: CudaWorkThread | None = None
        self.shares: dict[int, Any] = {}  # share id -> the whole storage as a uint8 tensor
        self.events: dict[int, Any] = {}  # event id -> the sender's event, opened
        self.window = ByteWindow()
        # Accepted receives not finished yet, per share id: the sender may drop a share
        # (least recently used) while a receive that names it still waits in the window,
        # so a drop waits for them (never "unknown share" for a message sent before it).
        self._uses: dict[int, int] = {}
        self._dropped: set[int] = set()
        self._plans: OrderedDict[Any, ManyPlan] = OrderedDict()  # layout key -> plan

    def answer(self, ask: Hello, reply: dict[str, Any]) -> None:
        if ask.cuda:
            reply["cuda"] = CudaInfo.from_wire(local_cuda_info())

    def accept(
        self,
        msg: InMessage,
        desc: Sequence[Any],
        frames: Sequence[Any],
        start: int,
        posted: PostedRecv | None,
    ) -> None:
        ipc = IpcDesc.from_wire(desc)
        token, address, specs, peer_uuid, parts = (
            ipc.token, ipc.address, ipc.specs, ipc.uuid, ipc.parts)
        event_id, handle = ipc.event_id, ipc.event_handle
        try:
            ipc_device = _local_uuids().index(peer_uuid)
        except ValueError:
            raise ProtocolError(
                f"CUDA IPC from a GPU this worker cannot see ({peer_uuid})"
            ) from None
        if len(parts) > MAX_IPC_TENSORS or len(self.shares) > 2 * (
            SHARES_PER_PEER + MAX_IPC_TENSORS
        ):
            raise ProtocolError(f"{self.source} keeps more CUDA IPC shares than agreed")
        if self.work_thread is None:
            self.work_thread = CudaWorkThread(f"aiorl-ipc-{self.source}")
        fut: asyncio.Future[None] = self.host.loop.create_future()
        msg.cuda_fut = fut
        job = _IpcJob(
            msg,
            list(specs),
            posted,
            ipc_device,
            list(parts),
            event_id,
            handle,
            sum(int(p[3]) for p in parts),
            token,
            address,
            fut,
        )
        uses = self._uses
        for part in job.parts:
            uses[part[0]] = uses.get(part[0], 0) + 1
        if self.window.offer(job, job.nbytes):
            self._start(job)

    def _start(self, job: _IpcJob) -> None:
        assert self.work_thread is not None
        landed = self.work_thread.issue(self.host, self._copy, job)
        landed.add_done_callback(lambda f: self._copied(f, job))

    def _copy(self, job: _IpcJob) -> tuple[Any, Any]:
        """Work thread: pick the targets (the posted buffer, else fresh tensors), wait for the
        sender's event, copy from its memory; returns the completion event and the targets.

        The mapped source is not in what is kept: ``self.shares`` holds it, and dropping it
        synchronises the work thread's stream first (`_release`), so the copy has read it by then.
        """
        import torch

        posted, specs, ipc_device = job.posted, job.specs, job.ipc_device

        assert self.work_thread is not None
        device = selected_device()
        # A receive cancelled before the copy is issued does not get its buffer written.
        user = (
            posted.buf
            if posted is not None and job.msg.kind == K_CUDA and not posted.work.done()
            else None
        )
        if (
            user is not None
            and user.device.type == "cuda"
            and len(specs) == 1
            and (nbytes_of(user) == job.nbytes)
        ):
            assert posted is not None
            device = user.device.index
            stream = self.work_thread.stream(device)
            with torch.cuda.device(device):
                wait_events(stream, posted.event)  # the caller may still use the buffer
            targets = [user]
        elif len(job.parts) >= FLAT_MIN_TENSORS:
            stream = self.work_thread.stream(device)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                self._wait_sender(job, stream)
                targets = self._plan(job).receive(device, torch.cuda.default_stream(device))
                done = blocking_event()
                done.record(stream)
            job.msg.cuda = targets
            return done, targets
        else:
            stream = self.work_thread.stream(device)
            targets = allocate([(dtype_of(d), s) for d, s in specs], device, stream)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            self._wait_sender(job, stream)
            live = [t for t in targets if t.numel()]
            for (share_id, args, offset, n), target in zip(job.parts, live, strict=True):
                whole = self._open(share_id, args, ipc_device)
                flat_u8(target).copy_(whole[offset : offset + n], non_blocking=True)
            done = blocking_event()
            done.record(stream)
        job.msg.cuda = targets
        return done, targets

    def _wait_sender(self, job: _IpcJob, stream: Any) -> None:
        """Work thread: make ``stream`` wait for the sender's event of ``job`` (opened once)."""
        ev = self.events.get(job.event_id)
        if ev is None:
            if job.handle is None:
                raise ProtocolError(f"unknown CUDA IPC event {job.event_id} from {self.source}")
            ev = untyped("torch.cuda").Event.from_ipc_handle(job.ipc_device, job.handle)
            self.events[job.event_id] = ev
        stream.wait_event(ev)

    def _plan(self, job: _IpcJob) -> ManyPlan:
        """Work thread: the receive plan of ``job``'s layout (same specs, same shares, offsets
        and sizes as an earlier message: the kept one; else made now and kept)."""
        key = (tuple((d, tuple(s)) for d, s in job.specs),
               tuple((p[0], p[2], p[3]) for p in job.parts))
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        specs = [(dtype_of(d), s) for d, s in job.specs]
        live_specs = [spec for spec in specs if math.prod(spec[1])]
        sources = []
        for (share_id, args, offset, n), (dtype, shape) in zip(job.parts, live_specs,
                                                               strict=True):
            whole = self._open(share_id, args, job.ipc_device)
            sources.append(typed_view(whole, offset, n, dtype, shape))
        plan = self._plans[key] = ManyPlan(specs, sources, {p[0] for p in job.parts})
        while len(self._plans) > PLANS_PER_PEER:
            self._plans.popitem(last=False)
        return plan

    def _open(self, share_id: int, args: Any, ipc_device: int) -> Any:
        """Work thread: a share's whole storage as uint8, mapped once (cached until dropped)."""
        whole = self.shares.get(share_id)
        if whole is not None:
            return whole
        if args is None:
            raise ProtocolError(f"unknown CUDA IPC share {share_id} from {self.source}")
        import torch

        reductions = untyped("torch.multiprocessing.reductions")
        _dev, handle, size, offset, ref_handle, ref_offset, ev_handle, ev_sync = args
        whole = reductions.rebuild_cuda_tensor(
            torch.Tensor,
            (size,),
            (1,),
            0,
            torch.UntypedStorage,
            torch.uint8,
            ipc_device,
            handle,
            size,
            offset,
            False,
            ref_handle,
            ref_offset,
            ev_handle,
            ev_sync,
        )
        self.shares[share_id] = whole
        return whole

    def _copied(self, f: asyncio.Future[None], job: _IpcJob) -> None:
        """Loop: acknowledge to the sender, settle the receive, start what the window held."""
        error = f.exception() if not f.cancelled() else PeerLostError("abandoned")
        endpoint = self.host.endpoint
        if not endpoint.is_lost(job.address):
            try:
                err = None if error is None else f"{type(error).__name__}: {error}"
                done = TransferDone(self.host.name, job.token, err)
                endpoint.send_oneway(job.address, _DONE, done.to_wire())
            except PeerLostError:
                pass
        if error is None:
            resolve(job.fut, None)
        else:
            fail(job.fut, ProtocolError(f"CUDA IPC receive from {self.source} failed: {error}"))
        uses = self._uses
        for part in job.parts:
            share_id = part[0]
            left = uses.get(share_id, 0) - 1
            if left > 0:
                uses[share_id] = left
                continue
            uses.pop(share_id, None)
            if share_id in self._dropped:
                self._dropped.discard(share_id)
                self._drop(share_id)
        if self.work_thread is not None:
            for waiting in self.window.release(job.nbytes):
                self._start(waiting)

    def on_control(self, message: PathControl) -> None:
        """The sender dropped a share or an event: forget it after the copies that use it."""
        if self.work_thread is None:
            return
        if isinstance(message, IpcDrop):
            ids = message.share_ids
            free = []
            for share_id in ids:
                if self._uses.get(share_id):
                    self._dropped.add(share_id)  # released when the receives using it end
                else:
                    free.append(share_id)
            self._drop(*free)
        elif isinstance(message, IpcDropEvent):
            # Dropped once acknowledged: no copy waits on it.
            self.events.pop(message.event_id, None)

    def _drop(self, *share_ids: int) -> None:
        """Loop: no accepted receive uses ``share_ids`` any more; release their mappings on
        the work thread (after the copies it issued), in one work-thread job."""
        gone = set(share_ids)
        for key in [k for k, plan in self._plans.items() if plan.share_ids & gone]:
            del self._plans[key]  # its views would keep the mappings alive
        wholes = [w for w in (self.shares.pop(i, None) for i in share_ids) if w is not None]
        if wholes and self.work_thread is not None:
            self.work_thread.run(self._release, wholes)

    def _release(self, mappings: list[Any]) -> None:
        """Drop mapped storages with the work thread's stream of their device current: torch's
        deleter synchronises the current stream before the sender may reuse the block, and
        the work thread's stream holds exactly the copies that read it (the default stream would
        wait for the user's kernels). Work thread, or the loop once the work thread is closed."""
        import torch

        while mappings:
            whole = mappings.pop()
            if whole is None:
                continue
            index = whole.device.index
            stream = None if self.work_thread is None else self.work_thread.existing_stream(index)
            if stream is None:
                del whole
                continue
            with torch.cuda.device(index), torch.cuda.stream(stream):
                del whole

    def lost(self, exc: PeerLostError | LookupError) -> None:
        self.close()

    def close(self) -> None:
        self.window.clear()
        self._uses.clear()
        self._dropped.clear()
        self._plans.clear()
        mappings, self.shares = list(self.shares.values()), {}
        if mappings:
            self._release(mappings)
        if self.work_thread is not None:
            self.work_thread.close()
            self.work_thread = None
        self.events.clear()

    def statistics(self) -> PathStatistics:
        return PathStatistics(usable=True, in_use=self.window.in_flight, resources=len(self.shares))


PATH = PathSpec("cuda_ipc", IPC, True, IpcSend.create, IpcRecv.create)
