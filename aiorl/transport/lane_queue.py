"""What waits for a lane's socket: writing framed messages, and the queue a full socket leaves.

A lane (`aiorl.transport.lane.LaneConnection`) writes a turn's messages in one ``sendmsg``;
what the socket does not take waits here, in order, until the loop sees the socket writable.
The queue also knows which of its messages not a byte has left yet: when the lane breaks, it
hands those to its owner, who sends them another way (the connection contract,
aiorl/transport/connection.py). A message cut short may have reached the peer: it is not
among them, and the owner's pending requests wait for an answer or a verdict instead.

Bounded: at most ``max_queued`` messages wait (a server's `MAX_QUEUED`: a client that does
not read loses what does not fit, as a ZMQ ROUTER's high-water mark drops it).

Threads: the owner's lock is held around every method (the loop thread and method threads
both write).
"""

from __future__ import annotations

import collections
import socket
from collections.abc import Sequence
from typing import Any

__all__ = ["COPY_BELOW", "MAX_QUEUED", "OutQueue", "PartlySent", "send_buffers", "sent_of",
           "untouched"]

#: Frames below this are copied when they must wait for the socket (a caller may reuse its
#: buffer once `send` returned); larger ones are referenced, as ZMQ does.
COPY_BELOW = 64 * 1024
#: Messages a server holds for a client that does not read its answers before it drops
#: more (what ZMQ's ROUTER high-water mark does on the other path).
MAX_QUEUED = 100_000
#: Buffers per ``sendmsg`` (Linux allows 1,024).
_MAX_IOV = 512

Buffers = list[bytes | memoryview]


class PartlySent(OSError):
    """A write failed after some of its bytes left: what was in it may have reached the peer;
    ``rest`` is what had not left (the messages wholly in it never did)."""

    def __init__(self, error: OSError, rest: Buffers) -> None:
        super().__init__(error.errno, error.strerror)
        self.error = error
        self.rest = rest


def send_buffers(sock: socket.socket, buffers: Buffers) -> Buffers:
    """Send as much of ``buffers`` as ``sock`` takes now; return the rest. An error before a
    byte left is raised as it is; one after some left, as `PartlySent`. (Every view is
    one-dimensional bytes: its ``len`` is its size.)"""
    if len(buffers) == 1:  # one message of small frames: most sends
        only = buffers[0]
        try:
            sent = sock.send(only)
        except (BlockingIOError, InterruptedError):
            return buffers
        return [] if sent == len(only) else [memoryview(only)[sent:]]
    first = True
    while buffers:
        chunk = buffers[:_MAX_IOV]
        try:
            sent = sock.sendmsg(chunk)
        except (BlockingIOError, InterruptedError):
            return buffers
        except OSError as exc:
            if first:
                raise
            raise PartlySent(exc, buffers) from exc
        first = False
        for i, view in enumerate(chunk):
            if sent < len(view):
                rest = buffers[i:]
                rest[0] = memoryview(view)[sent:]
                return rest
            sent -= len(view)
        buffers = buffers[len(chunk):]
    return buffers


def sent_of(buffers: Buffers, rest: Buffers) -> int:
    """Bytes of ``buffers`` that left, ``rest`` being what `send_buffers` left of them (a
    suffix, its first buffer possibly cut)."""
    done = len(buffers) - len(rest)
    sent = sum(map(len, buffers[:done]))
    if rest:
        sent += len(buffers[done]) - len(rest[0])
    return sent


def _framed_size(parts: Sequence[Any]) -> int:
    """The bytes ``parts`` takes on the stream: its head (a count, a length per frame), then
    its frames."""
    return 4 + 8 * len(parts) + sum(memoryview(p).nbytes for p in parts)


def untouched(parts: Sequence[Sequence[Any]], framed: Buffers,
              sent: int) -> list[tuple[int, Sequence[Any]]]:
    """The messages of ``parts`` (framed as ``framed``, of which the first ``sent`` bytes
    left) that not a byte of left, each with where it starts after those ``sent`` bytes."""
    sizes = [_framed_size(m) for m in parts]
    start = sum(map(len, framed)) - sum(sizes)  # a hello's answer byte comes first
    out: list[tuple[int, Sequence[Any]]] = []
    for message, size in zip(parts, sizes, strict=True):
        if start >= sent:
            out.append((start - sent, message))
        start += size
    return out


def _kept(parts: Sequence[Any]) -> Sequence[Any]:
    """A message kept to be sent again: small frames that are not bytes are copied (their
    owner may reuse them once the send returned), as the queued bytes are."""
    if all(p.__class__ is bytes for p in parts):
        return parts
    return [p if p.__class__ is bytes or memoryview(p).nbytes >= COPY_BELOW else bytes(p)
            for p in parts]


class OutQueue:
    """See the module docstring. Under the owner's lock."""

    __slots__ = ("buffers", "max_queued", "_count", "_messages", "_bytes", "_left")

    def __init__(self, max_queued: int) -> None:
        #: What waits for the socket, in order (whole buffers, or views of them).
        self.buffers: collections.deque[bytes | memoryview] = collections.deque()
        self.max_queued = max_queued
        self._count = 0  # messages in `buffers`, for max_queued
        #: The queued messages not a byte of which left, with where each starts in the bytes
        #: ever queued (``_bytes`` of them; ``_left`` of those have left).
        self._messages: collections.deque[tuple[int, Sequence[Any]]] = collections.deque()
        self._bytes = 0
        self._left = 0

    def __bool__(self) -> bool:
        return bool(self.buffers)

    def add(self, buffers: Buffers, count: int, parts: Sequence[Sequence[Any]] | None,
            framed: Buffers, sent: int) -> bool:
        """Queue ``buffers``: what is left of ``framed`` (``parts`` framed, ``count`` whole
        messages; None: not to be sent again) once its first ``sent`` bytes left. False when
        they do not fit (dropped)."""
        if self._count + count > self.max_queued:
            return False
        if parts:
            base = self._bytes
            self._messages.extend((base + at, _kept(m)) for at, m in untouched(parts, framed, sent))
        out = self.buffers
        for view in buffers:
            # bytes cannot change; a small view is copied (its owner may reuse the buffer).
            out.append(view if view.__class__ is bytes or len(view) >= COPY_BELOW
                       else bytes(view))
            self._bytes += len(view)
        self._count += count
        return True

    def flush(self, sock: socket.socket) -> bool:
        """Send what the socket takes now; True when nothing waits any more. Raises the
        socket's error (the lane broke)."""
        out = self.buffers
        buffers = list(out)
        try:
            left = send_buffers(sock, buffers)
        except PartlySent as exc:
            self._sent(sent_of(buffers, exc.rest))
            raise
        self._sent(sent_of(buffers, left))
        out.clear()
        out.extend(left)
        if not left:
            self._count = 0
        return not left

    def _sent(self, sent: int) -> None:
        """``sent`` more bytes left: the messages they began are not sent again."""
        self._left += sent
        messages = self._messages
        while messages and messages[0][0] < self._left:
            messages.popleft()

    @property
    def count(self) -> int:
        """Messages waiting (for the warning that drops more)."""
        return self._count

    def take_unsent(self) -> list[Sequence[Any]]:
        """The queued messages not a byte of which left, in order; the queue is emptied."""
        unsent = [m for _, m in self._messages]
        self.clear()
        return unsent

    def clear(self) -> None:
        self.buffers.clear()
        self._messages.clear()
