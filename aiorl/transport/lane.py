"""Lanes: a worker's messages from processes of its own machine, over a plain Unix stream.

A message through ZMQ wakes two threads in each process it passes: libzmq's I/O thread reads
the socket and signals the loop thread through a mailbox, and every send is handed back to the
I/O thread the same way. That is ~30 system calls per call in a worker (`getpid` and `poll`
in libzmq's command processing, `epoll_wait` in both threads, eventfd reads and writes) and
100-170 us of CPU, which a group call pays once per rank: on a 2-core machine 256 workers
burnt ~40 ms of CPU per no-op call (docs/scale.md). A lane is a Unix stream socket the
worker's loop reads itself: one wake-up, a `recv` and a `sendmsg` per message.

Who uses one: an `Endpoint` made with ``lane=True`` and bound ``ipc://`` (workers) also
listens on ``<its socket path>.lane``; any endpoint that sends to an ``ipc://`` address
whose lane exists talks to it through the lane instead of a DEALER, for the life of that
peer (one path per peer keeps the order of its messages). The peer's address and identity
are unchanged: the endpoint above sees the same requests, replies, errors and events.

Authentication, both ways, before a message is read (docs/security.md): the lane is in the
same private directory as the endpoint's ZMQ socket (only this user can create or connect
to it), each side checks the other's uid (``SO_PEERCRED``), and a client's first bytes prove
it holds the cluster's secret (an HMAC over the lane's path and the client's identity; the
secret itself never crosses). The server reads nothing more from a client before that.

On the stream, a message is ``<u32 frame count> <u64 length> ... <frames>``. What one turn
of the loop sends to one lane leaves in one ``sendmsg`` (the first message of a turn at
once, as on the ZMQ path). A lane reads at most `_DISPATCH_BATCH` messages per wake-up, so
answers leave while a burst of calls is still being read. A connection that breaks drops
nothing the endpoint waits on: as with ZMQ, a request pending on a peer ends when the peer
is marked lost (its worker's death), not when a socket closes.

Threads: the loop thread owns a lane; `LaneConnection.send_from_thread` (a method thread's
answer) writes under the lane's lock.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import hashlib
import hmac
import logging
import os
import re
import socket
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from aiorl.transport import security
from aiorl.transport.security import ClusterKeys
from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["LANE_SUFFIX", "LaneConnection", "LaneListener", "connect_lane", "lane_path"]

log = logging.getLogger("aiorl.transport")
_refused = RateLimitedLog(log)

LANE_SUFFIX = ".lane"
_IPC_PREFIX = "ipc://"
#: What a client proves with (an HMAC-SHA256, 32 bytes), and the identity's length prefix.
_PROOF_BYTES = 32
_HELLO = struct.Struct("<H")
_PROOF_CONTEXT = b"aiorl-lane-1\0"
#: The server's one-byte answer to a client's hello.
_ADMITTED, _REFUSED = 1, 0
_COUNT = struct.Struct("<I")
#: The head of a message of one frame: its count (1) and the frame's length.
_ONE_FRAME = struct.Struct("<IQ")
_ONE_FRAME_HEAD = _ONE_FRAME.size
#: A message with more frames than this, or more bytes, is refused (the connection closes):
#: far above what the endpoint sends, and a bound on what a broken peer makes us allocate.
MAX_FRAMES = 1 << 16
MAX_MESSAGE_BYTES = 1 << 40
#: Messages dispatched per wake-up before other callbacks run, so answers leave while a
#: burst is still being read. As many as one BATCH message of the ZMQ path carries: with 4
#: (the ZMQ path's count of BATCH messages per wake-up) 1,000 calls in flight measured ~30 %
#: fewer calls/s than through ZMQ; with 64 and 256 the same as through ZMQ.
_DISPATCH_BATCH = 64
#: Messages one turn holds for a lane before they leave anyway.
_MAX_HELD = 64
#: Buffers per ``sendmsg`` (Linux allows 1,024).
_MAX_IOV = 512
#: Frames below this are copied when they must wait for the socket (a caller may reuse its
#: buffer once `send` returned); larger ones are referenced, as ZMQ does.
_COPY_BELOW = 64 * 1024
#: A lane's read buffer to start with, grown for a large message and given back after it:
#: a driver holds a lane per worker of its machine, and a worker one per caller, so this is
#: paid hundreds of times (256 KiB each would be 64 MiB in a driver of 256 workers).
_READ_CHUNK = 16 * 1024
#: Less free room than this at the buffer's end: make room before reading.
_MIN_ROOM = _READ_CHUNK // 4
#: A buffer larger than this (grown for a large message) is given back once empty.
_KEEP_BUFFER = 4 * _READ_CHUNK
#: Messages a server holds for a client that does not read its answers before it drops
#: more (what ZMQ's ROUTER high-water mark does on the other path).
MAX_QUEUED = 100_000


#: A private directory (0700, ours) where endpoints bound on TCP keep their lanes: set by a
#: node agent that binds its workers on the node's IP, for itself and its workers, so that
#: a machine's own processes reach its workers by lane there too.
LANE_DIR_VAR = "AIORL_LANE_DIR"


def lane_path(address: str) -> str | None:
    """Where the lane of the endpoint at ``address`` listens: beside an ``ipc://`` socket,
    or, for a ``tcp://`` one, in this process's lane directory (`LANE_DIR_VAR`); None when
    it has no place for one."""
    if address.startswith(_IPC_PREFIX):
        return address[len(_IPC_PREFIX):] + LANE_SUFFIX
    directory = os.environ.get(LANE_DIR_VAR)
    if not directory or not address.startswith("tcp://"):
        return None
    return os.path.join(directory, re.sub(r"[^0-9A-Za-z.]", "_", address[6:]) + LANE_SUFFIX)


def _proof(keys: ClusterKeys | None, path: str, identity: bytes) -> bytes:
    secret = keys.secret if keys is not None else b""
    return hmac.new(secret, _PROOF_CONTEXT + path.encode() + b"\0" + identity,
                    hashlib.sha256).digest()


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


#: Layouts by frame count, made once for the counts messages have (a large count's is made
#: per message): a message's head (its count, then each frame's length), and the lengths alone.
_CACHED_COUNTS = 64
_HEADS = [struct.Struct(f"<I{count}Q") for count in range(_CACHED_COUNTS + 1)]
_LENGTHS = [struct.Struct(f"<{count}Q") for count in range(_CACHED_COUNTS + 1)]


def _heads(count: int) -> struct.Struct:
    """The layout of a message's head: its frame count, then each frame's length."""
    return _HEADS[count] if count <= _CACHED_COUNTS else struct.Struct(f"<I{count}Q")


def _as_bytes_view(part: Any) -> memoryview:
    view = memoryview(part)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


class _TurnClock:
    """Where one event loop's turn ends, for all of its lanes: a lane's first message of a
    turn leaves at once, the rest of that turn's messages together at its end (`send`).

    One end-of-turn callback per turn for every lane of the loop: a driver calling 256
    workers of its machine sends the first message of a turn on 256 lanes, and a batcher per
    lane scheduled (and ran) 256 callbacks per group call for that. Loop thread only."""

    __slots__ = ("turn", "scheduled", "holding", "__weakref__")

    def __init__(self) -> None:
        self.turn = 1  # a lane's `_turn` starts at 0: its first message leaves at once
        self.scheduled = False
        #: Lanes that hold messages until the turn ends.
        self.holding: list[LaneConnection] = []

    def begin(self, loop: asyncio.AbstractEventLoop) -> int:
        """A lane sends its first message of this turn: the turn's number (the turn ends
        with a callback scheduled now if none is)."""
        if not self.scheduled:
            self.scheduled = True
            loop.call_soon(self._end_of_turn)
        return self.turn

    def _end_of_turn(self) -> None:
        self.scheduled = False
        self.turn += 1
        holding, self.holding = self.holding, []
        for conn in holding:
            conn._send_held()


_CLOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _TurnClock] = (
    weakref.WeakKeyDictionary())


def _clock_of(loop: asyncio.AbstractEventLoop) -> _TurnClock:
    clock = _CLOCKS.get(loop)
    if clock is None:
        clock = _CLOCKS[loop] = _TurnClock()
    return clock


class LaneConnection:
    """One end of a lane: frames messages out and in. ``on_message(frames)`` gets each
    whole message (a list of ``bytes``) on the loop; ``on_closed()`` runs once when the
    stream ends or breaks (not after `close`)."""

    __slots__ = ("sock", "loop", "on_message", "on_closed", "lock", "closed", "_fd", "_out",
                 "_queued", "_writing", "_clock", "_turn", "_held", "_buf", "_view", "_start",
                 "_end", "_need", "_reading", "_parse_scheduled", "_expect_hello",
                 "peer_identity", "max_queued", "_expect_answer", "_greeting", "on_refused")

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop,
                 on_message: Callable[[list[Any]], None],
                 on_closed: Callable[[], None] | None = None, *,
                 expect_hello: Callable[[LaneConnection, bytes, bytes], bool] | None = None,
                 ) -> None:
        self.sock = sock
        self.loop = loop
        self.on_message = on_message
        self.on_closed = on_closed
        #: Held by whoever writes the socket or `_out` (the loop thread, a method thread).
        self.lock = threading.RLock()
        self.closed = False
        self._fd = sock.fileno()
        #: What waits for the socket to take it, in order (whole buffers, or views of them).
        self._out: collections.deque[bytes | memoryview] = collections.deque()
        self._queued = 0  # messages in _out, for MAX_QUEUED
        self._writing = False  # a writer callback is registered
        self._clock = _clock_of(loop)
        self._turn = 0  # the last turn in which a message left at once (`_TurnClock`)
        self._held: list[Sequence[Any]] = []  # this turn's later messages, until it ends
        self._buf = bytearray(_READ_CHUNK)
        #: A view of ``_buf`` kept for reads and frame copies (replaced with the buffer).
        self._view = memoryview(self._buf)
        self._start = 0  # first unparsed byte
        self._end = 0  # end of what was read
        self._need = 0  # bytes the message at _start needs in all (0: not known yet)
        self._reading = False
        self._parse_scheduled = False
        #: A server's check of a new client: ``(connection, proof, identity) -> admitted``;
        #: until it passes, nothing else the client sent is read.
        self._expect_hello = expect_hello
        self.peer_identity = b""
        #: A client's first byte from the server answers its hello: admitted, or refused
        #: (then ``on_refused()`` runs and the lane closes).
        self._expect_answer = expect_hello is None
        #: Either of the two above is still to come (one check on the hot path).
        self._greeting = True
        self.on_refused: Callable[[], None] | None = None
        #: Messages held for a peer that does not read before more are dropped: a server's
        #: bound (`MAX_QUEUED`); a client's requests are never dropped (as a DEALER's).
        self.max_queued = MAX_QUEUED if expect_hello is not None else 1 << 62
        self._resume_reading()

    # ------------------------------------------------------------------ sending
    def send(self, parts: Sequence[Any]) -> None:
        """Send one message from the loop thread (the first of a turn at once, the rest of
        the turn together at its end, or once `_MAX_HELD` wait)."""
        if self.closed:
            return
        clock = self._clock
        held = self._held
        if self._turn != clock.turn:
            self._turn = clock.begin(self.loop)
            if held:  # held in an earlier turn whose end has not reached us yet: order first
                self._held = []
                held.append(parts)
                self._write(held)
            else:
                self._write([parts])
            return
        if not held:
            clock.holding.append(self)
        held.append(parts)
        if len(held) >= _MAX_HELD:
            self._held = []
            self._write(held)

    def send_direct(self, parts: Sequence[Any]) -> None:
        """Send now, after anything held this turn (order kept)."""
        if self.closed:
            return
        held = self._held
        if held:
            self._held = []
            held.append(parts)
            self._write(held)
        else:
            self._write([parts])

    def send_from_thread(self, parts: Sequence[Any]) -> None:
        """Send from a thread other than the loop's (a method thread's answer)."""
        if not self.closed:
            self._write([parts], from_thread=True)

    def send_frame_from_thread(self, frame: bytes) -> None:
        """`send_from_thread` of a message of one small frame (a header alone: the answer of
        a method that returned None), without the general path's lists and loops when the
        socket takes it at once.

        At 256 workers on two cores each one runs this from cold caches, so every Python
        step it saves is a few milliseconds per group call (docs/scale.md)."""
        data = _ONE_FRAME.pack(1, len(frame)) + frame
        with self.lock:  # re-entrant: what is left goes through `_emit`, still in order
            if self.closed:
                return
            sent = 0
            if not self._out:  # nothing waits before it: straight to the socket
                try:
                    sent = self.sock.send(data)
                except OSError:  # EAGAIN, EINTR or broken: `_emit` tries again and decides
                    pass
                if sent == len(data):
                    return
            self._emit([memoryview(data)[sent:] if sent else data], 1, True)

    def _send_held(self) -> None:
        """The turn ended: what this turn held leaves (`_TurnClock`)."""
        held = self._held
        if held:
            self._held = []
            if not self.closed:
                self._write(held)

    def _write(self, messages: list[Sequence[Any]], from_thread: bool = False,
               answer: int | None = None) -> None:
        buffers: list[bytes | memoryview] = [] if answer is None else [bytes((answer,))]
        for parts in messages:
            count = len(parts)
            # A message of small bytes frames (a header, a small pickle: most calls and
            # answers) leaves as one buffer with its head; others as views, without a copy.
            if count == 1:  # a header alone (a call without arguments, an empty answer)
                only = parts[0]
                if only.__class__ is bytes and len(only) < _COPY_BELOW:
                    buffers.append(_ONE_FRAME.pack(1, len(only)) + only)
                    continue
            size = 0
            for part in parts:
                if part.__class__ is not bytes:
                    size = _COPY_BELOW
                    break
                size += len(part)
            head = _HEADS[count] if count <= _CACHED_COUNTS else _heads(count)
            if size < _COPY_BELOW:
                buffers.append(b"".join([head.pack(count, *map(len, parts)), *parts]))
            else:
                views = list(map(_as_bytes_view, parts))
                buffers.append(head.pack(count, *map(len, views)))
                buffers.extend(views)
        self._emit(buffers, len(messages), from_thread)

    def _emit(self, buffers: list[bytes | memoryview], messages: int, from_thread: bool) -> None:
        """Send ``buffers`` (``messages`` whole messages) now, or queue what the socket does
        not take yet behind what waits already (any thread: under the lock)."""
        broke = False
        with self.lock:
            if self.closed:
                return
            if self._out:  # earlier messages still wait for the socket: keep the order
                self._queue(buffers, messages)
            else:
                try:
                    left = self._sendmsg(buffers)
                except OSError:
                    broke = self.closed = True
                else:
                    if not left:  # all sent: most sends end here
                        return
                    self._queue(left, messages)
        if broke:
            self._broken(from_thread)
            return
        if self._out and not self._writing:
            if from_thread:
                self.loop.call_soon_threadsafe(self._start_writer)
            else:
                self._start_writer()

    def _sendmsg(self, buffers: list[bytes | memoryview]) -> list[bytes | memoryview]:
        """Send as much of ``buffers`` as the socket takes now; return the rest. (Every
        view is one-dimensional bytes: its ``len`` is its size.)"""
        sock = self.sock
        if len(buffers) == 1:  # one message of small frames: most sends
            only = buffers[0]
            try:
                sent = sock.send(only)
            except (BlockingIOError, InterruptedError):
                return buffers
            return [] if sent == len(only) else [memoryview(only)[sent:]]
        while buffers:
            chunk = buffers[:_MAX_IOV]
            try:
                sent = sock.sendmsg(chunk)
            except (BlockingIOError, InterruptedError):
                return buffers
            for i, view in enumerate(chunk):
                if sent < len(view):
                    rest = buffers[i:]
                    rest[0] = memoryview(view)[sent:]
                    return rest
                sent -= len(view)
            buffers = buffers[len(chunk):]
        return buffers

    def _queue(self, buffers: list[bytes | memoryview], messages: int) -> None:
        if self._queued + messages > self.max_queued:
            _refused.warning("lane queue full", "a peer does not read what it is sent on its "
                             "lane (%d messages queued): dropped %d message(s)",
                             self._queued, messages)
            return
        out = self._out
        for view in buffers:
            # bytes cannot change; a small view is copied (its owner may reuse the buffer).
            out.append(view if view.__class__ is bytes or len(view) >= _COPY_BELOW
                       else bytes(view))
        self._queued += messages

    def _start_writer(self) -> None:
        if not self._writing and not self.closed:
            self._writing = True
            self.loop.add_writer(self._fd, self._flush_out)

    def _flush_out(self) -> None:
        with self.lock:
            out = self._out
            try:
                left = self._sendmsg(list(out)) if out else []
            except OSError:
                left = None
            if left is not None:
                out.clear()
                out.extend(left)
                if not left:
                    self._queued = 0
            done = left is not None and not left
            broke = left is None
            if broke:
                self.closed = True
        if done or broke:
            self._writing = False
            self.loop.remove_writer(self._fd)
        if broke:
            self._broken(False)

    # ------------------------------------------------------------------ receiving
    def _resume_reading(self) -> None:
        if not self._reading and not self.closed:
            self._reading = True
            self.loop.add_reader(self._fd, self._on_readable)

    def _pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self.loop.remove_reader(self._fd)

    def _on_readable(self) -> None:
        end = self._end
        if len(self._buf) - end < _MIN_ROOM:
            self._make_room()
            end = self._end
        try:
            n = self.sock.recv_into(self._view[end:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if n == 0:
            self._broken(False)
            return
        self._end = end = end + n
        # Most wake-ups read one whole message of one frame (a call without arguments, an
        # answer) into an empty buffer: it is dispatched here, without `_parse`'s loop.
        if not self._start and not self._greeting and end >= _ONE_FRAME_HEAD:
            count, size = _ONE_FRAME.unpack_from(self._buf)
            if count == 1 and end == _ONE_FRAME_HEAD + size and not self._parse_scheduled:
                frame = bytes(self._view[_ONE_FRAME_HEAD:end])
                self._end = self._need = 0
                if len(self._buf) > _KEEP_BUFFER:
                    self._shrink()
                try:
                    self.on_message([frame])
                except Exception as exc:
                    self._dispatch_failed(exc)
                return
        self._parse()

    def _make_room(self) -> None:
        """Move what is unparsed to the front, and grow the buffer for a large message."""
        pending = self._end - self._start
        size = max(len(self._buf), self._need + _READ_CHUNK, pending + _READ_CHUNK)
        if size > len(self._buf) or self._start:
            # Same size: moved within the buffer (its view stays valid, no resize).
            buf = bytearray(size) if size > len(self._buf) else self._buf
            buf[:pending] = self._buf[self._start:self._end]
            self._start, self._end = 0, pending
            if buf is not self._buf:
                self._buf, self._view = buf, memoryview(buf)

    def _parse(self) -> None:
        self._parse_scheduled = False
        for _ in range(_DISPATCH_BATCH):
            if self.closed:
                return
            frames = self._next_message()
            if frames is None:
                if not self._reading:
                    self._resume_reading()
                return
            try:
                self.on_message(frames)
            except Exception as exc:
                self._dispatch_failed(exc)
            if self._start == self._end:  # all that was read is dispatched (most wake-ups)
                if not self._reading:
                    self._resume_reading()
                return
        # More may be complete already: continue after other callbacks (answers) ran, and
        # read no more until the backlog is worked through.
        self._pause_reading()
        if not self._parse_scheduled:
            self._parse_scheduled = True
            self.loop.call_soon(self._parse)

    @staticmethod
    def _dispatch_failed(exc: Exception) -> None:
        """A bug a peer's message can reach: logged, bounded; the lane reads on."""
        _refused.warning("lane dispatch", "unhandled error while dispatching a message from "
                         "a lane", exc_info=exc)

    def _next_message(self) -> list[Any] | None:
        """The next whole message in the buffer (None: not all of it is here yet)."""
        if self._greeting:
            return self._next_greeting()
        start, end = self._start, self._end
        buf = self._buf
        if end - start >= _ONE_FRAME_HEAD:  # a whole message of one frame: most calls
            count, size = _ONE_FRAME.unpack_from(buf, start)
            if count == 1 and end - start >= _ONE_FRAME_HEAD + size:
                pos = start + _ONE_FRAME_HEAD + size
                frames = [bytes(self._view[start + _ONE_FRAME_HEAD:pos])]
                self._need = 0
                if pos != end:
                    self._start = pos
                    return frames
                self._start = self._end = 0
                if len(buf) > _KEEP_BUFFER:
                    self._shrink()
                return frames
        elif end - start < 4:
            return None
        (count,) = _COUNT.unpack_from(buf, start)
        if count == 0 or count > MAX_FRAMES:
            self._malformed(f"a message of {count} frames")
            return None
        head = 4 + 8 * count
        if end - start < head:
            return None
        lengths = (_LENGTHS[count] if count <= _CACHED_COUNTS
                   else struct.Struct(f"<{count}Q")).unpack_from(buf, start + 4)
        total = head + sum(lengths)
        if total > MAX_MESSAGE_BYTES:
            self._malformed(f"a message of {total} bytes")
            return None
        if end - start < total:
            self._need = total
            return None
        self._need = 0
        pos = start + head
        view = self._view
        frames = []
        for n in lengths:
            frames.append(bytes(view[pos:pos + n]))
            pos += n
        if pos == end:
            self._start = self._end = 0
            if len(buf) > _KEEP_BUFFER:
                self._shrink()
        else:
            self._start = pos
        return frames

    def _shrink(self) -> None:
        """A large message passed, and the buffer is empty: give its memory back."""
        self._buf = bytearray(_READ_CHUNK)
        self._view = memoryview(self._buf)

    def _next_greeting(self) -> list[Any] | None:
        """`_next_message` before the hello (a server) or its answer (a client) was read."""
        buf, start, end = self._buf, self._start, self._end
        if self._expect_hello is not None:
            return self._hello(buf, start, end)
        if end == start:
            return None
        self._expect_answer = self._greeting = False
        self._start = start + 1
        if buf[start] != _ADMITTED:
            refused, self.on_refused = self.on_refused, None
            self.on_closed = None  # refused, not broken: the owner hears it once
            self.close()
            if refused is not None:
                refused()
            return None
        return self._next_message()

    def _hello(self, buf: bytearray, start: int, end: int) -> list[Any] | None:
        head = _PROOF_BYTES + _HELLO.size
        if end - start < head:
            return None
        (n,) = _HELLO.unpack_from(buf, start + _PROOF_BYTES)
        if end - start < head + n:
            return None
        proof = bytes(buf[start:start + _PROOF_BYTES])
        identity = bytes(buf[start + head:start + head + n])
        check, self._expect_hello = self._expect_hello, None
        self._greeting = False  # a server's client expects no answer from us
        assert check is not None
        self._start = start + head + n
        self.peer_identity = identity
        if not check(self, proof, identity):
            _refused.warning("lane refused", "refused a lane client that did not prove it "
                             "holds this cluster's key")
            self.peer_identity = b""
            self._write([], answer=_REFUSED)
            self.close()
            return None
        self._write([], answer=_ADMITTED)
        return self._next_message()

    def _malformed(self, what: str) -> None:
        _refused.warning("lane malformed", "closed a lane that sent %s (refused: at most "
                         "%d frames and %d bytes)", what, MAX_FRAMES, MAX_MESSAGE_BYTES)
        self._broken(False)

    # ------------------------------------------------------------------ ending
    def _broken(self, from_thread: bool) -> None:
        """The stream ended or broke: close it, and tell the owner once."""
        if from_thread:
            self.loop.call_soon_threadsafe(self._broken, False)
            return
        callback, self.on_closed = self.on_closed, None
        self.close()
        if callback is not None:
            callback()

    def close(self) -> None:
        """Close the stream; what was sent this turn leaves first (as far as it can now).
        ``on_closed`` is not called."""
        if self._fd < 0:
            return
        self.on_closed = None
        if not self.closed:
            held = self._held
            if held:
                self._held = []
                self._write(held)
        with self.lock:
            self.closed = True
        self._pause_reading()
        if self._writing:
            self._writing = False
            self.loop.remove_writer(self._fd)
        self._fd = -1
        self.sock.close()


def connect_lane(address: str, identity: bytes, keys: ClusterKeys | None,
                 loop: asyncio.AbstractEventLoop,
                 on_message: Callable[[list[Any]], None]) -> LaneConnection | None:
    """A lane to the endpoint at ``address``, or None when it has none (not ``ipc://``,
    no lane there, or it cannot take a connection now): the caller then uses ZMQ."""
    path = lane_path(address)
    if path is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect(path)  # a Unix socket connects at once, or not at all
        if _peer_uid(sock) != os.getuid():  # not ours: speak ZMQ, which authenticates
            raise PermissionError(f"{path} is served by another user")
    except OSError:
        sock.close()
        return None
    conn = LaneConnection(sock, loop, on_message)
    hello = _proof(keys, path, identity) + _HELLO.pack(len(identity)) + identity
    try:
        with conn.lock:
            left = conn._sendmsg([memoryview(hello)])  # the first bytes: fit in any buffer
    except OSError:  # the worker closed its lane just now (EPIPE): it is going away
        left = [memoryview(hello)]
    if left:
        conn.close()
        return None
    return conn


class LaneListener:
    """A server's lane: accepts this user's clients that prove the cluster key, and hands
    each ``on_client(connection)`` once its hello passed; the connection's messages then go
    to ``on_message(connection, frames)``."""

    def __init__(self, address: str, keys: ClusterKeys | None,
                 loop: asyncio.AbstractEventLoop,
                 on_client: Callable[[LaneConnection], None],
                 on_message: Callable[[LaneConnection, list[Any]], None],
                 on_gone: Callable[[LaneConnection], None]) -> None:
        path = lane_path(address)
        if path is None:
            raise ValueError(f"no place for a lane for {address!r} (not ipc://, and no "
                             f"{LANE_DIR_VAR} for a tcp:// one)")
        if not address.startswith(_IPC_PREFIX):  # an ipc:// one's was checked at its bind
            security.check_private_directory(os.path.dirname(path))
        self.path = path
        self.keys = keys
        self.loop = loop
        self._on_client = on_client
        self._on_message = on_message
        self._on_gone = on_gone
        self._clients: set[LaneConnection] = set()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _bind_fresh(sock, path)  # in a private directory (checked above, or at the bind)
            sock.listen(1024)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                _refused.warning("lane accept", "lane %s: accept failed: %s", self.path, exc)
                return
            sock.setblocking(False)
            if _peer_uid(sock) != os.getuid():
                _refused.warning("lane uid", "refused a lane client of another user")
                sock.close()
                continue
            conn = LaneConnection(sock, self.loop, _nothing, expect_hello=self._check)
            conn.on_message = functools.partial(self._on_message, conn)
            conn.on_closed = functools.partial(self._gone, conn)
            self._clients.add(conn)

    def _check(self, conn: LaneConnection, proof: bytes, identity: bytes) -> bool:
        """A new client's hello: admitted when it proves the cluster key."""
        if not hmac.compare_digest(proof, _proof(self.keys, self.path, identity)):
            self._clients.discard(conn)  # it closes now, without telling `_gone`
            return False
        self._on_client(conn)
        return True

    def _gone(self, conn: LaneConnection) -> None:
        self._clients.discard(conn)
        if conn.peer_identity:
            self._on_gone(conn)

    def close(self) -> None:
        """Stop listening, close every client's lane and remove the socket file."""
        if self.sock.fileno() >= 0:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
        clients, self._clients = self._clients, set()
        for conn in clients:
            conn.close()


def _bind_fresh(sock: socket.socket, path: str) -> None:
    """Bind ``path``, first removing a lane file left by a process that died there (a TCP
    port, unlike an ipc:// name, is used again); a lane someone still serves is kept."""
    try:
        sock.bind(path)
        return
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # nobody listens: a dead process's lane
    else:
        raise OSError(errno.EADDRINUSE, f"a live lane is at {path}")
    finally:
        probe.close()
    sock.bind(path)


def _nothing(frames: list[Any]) -> None:
    """What a server's connection does with a message before it is set up (never runs)."""
