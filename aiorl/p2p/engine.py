# HOT PATH: send/recv entry points run per message.
"""Worker-to-worker point-to-point messages: ``send``/``recv`` and ``send_tensor``/``recv_tensor``.

One `P2PEngine` per process runtime (`get_p2p`). Control goes worker to
worker over the runtime's ZMQ endpoint (never through the registry); payloads take the
fastest path that fits (`aiorl.p2p.sender` explains the choice,
`aiorl.p2p.paths` lists the paths). The engine holds a
`Sender` per destination and an `Inbox`
per source, routes the endpoint's ops and peer losses to them, and owns nothing else.

Ordering (``docs/ordering.md``): every message of a (sender, receiver) pair is announced
by one control message on the sender's single connection to the receiver, in call
order, whatever its kind or path; the receiver matches control messages to posted
receives first-in first-out per sender. Beyond ``AIORL_P2P_DIRECT_PEERS`` destinations on
other nodes, a pair's control messages take one fixed route through the node agents
instead (`aiorl.p2p.p2p_relay`), FIFO at every hop, and arrive as ``p2p.via``; the receiver
grants their bytes back to the sender as it reads them (``p2p.credit``, what bounds the
agents): at once from a quarter of a window on, else within 10 ms. Every pair, direct or
relayed, also has a receive window (`aiorl.p2p.window`): the receiver tells the sender how
many messages its receives took (``p2p.taken``, within 10 ms), over the connection they came
on or back through the agents.

Threads: every public method may be called from the event loop (no thread hop) or from
another thread such as a worker's method thread. Validation and pickling happen at call
time on the caller's thread, so errors (non-contiguous tensors, unpicklable objects) are
raised synchronously; the rest runs on the loop, reached through the runtime's
``submit`` (FIFO, so calls from one thread keep their order).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from threading import get_ident as _get_ident
from typing import Any, TypeVar

from aiorl.cuda.devices import cuda_needs_init, local_cuda_info
from aiorl.errors import PeerLostError, ProtocolError, RegistryUnavailable
from aiorl.names import WorkerAddress
from aiorl.p2p.inbox import Inbox, InboxStatistics
from aiorl.p2p.message import (
    OutMessage,
    PostedRecv,
    check_buffer,
    encode_object,
    encode_tensor,
)
from aiorl.p2p.p2p_relay import (
    RelayRoute,
    direct_peers,
    node_agent_endpoint,
    relay_stall_s,
    relay_window,
)
from aiorl.p2p.paths.cuda_host import stage
from aiorl.p2p.paths.cuda_ipc import release_ref_counter_files
from aiorl.p2p.sender import Sender, SenderStatistics
from aiorl.p2p.settings import RESOLVE_RETRY_S
from aiorl.p2p.window import ReceiveWindow, receive_window
from aiorl.protocol.ops import AgentOp, P2POp
from aiorl.protocol.p2p import (
    Hello,
    PathAck,
    PathControl,
    SegmentAck,
    SegmentDrop,
    Taken,
    TransferDone,
    batch_from_wire,
    cuda_control_from_wire,
    data_from_wire,
)
from aiorl.protocol.p2p_relay import (
    P2P_CREDIT,
    P2P_TAKEN,
    P2P_UNDELIVERED,
    RelayedP2P,
    ViaP2P,
    envelope_bytes,
)
from aiorl.runtime import AsyncWork, Runtime
from aiorl.runtime.promise import reject, trace_until_settled
from aiorl.runtime.waiter import BlockingWaiter
from aiorl.trace import recorder as _trace
from aiorl.transport.endpoint import Incoming
from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["P2PEngine", "P2PStatistics", "get_p2p"]

log = logging.getLogger("aiorl.p2p")
#: What a peer can repeat (a malformed relayed message) is logged once a second at most.
_warn = RateLimitedLog(log)

#: A source's messages came from a newer process than the dead one the runtime knows of:
#: how soon to resolve its name again (doubling up to the maximum) until it is ready.
_REWATCH_FIRST_S = 0.02
#: The ops as plain strs (an enum member costs msgpack a slow path per message).
_RELAY_P2P = AgentOp.RELAY_P2P.value
_DATA, _BATCH = P2POp.DATA.value, P2POp.BATCH.value
#: Credit owed to a relayed source below a quarter of its window waits this long for more
#: (`P2PEngine._grant`), and so does a direct source's count of messages taken
#: (`P2PEngine._owe_taken`).
GRANT_DELAY_S = 0.01
_TAKEN = P2POp.TAKEN.value
_REWATCH_MAX_S = 1.0
_M = TypeVar("_M")


@dataclass(frozen=True)
class P2PStatistics:
    """What the engine of one process holds, by peer name (for tests and debugging)."""

    senders: Mapping[str, SenderStatistics]
    inboxes: Mapping[str, InboxStatistics]
    #: Destinations on other nodes this process holds a direct connection to (its budget).
    direct_remote: int = 0


#: Group names this process already checked against the name grammar (a worker sends to a
#: handful of groups; checking once keeps the regular expression off the per-message path).
_checked_groups: set[str] = set()


def _worker_name(group: str, rank: int | Sequence[int]) -> str:
    """The name of worker ``group:rank``; ValueError at once for a name outside the grammar.

    At the call, not later: resolving a malformed name on the loop raised inside the
    resolution task, where nothing told the operation, and the send or receive waited for
    ever (docs/ordering.md, "Errors at the sender").
    """
    if type(rank) is int and rank >= 0 and type(group) is str and group in _checked_groups:
        return f"{group}:{rank}"
    name = WorkerAddress(group, rank).get_name()
    _checked_groups.add(group)
    return name


def _answer_hello(msg: Incoming, ib: Inbox, hello: Hello) -> None:
    """Answer a ``p2p.hello``, or say why not: the sender then goes on without the paths that
    needed the answer (`Sender._hello`) instead of waiting out ``HELLO_TIMEOUT_S``. The
    endpoint answers for a handler that raises, but not for this answer deferred behind a
    first CUDA initialisation, which may fail (a broken driver, no device left)."""
    try:
        reply = ib.answer(hello)
    except Exception as exc:  # noqa: BLE001 - goes back to the asking sender
        log.warning("p2p set-up asked by %s cannot be answered: %s", ib.name, exc)
        msg.reply_error(exc)
        return
    msg.reply(reply.to_wire())


class P2PEngine:
    """The point-to-point engine of one process. Obtain it with `get_p2p`.

    ``node_id`` is this worker's node (None in a driver): payload paths that need one
    node (shared memory, CMA, CUDA IPC) apply only toward workers of the same node.
    ``agent``: that node's agent endpoint, where relayed messages and credits go (looked up
    in the registry when not given).
    """

    def __init__(self, runtime: Runtime, node_id: str | None, agent: str | None = None) -> None:
        self.runtime = runtime
        self.loop: asyncio.AbstractEventLoop = runtime.loop
        self.endpoint = runtime.endpoint
        self.name: str = runtime.name
        self.pid = os.getpid()
        self.node_id = node_id or None
        self.waiter: BlockingWaiter = runtime.waiter
        self._closed = False
        self._senders: dict[str, Sender] = {}
        self._inboxes: dict[str, Inbox] = {}
        self._sender_by_address: dict[str, Sender] = {}
        self._inbox_by_address: dict[str, Inbox] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: At most this many destinations on other nodes get a direct connection ...
        self.direct_peers = direct_peers()
        #: ... these (by address); later ones are relayed through the node agents.
        self._direct_remote: set[str] = set()
        self._agent: asyncio.Future[str | None] | None = None  # this node's agent endpoint
        if agent is not None:
            self._agent = self.loop.create_future()
            self._agent.set_result(agent)
        #: A relayed pair's window (bytes sent and not yet granted back by the receiver).
        self.relay_window = relay_window()
        self.relay_stall_s = relay_stall_s()
        #: Credit owed to relayed sources, by (node, address): see `_grant`.
        self._grants: dict[tuple[str, str], int] = {}
        self._grants_soon = False  # a send of the grants at the end of this loop iteration
        self._grants_later: asyncio.TimerHandle | None = None  # ... or after GRANT_DELAY_S
        #: Every pair's receive window: what a receiver may hold from one sender untaken.
        self.receive_window = receive_window()
        #: Inboxes whose sender is owed a count of messages taken (`_owe_taken`).
        self._owing: list[Inbox] = []
        self._taken_later: asyncio.TimerHandle | None = None
        #: Counts of messages taken owed to relayed sources, waiting for this node's agent
        #: to be known: (the source's node, its address, count).
        self._taken_back: list[tuple[str, str, int]] = []
        # Bound once: on every call's path.
        self._loop_tid = runtime.loop_thread.thread_id  # compared inline on each send/recv
        self._submit = runtime.submit
        ep = self.endpoint
        ep.handle(_DATA, self._on_data)
        ep.handle(_BATCH, self._on_batch)
        ep.handle(P2POp.ACK.value, partial(self._on_ack, read=SegmentAck.from_wire))
        ep.handle(P2POp.DONE.value, partial(self._on_ack, read=TransferDone.from_wire))
        ep.handle(P2POp.DROP.value, partial(self._on_control, read=SegmentDrop.from_wire))
        ep.handle(P2POp.CUDA.value, partial(self._on_control, read=cuda_control_from_wire))
        ep.handle(P2POp.HELLO.value, self._on_hello)
        ep.handle(P2POp.VIA.value, self._on_via)
        ep.on_event(_TAKEN, self._on_taken)
        self._via_handlers = {_DATA: self._on_data, _BATCH: self._on_batch}
        ep.on_peer_lost(self._on_peer_lost)
        runtime.on_close(self.close)

    # ------------------------------------------------------------------ public API
    def send(self, obj: Any, dst_group_name: str, dst_rank: int | Sequence[int]) -> AsyncWork[None]:
        """Send ``obj`` to worker ``dst_group_name:dst_rank``; done when ``obj`` may be reused.

        Raises at once `ValueError` for a non-contiguous tensor and
        `SerializationError` (a TypeError)
        for an object that cannot be pickled.
        """
        msg = encode_object(obj)
        if msg.cuda:
            stage(msg)  # small CUDA tensors: copied to pinned memory now, sent inline
        return self._start_send(_worker_name(dst_group_name, dst_rank), msg)

    def send_tensor(
        self, tensor: Any, dst_group_name: str, dst_rank: int | Sequence[int]
    ) -> AsyncWork[None]:
        """Send one contiguous tensor into the receiver's preallocated buffer (``recv_tensor``)."""
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(
                f"send_tensor needs a dense torch.Tensor, got {type(tensor).__qualname__}"
            )
        name = _worker_name(dst_group_name, dst_rank)
        msg = encode_tensor(tensor)
        msg.raw = True
        if msg.cuda:
            stage(msg)
        return self._start_send(name, msg)

    def recv(self, src_group_name: str, src_rank: int | Sequence[int]) -> AsyncWork[Any]:
        """Receive the next message from ``src_group_name:src_rank`` (whatever was sent)."""
        return self._start_recv(_worker_name(src_group_name, src_rank), None)

    def recv_tensor(
        self, buf: Any, src_group_name: str, src_rank: int | Sequence[int]
    ) -> AsyncWork[Any]:
        """Fill ``buf`` with the next message from the source; the work's result is ``buf``.

        The message must carry as many bytes as ``buf`` holds (a ``send_tensor`` of a
        tensor of the same size, or a ``send`` of one); its bytes are taken as ``buf``'s
        dtype and shape.
        """
        check_buffer(buf)
        return self._start_recv(_worker_name(src_group_name, src_rank), buf)

    # ------------------------------------------------------------------ onto the loop
    def _start_send(self, name: str, msg: OutMessage) -> AsyncWork[None]:
        work: AsyncWork[None] = AsyncWork(self.loop)
        if _trace.ON:
            self._trace(work, "send", name, msg.nbytes + len(msg.pickle or b""))
        if self._closed:
            reject(work, PeerLostError(f"cannot send to {name}: the p2p engine is closed"))
        elif _get_ident() == self._loop_tid:
            (self._senders.get(name) or self.sender(name)).submit(msg, work)
        else:
            self._submit(self._send_on_loop, name, msg, work)
        return work

    def _send_on_loop(self, name: str, msg: OutMessage, work: AsyncWork[None]) -> None:
        (self._senders.get(name) or self.sender(name)).submit(msg, work)

    def _start_recv(self, name: str, buf: Any) -> AsyncWork[Any]:
        event = None
        if buf is not None and buf.device.type == "cuda":
            from aiorl.p2p.message import record_event

            event = record_event(buf)  # the caller's stream may still use the buffer
        work: AsyncWork[Any] = AsyncWork(self.loop)
        if _trace.ON:
            self._trace(work, "recv", name, 0)
        posted = PostedRecv(work, buf, event)
        if self._closed:
            reject(work, PeerLostError(f"cannot receive from {name}: the p2p engine is closed"))
        elif _get_ident() == self._loop_tid:
            (self._inboxes.get(name) or self.inbox(name)).post(posted)
        else:
            self._submit(self._recv_on_loop, name, posted)
        return work

    def _recv_on_loop(self, name: str, posted: PostedRecv) -> None:
        (self._inboxes.get(name) or self.inbox(name)).post(posted)

    def _trace(self, work: AsyncWork[Any], kind: str, peer: str, nbytes: int) -> None:
        """Tracing: a span until ``work`` settles, linked to its counterpart in ``peer``.

        The k-th send from A to B is the k-th receive of B from A (docs/ordering.md), so
        each end names the flow by the pair and its own count.
        """
        span = _trace.Span(kind, kind, peer)
        span.nbytes = nbytes
        if kind == "send":
            span.flow_out = _trace.flow_seq(f"{self.name}>{peer}/p2p")
        else:
            span.flow_in = _trace.flow_seq(f"{peer}>{self.name}/p2p")
        trace_until_settled(work, span)

    # ------------------------------------------------------------------ what the doctor sees
    def waits(self) -> list[dict[str, Any]]:
        """Every receive posted and not matched (``{"kind": "recv", "peer", "address"}``) and
        every send not yet taken by its receiver (``{"kind": "send", "peer", "resolved"}``):
        what ``aiorl doctor`` lists as this process's waits on its peers."""
        out: list[dict[str, Any]] = []
        for name, inbox in self._inboxes.items():
            out += [{"kind": "recv", "peer": name, "address": inbox.address}
                    for _ in inbox.posted]
        for name, sender in self._senders.items():
            waiting = len(sender.backlog) + len(sender.pending)
            out += [{"kind": "send", "peer": name, "resolved": sender.ready}
                    for _ in range(waiting)]
        return out

    def arrived(self) -> int:
        """Messages that arrived and wait for their receive."""
        return sum(len(inbox.arrived) for inbox in self._inboxes.values())

    # ------------------------------------------------------------------ peers
    def sender(self, name: str) -> Sender:
        """The Sender toward worker ``name``, created (and its resolution started) once."""
        s = self._senders.get(name)
        if s is None:
            s = self._senders[name] = Sender(self, name)
            if self._closed:
                s.lost(PeerLostError("the p2p engine is closed"))
            else:
                self.spawn(self._resolve_sender(s))
        return s

    def inbox(self, name: str) -> Inbox:
        """The Inbox for worker ``name``, created (and the source watched for loss) once."""
        ib = self._inboxes.get(name)
        if ib is None:
            ib = self._inboxes[name] = Inbox(self, name, self._owe_taken)
            if not self._closed:
                self.spawn(self._watch_source(ib))
        return ib

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task of the engine (cancelled when it closes)."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str) -> dict[str, Any] | PeerLostError | LookupError:
        """The peer's registry info once it is ready (waits for ever), or why it never will be."""
        while True:
            try:
                return await self.runtime.resolve_worker(name, timeout=RESOLVE_RETRY_S)
            except TimeoutError:
                log.info("%s: still waiting for worker %s to be ready", self.name, name)
            except RegistryUnavailable:
                await asyncio.sleep(1.0)
            except (PeerLostError, LookupError) as exc:
                return exc  # LookupError: no such group or rank; the operations fail with it
            except Exception as exc:  # noqa: BLE001 - e.g. the registry refused the watch
                # Raised here, it would end the resolution task and leave the operations
                # waiting for ever; they fail with it instead (a later one resolves again).
                log.warning("%s: cannot resolve worker %s: %r", self.name, name, exc)
                lost = PeerLostError(f"cannot resolve worker {name}: {exc}")
                lost.__cause__ = exc
                return lost

    async def _resolve_sender(self, s: Sender) -> None:
        info = await self._resolve(s.name)
        if not isinstance(info, dict):
            self._sender_lost(s, info)
            return
        address: str = info["endpoint"]
        peer_node = info.get("node_id") or None
        self._sender_by_address[address] = s
        if self.endpoint.is_lost(address):
            self._sender_lost(s, PeerLostError(f"worker {s.name} is gone"))
            return
        same_node = peer_node is not None and peer_node == self.node_id
        relay = None
        if not same_node and peer_node is not None and address not in self._direct_remote:
            if len(self._direct_remote) < self.direct_peers:
                self._direct_remote.add(address)
            else:
                relay = await self._relay_route(peer_node, address)
                if s.lost_exc is not None:
                    return  # lost while this node's agent was looked up
        s.on_resolved(address, same_node, ReceiveWindow(self.receive_window), relay)

    async def _relay_route(self, peer_node: str, address: str) -> RelayRoute | None:
        """The route through the node agents to ``address``; None (a direct connection)
        where this process has no agent to relay through (a driver, no registry)."""
        if self._agent is None or (self._agent.done() and self._agent.result() is None):
            self._agent = self.loop.create_future()
            self.spawn(self._find_agent(self._agent))
        agent = await asyncio.shield(self._agent)
        if agent is None:
            self._direct_remote.add(address)
            return None
        assert self.node_id is not None  # an agent was found for it
        return RelayRoute(self.endpoint, agent, peer_node, address, self.endpoint.identity,
                          self.node_id, self.relay_window, self.relay_stall_s)

    async def _find_agent(self, found: asyncio.Future[str | None]) -> None:
        agent = await node_agent_endpoint(self.runtime.registry, self.node_id, self.name)
        if not found.done():
            found.set_result(agent)

    async def _watch_source(self, ib: Inbox) -> None:
        """Resolve the sender through the registry so that its death fails our receives.

        The death the runtime knows for the name may be an earlier process's: a restarted
        rank (or a new group of that name) can send before this process has heard that it
        is ready, and its first messages then reach a fresh Inbox whose resolution fails at
        once with the predecessor's death. Those messages are not dropped with it: while
        the registry's last record of the name is not the end of the process they come
        from, the name is resolved again until the new process is ready (or ends).
        """
        delay = _REWATCH_FIRST_S
        while True:
            info = await self._resolve(ib.name)
            if isinstance(info, dict) or not self._death_of_a_predecessor(ib, info):
                break
            await asyncio.sleep(delay)
            delay = min(2 * delay, _REWATCH_MAX_S)
            if ib.lost_exc is not None:
                return  # failed meanwhile (the engine closed)
        if not isinstance(info, dict):
            self._inbox_lost(ib, info)
            return
        address: str = info["endpoint"]
        ib.address = address
        self._inbox_by_address[address] = ib
        if self.endpoint.is_lost(address):
            self._inbox_lost(ib, PeerLostError(f"worker {ib.name} is gone"))

    def _death_of_a_predecessor(self, ib: Inbox, exc: PeerLostError | LookupError) -> bool:
        """Whether the loss ``exc`` of ``ib``'s name is not that of the process whose
        messages ``ib`` holds: the registry's last record of the name is a live process, or
        the end of another one (another pid). Without a message yet, or without a record
        to compare, the loss stands (receives from a dead name fail at once)."""
        if ib.sender is None or not isinstance(exc, PeerLostError):
            return False
        record = self.runtime.registry.known.get(ib.name)
        if record is None:
            return False
        if not record.state.is_final:
            return True  # a process of the name is starting or ready: the sender
        sender_pid, dead_pid = _pid_of(ib.sender), record.info.pid
        return 0 not in (sender_pid, dead_pid) and sender_pid != dead_pid

    def _on_peer_lost(self, address: str, exc: BaseException) -> None:
        """A peer process is gone: what is pending toward it or from it fails, and its name's
        Sender and Inbox are forgotten, so that a later send or recv resolves the name again:
        a restarted rank (a new incarnation at a new address) is reached, a dead one fails."""
        lost = exc if isinstance(exc, (PeerLostError, LookupError)) else PeerLostError(str(exc))
        s = self._sender_by_address.pop(address, None)
        if s is not None:
            self._sender_lost(s, lost)
        self._direct_remote.discard(address)  # its connection is closed: a slot is free
        ib = self._inbox_by_address.pop(address, None)
        if ib is not None:
            self._inbox_lost(ib, lost)

    def _sender_lost(self, s: Sender, exc: PeerLostError | LookupError) -> None:
        s.lost(exc)
        if self._senders.get(s.name) is s:
            del self._senders[s.name]

    def _inbox_lost(self, ib: Inbox, exc: PeerLostError | LookupError) -> None:
        ib.lost(exc)
        if self._inboxes.get(ib.name) is ib:
            del self._inboxes[ib.name]

    # ------------------------------------------------------------------ op handlers
    # A malformed one-way message is dropped with a warning (`_malformed`): the peer that
    # sent it gets no answer to act on, and the pair's other messages go on.
    def _on_data(self, msg: Incoming) -> None:
        try:
            src, kind, head, bufdesc, cudadesc = data_from_wire(msg.meta)
        except ProtocolError as exc:
            self._malformed(msg, exc)
            return
        ib = self._inboxes.get(src) or self.inbox(src)
        if ib.sender is None:
            ib.sender = msg.identity
        ib.handle(kind, head, bufdesc, cudadesc, msg.frames)

    def _on_batch(self, msg: Incoming) -> None:
        try:
            src, entries = batch_from_wire(msg.meta, len(msg.frames))
        except ProtocolError as exc:
            self._malformed(msg, exc)
            return
        ib = self._inboxes.get(src) or self.inbox(src)
        if ib.sender is None:
            ib.sender = msg.identity
        ib.handle_batch(entries, msg.frames)

    def _on_ack(self, msg: Incoming, read: Callable[[object], PathAck]) -> None:
        """``p2p.ack``/``p2p.done`` from a receiver, read by ``read``: to the Sender toward it."""
        ack = self._read(msg, read)
        if ack is not None and (s := self._senders.get(ack.src)) is not None:
            s.on_ack(msg.op, ack)

    def _on_control(self, msg: Incoming, read: Callable[[object], PathControl]) -> None:
        """``p2p.drop``/``p2p.cuda`` from a sender, read by ``read``: to the Inbox for it."""
        control = self._read(msg, read)
        if control is not None and (ib := self._inboxes.get(control.src)) is not None:
            ib.on_control(msg.op, control)

    def _read(self, msg: Incoming, read: Callable[[object], _M]) -> _M | None:
        """``read(msg.meta)``, or None for a malformed message (dropped)."""
        try:
            return read(msg.meta)
        except ProtocolError as exc:
            self._malformed(msg, exc)
            return None

    def _malformed(self, msg: Incoming, exc: ProtocolError) -> None:
        """Drop a one-way message that does not read as its op says (logged once a second
        at most: a broken peer may repeat it)."""
        _warn.warning(msg.op, "%s: dropped a malformed %s message: %s", self.name, msg.op, exc)

    def _on_via(self, msg: Incoming) -> None:
        """``p2p.via`` from a node agent: a relayed message, served as the inner op from the
        original sender (its routing id is what the Inbox and `_death_of_a_predecessor` see)."""
        try:
            via = ViaP2P.from_wire(msg.meta)
        except ProtocolError as exc:
            _warn.warning("p2p.via", "%s: dropped a malformed relayed p2p message: %s", self.name, exc)
            return
        if via.op == P2P_CREDIT:
            s = self._sender_by_address.get(via.src_address)
            if s is not None and s.relay is not None:
                s.relay.release(via.meta[0])
            return  # else: a Sender that is gone, or a direct one: nothing to grant
        if via.op == P2P_TAKEN:
            self._on_taken(via.src_address, via.meta, msg.frames)
            return
        if via.op == P2P_UNDELIVERED:
            # A message of ours was lost on the way: the pair fails, and stays failed (later
            # sends too) until the receiver's death is known, which forgets the Sender.
            s = self._sender_by_address.get(via.src_address)
            if s is not None:
                s.lost(PeerLostError(f"cannot send to {s.name}: {via.meta[0]}"))
            return
        inner = Incoming(self.endpoint, via.src_identity, msg.kind, 0, via.op, via.meta, msg.frames)
        try:
            self._via_handlers[via.op](inner)
        finally:  # read, handled or not: the sender may send these bytes again
            self._grant(via.src_node, via.src_address, envelope_bytes(msg.frames))
        src = via.meta[0] if via.meta else None  # the handler made its Inbox, if well formed
        if type(src) is str and (ib := self._inboxes.get(src)) is not None and ib.route_back is None:
            ib.route_back = (via.src_node, via.src_address)  # where its p2p.taken goes

    def _grant(self, node: str, address: str, nbytes: int) -> None:
        """Owe ``nbytes`` of credit to the relayed source at ``address``.

        Once a source is owed a quarter of a window, what it is owed goes back at the end of
        this loop iteration (a sender streaming at full speed is never held up by its own
        credit); less goes back after ``GRANT_DELAY_S``, with whatever came meanwhile. A
        credit per small message would double what the agents forward: measured, it doubled
        a relayed round trip. A sender can then wait for its credit only while three
        quarters of a window are on their way here (which brings it), and an idle pair's
        credit is home, and the agents' counts exact, within ``GRANT_DELAY_S``.
        """
        key = (node, address)
        owed = self._grants[key] = self._grants.get(key, 0) + nbytes
        if owed >= self.relay_window >> 2:
            if not self._grants_soon:
                self._grants_soon = True
                self.loop.call_soon(self._send_grants)
        elif self._grants_later is None:
            self._grants_later = self.loop.call_later(GRANT_DELAY_S, self._send_grants)

    def _send_grants(self) -> None:
        """Send what is owed, through this node's agent (the relayed route back)."""
        self._grants_soon = False
        if self._grants_later is not None:
            self._grants_later.cancel()
            self._grants_later = None
        if not self._grants or self._closed:
            return
        agent = self._agent_back(self._send_grants)
        if agent is None:
            return
        grants, self._grants = self._grants, {}
        if not agent:  # not a node's worker: no route back (relayed messages reach workers)
            return
        self._relay_back(agent, P2P_CREDIT, [(*src, [nbytes]) for src, nbytes in grants.items()])

    def _agent_back(self, again: Callable[[], None]) -> str | None:
        """This node's agent, where what a relayed source is owed goes back: its endpoint,
        "" where there is none (a driver), or None while it is looked up (``again`` runs
        once it is known)."""
        found = self._agent
        if found is None:
            found = self._agent = self.loop.create_future()
            self.spawn(self._find_agent(found))
        if not found.done():
            found.add_done_callback(lambda _f: again())
            return None
        return found.result() or ""

    def _relay_back(self, agent: str, op: str, owed: list[tuple[str, str, list[Any]]]) -> None:
        """Send ``op`` with each meta of ``owed`` to its relayed source (node, address),
        through this node's ``agent`` (the relayed route back)."""
        assert self.node_id is not None  # a worker's engine: relayed messages reach workers
        me, identity, node = self.endpoint.address, self.endpoint.identity, self.node_id
        for src_node, src_address, meta in owed:
            back = RelayedP2P(src_node, src_address, identity, op, meta, node, me)
            try:
                self.endpoint.send_oneway(agent, _RELAY_P2P, back.to_wire())
            except Exception as exc:  # noqa: BLE001 - our agent is gone: so is this node
                _warn.warning(op, "%s: cannot send %s to a relayed source: %s", self.name, op, exc)
                return

    def _owe_taken(self, ib: Inbox) -> None:
        """Receives took a message from ``ib``'s source: tell it within ``GRANT_DELAY_S``,
        with whatever else was taken meanwhile (one ``p2p.taken`` per source and delay, not
        per message: a small message's round trip stays one message each way)."""
        self._owing.append(ib)
        if self._taken_later is None:
            self._taken_later = self.loop.call_later(GRANT_DELAY_S, self._send_taken)

    def _send_taken(self) -> None:
        """Tell each owed source how many of its messages were taken (its window's grant),
        back the way its messages came: over their connection (no connection of our own to
        it), or through the node agents."""
        self._taken_later = None
        owing, self._owing = self._owing, []
        for ib in owing:
            count, ib.taken = ib.taken, 0
            if ib.sender is None or ib.lost_exc is not None or self._closed:
                continue  # a lost source needs no grant
            if ib.route_back is not None:
                self._taken_back.append((*ib.route_back, count))
            else:
                self.endpoint.push_event(ib.sender, _TAKEN, Taken(self.name, count).to_wire())
        if self._taken_back:
            self._send_taken_back()

    def _send_taken_back(self) -> None:
        """Send the counts owed to relayed sources, through this node's agent."""
        if self._closed:
            return
        agent = self._agent_back(self._send_taken_back)
        if agent is None:
            return
        owed, self._taken_back = self._taken_back, []
        if agent:
            self._relay_back(agent, P2P_TAKEN,
                             [(node, address, [self.name, n]) for node, address, n in owed])

    def _on_taken(self, address: str, meta: Any, frames: list[Any]) -> None:
        """``p2p.taken`` from the receiver at ``address``: its receives took that many of our
        messages. Matched by address, so a dead receiver's word never reaches the Sender
        toward its successor."""
        try:
            taken = Taken.from_wire(meta)
        except ProtocolError as exc:
            _warn.warning(_TAKEN, "%s: dropped a malformed %s event: %s", self.name, _TAKEN, exc)
            return
        s = self._sender_by_address.get(address)
        if s is not None and s.name == taken.src and s.receive is not None:
            s.receive.taken(taken.count)

    def _on_hello(self, msg: Incoming) -> None:
        """A sender's set-up questions; a malformed one raises, and the endpoint answers the
        error (the sender goes on without the paths that asked)."""
        hello = Hello.from_wire(msg.meta)
        ib = self.inbox(hello.src)
        if ib.sender is None:
            ib.sender = msg.identity
        if hello.cuda and cuda_needs_init():
            # This process's first CUDA use: initialise it off the loop, answer after.
            fut = self.loop.run_in_executor(None, local_cuda_info)
            fut.add_done_callback(lambda _f: _answer_hello(msg, ib, hello))
            return
        _answer_hello(msg, ib, hello)

    # ------------------------------------------------------------------ state
    @property
    def closed(self) -> bool:
        return self._closed

    def on_loop(self) -> bool:
        return _get_ident() == self._loop_tid

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the loop, from any thread, in submission order."""
        self._submit(fn, *args)

    def statistics(self) -> P2PStatistics:
        """A snapshot of every Sender and Inbox (loop thread)."""
        return P2PStatistics(
            senders={name: s.statistics() for name, s in self._senders.items()},
            inboxes={name: ib.statistics() for name, ib in self._inboxes.items()},
            direct_remote=len(self._direct_remote),
        )

    def close(self) -> None:
        """Release shared memory and CUDA resources; later operations fail (the runtime stops)."""
        if self._closed:
            return
        self._closed = True
        closed = PeerLostError("the p2p engine is closed")
        for s in self._senders.values():
            s.lost(closed)
            s.close()
        for ib in self._inboxes.values():
            ib.lost(closed)
            ib.close()
        for task in list(self._tasks):
            task.cancel()
        if self._taken_later is not None:
            self._taken_later.cancel()
        # Last: torch unlinks its CUDA IPC reference-counter files only in a static
        # destructor, which a forked worker's os._exit skips (the files stayed in /dev/shm).
        release_ref_counter_files()


def _pid_of(identity: bytes) -> int:
    """The process id in an endpoint's routing identity (``name/pid/nonce``); 0 if none."""
    try:
        return int(identity.rsplit(b"/", 2)[-2])
    except (IndexError, ValueError):
        return 0


def get_p2p(runtime: Runtime, node_id: str | None = None, agent: str | None = None) -> P2PEngine:
    """The point-to-point engine of ``runtime``, created (and its handlers registered) once.

    Worker processes create it when they start (with their node id), so a worker that
    never calls a p2p method still accepts messages sent to it.
    """
    return runtime.service(P2PEngine, runtime, node_id, agent)
