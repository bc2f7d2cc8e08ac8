"""What a connection to one peer owes its owner, and the ZMQ socket that keeps it.

An endpoint talks to a peer through one `Connection` at a time: a ZMQ link (`ZmqLink` over a
DEALER; a ROUTER serves many clients through one) or, on the same machine, a lane
(`aiorl.transport.lane.LaneConnection`, a Unix stream its loop reads itself). Both keep one
contract (docs/reference/contract.md, "Connections"), tested once against both
(tests/system/test_connection_contract.py):

* **Sending.** `send` (from the loop: the first message of a turn at once, the rest of the
  turn together at its end), `send_direct` (now, after what the turn held) and
  `send_from_thread` (another thread: a method thread's answer) keep the order of one
  connection's messages. A send on a closed connection raises `ConnectionClosed`: it is
  never a silent no-op, so the owner can carry the message on another connection.
* **Breaking.** A connection that breaks by itself (the peer closed or reset it, a write
  failed) tells its owner once, on the loop (``on_broken(reason, unsent)``), with the
  messages it held that provably never left (``unsent``): the owner sends those on its next
  connection. What may have reached the peer stays pending with the owner
  (`aiorl.transport.peer.Peer`), which waits a bounded time for its answer or a verdict on the
  peer, then fails it with `aiorl.ConnectionLostError`.
* **Closing.** `close` by the owner flushes what the turn held (as far as the socket takes
  it now) and tells nobody.

`ZmqLink` is also how an endpoint watches any ZMQ socket on its loop (its ROUTER, a DEALER's
handshake monitor). The loop thread owns the socket; `send_from_thread` takes ``lock``,
which every socket operation takes: a mutex gives the full memory barrier libzmq requires
when a socket changes threads.

Edge-triggered wake-ups: the ZMQ FD signals a *change* of state, so a reader drains until
``EVENTS`` shows no ``POLLIN``, and looks at ``EVENTS`` again after every send, because a send
can consume the edge that announced queued input. Breaking either rule loses wake-ups.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq

from aiorl.transport.sockets import monitor_connection
from aiorl.transport.wire import (
    MAX_BATCH_MESSAGES,
    PACK_MIN_FRAMES,
    encode_batch,
    oversized,
    pack,
    split_frames,
)
from aiorl.util.batching import TurnBatcher
from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["Broken", "Connection", "ConnectionClosed", "ZmqLink", "recv_parts", "send_parts"]

log = logging.getLogger("aiorl.transport")
_dispatch_errors = RateLimitedLog(log)

#: How a connection tells its owner it broke: ``on_broken(reason, unsent)``, once, on the
#: loop; ``unsent`` are whole messages (lists of frames) that never left, in order.
Broken = Callable[[str, list[Sequence[Any]]], None]


class ConnectionClosed(ConnectionError):
    """A send on a connection that is closed (by its owner, or because it broke): nothing of
    the message left. The owner sends it on another connection or fails what waits on it."""


class Connection(Protocol):
    """One way to one peer: see the module docstring for what every implementation keeps."""

    #: ``"zmq"`` or ``"lane"``: which implementation (for the doctor and tests).
    kind: str

    @property
    def closed(self) -> bool:
        """Whether the connection is closed (closed connections never open again)."""

    def send(self, parts: Sequence[Any]) -> None:
        """Send one message from the loop thread; `ConnectionClosed` when closed."""

    def send_direct(self, parts: Sequence[Any]) -> None:
        """Send now, after anything held this turn; `ConnectionClosed` when closed."""

    def send_from_thread(self, parts: Sequence[Any]) -> None:
        """Send from another thread, in order; `ConnectionClosed` when closed."""

    def close(self) -> None:
        """Close; what the turn held leaves first, as far as the socket takes it now."""


# The Cython socket methods, called directly: pyzmq's Python "sugar" layer (enum flags,
# per-part dispatch) costs more per message than the send itself.
_RawSocket: Any = zmq.Socket.__mro__[1]
_raw_send = _RawSocket.send
_raw_recv = _RawSocket.recv
_raw_get = _RawSocket.get
_EVENTS, _POLLIN, _NOBLOCK, _SNDMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK), int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
#: Frames at least this large are handed to ZMQ without a copy (it keeps a reference).
_ZERO_COPY_BYTES = 64 * 1024
#: ZMQ messages handled per wake-up before yielding to other callbacks. Small on purpose: a
#: burst is worked through in slices, so the first answers leave while later calls are still
#: being read (docs/architecture.md, "The path of one call"); with one big slice a process
#: read a whole burst, ran it and only then answered, and the two ends took turns instead of
#: working at once.
_DRAIN_BATCH = 4
#: At most this many messages to one peer leave as one BATCH (a larger burst leaves as several,
#: in order); bytes are not counted: held messages are small control messages.
_MAX_HELD_BYTES = 1 << 62


def send_parts(sock: zmq.Socket[Any], parts: Sequence[Any]) -> None:
    """Send one multipart message without blocking (HWMs are unlimited, see sockets.py)."""
    last = len(parts) - 1
    for i, part in enumerate(parts):
        flags = _NOBLOCK | _SNDMORE if i < last else _NOBLOCK
        # bytes cannot change after the call, so a large one is lent to ZMQ like a view (an
        # agent forwarding a relayed payload sends the bytes it received).
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


class ZmqLink:
    """A ZMQ socket registered with the loop, drained completely after every wake-up: the
    ZMQ implementation of `Connection` (and the watcher of a ROUTER or a monitor socket).

    Args:
        sock: the socket; the link owns and closes it.
        on_message: gets each whole message (a list of frames) on the loop.
        loop: the loop that owns the socket.
        routed: a ROUTER: the first frame of every message names the peer.
        on_send_failed: told when messages held to the end of a turn could not leave
            (``zmq.ZMQError``); None drops them (replies to a routed peer that vanished).
        max_held: messages one peer's turn holds before they leave as one BATCH (at
            most what receivers accept, wire.py).
        on_link_event: for a DEALER: gets each of its handshake and disconnection events
            (`aiorl.transport.sockets.monitor_connection`; connect the socket after this).
    """

    kind = "zmq"
    __slots__ = ("sock", "on_message", "loop", "_scheduled", "closed", "lock", "routed",
                 "_batcher", "on_send_failed", "_monitor")

    def __init__(
        self,
        sock: zmq.Socket[Any],
        on_message: Callable[[list[Any]], None],
        loop: asyncio.AbstractEventLoop,
        routed: bool = False,
        on_send_failed: Callable[[zmq.ZMQError], None] | None = None,
        max_held: int = MAX_BATCH_MESSAGES,
        on_link_event: Callable[[list[Any]], None] | None = None,
    ) -> None:
        self.sock = sock
        self.on_message = on_message
        self.loop = loop
        self.on_send_failed = on_send_failed
        self._scheduled = False
        self.closed = False
        self.lock = threading.Lock()
        self.routed = routed
        # The first message of a loop turn leaves at once; later ones are held per peer
        # and leave as one BATCH message when the turn ends.
        self._batcher: TurnBatcher[bytes, list[Any]] = TurnBatcher(
            loop, self._send_held, max_items=max_held, max_bytes=_MAX_HELD_BYTES)
        self._monitor = (None if on_link_event is None
                         else ZmqLink(monitor_connection(sock), on_link_event, loop))
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
            raise ConnectionClosed("the ZMQ link is closed")
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
        if self.closed:
            raise ConnectionClosed("the ZMQ link is closed")
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
        if self._send_locked(parts):
            self.schedule_drain()

    def _send_locked(self, parts: Sequence[Any]) -> bool:
        """Send under the lock (any thread); whether input waits that the send may have
        hidden from the FD's edge."""
        with self.lock:
            if self.closed:
                raise ConnectionClosed("the ZMQ link is closed")
            try:
                send_parts(self.sock, self._packed(parts))
            finally:
                pending = _raw_get(self.sock, _EVENTS) & _POLLIN
        return bool(pending)

    def _packed(self, parts: Sequence[Any]) -> Sequence[Any]:
        """``parts`` as one PACKED frame when they are many and small (see wire.py): the
        receiver then reads one frame instead of hundreds. A message with a frame over
        `MAX_FRAME_BYTES` leaves SPLIT instead: one huge frame under CURVE can outlast the
        ZMTP heartbeat timeout, and the connection drops it (wire.py)."""
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
        if self._send_locked(parts):
            self.loop.call_soon_threadsafe(self.schedule_drain)

    def close(self) -> None:
        if not self.closed:
            self._batcher.flush_all()  # what was sent before close() still leaves
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            # Stop the socket's events before their reader goes. Closing the reader first,
            # while a handshake with a closing peer could still be reported, stalls libzmq's
            # I/O thread (it reports monitor events from there), and with it every socket of
            # the process.
            with self.lock:
                if not self.closed:
                    try:
                        self.sock.disable_monitor()
                    except zmq.ZMQError:
                        pass
            monitor.close()
        with self.lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.loop.remove_reader(self.sock.FD)
            except Exception:
                pass
            self.sock.close()
