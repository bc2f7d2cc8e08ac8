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
from collections.abc import Callable, Sequence
from typing import Any

from aiorl.transport import security
from aiorl.transport.security import ClusterKeys
from aiorl.util.batching import TurnBatcher
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


_HEADS: dict[int, struct.Struct] = {}


def _heads(count: int) -> struct.Struct:
    """The layout of a message's head: its frame count, then each frame's length."""
    head = _HEADS.get(count)
    if head is None:
        head = struct.Struct(f"<I{count}Q")
        if count <= 64:
            _HEADS[count] = head
    return head


def _as_bytes_view(part: Any) -> memoryview:
    view = memoryview(part)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


class LaneConnection:
    """One end of a lane: frames messages out and in. ``on_message(frames)`` gets each
    whole message (a list of ``bytes``) on the loop; ``on_closed()`` runs once when the
    stream ends or breaks (not after `close`)."""

    __slots__ = ("sock", "loop", "on_message", "on_closed", "lock", "closed", "_fd", "_out",
                 "_queued", "_writing", "_batcher", "_buf", "_start", "_end", "_need",
                 "_reading", "_parse_scheduled", "_expect_hello", "peer_identity", "max_queued",
                 "_expect_answer", "on_refused")

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop,
                 on_message: Callable[[list[Any]], None],
                 on_closed: Callable[[], None] | None = None, *,
                 expect_hello: Callable[[LaneConnection, bytes, bytes], bool] | None = None,
                 ) -> None:
        self.sock = sock
        self.loop = loop
        self.on_message = on_message
        self.on_closed = on_closed
        self.lock = threading.Lock()
        self.closed = False
        self._fd = sock.fileno()
        #: What waits for the socket to take it, in order (views of whole buffers).
        self._out: collections.deque[memoryview] = collections.deque()
        self._queued = 0  # messages in _out, for MAX_QUEUED
        self._writing = False  # a writer callback is registered
        self._batcher: TurnBatcher[bytes, Sequence[Any]] = TurnBatcher(
            loop, self._send_held, max_items=_MAX_HELD, max_bytes=1 << 62)
        self._buf = bytearray(_READ_CHUNK)
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
        self.on_refused: Callable[[], None] | None = None
        #: Messages held for a peer that does not read before more are dropped: a server's
        #: bound (`MAX_QUEUED`); a client's requests are never dropped (as a DEALER's).
        self.max_queued = MAX_QUEUED if expect_hello is not None else 1 << 62
        self._resume_reading()

    # ------------------------------------------------------------------ sending
    def send(self, parts: Sequence[Any]) -> None:
        """Send one message from the loop thread (the first of a turn at once, the rest of
        the turn together at its end)."""
        if self.closed:
            return
        if self._batcher.first_in_turn():
            self._write([parts])
        else:
            self._batcher.add(b"", parts)

    def send_direct(self, parts: Sequence[Any]) -> None:
        """Send now, after anything held this turn (order kept)."""
        if self.closed:
            return
        held = self._batcher.take(b"")
        held.append(parts)
        self._write(held)

    def send_from_thread(self, parts: Sequence[Any]) -> None:
        """Send from a thread other than the loop's (a method thread's answer)."""
        if not self.closed:
            self._write([parts], from_thread=True)

    def _send_held(self, _key: bytes, messages: list[Sequence[Any]]) -> None:
        if not self.closed:
            self._write(messages)

    def _write(self, messages: list[Sequence[Any]], from_thread: bool = False,
               answer: int | None = None) -> None:
        buffers: list[memoryview] = [] if answer is None else [memoryview(bytes((answer,)))]
        for parts in messages:
            views = [_as_bytes_view(p) for p in parts]
            buffers.append(memoryview(_heads(len(views)).pack(len(views),
                                                              *[v.nbytes for v in views])))
            buffers.extend(views)
        broke = False
        with self.lock:
            if self.closed:
                return
            if self._out:  # earlier messages still wait for the socket: keep the order
                self._queue(buffers, len(messages))
            else:
                try:
                    left = self._sendmsg(buffers)
                except OSError:
                    broke = self.closed = True
                else:
                    if left:
                        self._queue(left, len(messages))
        if broke:
            self._broken(from_thread)
            return
        if self._out and not self._writing:
            if from_thread:
                self.loop.call_soon_threadsafe(self._start_writer)
            else:
                self._start_writer()

    def _sendmsg(self, buffers: list[memoryview]) -> list[memoryview]:
        """Send as much of ``buffers`` as the socket takes now; return the rest."""
        sock = self.sock
        while buffers:
            chunk = buffers[:_MAX_IOV]
            try:
                sent = sock.sendmsg(chunk)
            except (BlockingIOError, InterruptedError):
                return buffers
            for i, view in enumerate(chunk):
                if sent < view.nbytes:
                    rest = buffers[i:]
                    rest[0] = view[sent:]
                    return rest
                sent -= view.nbytes
            buffers = buffers[len(chunk):]
        return buffers

    def _queue(self, buffers: list[memoryview], messages: int) -> None:
        if self._queued + messages > self.max_queued:
            _refused.warning("lane queue full", "a peer does not read what it is sent on its "
                             "lane (%d messages queued): dropped %d message(s)",
                             self._queued, messages)
            return
        for view in buffers:
            self._out.append(memoryview(bytes(view)) if view.nbytes < _COPY_BELOW else view)
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
        free = len(self._buf) - self._end
        if free < _READ_CHUNK // 4:
            self._make_room()
        try:
            n = self.sock.recv_into(memoryview(self._buf)[self._end:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if n == 0:
            self._broken(False)
            return
        self._end += n
        self._parse()

    def _make_room(self) -> None:
        """Move what is unparsed to the front, and grow the buffer for a large message."""
        pending = self._end - self._start
        size = max(len(self._buf), self._need + _READ_CHUNK, pending + _READ_CHUNK)
        if size > len(self._buf) or self._start:
            buf = bytearray(size) if size > len(self._buf) else self._buf
            buf[:pending] = self._buf[self._start:self._end]
            self._buf, self._start, self._end = buf, 0, pending

    def _parse(self) -> None:
        self._parse_scheduled = False
        for _ in range(_DISPATCH_BATCH):
            if self.closed:
                return
            frames = self._next_message()
            if frames is None:
                self._resume_reading()
                return
            try:
                self.on_message(frames)
            except Exception as exc:  # a bug a peer's message can reach: logged, bounded
                _refused.warning("lane dispatch", "unhandled error while dispatching a "
                                 "message from a lane", exc_info=exc)
        # More may be complete already: continue after other callbacks (answers) ran, and
        # read no more until the backlog is worked through.
        self._pause_reading()
        if not self._parse_scheduled:
            self._parse_scheduled = True
            self.loop.call_soon(self._parse)

    def _next_message(self) -> list[Any] | None:
        """The next whole message in the buffer (None: not all of it is here yet)."""
        buf, start, end = self._buf, self._start, self._end
        if self._expect_hello is not None:
            return self._hello(buf, start, end)
        if self._expect_answer:
            if end == start:
                return None
            self._expect_answer = False
            self._start = start + 1
            if buf[start] != _ADMITTED:
                refused, self.on_refused = self.on_refused, None
                self.on_closed = None  # refused, not broken: the owner hears it once
                self.close()
                if refused is not None:
                    refused()
                return None
            return self._next_message()
        if end - start < 4:
            return None
        (count,) = _COUNT.unpack_from(buf, start)
        if count == 0 or count > MAX_FRAMES:
            self._malformed(f"a message of {count} frames")
            return None
        head = 4 + 8 * count
        if end - start < head:
            return None
        lengths = struct.unpack_from(f"<{count}Q", buf, start + 4)
        total = head + sum(lengths)
        if total > MAX_MESSAGE_BYTES:
            self._malformed(f"a message of {total} bytes")
            return None
        if end - start < total:
            self._need = total
            return None
        self._need = 0
        frames: list[Any] = []
        pos = start + head
        with memoryview(buf) as view:
            for n in lengths:
                frames.append(bytes(view[pos:pos + n]))
                pos += n
        self._start = pos
        if pos == end:
            self._start = self._end = 0
            if len(buf) > 4 * _READ_CHUNK:  # a large message passed: give its memory back
                self._buf = bytearray(_READ_CHUNK)
        return frames

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
            held = self._batcher.take(b"")
            if held:
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
