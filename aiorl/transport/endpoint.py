"""The asyncio endpoint: one bound ROUTER for what comes in, one DEALER per peer for what goes out.

Every aiorl process (registry, node agent, worker, driver) owns one
`Endpoint`. It serves operations registered with `Endpoint.handle`
on its ROUTER, and sends requests, one-way messages and event subscriptions to
other endpoints through a DEALER per peer address.

Event-loop integration
    Sockets are watched with ``loop.add_reader(sock.FD)`` and drained with
    non-blocking receives, which measured ~1.5x faster per round trip than
    ``zmq.asyncio`` here (see ``../shared/PERF-NOTES.md``); the rules an edge-triggered
    ZMQ FD needs are kept in `aiorl.transport.connection.ZmqLink`.

Connections
    Toward each peer the endpoint keeps a `aiorl.transport.peer.Peer`: one connection at a
    time (a lane on this machine, else a ZMQ DEALER) behind one interface
    (`aiorl.transport.connection.Connection`), and the requests pending on it. What a
    connection owes its callers when it closes or breaks is stated there and in
    docs/reference/contract.md ("Connections").

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
    A refused handshake fails what is pending with
    [`AuthenticationError`][aiorl.AuthenticationError]; a broken connection with
    [`ConnectionLostError`][aiorl.ConnectionLostError] when no answer nor verdict comes in
    time (`aiorl.transport.peer`). ZMQ exceptions never leave the transport.

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

from aiorl.errors import (
    AuthenticationError,
    PeerLostError,
    ProtocolError,
    WaitTimeout,
    from_wire,
)
from aiorl.transport import security
from aiorl.transport.connection import ConnectionClosed, ZmqLink
from aiorl.transport.incoming import Incoming
from aiorl.transport.lane import LaneConnection
from aiorl.transport.lane_setup import LaneListener, lane_path
from aiorl.transport.parked import ParkedAnswers
from aiorl.transport.peer import VERDICT_WAIT_S, Peer, Reply, Settle
from aiorl.transport.security import ClusterKeys
from aiorl.transport.sockets import IPC_PREFIX, ROUTER_HWM, bind_endpoint, make_socket
from aiorl.transport.wire import (
    RESUME,
    Kind,
    decode_fields,
    encode_header,
    join_frames,
    split_batch,
    unpack,
)
from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["Endpoint", "Incoming", "Reply"]  # Incoming: transport/incoming.py

log = logging.getLogger("aiorl.transport")
_dispatch_errors = RateLimitedLog(log)

# Plain ints on the hot path: comparing IntEnum members costs more than the send itself.
_REQUEST, _REPLY, _ERROR, _ONEWAY, _EVENT, _BATCH, _PACKED, _SPLIT = (
    int(Kind.REQUEST), int(Kind.REPLY), int(Kind.ERROR), int(Kind.ONEWAY), int(Kind.EVENT),
    int(Kind.BATCH), int(Kind.PACKED), int(Kind.SPLIT),
)

_thread_id = threading.get_ident

_FROM_ENVIRONMENT = object()
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
        verdict_wait: how long requests pending on a broken connection wait for their answer
            or a verdict on the peer (`aiorl.transport.peer.VERDICT_WAIT_S`).
        hello_deadline: how long a lane client may take to say hello
            (`aiorl.transport.lane_setup.HELLO_DEADLINE_S` when None).
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
        verdict_wait: float = VERDICT_WAIT_S,
        hello_deadline: float | None = None,
    ) -> None:
        self.name = name
        self.verdict_wait = verdict_wait
        #: Whether verdicts on peers may come late (the registry is unreachable): set by the
        #: runtime above; requests on a broken connection then wait for one longer.
        self.verdict_hold: Callable[[], bool] = _never
        #: The address of whoever gives verdicts (the registry): while it is silent, a peer
        #: that accepts no connection is taken as gone, but never that one itself (it may
        #: come back, restarted, at the same address).
        self.verdicts_from: str | None = None
        #: Whether whoever gives verdicts is silent now (not merely back a moment ago, when
        #: its verdicts are still to come): only then is a peer taken as gone.
        self.verdicts_silent: Callable[[], bool] = _never
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
        self._router = ZmqLink(router, self._on_router_message, self.loop, routed=True)
        self._loop_thread = threading.get_ident()  # built on its loop's thread (see Threads)
        self._handlers: dict[str, Handler] = {}
        self._event_handlers: dict[str, EventHandler] = {}
        self._peers: dict[str, Peer] = {}
        self._lost: dict[str, BaseException] = {}
        self._request_ids = itertools.count(1)
        self._peer_lost_callbacks: list[Callable[[str, BaseException], None]] = []
        self.closed = False
        #: Clients on our lane, by their endpoint's routing id (what a ROUTER would name them).
        self._lanes: dict[bytes, LaneConnection] = {}
        #: Answers for clients whose lane broke, until they are back by ZMQ.
        self._parked = ParkedAnswers(name, self.loop, verdict_wait)
        self._handlers[RESUME] = self._resumed
        self._lane_listener: LaneListener | None = None
        if lane and lane_path(self.address) is not None:
            try:
                self._lane_listener = LaneListener(
                    self.address, self.keys, self.loop, on_client=self._lane_client,
                    on_message=self._lane_message, on_gone=self._lane_gone,
                    **({} if hello_deadline is None else {"hello_deadline": hello_deadline}))
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
        if self._parked.clients and not within:  # a client whose lane broke is back
            for parts in self._parked.take(identity):
                self._send_parked(identity, parts)
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
            try:
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
            except ConnectionClosed:
                pass  # it closed meanwhile: a client whose lane broke reaches us by ZMQ
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
                if kind == _EVENT:  # events report whether the subscriber is still there
                    return False
                if _thread_id() != self._loop_thread:
                    self.loop.call_soon_threadsafe(self._parked.park, identity, [head, *frames])
                    return True
                # Held if its lane just broke (it comes back by ZMQ); else it went away.
                return self._parked.park(identity, [head, *frames])
            if exc.errno == zmq.EAGAIN:  # its queue is full (ROUTER_HWM): it does not read
                _dispatch_errors.warning(
                    "peer not reading", "%s: a peer does not read what it is sent (%d "
                    "messages queued for it): dropped a %s", self.name, ROUTER_HWM,
                    Kind(kind).name)
                return True
            raise
        return True

    # ------------------------------------------------------------------ lanes (serving)
    def _lane_client(self, conn: LaneConnection) -> bool:
        """A client of this machine proved the cluster key on our lane: its messages are
        served as the ROUTER's are, and our answers to its routing id take its lane. Refused
        (False) while another live lane holds that routing id: its owner keeps its answers."""
        old = self._lanes.get(conn.peer_identity)
        if old is not None and not old.closed:
            return False
        self._lanes[conn.peer_identity] = conn
        return True

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

    def _lane_gone(self, conn: LaneConnection, unsent: list[Sequence[Any]]) -> None:
        """A client's lane ended: it may come back by ZMQ under the same routing id; what
        could not leave on the lane goes that way, held until it is back."""
        identity = conn.peer_identity
        if self._lanes.get(identity) is conn:
            del self._lanes[identity]
        if self.closed:
            return
        self._parked.expect(identity)
        for parts in unsent:
            self._send_parked(identity, parts)

    def _resumed(self, msg: Incoming) -> None:
        """`RESUME`: a client whose lane broke is back by ZMQ (what was held for it left on
        arrival, in `_on_router_message`). Its lane is over even where we have not read its
        end yet (a loaded loop reads the ROUTER first): it is ended now, so that the answers
        to what the client sends from here on go back the way it came, and what never left
        on the lane follows by ZMQ. (An answer sent on that lane could be lost with it, and
        a request sent after the break has no verdict to end it: it waits for its answer.)"""
        if msg.lane is not None:
            return
        lane = self._lanes.get(msg.identity)
        if lane is not None:
            lane.end("its client came back by ZMQ")
            for parts in self._parked.take(msg.identity):  # it is back: nothing to hold
                self._send_parked(msg.identity, parts)

    def _send_parked(self, identity: bytes, parts: Sequence[Any]) -> None:
        """Send a message held for (or not yet sent to) ``identity`` through the ROUTER, or
        hold it again while the client is not back."""
        try:
            self._router.send_direct([identity, *parts])
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH or not self._parked.park(identity, parts):
                log.debug("%s: dropped a message for a client whose lane broke: %s",
                          self.name, exc)
        except ConnectionClosed:
            pass

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
            settle(p.failure(), None)
            return 0
        rid = next(self._request_ids)
        if timeout is not None:
            handle = self.loop.call_later(timeout, _expire, p, rid, op, timeout)
            settle = functools.partial(_cancel_then, handle, settle)
        p.pending[rid] = settle
        p.send([encode_header(_REQUEST, rid, op, meta), *frames], False)
        if p.down_since is not None:  # a ZMQ link not (yet) up: the peer may be dead already
            p.watch_down()
        return rid

    def send_oneway(self, peer: str, op: str, meta: Any = None, frames: Sequence[Any] = ()) -> None:
        """Send a message that expects no reply. Raises PeerLostError for a lost peer and
        AuthenticationError while the peer's handshake fails."""
        p = self._peer(peer)
        if p.lost is not None or p.refused is not None:
            raise p.failure()
        # One-way streams (p2p data, output lines) batch themselves where it pays; holding
        # them to the end of the turn measured 30 % slower for p2p.
        p.send([encode_header(_ONEWAY, 0, op, meta), *frames], True)
        if p.refused is not None:
            raise p.failure()

    def _peer(self, address: str) -> Peer:
        p = self._peers.get(address)
        if p is None:
            if self.closed:
                raise PeerLostError(f"endpoint {self.name} is closed")
            if not address.startswith(IPC_PREFIX):
                _refuse_plain_over_tcp(self.keys, f"connect to {address}")
            p = Peer(self.name, address, self._identity, self.keys, self.loop,
                     self._on_dealer_message, self.verdict_wait, self._holding_verdicts,
                     None if address == self.verdicts_from
                     else functools.partial(self.mark_peer_lost, address),
                     self._verdicts_silent)
            p.open()
            lost = self._lost.get(address)
            if lost is not None:
                p.lost = lost
            self._peers[address] = p
        return p

    def _on_dealer_message(self, p: Peer, frames: list[Any], within: int = 0) -> None:
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

    def _holding_verdicts(self) -> bool:
        return self.verdict_hold()

    def _verdicts_silent(self) -> bool:
        return self.verdicts_silent()

    def link_down_for(self, address: str) -> float:
        """For how long (seconds) the ZMQ link to ``address`` has been down: made or dropped,
        and no handshake since; 0 while it is up, on a lane, or before this endpoint sent
        ``address`` anything. A peer process that ended drops it at once (its kernel resets
        the connection); a slow or stopped one keeps it."""
        p = self._peers.get(address)
        if p is None or p.down_since is None:
            return 0.0
        return self.loop.time() - p.down_since

    def pending_requests(self) -> list[tuple[str, Settle]]:
        """Every request waiting for an answer, as ``(peer address, settle)`` (what the
        doctor reads; ``settle`` is what the request was sent with)."""
        return [(address, settle) for address, p in self._peers.items()
                for settle in p.pending.values()]

    def connection_kind(self, address: str) -> str | None:
        """How this endpoint reaches ``address`` now: ``"lane"``, ``"zmq"``, ``"none"``
        (refused, to be rebuilt), or None when it has not talked to it (or it is lost)."""
        p = self._peers.get(address)
        return None if p is None else p.kind

    def mark_peer_lost(self, address: str, reason: str) -> None:
        """Fail all pending and future requests to ``address`` with PeerLostError(reason)."""
        if address in self._lost:
            return
        exc = PeerLostError(reason)
        self._lost[address] = exc
        p = self._peers.get(address)
        if p is not None:
            p.lost = exc
            p.fail_pending(p.failure)
            # Nothing more will be read from or written to a dead peer's connection.
            p.retire()
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
        DEALER or a lane (a relayed p2p message carries it: `aiorl.p2p.p2p_relay`)."""
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
            p.fail_pending(lambda: PeerLostError(str(exc)))
            p.retire()
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
        self._parked.close()
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


def _never() -> bool:
    return False


def _refuse_plain_over_tcp(keys: ClusterKeys | None, action: str) -> None:
    if keys is not None and keys.mechanism == "plain":
        raise AuthenticationError(
            f"cannot {action} with the PLAIN mechanism: PLAIN sends the cluster secret to "
            "whoever answers the address, so aiorl uses it only over ipc:// sockets in a "
            "private directory (embedded clusters); across machines use mechanism=curve")


def _expire(p: Peer, rid: int, op: str, timeout: float) -> None:
    settle = p.pending.pop(rid, None)
    if settle is not None:
        settle(WaitTimeout(f"'{op}' to {p.address} got no answer within {timeout:g} s"), None)


def _cancel_then(handle: asyncio.TimerHandle, settle: Settle, error: BaseException | None,
                 reply: Reply | None) -> None:
    handle.cancel()
    settle(error, reply)
