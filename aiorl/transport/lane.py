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

Authentication, both ways, before a message is read (docs/security.md; how a lane is set
up: `aiorl.transport.lane_setup`): the lane is in the same private directory as the
endpoint's ZMQ socket, each side checks the other's uid, and a client's first bytes prove it
holds the cluster's secret. The server reads nothing more from a client before that, and
answers one byte: admitted, refused, or taken (another live lane holds that routing id).

On the stream, a message is ``<u32 frame count> <u64 length> ... <frames>``. What one turn
of the loop sends to one lane leaves in one ``sendmsg`` (the first message of a turn at
once, as on the ZMQ path). A lane reads at most `_DISPATCH_BATCH` messages per wake-up, so
answers leave while a burst of calls is still being read.

A lane is a `aiorl.transport.connection.Connection` and keeps its contract: a send on a
closed lane raises `ConnectionClosed`; a lane that ends or breaks by itself tells its owner
once (``on_broken(reason, unsent)``, with every message not a byte of which left, in order:
those queued for a full socket, those whose write failed, from any thread, then what this
turn held; a message cut short may have reached the peer and is not among them);
a reader that raises closes its lane and is never run again; a read buffer grows with what
has arrived, not with what a head announces, and is given back when the lane closes. A large
message (`aiorl.transport.large_message`) is read into memory of its own, bounded the same,
and its large frames are handed out as writable views of it, without a copy.

Threads: the loop thread owns a lane; `LaneConnection.send_from_thread` (a method thread's
answer) writes under the lane's lock.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

from aiorl.transport.connection import Broken, ConnectionClosed
from aiorl.transport.lane_queue import (
    COPY_BELOW,
    MAX_QUEUED,
    OutQueue,
    PartlySent,
    send_buffers,
    sent_of,
    untouched,
)
from aiorl.transport.large_message import LARGE_MESSAGE, LargeMessage
from aiorl.util.batching import turn_clock_of
from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["ADMITTED", "HELLO_HEAD", "MAX_FRAMES", "MAX_MESSAGE_BYTES", "PROOF_BYTES", "REFUSED",
           "TAKEN", "LaneConnection"]

log = logging.getLogger("aiorl.transport")
_refused = RateLimitedLog(log)

#: What a client proves with (an HMAC-SHA256, 32 bytes), and the identity's length prefix.
PROOF_BYTES = 32
HELLO_HEAD = struct.Struct("<H")
#: The server's one-byte answer to a client's hello.
ADMITTED, REFUSED, TAKEN = 1, 0, 2
#: What a client is told by each answer other than ADMITTED.
_REFUSALS = {
    REFUSED: "it refused this cluster's key on its lane",
    TAKEN: "its lane already serves another connection under this process's routing id",
}
_COUNT = struct.Struct("<I")
#: The head of a message of one frame: its count (1) and the frame's length.
_ONE_FRAME = struct.Struct("<IQ")
_ONE_FRAME_HEAD = _ONE_FRAME.size
#: A message with more frames than this, or more bytes, is refused (the connection closes):
#: far above what the endpoint sends. What a message announces is never allocated up front:
#: the read buffer grows at most `_GROWTH` times what has arrived, so a peer that announces a
#: terabyte and sends a kilobyte costs a few kilobytes.
MAX_FRAMES = 1 << 16
MAX_MESSAGE_BYTES = 1 << 40
_GROWTH = 4
#: Messages dispatched per wake-up before other callbacks run, so answers leave while a
#: burst is still being read. As many as one BATCH message of the ZMQ path carries: with 4
#: (the ZMQ path's count of BATCH messages per wake-up) 1,000 calls in flight measured ~30 %
#: fewer calls/s than through ZMQ; with 64 and 256 the same as through ZMQ.
_DISPATCH_BATCH = 64
#: Messages one turn holds for a lane before they leave anyway.
_MAX_HELD = 64
#: A lane's read buffer to start with, grown for a large message and given back after it:
#: a driver holds a lane per worker of its machine, and a worker one per caller, so this is
#: paid hundreds of times (256 KiB each would be 64 MiB in a driver of 256 workers).
_READ_CHUNK = 16 * 1024
#: Less free room than this at the buffer's end: make room before reading.
_MIN_ROOM = _READ_CHUNK // 4
#: A buffer larger than this (grown for a large message) is given back once empty.
_KEEP_BUFFER = 4 * _READ_CHUNK


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


def _framed(messages: list[Sequence[Any]], answer: int | None) -> list[bytes | memoryview]:
    """``messages`` as the lane's stream: ``<u32 count> <u64 length>... <frames>`` each (after
    ``answer``'s byte, a server's answer to a hello). A message of small bytes frames (a
    header, a small pickle: most calls and answers) is one buffer with its head; others are
    views of their frames, without a copy."""
    buffers: list[bytes | memoryview] = [] if answer is None else [bytes((answer,))]
    for parts in messages:
        count = len(parts)
        if count == 1:  # a header alone (a call without arguments, an empty answer)
            only = parts[0]
            if only.__class__ is bytes and len(only) < COPY_BELOW:
                buffers.append(_ONE_FRAME.pack(1, len(only)) + only)
                continue
        size = 0
        for part in parts:
            if part.__class__ is not bytes:
                size = COPY_BELOW
                break
            size += len(part)
        head = _HEADS[count] if count <= _CACHED_COUNTS else _heads(count)
        if size < COPY_BELOW:
            buffers.append(b"".join([head.pack(count, *map(len, parts)), *parts]))
        else:
            views = list(map(_as_bytes_view, parts))
            buffers.append(head.pack(count, *map(len, views)))
            buffers.extend(views)
    return buffers


class LaneConnection:
    """One end of a lane: frames messages out and in. ``on_message(frames)`` gets each
    whole message (a list of ``bytes``) on the loop; ``on_broken(reason, unsent)`` runs once
    when the stream ends or breaks (not after `close`); a client's ``on_refused(reason)``
    runs instead when the server does not admit it."""

    kind = "lane"
    __slots__ = ("sock", "loop", "on_message", "on_broken", "lock", "closed", "_fd", "_out",
                 "_writing", "_clock", "_turn", "_held", "_buf", "_view", "_start",
                 "_end", "_need", "_reading", "_parse_scheduled", "_expect_hello",
                 "peer_identity", "_expect_answer", "_greeting", "on_refused", "_unsent",
                 "_large")

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop,
                 on_message: Callable[[list[Any]], None],
                 on_broken: Broken | None = None, *,
                 expect_hello: Callable[[LaneConnection, bytes, bytes], int] | None = None,
                 ) -> None:
        self.sock = sock
        self.loop = loop
        self.on_message = on_message
        self.on_broken = on_broken
        #: Held by whoever writes the socket or `_out` (the loop thread, a method thread).
        self.lock = threading.RLock()
        self.closed = False
        self._fd = sock.fileno()
        #: What waits for the socket to take it. Messages held for a peer that does not
        #: read before more are dropped: a server's bound (`MAX_QUEUED`); a client's
        #: requests are never dropped (as a DEALER's).
        self._out = OutQueue(MAX_QUEUED if expect_hello is not None else 1 << 62)
        self._writing = False  # a writer callback is registered
        self._clock = turn_clock_of(loop)
        self._turn = 0  # the last turn in which a message left at once (`aiorl.util.batching.TurnClock`)
        self._held: list[Sequence[Any]] = []  # this turn's later messages, until it ends
        #: Messages whose write failed before a byte of them left, until `_broken` hands
        #: them to the owner. Under the lock, with ``closed``: a thread's write that fails
        #: while the loop is already telling the owner of the break (the peer's end was read)
        #: lands here before that news leaves, or finds the lane closed and raises.
        self._unsent: list[Sequence[Any]] = []
        #: The large message being read into memory of its own (`aiorl.transport.large_message`).
        self._large: LargeMessage | None = None
        self._buf = bytearray(_READ_CHUNK)
        #: A view of ``_buf`` kept for reads and frame copies (replaced with the buffer).
        self._view = memoryview(self._buf)
        self._start = 0  # first unparsed byte
        self._end = 0  # end of what was read
        self._need = 0  # bytes the message at _start needs in all (0: not known yet)
        self._reading = False
        self._parse_scheduled = False
        #: A server's check of a new client: ``(connection, proof, identity) -> answer``
        #: (ADMITTED, REFUSED or TAKEN); until it passes, nothing else the client sent is read.
        self._expect_hello = expect_hello
        self.peer_identity = b""
        #: A client's first byte from the server answers its hello: admitted, or refused
        #: (then ``on_refused(reason)`` runs and the lane closes).
        self._expect_answer = expect_hello is None
        #: Either of the two above is still to come (one check on the hot path).
        self._greeting = True
        self.on_refused: Callable[[str], None] | None = None
        self._resume_reading()

    # ------------------------------------------------------------------ sending
    def send(self, parts: Sequence[Any]) -> None:
        """Send one message from the loop thread (the first of a turn at once, the rest of
        the turn together at its end, or once `_MAX_HELD` wait)."""
        if self.closed:
            raise ConnectionClosed("the lane is closed")
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
            raise ConnectionClosed("the lane is closed")
        held = self._held
        if held:
            self._held = []
            held.append(parts)
            self._write(held)
        else:
            self._write([parts])

    def send_from_thread(self, parts: Sequence[Any]) -> None:
        """Send from a thread other than the loop's (a method thread's answer)."""
        if self.closed:
            raise ConnectionClosed("the lane is closed")
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
                raise ConnectionClosed("the lane is closed")
            sent = 0
            if not self._out:  # nothing waits before it: straight to the socket
                try:
                    sent = self.sock.send(data)
                except OSError:  # EAGAIN, EINTR or broken: `_emit` tries again and decides
                    pass
                if sent == len(data):
                    return
            # Unsent if it breaks, unless part of it left already.
            self._emit([memoryview(data)[sent:] if sent else data], 1, True,
                       None if sent else [[frame]])

    def send_hello(self, hello: bytes) -> bool:
        """A client's first bytes (`aiorl.transport.lane_setup.connect_lane`): False when the
        socket does not take them whole at once (the server is going away)."""
        try:
            with self.lock:
                return not send_buffers(self.sock, [memoryview(hello)])
        except OSError:
            return False

    def send_held(self) -> None:
        """The turn ended: what this turn held leaves (`aiorl.util.batching.TurnClock`)."""
        held = self._held
        if held and not self.closed:
            self._held = []
            try:
                self._write(held)
            except ConnectionClosed:  # closed from another thread meanwhile: never left
                self._held = held

    def _write(self, messages: list[Sequence[Any]], from_thread: bool = False,
               answer: int | None = None) -> None:
        self._emit(_framed(messages, answer), len(messages), from_thread, messages)

    def _emit(self, buffers: list[bytes | memoryview], messages: int, from_thread: bool,
              parts: list[Sequence[Any]] | None = None) -> None:
        """Send ``buffers`` (``messages`` whole messages, ``parts`` before they were framed)
        now, or queue what the socket does not take yet behind what waits already (any
        thread: under the lock)."""
        broke: OSError | None = None
        with self.lock:
            if self.closed:
                raise ConnectionClosed("the lane is closed")
            if self._out:  # earlier messages still wait for the socket: keep the order
                self._queue(buffers, messages, parts, buffers, 0)
            else:
                try:
                    left = send_buffers(self.sock, buffers)
                except PartlySent as exc:
                    # The message cut may have reached the peer: the owner's pending requests
                    # wait for their answers or a verdict (aiorl.transport.peer); none is sent
                    # twice. Those after it never left: the owner sends them again.
                    broke = exc.error
                    if parts:
                        self._unsent.extend(m for _, m in untouched(
                            parts, buffers, sent_of(buffers, exc.rest)))
                    self.closed = True
                except OSError as exc:  # not a byte of it left: the owner sends it again
                    broke = exc
                    self._unsent.extend(parts or ())
                    self.closed = True
                else:
                    if not left:  # all sent: most sends end here
                        return
                    self._queue(left, messages, parts, buffers, sent_of(buffers, left))
        if broke is not None:
            self._broken(from_thread, f"a write failed: {broke.strerror or broke}")
            return
        if self._out and not self._writing:
            if from_thread:
                self.loop.call_soon_threadsafe(self._start_writer)
            else:
                self._start_writer()

    def _queue(self, buffers: list[bytes | memoryview], messages: int,
               parts: list[Sequence[Any]] | None, framed: list[bytes | memoryview],
               sent: int) -> None:
        """`OutQueue.add`, with the warning when a peer that does not read loses messages."""
        if not self._out.add(buffers, messages, parts, framed, sent):
            _refused.warning("lane queue full", "a peer does not read what it is sent on its "
                             "lane (%d messages queued): dropped %d message(s)",
                             self._out.count, messages)

    def _start_writer(self) -> None:
        if not self._writing and not self.closed:
            self._writing = True
            self.loop.add_writer(self._fd, self._flush_out)

    def _flush_out(self) -> None:
        failure: OSError | None = None
        with self.lock:
            try:
                emptied = self._out.flush(self.sock)
            except OSError as exc:
                failure = exc
                self.closed = True
        if failure is not None or emptied:
            self._writing = False
            self.loop.remove_writer(self._fd)
        if failure is not None:
            self._broken(False, f"a write failed: {failure.strerror or failure}")

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
        """Read what the socket has. Whatever goes wrong here (a bug a peer's bytes reach,
        memory) closes this lane: a reader left registered after raising would be called
        again at once, for ever."""
        try:
            if self._large is not None:
                self._read_large(self._large)
                return
            end = self._end
            if len(self._buf) - end < _MIN_ROOM:
                self._make_room()
                end = self._end
            n = self._receive(self._view[end:])
            if n <= 0:
                return
            self._end = end = end + n
            # Most wake-ups read one whole message of one frame (a call without arguments,
            # an answer) into an empty buffer: it is dispatched here, without `_parse`'s loop.
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
        except Exception as exc:
            self._reader_failed(exc)

    def _receive(self, room: memoryview) -> int:
        """Read into ``room``: the bytes read; 0 when none are there yet; -1 when the stream
        ended or failed (the lane is broken then)."""
        try:
            n = self.sock.recv_into(room)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            n = 0
        if n == 0:
            self._broken(False, "the peer closed it")
            return -1
        return n

    def _read_large(self, large: LargeMessage) -> None:
        """Read on into the large message; dispatch it once it is whole (nothing after it
        was read: the lane's buffer takes the next message)."""
        n = self._receive(large.room())
        if n <= 0:
            return
        large.have += n
        if not large.complete:
            return
        self._large = None
        try:
            self.on_message(large.frames())
        except Exception as exc:
            self._dispatch_failed(exc)

    def _reader_failed(self, exc: Exception) -> None:
        _refused.warning("lane reader failed", "closed a lane whose reader failed: %r", exc,
                         exc_info=exc)
        self._broken(False, f"its reader failed: {exc!r}")

    def _make_room(self) -> None:
        """Move what is unparsed to the front, and grow the buffer for a large message: to
        at most `_GROWTH` times what has arrived of it, never to what its head announces (a
        head is a peer's claim, the bytes that came are a fact)."""
        pending = self._end - self._start
        size = max(len(self._buf), min(self._need, _GROWTH * pending) + _READ_CHUNK,
                   pending + _READ_CHUNK)
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
            self.loop.call_soon(self._parse_later)

    def _parse_later(self) -> None:
        try:
            self._parse()
        except Exception as exc:  # as in `_on_readable`: never left half-read and paused
            self._reader_failed(exc)

    @staticmethod
    def _dispatch_failed(exc: Exception) -> None:
        """A bug a peer's message can reach: logged, bounded; the lane reads on."""
        _refused.warning("lane dispatch", "unhandled error while dispatching a message from "
                         "a lane", exc_info=exc)

    def _next_message(self) -> list[Any] | None:
        """The next whole message in the buffer (None: not all of it is here yet)."""
        if self._greeting:
            return _next_greeting(self)
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
            if total >= LARGE_MESSAGE:  # the rest goes into memory of its own
                self._large = LargeMessage(lengths, total, self._view[start:end])
                self._start = self._end = self._need = 0
                if len(buf) > _KEEP_BUFFER:
                    self._shrink()
                return None
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

    def _malformed(self, what: str) -> None:
        _refused.warning("lane malformed", "closed a lane that sent %s (refused: at most "
                         "%d frames and %d bytes)", what, MAX_FRAMES, MAX_MESSAGE_BYTES)
        self._broken(False, f"it sent {what}")

    # ------------------------------------------------------------------ ending
    def _refused(self, answer: int) -> None:
        """The server did not admit this client: close, and tell the owner once."""
        refused, self.on_refused = self.on_refused, None
        self.on_broken = None  # refused, not broken: the owner hears it once
        self.close()
        if refused is not None:
            refused(_REFUSALS.get(answer, f"it answered our hello with {answer}"))

    def end(self, reason: str) -> None:
        """The peer gave this lane up, and its owner heard so another way before the end of
        the stream was read (a client that came back by ZMQ): end it now, as if it broke by
        itself, so that nothing more is sent on it. Loop thread."""
        if self._fd >= 0:
            self._broken(False, reason)

    def _broken(self, from_thread: bool, reason: str) -> None:
        """The stream ended or broke: close it, and tell the owner once, with what never left
        (failed writes, then what this turn held)."""
        if from_thread:
            self.loop.call_soon_threadsafe(self._broken, False, reason)
            return
        if self._expect_answer and self._fd >= 0:
            # A client's write can fail (EPIPE) before its loop read the server's answer to
            # its hello; a refusal is then still waiting to be read, and says more.
            try:
                answer = self.sock.recv(1)
            except OSError:
                answer = b""
            if answer and answer[0] != ADMITTED:
                self._refused(answer[0])
                return
        with self.lock:  # from here a thread's write raises ConnectionClosed
            self.closed = True
            unsent = self._out.take_unsent()  # queued, not a byte of them left
            unsent += self._unsent
            self._unsent = []
        callback, self.on_broken = self.on_broken, None
        held, self._held = self._held, []
        self.close()
        if callback is not None:
            callback(reason, [*unsent, *held])

    def close(self) -> None:
        """Close the stream; what was sent this turn leaves first (as far as it can now),
        and the read buffer is given back. ``on_broken`` is not called."""
        if self._fd < 0:
            return
        self.on_broken = None
        if not self.closed:
            held = self._held
            if held:
                self._held = []
                try:
                    self._write(held)
                except ConnectionClosed:
                    pass
        with self.lock:
            self.closed = True
        self._pause_reading()
        if self._writing:
            self._writing = False
            self.loop.remove_writer(self._fd)
        self._fd = -1
        self.sock.close()
        with self.lock:  # what waited for the socket goes with it
            self._out.clear()
        self._buf = bytearray()
        self._view = memoryview(self._buf)
        self._start = self._end = self._need = 0
        self._large = None


def _next_greeting(conn: LaneConnection) -> list[Any] | None:
    """`LaneConnection._next_message` before the hello (a server) or its answer (a client)
    was read: what a lane reads first, once."""
    buf, start, end = conn._buf, conn._start, conn._end
    if conn._expect_hello is not None:
        return _hello(conn, buf, start, end)
    if end == start:
        return None
    conn._expect_answer = conn._greeting = False
    conn._start = start + 1
    if buf[start] != ADMITTED:
        conn._refused(buf[start])
        return None
    return conn._next_message()


def _hello(conn: LaneConnection, buf: bytearray, start: int, end: int) -> list[Any] | None:
    """A server reads its client's hello (its proof and routing id) and answers it."""
    head = PROOF_BYTES + HELLO_HEAD.size
    if end - start < head:
        return None
    (n,) = HELLO_HEAD.unpack_from(buf, start + PROOF_BYTES)
    if end - start < head + n:
        return None
    proof = bytes(buf[start:start + PROOF_BYTES])
    identity = bytes(buf[start + head:start + head + n])
    check, conn._expect_hello = conn._expect_hello, None
    conn._greeting = False  # a server's client expects no answer from us
    assert check is not None
    conn._start = start + head + n
    conn.peer_identity = identity
    answer = check(conn, proof, identity)
    if answer != ADMITTED:
        conn.peer_identity = b""
        conn.on_broken = None  # refused, not broken: its listener already let go of it
        try:
            conn._write([], answer=answer)
        except ConnectionClosed:
            pass
        conn.close()
        return None
    conn._write([], answer=ADMITTED)
    return conn._next_message()
