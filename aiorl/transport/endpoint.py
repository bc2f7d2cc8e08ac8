"""The asyncio endpoint: one bound ROUTER for what comes in, one DEALER per peer for what goes out.

Every aiorl process (registry, node agent, worker, driver) owns one
:class:`Endpoint`. It serves operations registered with :meth:`Endpoint.handle`
on its ROUTER, and sends requests, one-way messages and event subscriptions to
other endpoints through a DEALER per peer address.

Event-loop integration
    Sockets are watched with ``loop.add_reader(sock.FD)`` and drained with
    non-blocking receives, which measured ~1.5x faster per round trip than
    ``zmq.asyncio`` here (see ``../shared/PERF-NOTES.md``). The ZMQ FD is
    edge-triggered: it signals a *change* of state, so a reader must drain until
    ``EVENTS`` shows no ``POLLIN``, and must look at ``EVENTS`` again after every
    send, because a send can consume the edge that announced queued input. Both
    rules are applied in :class:`_Watched`; breaking either loses wake-ups.

Batching
    The first message to a peer in an event-loop turn leaves at once; the rest
    of that turn's messages to the same peer leave together at the end of the
    turn as one BATCH message (see wire.py). A burst of 1,000 calls or replies
    then costs a few system calls instead of 1,000, and a lone call waits for
    nothing. Events and one-way messages go out unbatched, after anything held
    for their peer (so order is kept): a server learns at once when a
    subscriber is gone, and one-way streams (p2p) batch themselves.

Ordering
    Messages to one peer go through one DEALER and one TCP connection, and a
    batch keeps its messages in order, so they arrive in the order they were sent. Incoming messages from one peer are
    dispatched in arrival order; a handler that starts a task gives up that
    order for its own work.

Failure
    :meth:`Endpoint.mark_peer_lost` fails every pending request to a peer with
    :class:`~aiorl.errors.PeerLostError` and makes later requests fail at once.
    Who decides that a peer is lost (the registry, a node agent) lives above.

Threads
    An endpoint belongs to its event loop's thread. Other threads use
    :meth:`Endpoint.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from aiorl import errors
from aiorl.errors import PeerLostError, ProtocolError
from aiorl.transport import security, serialization
from aiorl.transport.security import ClusterKeys
from aiorl.transport.sockets import bind_random_port, make_socket
from aiorl.transport.wire import Kind, decode_header, encode_batch, encode_header, split_batch

__all__ = ["Endpoint", "Incoming", "Reply", "error_from_meta", "error_meta"]

log = logging.getLogger("aiorl.transport")

# Plain ints on the hot path: comparing IntEnum members costs more than the send itself.
_REQUEST, _REPLY, _ERROR, _ONEWAY, _EVENT, _BATCH = (
    int(Kind.REQUEST), int(Kind.REPLY), int(Kind.ERROR), int(Kind.ONEWAY), int(Kind.EVENT),
    int(Kind.BATCH),
)

# The Cython socket methods, called directly: pyzmq's Python "sugar" layer (enum flags,
# per-part dispatch) cost ~5 us per message here, more than the send itself.
_RawSocket = zmq.Socket.__mro__[1]
_raw_send = _RawSocket.send
_raw_get = _RawSocket.get
_EVENTS, _POLLIN, _NOBLOCK, _SNDMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK), int(zmq.SNDMORE)
#: Frames at least this large are handed to ZMQ without a copy (it keeps a reference).
_ZERO_COPY_BYTES = 64 * 1024


def send_parts(sock: zmq.Socket, parts: Sequence[Any]) -> None:
    """Send one multipart message without blocking (HWMs are unlimited, see sockets.py)."""
    last = len(parts) - 1
    for i, part in enumerate(parts):
        flags = _NOBLOCK | _SNDMORE if i < last else _NOBLOCK
        if isinstance(part, bytes) or memoryview(part).nbytes < _ZERO_COPY_BYTES:
            _raw_send(sock, part, flags, True, False)
        else:
            _raw_send(sock, part, flags, False, False)


#: Messages handled per wake-up before yielding to other callbacks (fairness).
_DRAIN_BATCH = 256

_FROM_ENVIRONMENT = object()
Reply = tuple[Any, list[Any]]  # (meta, payload frames)
Handler = Callable[["Incoming"], None]
EventHandler = Callable[[str, Any, list[Any]], None]


class _DropLog:
    """Warn about dropped messages at most once a second, with a count of the rest.

    A flood of garbage must not become a flood of log lines (that would be a
    denial of service of its own)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.suppressed = 0
        self.next_at = 0.0

    def __call__(self, what: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.suppressed += 1
            return
        more = f" (and {self.suppressed} more dropped messages)" if self.suppressed else ""
        log.warning("%s: dropped " + what + more, self.name, *args)
        self.suppressed = 0
        self.next_at = now + 1.0


class Incoming:
    """One received request, one-way message or event, with the means to answer it."""

    __slots__ = ("endpoint", "identity", "kind", "request_id", "op", "meta", "frames", "_answered")

    def __init__(
        self,
        endpoint: Endpoint,
        identity: bytes,
        kind: Kind,
        request_id: int,
        op: str,
        meta: Any,
        frames: list[Any],
    ) -> None:
        self.endpoint = endpoint
        self.identity = identity
        self.kind = kind
        self.request_id = request_id
        self.op = op
        self.meta = meta
        self.frames = frames
        self._answered = False

    @property
    def expects_reply(self) -> bool:
        return self.kind == _REQUEST

    def reply(self, meta: Any = None, frames: Sequence[Any] = ()) -> None:
        """Answer a request (ignored for one-way messages and after the first answer)."""
        if self.kind != _REQUEST or self._answered:
            return
        self._answered = True
        self.endpoint._send_router(self.identity, _REPLY, self.request_id, self.op, meta, frames)

    def reply_error(self, exc: BaseException, **extra: Any) -> None:
        """Answer a request with an error; ``extra`` lands in the error's meta (e.g. rank)."""
        if self.kind != _REQUEST or self._answered:
            return
        self._answered = True
        meta, frames = error_meta(exc, **extra)
        self.endpoint._send_router(self.identity, _ERROR, self.request_id, self.op, meta, frames)


def error_meta(exc: BaseException, **extra: Any) -> tuple[dict[str, Any], list[Any]]:
    """Describe ``exc`` for the wire: msgpack meta plus, when picklable, the exception itself."""
    meta: dict[str, Any] = {
        "error": type(exc).__name__ if isinstance(exc, errors.AiorlError) else "RemoteError",
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }
    meta.update(extra)
    try:
        frames = serialization.dumps(exc)
    except Exception:
        frames = []
    return meta, frames


def error_from_meta(meta: Any, frames: list[Any]) -> BaseException:
    """Rebuild the exception an ERROR reply describes."""
    if not isinstance(meta, dict):
        return ProtocolError(f"malformed error reply: {meta!r}")
    name = meta.get("error", "RemoteError")
    message = str(meta.get("message", ""))
    cause: BaseException | None = None
    if frames:
        try:
            loaded = serialization.loads(frames)
            if isinstance(loaded, BaseException):
                cause = loaded
        except Exception:
            cause = None  # the type may not exist here; the text below still says what happened
    cls = getattr(errors, str(name), None)
    if isinstance(cls, type) and issubclass(cls, errors.RemoteError):
        return cls(
            str(meta.get("worker", "?")),
            int(meta.get("rank", -1)),
            str(meta.get("type", "Exception")),
            message,
            str(meta.get("traceback", "")),
            cause,
        )
    if isinstance(cls, type) and issubclass(cls, errors.AiorlError):
        return cause if isinstance(cause, cls) else cls(message)
    return errors.RemoteError(
        str(meta.get("worker", "?")),
        int(meta.get("rank", -1)),
        str(meta.get("type", name)),
        message,
        str(meta.get("traceback", "")),
        cause,
    )


class _Watched:
    """A socket registered with the loop, drained completely after every wake-up.

    The loop thread owns the socket. One exception: :meth:`send_from_thread` lets
    another thread (a worker's method thread answering a call) send on it, under
    ``lock``, which every socket operation takes; a mutex gives the full memory
    barrier that libzmq requires when a socket changes threads.
    """

    __slots__ = ("sock", "on_message", "loop", "_scheduled", "closed", "lock", "routed",
                 "_hot", "_corked")

    def __init__(
        self,
        sock: zmq.Socket,
        on_message: Callable[[list[Any]], None],
        loop: asyncio.AbstractEventLoop,
        routed: bool = False,
    ) -> None:
        self.sock = sock
        self.on_message = on_message
        self.loop = loop
        self._scheduled = False
        self.closed = False
        self.lock = threading.Lock()
        self.routed = routed  # a ROUTER: the first frame of every message names the peer
        self._hot = False  # a message left directly during this loop turn
        self._corked: dict[bytes, list[list[Any]]] | None = None  # held until the turn ends
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
                frames = sock.recv_multipart(zmq.NOBLOCK)
            try:
                self.on_message(frames)
            except Exception:
                log.exception("unhandled error while dispatching a message")
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
        key = parts[0] if self.routed else b""
        corked = self._corked
        if corked is not None:
            corked.setdefault(key, []).append(parts[1:] if self.routed else list(parts))
            return
        if self._hot:
            self._corked = {key: [parts[1:] if self.routed else list(parts)]}
            return
        self._hot = True
        self.loop.call_soon(self._end_of_turn)
        self._send_now(parts)

    def send_direct(self, parts: Sequence[Any]) -> None:
        """Send now, after anything held for the same peer (order kept). Raises
        ``zmq.ZMQError`` (EHOSTUNREACH) at once when a routed peer is gone, which is
        how a server learns that a subscriber disconnected."""
        corked = self._corked
        if corked:
            held = corked.pop(parts[0] if self.routed else b"", None)
            if held:
                body = held[0] if len(held) == 1 else encode_batch(held)
                self._send_now([parts[0], *body] if self.routed else body)
        self._send_now(parts)

    def _end_of_turn(self) -> None:
        self._hot = False
        corked, self._corked = self._corked, None
        if not corked or self.closed:
            return
        for key, messages in corked.items():
            body = messages[0] if len(messages) == 1 else encode_batch(messages)
            try:
                self._send_now([key, *body] if self.routed else body)
            except zmq.ZMQError as exc:
                # A routed peer that vanished (EHOSTUNREACH): nothing waits for these.
                log.debug("dropped %d held message(s): %s", len(messages), exc)

    def _send_now(self, parts: Sequence[Any]) -> None:
        """Send now, then re-check EVENTS (a send can consume the FD's edge)."""
        with self.lock:
            if self.closed:
                raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
            try:
                send_parts(self.sock, parts)
            finally:
                pending = _raw_get(self.sock, _EVENTS) & _POLLIN
        if pending:
            self.schedule_drain()

    def send_from_thread(self, parts: Sequence[Any]) -> None:
        """Send from a thread other than the loop's. If the send consumed the edge of
        waiting input, wake the loop to drain it, or that input would sit unnoticed."""
        with self.lock:
            if self.closed:
                return
            try:
                send_parts(self.sock, parts)
            finally:
                pending = _raw_get(self.sock, _EVENTS) & _POLLIN
        if pending:
            self.loop.call_soon_threadsafe(self.schedule_drain)

    def close(self) -> None:
        if self._corked and not self.closed:
            self._end_of_turn()  # what was sent before close() still leaves
        with self.lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.loop.remove_reader(self.sock.FD)
            except Exception:
                pass
            self.sock.close()


class _Peer:
    """The outgoing side toward one remote endpoint."""

    __slots__ = ("address", "watched", "pending", "lost")

    def __init__(self, address: str, watched: _Watched) -> None:
        self.address = address
        self.watched = watched
        self.pending: dict[int, asyncio.Future[Reply]] = {}
        self.lost: BaseException | None = None


class Endpoint:
    """A process's messaging endpoint. See the module docstring for the rules it keeps.

    Args:
        name: a readable name for logs and routing ids (e.g. ``"rollout:3"``).
        host: interface to bind the ROUTER on.
        port: port to bind (0 = any free port).
        loop: the event loop that owns the endpoint (default: the running loop).
        keys: the cluster's CURVE keys; by default those of the environment
            (:func:`~aiorl.transport.security.keys_from_environment`); None = insecure.
    """

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        loop: asyncio.AbstractEventLoop | None = None,
        keys: ClusterKeys | None | object = _FROM_ENVIRONMENT,
    ) -> None:
        self.name = name
        self.keys: ClusterKeys | None = (
            security.keys_from_environment() if keys is _FROM_ENVIRONMENT else keys  # type: ignore[assignment]
        )
        self.loop = loop or asyncio.get_running_loop()
        self._identity = f"{name}/{os.getpid()}/{uuid.uuid4().hex[:8]}".encode()
        router = make_socket(zmq.ROUTER, keys=self.keys)
        self.address = bind_random_port(router, host, port)
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

    def _on_router_message(self, frames: list[Any], nested: bool = False) -> None:
        if len(frames) < 2:
            self._dropped("a message with %d frames (need identity and header)", len(frames))
            return
        identity = frames[0]
        try:
            header = decode_header(frames[1])
        except ProtocolError as exc:
            self._dropped("a malformed message: %s", exc)
            return
        if header.kind == _BATCH and not nested:
            try:
                parts = split_batch(header.meta, frames[2:])
            except ProtocolError as exc:
                self._dropped("a malformed batch: %s", exc)
                return
            for part in parts:
                self._on_router_message([identity, *part], nested=True)
            return
        msg = Incoming(self, identity, header.kind, header.request_id, header.op, header.meta, frames[2:])
        if header.kind not in (_REQUEST, _ONEWAY):
            self._dropped("a %s message sent to a server socket", Kind(header.kind).name)
            return
        handler = self._handlers.get(header.op)
        if handler is None:
            msg.reply_error(ProtocolError(f"{self.name} does not serve operation {header.op!r}"))
            return
        try:
            handler(msg)
        except Exception as exc:
            log.debug("%s: handler for %r raised", self.name, header.op, exc_info=True)
            msg.reply_error(exc)

    def _send_router(
        self, identity: bytes, kind: int, request_id: int, op: str, meta: Any, frames: Sequence[Any]
    ) -> bool:
        if self.closed:
            return False
        head = encode_header(kind, request_id, op, meta)
        try:
            if threading.get_ident() != self._loop_thread:
                self._router.send_from_thread([identity, head, *frames])
            elif kind == _EVENT:
                # Events report whether the subscriber is still there: no batching.
                self._router.send_direct([identity, head, *frames])
            else:
                self._router.send([identity, head, *frames])
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False  # the client went away; nothing is waiting for this any more
            raise
        return True

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
        :class:`TimeoutError`; a late reply is dropped.
        """
        fut: asyncio.Future[Reply] = self.loop.create_future()
        p = self._peer(peer)
        if p.lost is not None:
            fut.set_exception(_copy_lost(p.lost))
            return fut
        rid = next(self._request_ids)
        p.pending[rid] = fut
        self._send_dealer(p, _REQUEST, rid, op, meta, frames)
        if timeout is not None:
            handle = self.loop.call_later(timeout, _expire, p, rid, op, timeout)
            fut.add_done_callback(lambda _f: handle.cancel())
        return fut

    def send_oneway(self, peer: str, op: str, meta: Any = None, frames: Sequence[Any] = ()) -> None:
        """Send a message that expects no reply. Raises PeerLostError for a lost peer."""
        p = self._peer(peer)
        if p.lost is not None:
            raise _copy_lost(p.lost)
        self._send_dealer(p, _ONEWAY, 0, op, meta, frames)

    def _send_dealer(
        self, p: _Peer, kind: int, rid: int, op: str, meta: Any, frames: Sequence[Any]
    ) -> None:
        parts = [encode_header(kind, rid, op, meta), *frames]
        if kind == _ONEWAY:
            # One-way streams (p2p data, output lines) batch themselves where it pays;
            # holding them to the end of the turn measured 30 % slower for p2p.
            p.watched.send_direct(parts)
        else:
            p.watched.send(parts)

    def _peer(self, address: str) -> _Peer:
        p = self._peers.get(address)
        if p is None:
            if self.closed:
                raise PeerLostError(f"endpoint {self.name} is closed")
            sock = make_socket(zmq.DEALER, identity=self._identity, keys=self.keys)
            sock.connect(address)
            p = _Peer(address, None)  # type: ignore[arg-type]
            p.watched = _Watched(sock, lambda frames, p=p: self._on_dealer_message(p, frames), self.loop)
            lost = self._lost.get(address)
            if lost is not None:
                p.lost = lost
            self._peers[address] = p
        return p

    def _on_dealer_message(self, p: _Peer, frames: list[Any], nested: bool = False) -> None:
        try:
            header = decode_header(frames[0])
        except (ProtocolError, IndexError) as exc:
            self._dropped("a malformed message from %s: %s", p.address, exc)
            return
        if header.kind == _BATCH and not nested:
            try:
                parts = split_batch(header.meta, frames[1:])
            except ProtocolError as exc:
                self._dropped("a malformed batch from %s: %s", p.address, exc)
                return
            for part in parts:
                self._on_dealer_message(p, part, nested=True)
            return
        if header.kind == _EVENT:
            handler = self._event_handlers.get(header.op)
            if handler is None:
                log.debug("%s: no handler for event %r", self.name, header.op)
                return
            handler(p.address, header.meta, frames[1:])
            return
        fut = p.pending.pop(header.request_id, None)
        if fut is None or fut.done():
            return  # timed out or cancelled locally; the late answer has no reader
        if header.kind == _REPLY:
            fut.set_result((header.meta, frames[1:]))
        elif header.kind == _ERROR:
            fut.set_exception(error_from_meta(header.meta, frames[1:]))
        else:
            fut.set_exception(ProtocolError(f"unexpected {Kind(header.kind).name} in reply to a request"))

    # ------------------------------------------------------------------ failure
    def on_peer_lost(self, callback: Callable[[str, BaseException], None]) -> None:
        """Call ``callback(peer_address, error)`` whenever a peer is marked lost."""
        self._peer_lost_callbacks.append(callback)

    def is_lost(self, address: str) -> bool:
        return address in self._lost

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
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(_copy_lost(exc))
            # Nothing more will be read from or written to a dead peer's connection.
            p.watched.close()
            del self._peers[address]
        for cb in list(self._peer_lost_callbacks):
            try:
                cb(address, exc)
            except Exception:
                log.exception("peer-lost callback failed")

    # ------------------------------------------------------------------ lifecycle
    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        """Close every socket. Pending requests fail with PeerLostError."""
        if self.closed:
            return
        self.closed = True
        exc = PeerLostError(f"endpoint {self.name} closed")
        for p in list(self._peers.values()):
            for fut in p.pending.values():
                if not fut.done():
                    fut.set_exception(_copy_lost(exc))
                    fut.exception()  # closing: an abandoned request need not warn
            p.watched.close()
            # Layers above (channels, p2p) fail what they hold for this peer too.
            for cb in list(self._peer_lost_callbacks):
                try:
                    cb(p.address, exc)
                except Exception:
                    log.exception("peer-lost callback failed")
        self._peers.clear()
        self._router.close()


def _copy_lost(exc: BaseException) -> PeerLostError:
    return PeerLostError(str(exc))


def _expire(p: _Peer, rid: int, op: str, timeout: float) -> None:
    fut = p.pending.pop(rid, None)
    if fut is not None and not fut.done():
        fut.set_exception(TimeoutError(f"{op!r} to {p.address} got no answer within {timeout:g} s"))
