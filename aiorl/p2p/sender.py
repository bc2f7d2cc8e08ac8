# HOT PATH: the inline branch (submit -> _enqueue -> _flush) runs per small message.
"""The sending side of one (this worker -> destination) pair: a `Sender`.

A send becomes exactly one control message on this process's single connection to
the receiver, in call order (``docs/ordering.md``). The Sender keeps that order:

1. **Resolution.** The first send starts resolving the destination through the
   registry; until it is known, sends wait in the *backlog*, in order.
2. **Set-up.** A same-node payload path may need one question answered first
   (``p2p.hello``: can the receiver map our memory, read it, which GPU does it use?).
   The questions of every path that needs one travel together; later sends queue
   behind it. Once the backlog is empty, sends go out synchronously at call time.
3. **Path choice** (`Sender._emit`), for a message that needs nothing else:

   * *inline*, no path: a pickle below ``INLINE_MAX`` without out-of-band buffers, or one
     CPU tensor below it, is queued and sent at the end of the loop iteration together
     with the other small messages to this destination (``p2p.batch``, up to
     ``BATCH_MAX_MSGS`` messages / ``BATCH_MAX_BYTES``);
   * otherwise the pending batch is flushed first (order), then the message's CPU bytes
     take the first CPU path (`aiorl.p2p.paths.CPU_PATHS`: CMA, shared memory,
     frames) that fits and does not decline, and its CUDA tensors the first CUDA path
     (small ones inline through pinned memory, CUDA IPC, NCCL); all-empty CUDA tensors
     take none (``NOTHING``). A message whose small CUDA tensors are still being copied
     to pinned memory waits in the backlog until the copy is done, and later sends
     behind it.
4. **Completion**: when every path that placed part of the message says its bytes may
   be reused (at once, ZMQ released the frames, the receiver read them, the GPU is done).
   Before each message a Sender checks its pair's windows (`aiorl.p2p.window`): every
   pair's receive window, what the receiver holds that no receive has taken (each message
   charged its `message_cost` once it left), and a relayed pair's credit too
   (`aiorl.p2p.p2p_relay`). Sends behind a spent window wait in the backlog, in order.

Loss: `Sender.lost` fails the backlog, the batch and the pending sends, then lets
each path fail what it still waits for (its own completion tokens) and release its
resources. Later sends fail at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiorl.errors import PeerLostError, ProtocolError
from aiorl.p2p.message import OutMessage, cuda_specs, nbytes_of
from aiorl.p2p.paths import CPU_PATHS, CUDA_PATHS, RELAYED_PATHS
from aiorl.p2p.paths.base import (
    PathHost,
    PathStatistics,
    Placed,
    SendPath,
    fail,
    lost_error,
    resolve,
)
from aiorl.p2p.paths.cuda_host import stage, staged_future, staged_ready
from aiorl.p2p.settings import BATCH_MAX_BYTES, BATCH_MAX_MSGS, HELLO_TIMEOUT_S
from aiorl.p2p.window import MESSAGE_COST, ReceiveWindow, Window
from aiorl.protocol.ops import P2POp
from aiorl.protocol.p2p import (
    K_OBJ,
    OBJECT_ENTRY,
    EmptyCudaDesc,
    Hello,
    HelloReply,
    PathAck,
    batch_to_wire,
    data_to_wire,
    frames_to_wire,
)
from aiorl.runtime.promise import reject as reject_work
from aiorl.runtime.promise import resolve as resolve_work

if TYPE_CHECKING:
    from aiorl.p2p.p2p_relay import RelayRoute
    from aiorl.runtime import AsyncWork

__all__ = ["Sender", "SenderStatistics"]

log = logging.getLogger("aiorl.p2p")

#: The ops as plain strs (an enum member costs msgpack a slow path per message).
_DATA, _BATCH, _HELLO = P2POp.DATA.value, P2POp.BATCH.value, P2POp.HELLO.value
#: A relayed Sender's CUDA tensors all travel through pinned host memory, whatever their size.
_NO_LIMIT = 1 << 62


class SenderHost(PathHost, Protocol):
    """What a Sender uses of its engine: what its paths use, and a place to run tasks."""

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...


@dataclass(frozen=True)
class SenderStatistics:
    """One destination as its Sender sees it."""

    same_node: bool
    resolved: bool
    backlog: int  # sends waiting for resolution or set-up
    batched: int  # small sends waiting for the end of the loop iteration
    pending: int  # sends out but not complete yet
    lost: bool
    paths: Mapping[str, PathStatistics]  # by path name; only the paths that apply
    relayed: bool = False  # through the node agents (`aiorl.p2p.p2p_relay`), not a connection
    #: The pair's receive window (`aiorl.p2p.window`): what the receiver holds that no
    #: receive has taken, as charged (payload bytes and `MESSAGE_COST` per message).
    outstanding: int = 0
    #: A relayed pair's credit: the bytes sent that the receiver has not read yet.
    unread: int = 0

    def usable(self, path: str) -> bool | None:
        """Whether ``path`` was found usable toward this destination (None: not probed)."""
        stats = self.paths.get(path)
        return None if stats is None else stats.usable


class Sender:
    """Everything about sending to one destination (loop thread only)."""

    __slots__ = (
        "engine",
        "name",
        "address",
        "same_node",
        "relay",
        "windows",
        "receive",
        "ready",
        "resolved",
        "backlog",
        "pumping",
        "lost_exc",
        "cpu_paths",
        "cuda_paths",
        "askers",
        "path_names",
        "pending",
        "outbox",
        "outbox_frames",
        "outbox_works",
        "outbox_bytes",
        "flush_scheduled",
        "_tokens",
        "_src",
    )

    def __init__(self, engine: SenderHost, name: str) -> None:
        self.engine = engine
        self.name = name
        self.address: str | None = None
        self.same_node = False
        self.relay: RelayRoute | None = None
        #: The pair's messages the receiver holds untaken (`aiorl.p2p.window`).
        self.receive: ReceiveWindow | None = None
        #: What a send waits for while one is spent: the receive window, and a relay's credit.
        self.windows: tuple[Window, ...] = ()
        self.ready = False
        self.resolved: asyncio.Future[None] = engine.loop.create_future()
        self.backlog: deque[tuple[OutMessage, AsyncWork[None]]] = deque()
        self.pumping = False
        self.lost_exc: BaseException | None = None
        self.cpu_paths: tuple[SendPath, ...] = ()
        self.cuda_paths: tuple[SendPath, ...] = ()
        self.askers: tuple[SendPath, ...] = ()  # paths that may still need a set-up question
        self.path_names: dict[str, SendPath] = {}
        self.pending: set[AsyncWork[None]] = set()
        # Small messages waiting for the end of this loop iteration: metas, frames, works.
        self.outbox: list[list[Any]] = []
        self.outbox_frames: list[Any] = []
        self.outbox_works: list[AsyncWork[None]] = []
        self.outbox_bytes = 0
        self.flush_scheduled = False
        self._tokens = itertools.count(1)
        self._src = engine.name

    def next_token(self) -> int:
        """A completion token unique toward this destination (paths that wait for
        ``p2p.done`` draw theirs here, so the reply finds the path that placed it)."""
        return next(self._tokens)

    # ------------------------------------------------------------------ resolution
    def on_resolved(self, address: str, same_node: bool, receive: ReceiveWindow | None = None,
                    relay: RelayRoute | None = None) -> None:
        """The destination is known: create the paths that apply to it and start sending.

        ``receive``: the pair's receive window (what the receiver holds untaken).
        ``relay``: this pair's messages go through the node agents (for the Sender's
        life), so only the paths that need no set-up and send nothing back apply; its
        credit is a second window.
        """
        self.address = address
        self.same_node = same_node
        self.relay = relay
        self.receive = receive
        self.windows = tuple(w for w in (receive, relay) if w is not None)
        engine = self.engine
        cpu: list[SendPath] = []
        cuda: list[SendPath] = []
        for specs, out in ((CPU_PATHS, cpu), (CUDA_PATHS, cuda)):
            for spec in specs:
                if relay is not None and spec not in RELAYED_PATHS:
                    continue
                path = spec.send(engine, self)
                if path is not None:
                    out.append(path)
                    self.path_names[spec.name] = path
        self.cpu_paths, self.cuda_paths = tuple(cpu), tuple(cuda)
        self.askers = tuple(p for p in (*cpu, *cuda) if not p.settled)
        self.ready = True
        resolve(self.resolved, None)

    # ------------------------------------------------------------------ sending
    def submit(self, msg: OutMessage, work: AsyncWork[None]) -> None:
        """Send ``msg`` now if nothing is ahead of it, else queue it (loop thread)."""
        if self.lost_exc is not None:
            reject_work(work, lost_error(self.lost_exc, f"cannot send to {self.name}"))
            return
        if self.ready and not self.backlog and self._spent() is None:
            if msg.inline is not None:
                self._enqueue(msg, work)
                return
            if not self._staged_for_relay(msg, work):
                return
            staged = msg.staged
            if (staged is None or staged_ready(staged)) and (
                not self.askers or not self._needs_setup(msg)
            ):
                self._emit(msg, work)
                return
        self.backlog.append((msg, work))
        if not self.pumping:
            self.pumping = True
            self.engine.spawn(self._pump())

    def _staged_for_relay(self, msg: OutMessage, work: AsyncWork[None]) -> bool:
        """A relayed Sender's CUDA tensors all travel through pinned host memory: stage
        ``msg``'s now if nothing did. False (``work`` failed) if staging failed."""
        if self.relay is None or not msg.cuda or msg.staged is not None:
            return True
        try:
            stage(msg, _NO_LIMIT)
        except Exception as exc:  # noqa: BLE001 - e.g. no pinned memory left
            reject_work(work, exc)
            return False
        return True

    def _spent(self) -> Window | None:
        """The first of the pair's windows that is spent, if one is: a message may go only
        while none is (counting the small messages batched to go)."""
        for window in self.windows:
            if window.outstanding >= window.open_below and not window.has_room(
                    self.outbox_bytes + MESSAGE_COST * len(self.outbox_works)):
                return window
        return None

    def _needs_setup(self, msg: OutMessage) -> bool:
        for path in self.askers:
            if path.wants(msg):
                return True
        return False

    async def _pump(self) -> None:
        """Send the backlog in order once the destination is known and set up."""
        try:
            if not self.ready:
                await self.resolved
            backlog = self.backlog
            while backlog:
                msg, work = backlog[0]
                if work.done():  # cancelled before it left: withdraw it
                    backlog.popleft()
                    continue
                if not self._staged_for_relay(msg, work):  # sent before the route was known
                    backlog.popleft()
                    continue
                staged = msg.staged
                if staged is not None and not staged.ready():
                    # Small CUDA tensors still being copied to pinned memory: later sends
                    # wait behind this one (the pair's order).
                    try:
                        await staged_future(self.engine, staged)
                    except Exception as exc:  # noqa: BLE001 - that copy failed: that send fails
                        if backlog and backlog[0][1] is work:
                            backlog.popleft()
                        reject_work(work, exc)
                    continue  # re-check: the loss of the peer may have emptied the backlog
                if self.askers and self._needs_setup(msg):
                    await self._hello(msg)
                    continue  # re-check: the loss of the peer may have emptied the backlog
                window = self._spent()
                if window is not None:
                    # A window of the pair is spent: wait for the receiver's receives to
                    # take what it holds, or (a relay's credit) for it to read what is on
                    # its way (aiorl.p2p.window); later sends wait behind.
                    if window is self.relay:
                        await self._wait_for_credit(self.relay)
                    else:
                        await window.wait_room(self.engine.loop)
                    continue  # re-check: the loss of the peer may have emptied the backlog
                backlog.popleft()
                self._emit(msg, work)
        except PeerLostError as exc:
            self.lost(exc)
        except Exception as exc:  # noqa: BLE001 - a bug here must fail the sends, not hang them
            log.exception("%s: sending to %s failed", self._src, self.name)
            while self.backlog:
                reject_work(self.backlog.popleft()[1], exc)
        finally:
            self.pumping = False

    async def _wait_for_credit(self, route: RelayRoute) -> None:
        """Until the receiver grants some of the relayed window back; raises PeerLostError
        (the pair fails) when none comes within ``route.stall_s``: credit comes back as the
        receiver's loop reads, so its absence is a message or a credit lost on the way."""
        try:
            await asyncio.wait_for(asyncio.shield(route.wait_room(self.engine.loop)),
                                   route.stall_s)
        except asyncio.TimeoutError:
            raise PeerLostError(
                f"the relayed pair {self._src} -> {self.name} made no progress for "
                f"{route.stall_s:g} s: {route.outstanding} bytes sent through the node agents "
                "were not granted back, and no death of the receiver was reported; the pair "
                "fails instead of waiting for ever (AIORL_P2P_RELAY_STALL_S sets the bound; a "
                "receiver whose event loop is blocked that long stalls its senders too)"
            ) from None

    async def _hello(self, msg: OutMessage) -> None:
        """Ask the receiver every set-up question ``msg`` needs, in one request."""
        engine = self.engine
        questions: dict[str, Any] = {}
        asked: list[SendPath] = []
        for path in self.askers:
            if path.wants(msg):
                keys = path.ask(msg)
                if keys is not None:
                    questions.update(keys)
                    asked.append(path)
        reply = HelloReply()
        if asked:
            assert self.address is not None
            ask = Hello(self._src, engine.endpoint.address, engine.pid, **questions)
            try:
                answer, _ = await engine.endpoint.request(
                    self.address, _HELLO, ask.to_wire(), timeout=HELLO_TIMEOUT_S
                )
                reply = HelloReply.from_wire(answer)
            except PeerLostError:
                for path in asked:
                    path.on_hello(HelloReply())  # releases its probe
                raise
            except Exception as exc:  # noqa: BLE001 - degrade to the paths that need no set-up
                log.warning(
                    "%s: p2p set-up with %s failed (%s); using ZMQ/NCCL", self._src, self.name, exc
                )
            for path in asked:
                path.on_hello(reply)
        self.askers = tuple(p for p in self.askers if not p.settled)

    def _emit(self, msg: OutMessage, work: AsyncWork[None]) -> None:
        """Place the payload, then send the control message (loop thread, in order)."""
        if msg.inline is not None:
            self._enqueue(msg, work)
            return
        if self.outbox_works:
            self._flush()
        frames: list[Any] = [msg.pickle] if msg.kind == K_OBJ else []
        placed_cpu: Placed | None = None
        placed_cuda: Placed | None = None
        try:
            bufdesc = None
            if msg.bufs:
                placed_cpu = _place(self.cpu_paths, msg, frames)
                bufdesc = placed_cpu.desc
            cudadesc = None
            if msg.cuda:
                specs, live = cuda_specs(msg)
                if live:
                    placed_cuda = _place(self.cuda_paths, msg, frames)
                    cudadesc = placed_cuda.desc
                else:
                    cudadesc = EmptyCudaDesc(specs).to_wire()
            self._send(_DATA, data_to_wire(self._src, msg.kind, msg.head, bufdesc, cudadesc),
                       frames)
            if self.receive is not None:
                self.receive.charge(message_cost(msg))
        except BaseException as exc:  # noqa: BLE001 - nothing went out: the send fails, not hangs
            for placed in (placed_cpu, placed_cuda):
                if placed is not None and placed.undo is not None:
                    placed.undo()
            reject_work(work, exc)
            if isinstance(exc, PeerLostError):
                self.lost(exc)
            else:
                log.exception("%s: sending to %s failed", self._src, self.name)
            return
        waits: list[asyncio.Future[None]] = []
        for placed in (placed_cpu, placed_cuda):
            if placed is not None:
                try:
                    fut = placed.after_send() if placed.after_send is not None else placed.done
                except Exception as exc:  # noqa: BLE001 - the send fails; the pair goes on
                    reject_work(work, exc)
                    return
                if fut is not None:
                    waits.append(fut)
        if not waits:
            resolve_work(work, None)
            return
        self.pending.add(work)
        remaining = len(waits)
        pending = self.pending

        def one_done(f: asyncio.Future[None]) -> None:
            nonlocal remaining
            if work.done():
                return
            if f.cancelled() or f.exception() is not None:
                pending.discard(work)
                exc = f.exception() if not f.cancelled() else None
                reject_work(work, exc or ProtocolError("a p2p transfer was cancelled"))
                return
            remaining -= 1
            if remaining == 0:
                pending.discard(work)
                resolve_work(work, None)

        for f in waits:
            f.add_done_callback(one_done)

    def _enqueue(self, msg: OutMessage, work: AsyncWork[None]) -> None:
        frame = msg.inline
        if msg.kind == K_OBJ:
            self.outbox.append(OBJECT_ENTRY)
            n = len(frame)
        else:
            n = msg.nbytes
            self.outbox.append([msg.kind, msg.head, frames_to_wire([n], [1])])
        self.outbox_bytes += n
        self.outbox_frames.append(frame)
        works = self.outbox_works
        works.append(work)
        if len(works) >= BATCH_MAX_MSGS or self.outbox_bytes >= BATCH_MAX_BYTES:
            self._flush()
        elif not self.flush_scheduled:
            self.flush_scheduled = True
            self.engine.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Send the queued small messages as one ZMQ message; complete their sends."""
        self.flush_scheduled = False
        works = self.outbox_works
        if not works:
            return
        metas, frames, nbytes = self.outbox, self.outbox_frames, self.outbox_bytes
        self.outbox, self.outbox_frames, self.outbox_works, self.outbox_bytes = [], [], [], 0
        try:
            if len(works) == 1:
                kind, head, bufdesc = metas[0]
                op, meta = _DATA, data_to_wire(self._src, kind, head, bufdesc, None)
            else:
                op, meta = _BATCH, batch_to_wire(self._src, metas)
            self._send(op, meta, frames)
            if self.receive is not None:  # each its `message_cost`, in all
                self.receive.charge_batch(len(works), nbytes + MESSAGE_COST * len(works))
        except BaseException as exc:  # noqa: BLE001 - the sends fail, they do not hang
            for w in works:
                reject_work(w, exc)
            if isinstance(exc, PeerLostError):
                self.lost(exc)
            else:
                log.exception("%s: sending to %s failed", self._src, self.name)
            return
        for w in works:
            resolve_work(w, None)

    def _send(self, op: str, meta: list[Any], frames: Sequence[Any]) -> None:
        """One p2p message toward the destination: on this process's connection to it, or
        through the node agents (`relay`)."""
        if self.relay is None:
            assert self.address is not None
            self.engine.endpoint.send_oneway(self.address, op, meta, frames)
        else:
            self.relay.send(op, meta, frames)

    # ------------------------------------------------------------------ replies, loss
    def on_ack(self, op: str, ack: PathAck) -> None:
        """A ``p2p.ack``/``p2p.done`` from the receiver: to the path that placed the payload."""
        for path in (*self.cpu_paths, *self.cuda_paths):
            if path.acks == op and path.on_ack(ack):
                return

    def lost(self, exc: PeerLostError | LookupError) -> None:
        """The destination is gone (or never existed): fail everything still waiting for it."""
        if self.lost_exc is None:
            self.lost_exc = exc
        fail(self.resolved, lost_error(exc, f"worker {self.name} is gone"))
        self.resolved.exception()  # retrieved: nobody else may await it
        while self.backlog:
            reject_work(self.backlog.popleft()[1], lost_error(exc, f"cannot send to {self.name}"))
        batch = self.outbox_works
        self.outbox, self.outbox_frames, self.outbox_works, self.outbox_bytes = [], [], [], 0
        for w in batch:
            reject_work(w, lost_error(exc, f"cannot send to {self.name}"))
        for work in list(self.pending):
            reject_work(work, lost_error(exc, f"send to {self.name} did not complete"))
        self.pending.clear()
        for path in (*self.cpu_paths, *self.cuda_paths):
            path.lost(exc)
        for window in self.windows:
            window.wake()  # a backlog waiting for its window: its pump ends

    def close(self) -> None:
        for path in (*self.cpu_paths, *self.cuda_paths):
            path.close()

    def statistics(self) -> SenderStatistics:
        return SenderStatistics(
            same_node=self.same_node,
            resolved=self.ready,
            backlog=len(self.backlog),
            batched=len(self.outbox_works),
            pending=len(self.pending),
            lost=self.lost_exc is not None,
            paths={name: path.statistics() for name, path in self.path_names.items()},
            relayed=self.relay is not None,
            outstanding=0 if self.receive is None else self.receive.outstanding,
            unread=0 if self.relay is None else self.relay.outstanding,
        )


def message_cost(msg: OutMessage) -> int:
    """What ``msg`` counts in its pair's receive window: its payload's bytes (pickle, CPU
    buffers, CUDA tensors) and `MESSAGE_COST`."""
    cost = MESSAGE_COST + msg.nbytes
    if msg.pickle is not None:
        cost += len(msg.pickle)
    for t in msg.cuda:
        cost += nbytes_of(t)
    return cost


def _place(paths: tuple[SendPath, ...], msg: OutMessage, frames: list[Any]) -> Placed:
    """The first of ``paths`` that fits ``msg`` and does not decline places it."""
    for path in paths:
        if path.fits(msg):
            placed = path.place(msg, frames)
            if placed is not None:
                return placed
    raise ProtocolError("no payload path takes this message")  # frames and NCCL always fit
