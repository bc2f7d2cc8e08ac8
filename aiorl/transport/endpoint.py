"""The asyncio endpoint: one bound ROUTER for what comes in, one DEALER per peer for what goes out.

Every aiorl process (registry, node agent, worker, driver) owns one
`Endpoint`. It serves operations registered with `Endpoint.handle`
on its ROUTER, and sends requests, one-way messages and event subscriptions to
other endpoints through a DEALER per peer address.

Event-loop integration
    Sockets are watched with ``loop.add_reader(sock.FD)`` and drained with
    non-blocking receives, which measured ~1.5x faster per round trip than
    ``zmq.asyncio`` here (see ``../shared/PERF-NOTES.md``). The ZMQ FD is
    edge-triggered: it signals a *change* of state, so a reader must drain until
    ``EVENTS`` shows no ``POLLIN``, and must look at ``EVENTS`` again after every
    send, because a send can consume the edge that announced queued input. Both
    rules are applied in `_Watched`; breaking either loses wake-ups.

Batching
    The first message to a peer in an event-loop turn leaves at once; the rest
    of that turn's messages to the same peer leave together at the end of the
    turn as BATCH messages of at most 64 (see wire.py). A burst of 1,000 calls or
    replies then costs a few system calls instead of 1,000, and a lone call waits
    for nothing. A reader handles a few messages per wake-up, so a burst is worked
    through in slices and answers flow back while it is still being read. Events
    and one-way messages go out unbatched, after anything held for their peer (so
    order is kept): a server learns at once when a subscriber is gone, and one-way
    streams (p2p) batch themselves.

Ordering
    Messages to one peer go through one DEALER and one TCP connection, and a
    batch keeps its messages in order, so they arrive in the order they were sent. Incoming messages from one peer are
    dispatched in arrival order; a handler that starts a task gives up that
    order for its own work.

Failure
    `Endpoint.mark_peer_lost` fails every pending request to a peer with
    [`PeerLostError`][aiorl.PeerLostError] and makes later requests fail at once.
    Who decides that a peer is lost (the registry, a node agent) lives above.

    A failed handshake (the peer speaks another mechanism, refuses our
    credentials, or cannot prove it holds the cluster key) makes libzmq drop the
    connection for good. Each outgoing socket is watched for handshake events;
    after such a failure, pending requests to that peer fail with
    [`AuthenticationError`][aiorl.AuthenticationError], new ones fail the same way at once,
    and the socket is rebuilt after a backoff (0.1 s doubling to 2 s) until a
    handshake succeeds again. ZMQ exceptions never leave this module.

Errors
    ERROR replies carry `aiorl.errors.to_wire` data (type name, message,
    traceback text) and are rebuilt by `aiorl.errors.from_wire`; nothing in
    an error reply is ever unpickled.

Threads
    An endpoint belongs to its event loop's thread. Other threads use
    `Endpoint.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from aiorl.errors import (
    AiorlError,
    AuthenticationError,
    PeerLostError,
    ProtocolError,
    WaitTimeout,
    from_wire,
    to_wire,
)
from aiorl.transport import security
from aiorl.transport.lane import LaneConnection, LaneListener, connect_lane, lane_path
from aiorl.transport.security import ClusterKeys
from aiorl.transport.sockets import (
    HANDSHAKE_FAILED_EVENTS,
    IPC_PREFIX,
    ROUTER_HWM,
    bind_endpoint,
    make_socket,
    monitor_handshakes,
)
from aiorl.transport.wire import (
    MAX_BATCH_MESSAGES,
    PACK_MIN_FRAMES,
    Kind,
    decode_fields,
    encode_batch,
    encode_header,
    join_frames,
    oversized,
    pack,
    split_batch,
    split_frames,
    unpack,
)
from aiorl.util.batching import TurnBatcher
from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["Endpoint", "Incoming", "Reply"]

log = logging.getLogger("aiorl.transport")
_dispatch_errors = RateLimitedLog(log)

# Plain ints on the hot path: comparing IntEnum members costs more than the send itself.
_REQUEST, _REPLY, _ERROR, _ONEWAY, _EVENT, _BATCH, _PACKED, _SPLIT = (
    int(Kind.REQUEST), int(Kind.REPLY), int(Kind.ERROR), int(Kind.ONEWAY), int(Kind.EVENT),
    int(Kind.BATCH), int(Kind.PACKED), int(Kind.SPLIT),
)

# The Cython socket methods, called directly: pyzmq's Python "sugar" layer (enum flags,
# per-part dispatch) cost ~5 us per message here, more than the send itself.
_RawSocket: Any = zmq.Socket.__mro__[1]
_raw_send = _RawSocket.send
_raw_recv = _RawSocket.recv
_raw_get = _RawSocket.get
_EVENTS, _POLLIN, _NOBLOCK, _SNDMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK), int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_thread_id = threading.get_ident
#: Frames at least this large are handed to ZMQ without a copy (it keeps a reference).
_ZERO_COPY_BYTES = 64 * 1024


def send_parts(sock: zmq.Socket[Any], parts: Sequence[Any]) -> None:
    """Send one multipart message without blocking (HWMs are unlimited, see sockets.py)."""
    last = len(parts) - 1
    for i, part in enumerate(parts):
        flags = _NOBLOCK | _SNDMORE if i < last else _NOBLOCK
        # bytes cannot change after the call, so a large one is lent to ZMQ like a view (an
        # agent forwarding a relayed p2p payload sends the bytes it received).
        size = len(part) if part.__class__ is bytes else memoryview(part).nbytes
        if size < _ZERO_COPY_BYTES:
            _raw_send(sock, part, flags, True, False)
        else:
            _raw_send(sock, part, flags, False, False)


def recv_parts(sock: zmq.Socket[Any]) -> list[bytes]:
    """Receive one whole multipart message without blocking (raises ``zmq.Again`` if none)."""
    parts = [_raw_recv(sock, _NOBLOCK, True, False)]
    while _raw_get(sock, _RCVMORE):
        parts.append(_raw_recv(sock, _NOBLOCK, True, False))
    return parts


#: ZMQ messages handled per wake-up before yielding to other callbacks. Small on purpose,
#: like _MAX_HELD_MESSAGES: a burst is worked through in slices, so the first answers leave
#: while later calls are still being read (docs/architecture.md, "The path of one call").
#: With one big slice a worker read all of 1,000 calls in flight, ran them all and only then
#: answered, and the two processes took turns instead of working at once: 64 x 4 measured
#: +35-50 % calls/s with 1,000 in flight (driver to worker and worker to worker) against
#: 1,024 x 256.
_DRAIN_BATCH = 4
#: At most this many messages to one peer leave as one BATCH (a burst larger than this
#: leaves as several, in order); bytes are not counted: held messages are small control
#: messages.
_MAX_HELD_MESSAGES = MAX_BATCH_MESSAGES  # what receivers accept (wire.py)
_MAX_HELD_BYTES = 1 << 62

_FROM_ENVIRONMENT = object()
Reply = tuple[Any, list[Any]]  # (meta, payload frames)
#: How a pending request is completed: ``settle(None, reply)`` or ``settle(error, None)``,
#: exactly once, on the loop.
Settle = Callable[[BaseException | None, "Reply | None"], None]
Handler = Callable[["Incoming"], None]
EventHandler = Callable[[str, Any, list[Any]], None]


class _DropLog:
    """Warn about dropped messages at most once a second, with a count of the rest
    (`RateLimitedLog`).

    A flood of garbage must not become a flood of log lines (that would be a
    denial of service of its own)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._log = RateLimitedLog(log)

    def __call__(self, what: str, *args: Any) -> None:
        self._log.warning("dropped", "%s: dropped " + what, self.name, *args)


class Incoming:
    """One received request, one-way message or event, with the means to answer it."""

    __slots__ = ("endpoint", "identity", "kind", "request_id", "op", "meta", "frames", "lane",
                 "_answered")

    def __init__(
        self,
        endpoint: Endpoint,
        identity: bytes,
        kind: int,  # a Kind value, as a plain int (see wire.Header)
        request_id: int,
        op: str,
        meta: Any,
        frames: list[Any],
        lane: LaneConnection | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.identity = identity
        self.kind = kind
        self.request_id = request_id
        self.op = op
        self.meta = meta
        self.frames = frames
        #: The lane it came on (None: through the ROUTER): the answer's way back, unless
        #: it broke meanwhile (then the client's lane now, or the ROUTER).
        self.lane = lane
        self._answered = False

    @property
    def expects_reply(self) -> bool:
        return self.kind == _REQUEST

    def reply(self, meta: Any = None, frames: Sequence[Any] = ()) -> None:
        """Answer a request (ignored for one-way messages and after the first answer)."""
        if self.kind != _REQUEST or self._answered:
            return
        self._answered = True
        self.endpoint._send_router(self.identity, _REPLY, self.request_id, self.op, meta, frames,
                                   self.lane)

    def reply_error(self, exc: BaseException, **extra: Any) -> None:
        """Answer a request with an error; ``extra`` lands in the error's meta (e.g. rank)."""
        if self.kind != _REQUEST or self._answered:
            return
        self._answered = True
        self.endpoint._send_router(self.identity, _ERROR, self.request_id, self.op,
                                   to_wire(exc, **extra), ())


class _Watched:
    """A socket registered with the loop, drained completely after every wake-up.

    The loop thread owns the socket. One exception: `send_from_thread` lets
    another thread (a worker's method thread answering a call) send on it, under
    ``lock``, which every socket operation takes; a mutex gives the full memory
    barrier that libzmq requires when a socket changes threads.
    """

    __slots__ = ("sock", "on_message", "loop", "_scheduled", "closed", "lock", "routed",
                 "_batcher", "on_send_failed")

    def __init__(
        self,
        sock: zmq.Socket[Any],
        on_message: Callable[[list[Any]], None],
        loop: asyncio.AbstractEventLoop,
        routed: bool = False,
        on_send_failed: Callable[[zmq.ZMQError], None] | None = None,
    ) -> None:
        self.sock = sock
        self.on_message = on_message
        self.loop = loop
        #: Told when held messages could not leave (see _send_held); None: drop them.
        self.on_send_failed = on_send_failed
        self._scheduled = False
        self.closed = False
        self.lock = threading.Lock()
        self.routed = routed  # a ROUTER: the first frame of every message names the peer
        # The first message of a loop turn leaves at once; later ones are held per peer
        # and leave as one BATCH message when the turn ends.
        self._batcher: TurnBatcher[bytes, list[Any]] = TurnBatcher(
            loop, self._send_held, max_items=_MAX_HELD_MESSAGES, max_bytes=_MAX_HELD_BYTES)
        loop.add_reader(sock.FD, self.drain)
        self.schedule_drain()  # input may have queued before the reader existed

    def schedule_drain(self) -> None:
        if not self._scheduled and not self.closed:
            self._scheduled = True
            self.loop.call_soon(self._scheduled_drain)

    def _scheduled_drain(self) -> None:
        self._scheduled = False
        self.drain()

    def drain(self) -> None:
        sock = self.sock
        lock = self.lock
        for _ in range(_DRAIN_BATCH):
            with lock:
                # Checking EVENTS is cheaper than provoking zmq.Again to learn the queue is empty.
                if self.closed or not _raw_get(sock, _EVENTS) & _POLLIN:
                    return
                frames = recv_parts(sock)
            try:
                self.on_message(frames)
            except Exception as exc:  # a bug a peer's message can reach: once a second at most
                _dispatch_errors.warning("dispatch", "unhandled error while dispatching a "
                                         "message", exc_info=exc)
        # Batch used up and input may remain: continue after other callbacks ran.
        self.schedule_drain()

    def send(self, parts: Sequence[Any]) -> None:
        """Send from the loop thread.

        The first message of an event-loop turn goes out at once (no added latency);
        further messages in the same turn are held and leave together, per peer, as
        one BATCH message at the end of the turn: one system call instead of hundreds
        when many calls or replies are in flight. Order per peer is kept.
        """
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
        batcher = self._batcher
        if batcher.first_in_turn():
            self._send_now(parts)
        elif self.routed:
            batcher.add(parts[0], list(parts[1:]))
        else:
            batcher.add(b"", list(parts))

    def send_direct(self, parts: Sequence[Any]) -> None:
        """Send now, after anything held for the same peer (order kept). Raises
        ``zmq.ZMQError`` (EHOSTUNREACH) at once when a routed peer is gone, which is
        how a server learns that a subscriber disconnected."""
        key = parts[0] if self.routed else b""
        held = self._batcher.take(key)
        if held:
            body = held[0] if len(held) == 1 else encode_batch(held)
            self._send_now([key, *body] if self.routed else body)
        self._send_now(parts)

    def _send_held(self, key: bytes, messages: list[list[Any]]) -> None:
        """The batcher's flush: what one peer was sent during a turn, as one message."""
        if self.closed:
            return
        body = messages[0] if len(messages) == 1 else encode_batch(messages)
        try:
            self._send_now([key, *body] if self.routed else body)
        except zmq.ZMQError as exc:
            if self.on_send_failed is not None:
                # Requests among them wait for replies that will never come: the owner
                # fails them (a DEALER whose connection libzmq dropped).
                self.on_send_failed(exc)
            else:
                # Replies to a routed peer that vanished (EHOSTUNREACH): nothing waits here.
                log.debug("dropped %d held message(s): %s", len(messages), exc)

    def _send_now(self, parts: Sequence[Any]) -> None:
        """Send now, then re-check EVENTS (a send can consume the FD's edge)."""
        with self.lock:
            if self.closed:
                raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
            try:
                send_parts(self.sock, self._packed(parts))
            finally:
                pending = _raw_get(self.sock, _EVENTS) & _POLLIN
        if pending:
            self.schedule_drain()

    def _packed(self, parts: Sequence[Any]) -> Sequence[Any]:
        """``parts`` as one PACKED frame when they are many and small (see wire.py): the
        receiver then reads one frame instead of hundreds. A message with a frame over
        `MAX_FRAME_BYTES` leaves SPLIT instead (wire.py: one huge frame under CURVE outlasted
        the ZMTP heartbeat timeout, and the connection dropped it)."""
        if oversized(parts, self.routed):
            return [parts[0], *split_frames(parts[1:])] if self.routed else split_frames(parts)
        if len(parts) < PACK_MIN_FRAMES + self.routed:
            return parts
        if self.routed:  # the routing id stays its own frame: ZMQ routes by it
            body = pack(parts[1:])
            return parts if body is None else [parts[0], *body]
        body = pack(parts)
        return parts if body is None else body

    def send_from_thread(self, parts: Sequence[Any]) -> None:
        """Send from a thread other than the loop's. If the send consumed the edge of
        waiting input, wake the loop to drain it, or that input would sit unnoticed."""
        with self.lock:
            if self.closed:
                return
            try:
                send_parts(self.sock, self._packed(parts))
            finally:
                pending = _raw_get(self.sock, _EVENTS) & _POLLIN
        if pending:
            self.loop.call_soon_threadsafe(self.schedule_drain)

    def close(self) -> None:
        if not self.closed:
            self._batcher.flush_all()  # what was sent before close() still leaves
        with self.lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.loop.remove_reader(self.sock.FD)
            except Exception:
                pass
            self.sock.close()


#: Rebuilding a socket after a failed handshake waits this long, doubling up to the cap.
_REBUILD_FIRST_S = 0.1
_REBUILD_MAX_S = 2.0
#: Handshakes that break off without detail, in a row, before a warning.
_BROKEN_HANDSHAKES_WARN = 5

_HANDSHAKE_FAILURES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        "it speaks another security mechanism (is one side --insecure, or not an aiorl "
        "process of this cluster?)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "it refused this cluster's credentials",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        "the handshake broke off (under CURVE: the peer does not hold this cluster's key)",
}


class _Peer:
    """The outgoing side toward one remote endpoint: a DEALER, and a monitor of its handshakes.

    ``refused`` is set while the connection is down after a failed handshake (until
    the rebuilt socket is made); ``backoff`` is the next rebuild delay, reset by a
    successful handshake."""

    __slots__ = ("address", "watched", "monitor", "pending", "lost", "refused", "backoff",
                 "rebuild", "broken_handshakes")

    def __init__(self, address: str) -> None:
        self.address = address
        #: The DEALER, or the peer's lane (transport/lane.py) when it has one on this machine.
        self.watched: _Watched | LaneConnection | None = None
        self.monitor: _Watched | None = None
        self.pending: dict[int, Settle] = {}
        self.lost: BaseException | None = None
        self.refused: AuthenticationError | None = None
        self.backoff = 0.0
        self.rebuild: asyncio.TimerHandle | None = None
        self.broken_handshakes = 0  # in a row, of the kind libzmq retries by itself

    def close_sockets(self) -> None:
        watched, monitor = self.watched, self.monitor
        if monitor is not None and isinstance(watched, _Watched):
            # Stop the DEALER's handshake events before their reader goes. Closing the
            # reader first, while a handshake with a peer that was closing could still be
            # reported, stalled libzmq's I/O thread (it reports monitor events from there),
            # and with it every socket of the process: a driver lost its registry link and
            # its heartbeats, and the registry tore its groups down (tests/test_lane.py).
            with watched.lock:
                if not watched.closed:
                    try:
                        watched.sock.disable_monitor()
                    except zmq.ZMQError:
                        pass
        for each in (watched, monitor):
            if each is not None:
                each.close()
        if self.rebuild is not None:
            self.rebuild.cancel()
            self.rebuild = None


class Endpoint:
    """A process's messaging endpoint. See the module docstring for the rules it keeps.

    Args:
        name: a readable name for logs and routing ids (e.g. ``"rollout:3"``).
        host: interface to bind the ROUTER on, or ``ipc://DIR`` for a Unix socket in
            the private directory DIR (see `bind_endpoint`).
        port: port to bind (0 = any free port; ignored for ``ipc://``).
        loop: the event loop that owns the endpoint (default: the running loop).
        keys: the cluster's keys; by default this process's
            (`keys_from_environment`); None = insecure.
            ``plain`` keys work only over ``ipc://``: PLAIN hands the secret to whoever
            answers an address, which over TCP may be anyone who took a freed port.
        lane: also serve processes of this machine over a lane (`aiorl.transport.lane`: a
            Unix stream this loop reads itself, without ZMQ's I/O thread), beside an
            ``ipc://`` socket or, bound on TCP, in the lane directory its node agent gave
            (``AIORL_LANE_DIR``). Workers do: a group call wakes each of them once per message.
    """

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        loop: asyncio.AbstractEventLoop | None = None,
        keys: ClusterKeys | None | object = _FROM_ENVIRONMENT,
        lane: bool = False,
    ) -> None:
        self.name = name
        self.keys: ClusterKeys | None = (
            security.keys_from_environment() if keys is _FROM_ENVIRONMENT else keys  # type: ignore[assignment]
        )
        if not host.startswith(IPC_PREFIX):
            _refuse_plain_over_tcp(self.keys, f"bind {name} on {host}")
        self.loop = loop or asyncio.get_running_loop()
        self._identity = f"{name}/{os.getpid()}/{uuid.uuid4().hex[:8]}".encode()
        router = make_socket(zmq.ROUTER, keys=self.keys)
        try:
            self.address = bind_endpoint(router, host, port)
        except BaseException:
            router.close(0)
            raise
        #: The IP at which other processes reach this machine (for side channels such as
        #: a TCPStore): the bound host, or loopback for an ``ipc://`` endpoint (one machine).
        self.ip = "127.0.0.1" if host.startswith(IPC_PREFIX) else host
        self._dropped = _DropLog(name)
        self._router = _Watched(router, self._on_router_message, self.loop, routed=True)
        self._loop_thread = threading.get_ident()  # built on its loop's thread (see Threads)
        self._handlers: dict[str, Handler] = {}
        self._event_handlers: dict[str, EventHandler] = {}
        self._peers: dict[str, _Peer] = {}
        self._lost: dict[str, BaseException] = {}
        self._request_ids = itertools.count(1)
        self._peer_lost_callbacks: list[Callable[[str, BaseException], None]] = []
        self.closed = False
        #: Clients on our lane, by their endpoint's routing id (what a ROUTER would name them).
        self._lanes: dict[bytes, LaneConnection] = {}
        self._lane_listener: LaneListener | None = None
        if lane and lane_path(self.address) is not None:
            try:
                self._lane_listener = LaneListener(
                    self.address, self.keys, self.loop, on_client=self._lane_client,
                    on_message=self._lane_message, on_gone=self._lane_gone)
            except (OSError, AuthenticationError) as exc:  # served through ZMQ alone
                log.warning("%s: no lane (%s); its callers on this machine use ZMQ", name, exc)

    # ------------------------------------------------------------------ serving
    def handle(self, op: str, handler: Handler) -> None:
        """Serve ``op``: ``handler(incoming)`` runs on the loop and answers via ``incoming.reply``."""
        self._handlers[op] = handler

    def on_event(self, op: str, handler: EventHandler) -> None:
        """Call ``handler(peer_address, meta, frames)`` for events named ``op`` pushed to us."""
        self._event_handlers[op] = handler

    def push_event(self, identity: bytes, op: str, meta: Any = None, frames: Sequence[Any] = ()) -> bool:
        """Push an event to the client whose routing id is ``identity``; False if it is gone."""
        return self._send_router(identity, _EVENT, 0, op, meta, frames)

    def _on_router_message(self, frames: list[Any], within: int = 0) -> None:
        if len(frames) < 2:
            self._dropped("a message with %d frames (need identity and header)", len(frames))
            return
        identity = frames[0]
        try:
            kind, request_id, op, meta = decode_fields(frames[1])
        except ProtocolError as exc:
            self._dropped("a malformed message: %s", exc)
            return
        if _opens(kind, within):
            try:
                parts = _contents(kind, meta, frames[2:])
            except ProtocolError as exc:
                self._dropped("a malformed %s message: %s", Kind(kind).name, exc)
                return
            for part in parts:
                self._on_router_message([identity, *part], kind)
            return
        if kind != _REQUEST and kind != _ONEWAY:
            self._dropped("a %s message sent to a server socket", Kind(kind).name)
            return
        self._serve(identity, kind, request_id, op, meta, frames[2:])

    def _serve(self, identity: bytes, kind: int, request_id: int, op: str, meta: Any,
               payload: list[Any], lane: LaneConnection | None = None) -> None:
        """Hand a request or one-way message to its op's handler."""
        msg = Incoming(self, identity, kind, request_id, op, meta, payload, lane)
        handler = self._handlers.get(op)
        if handler is None:
            msg.reply_error(ProtocolError(f"{self.name} does not serve operation {op!r}"))
            return
        try:
            handler(msg)
        except Exception as exc:
            log.debug("%s: handler for %r raised", self.name, op, exc_info=True)
            msg.reply_error(exc)

    def _send_router(
        self, identity: bytes, kind: int, request_id: int, op: str, meta: Any, frames: Sequence[Any],
        lane: LaneConnection | None = None,
    ) -> bool:
        """Send to the client ``identity``: on ``lane`` (where its request came) while that is
        open, else on the client's lane now, else through the ROUTER."""
        if self.closed:
            return False
        head = encode_header(kind, request_id, op, meta)
        if lane is None or lane.closed:
            lane = self._lanes.get(identity)
        if lane is not None:
            if _thread_id() != self._loop_thread:
                if frames:
                    lane.send_from_thread([head, *frames])
                else:  # a header alone (a method's None answer: most answers at scale)
                    lane.send_frame_from_thread(head)
            elif kind == _EVENT:
                lane.send_direct([head, *frames])
            else:
                lane.send([head, *frames])
            return not lane.closed
        try:
            if _thread_id() != self._loop_thread:
                self._router.send_from_thread([identity, head, *frames])
            elif kind == _EVENT:
                # Events report whether the subscriber is still there: no batching.
                self._router.send_direct([identity, head, *frames])
            else:
                self._router.send([identity, head, *frames])
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False  # the client went away; nothing is waiting for this any more
            if exc.errno == zmq.EAGAIN:  # its queue is full (ROUTER_HWM): it does not read
                _dispatch_errors.warning(
                    "peer not reading", "%s: a peer does not read what it is sent (%d "
                    "messages queued for it): dropped a %s", self.name, ROUTER_HWM,
                    Kind(kind).name)
                return True
            raise
        return True

    # ------------------------------------------------------------------ lanes (serving)
    def _lane_client(self, conn: LaneConnection) -> None:
        """A client of this machine proved the cluster key on our lane: its messages are
        served as the ROUTER's are, and our answers to its routing id take its lane."""
        old = self._lanes.get(conn.peer_identity)
        self._lanes[conn.peer_identity] = conn  # a reconnecting client takes its place
        if old is not None:
            old.close()

    def _lane_message(self, conn: LaneConnection, frames: list[Any]) -> None:
        try:
            kind, request_id, op, meta = decode_fields(frames[0])
        except (ProtocolError, IndexError):
            kind = 0
        if kind != _REQUEST and kind != _ONEWAY:
            # Malformed, or a container (PACKED, SPLIT): the ROUTER's path opens or refuses it.
            self._on_router_message([conn.peer_identity, *frames])
            return
        self._serve(conn.peer_identity, kind, request_id, op, meta, frames[1:], conn)

    def _lane_gone(self, conn: LaneConnection) -> None:
        if self._lanes.get(conn.peer_identity) is conn:
            del self._lanes[conn.peer_identity]

    # ------------------------------------------------------------------ calling
    def request(
        self,
        peer: str,
        op: str,
        meta: Any = None,
        frames: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> asyncio.Future[Reply]:
        """Send a request to the endpoint at ``peer``; the future resolves to ``(meta, frames)``.

        An ERROR reply becomes the future's exception. With ``timeout``, the
        request is forgotten locally when it expires and the future raises
        `TimeoutError`; a late reply is dropped.
        """
        return self.request_numbered(peer, op, meta, frames, timeout)[1]

    def request_numbered(
        self,
        peer: str,
        op: str,
        meta: Any = None,
        frames: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> tuple[int, asyncio.Future[Reply]]:
        """`request`, also returning the request id (0 when it failed at once), which
        the peer sees as `Incoming.request_id` (tracing names a call's flow by it)."""
        fut: asyncio.Future[Reply] = self.loop.create_future()
        rid = self.request_then(peer, op, meta, frames,
                                functools.partial(self._settle_future, fut), timeout)
        return rid, fut

    def _settle_future(self, fut: asyncio.Future[Reply], error: BaseException | None,
                       reply: Reply | None) -> None:
        """The settle of `request`: complete its future (unless cancelled meanwhile)."""
        if fut.done():
            return
        if error is None:
            fut.set_result(reply)  # type: ignore[arg-type]
            return
        fut.set_exception(error)
        if self.closed:
            fut.exception()  # closing: an abandoned request need not warn

    def request_then(
        self,
        peer: str,
        op: str,
        meta: Any,
        frames: Sequence[Any],
        settle: Settle,
        timeout: float | None = None,
    ) -> int:
        """`request` for the hot path: ``settle(error, reply)`` runs when it ends.

        No future and no extra loop callback per request: the reply (or the failure: a lost
        peer, a refused handshake, the timeout, close) calls ``settle`` directly, once, on
        the loop, in the order replies arrive. ``settle`` must not raise. Returns the
        request id, or 0 when the request failed at once (``settle`` already ran).
        """
        p = self._peers.get(peer) or self._peer(peer)  # a known peer: no call (per rank)
        if p.lost is not None or p.refused is not None:
            settle(_copy_failure(p), None)
            return 0
        rid = next(self._request_ids)
        if timeout is not None:
            handle = self.loop.call_later(timeout, _expire, p, rid, op, timeout)
            settle = functools.partial(_cancel_then, handle, settle)
        p.pending[rid] = settle
        self._send_dealer(p, _REQUEST, rid, op, meta, frames)
        return rid

    def send_oneway(self, peer: str, op: str, meta: Any = None, frames: Sequence[Any] = ()) -> None:
        """Send a message that expects no reply. Raises PeerLostError for a lost peer and
        AuthenticationError while the peer's handshake fails."""
        p = self._peer(peer)
        if p.lost is not None or p.refused is not None:
            raise _copy_failure(p)
        self._send_dealer(p, _ONEWAY, 0, op, meta, frames)
        if p.refused is not None:
            raise _copy_failure(p)

    def _send_dealer(
        self, p: _Peer, kind: int, rid: int, op: str, meta: Any, frames: Sequence[Any]
    ) -> None:
        parts = [encode_header(kind, rid, op, meta), *frames]
        watched = p.watched
        assert watched is not None  # callers checked p.refused
        try:
            if kind == _ONEWAY:
                # One-way streams (p2p data, output lines) batch themselves where it pays;
                # holding them to the end of the turn measured 30 % slower for p2p.
                watched.send_direct(parts)
            else:
                watched.send(parts)
        except zmq.Again as exc:
            self._send_failed(p, exc)

    def _send_failed(self, p: _Peer, exc: zmq.ZMQError) -> None:
        """A request to ``p`` could not leave, sent at once or held to the end of a turn: a
        DEALER has nowhere to send only once libzmq dropped its connection after a failed
        handshake (whose event may not have been read yet). What waits on ``p`` fails now."""
        self._handshake_failed(p, "it dropped the connection during the handshake")

    def _peer(self, address: str) -> _Peer:
        p = self._peers.get(address)
        if p is None:
            if self.closed:
                raise PeerLostError(f"endpoint {self.name} is closed")
            if not address.startswith(IPC_PREFIX):
                _refuse_plain_over_tcp(self.keys, f"connect to {address}")
            p = _Peer(address)
            lane = connect_lane(address, self._identity, self.keys, self.loop,
                                functools.partial(self._on_dealer_message, p))
            if lane is not None:
                lane.on_refused = functools.partial(
                    self._handshake_failed, p, "it refused this cluster's key on its lane")
                p.watched = lane
            else:
                self._connect(p)
            lost = self._lost.get(address)
            if lost is not None:
                p.lost = lost
            self._peers[address] = p
        return p

    def _connect(self, p: _Peer) -> None:
        """Give ``p`` a fresh DEALER (same routing id: the server hands the old one's place
        over) and a monitor of its handshakes."""
        sock = make_socket(zmq.DEALER, identity=self._identity, keys=self.keys)
        monitor = monitor_handshakes(sock)
        sock.connect(p.address)
        p.refused = None
        p.monitor = _Watched(monitor, lambda frames: self._on_handshake_event(p, frames), self.loop)
        p.watched = _Watched(sock, lambda frames: self._on_dealer_message(p, frames), self.loop,
                             on_send_failed=lambda exc: self._send_failed(p, exc))

    def _on_handshake_event(self, p: _Peer, frames: list[Any]) -> None:
        event = parse_monitor_message(frames)["event"]
        if not event & HANDSHAKE_FAILED_EVENTS:  # succeeded
            if p.backoff or p.broken_handshakes >= _BROKEN_HANDSHAKES_WARN:
                log.warning("%s: authenticated %s again", self.name, p.address)
            p.backoff = 0.0
            p.broken_handshakes = 0
            return
        reason = _HANDSHAKE_FAILURES.get(int(event), "the handshake failed")
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # libzmq retries this connection by itself and keeps what is queued. A peer
            # restarting mid-handshake and an impostor look alike here: fail nothing, and
            # warn only when it keeps happening.
            p.broken_handshakes += 1
            if p.broken_handshakes == _BROKEN_HANDSHAKES_WARN:
                log.warning("%s: %d handshakes in a row with %s broke off: %s", self.name,
                            p.broken_handshakes, p.address, reason)
            return
        self._handshake_failed(p, reason)

    def _handshake_failed(self, p: _Peer, reason: str) -> None:
        """libzmq gave up on ``p``'s connection: fail what waits on it, rebuild it later."""
        if p.refused is not None or p.lost is not None or self.closed:
            return
        delay = p.backoff = min(max(p.backoff * 2, _REBUILD_FIRST_S), _REBUILD_MAX_S)
        error = AuthenticationError(
            f"{self.name} could not authenticate {p.address}: {reason}; retrying in {delay:g} s")
        if delay == _REBUILD_FIRST_S:
            log.warning("%s", error)
        else:
            log.debug("%s", error)
        p.refused = error  # first: closing flushes held requests, which may fail back here
        p.close_sockets()
        pending, p.pending = p.pending, {}
        for settle in pending.values():
            settle(_copy_failure(p), None)
        p.rebuild = self.loop.call_later(delay, self._rebuild, p)

    def _rebuild(self, p: _Peer) -> None:
        p.rebuild = None
        if self._peers.get(p.address) is p and not self.closed:
            self._connect(p)

    def _on_dealer_message(self, p: _Peer, frames: list[Any], within: int = 0) -> None:
        try:
            kind, request_id, op, meta = decode_fields(frames[0])
        except (ProtocolError, IndexError) as exc:
            self._dropped("a malformed message from %s: %s", p.address, exc)
            return
        if kind == _REPLY:  # most messages: the container and event checks can wait
            settle = p.pending.pop(request_id, None)
            if settle is not None:  # None: timed out locally; the late answer has no reader
                settle(None, (meta, frames[1:]))
            return
        if _opens(kind, within):
            try:
                parts = _contents(kind, meta, frames[1:])
            except ProtocolError as exc:
                self._dropped("a malformed %s message from %s: %s", Kind(kind).name,
                              p.address, exc)
                return
            for part in parts:
                self._on_dealer_message(p, part, kind)
            return
        if kind == _EVENT:
            handler = self._event_handlers.get(op)
            if handler is None:
                log.debug("%s: no handler for event %r", self.name, op)
                return
            handler(p.address, meta, frames[1:])
            return
        settle = p.pending.pop(request_id, None)
        if settle is None:
            return  # timed out locally; the late answer has no reader
        if kind == _ERROR:
            settle(from_wire(meta), None)  # data only: never unpickled
        else:
            settle(ProtocolError(f"unexpected {Kind(kind).name} in reply to a request"), None)

    # ------------------------------------------------------------------ failure
    def on_peer_lost(self, callback: Callable[[str, BaseException], None]) -> None:
        """Call ``callback(peer_address, error)`` whenever a peer is marked lost."""
        self._peer_lost_callbacks.append(callback)

    def is_lost(self, address: str) -> bool:
        return address in self._lost

    def handshakes_breaking(self, address: str) -> int:
        """How many handshakes in a row with ``address`` broke off (0: none, or the last one
        succeeded). Under CURVE that is what a peer that does not hold our key looks like;
        a peer still starting refuses the connection instead, which counts nothing here."""
        p = self._peers.get(address)
        return 0 if p is None else p.broken_handshakes

    def mark_peer_lost(self, address: str, reason: str) -> None:
        """Fail all pending and future requests to ``address`` with PeerLostError(reason)."""
        if address in self._lost:
            return
        exc = PeerLostError(reason)
        self._lost[address] = exc
        p = self._peers.get(address)
        if p is not None:
            p.lost = exc
            pending, p.pending = p.pending, {}
            for settle in pending.values():
                settle(_copy_lost(exc), None)
            # Nothing more will be read from or written to a dead peer's connection.
            p.close_sockets()
            del self._peers[address]
        for cb in list(self._peer_lost_callbacks):
            try:
                cb(address, exc)
            except Exception:
                log.exception("peer-lost callback failed")

    # ------------------------------------------------------------------ lifecycle
    @property
    def identity(self) -> bytes:
        """This endpoint's routing id (``name/pid/nonce``): what a server sees it as, on a
        DEALER or a lane (a relayed p2p message carries it: `aiorl.p2p.relay`)."""
        return self._identity

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        """Close every socket. Pending requests fail with PeerLostError."""
        if self.closed:
            return
        self.closed = True
        exc = PeerLostError(f"endpoint {self.name} closed")
        for p in list(self._peers.values()):
            pending, p.pending = p.pending, {}
            for settle in pending.values():
                settle(_copy_lost(exc), None)
            p.close_sockets()
            # Layers above (channels, p2p) fail what they hold for this peer too.
            for cb in list(self._peer_lost_callbacks):
                try:
                    cb(p.address, exc)
                except Exception:
                    log.exception("peer-lost callback failed")
        self._peers.clear()
        if self._lane_listener is not None:
            self._lane_listener.close()
        self._lanes.clear()
        self._router.close()


def _opens(kind: int, within: int) -> bool:
    """Whether a message of ``kind`` read inside ``within`` (0: at the top, else the kind of
    the message that held it) is a container to open: PACKED and SPLIT only at the top,
    BATCH at the top or inside a PACKED or a SPLIT (that is how endpoints send them;
    anything else is malformed)."""
    if within == 0:
        return kind == _PACKED or kind == _BATCH or kind == _SPLIT
    return kind == _BATCH and within != _BATCH


def _contents(kind: int, meta: Any, payload: list[Any]) -> list[list[Any]]:
    """The messages inside a PACKED or SPLIT (one) or BATCH (several) message;
    ProtocolError if its meta does not describe its frames."""
    if kind == _PACKED:
        return [unpack(meta, payload)]
    if kind == _SPLIT:
        return [join_frames(meta, payload)]
    return split_batch(meta, payload)


def _copy_lost(exc: BaseException) -> PeerLostError:
    return PeerLostError(str(exc))


def _copy_failure(p: _Peer) -> AiorlError:
    """A fresh copy of why ``p`` cannot be reached (each waiter gets its own exception)."""
    if p.lost is not None:
        return _copy_lost(p.lost)
    return AuthenticationError(str(p.refused))


def _refuse_plain_over_tcp(keys: ClusterKeys | None, action: str) -> None:
    if keys is not None and keys.mechanism == "plain":
        raise AuthenticationError(
            f"cannot {action} with the PLAIN mechanism: PLAIN sends the cluster secret to "
            "whoever answers the address, so aiorl uses it only over ipc:// sockets in a "
            "private directory (embedded clusters); across machines use mechanism=curve")


def _expire(p: _Peer, rid: int, op: str, timeout: float) -> None:
    settle = p.pending.pop(rid, None)
    if settle is not None:
        settle(WaitTimeout(f"'{op}' to {p.address} got no answer within {timeout:g} s"), None)


def _cancel_then(handle: asyncio.TimerHandle, settle: Settle, error: BaseException | None,
                 reply: Reply | None) -> None:
    handle.cancel()
    settle(error, reply)
