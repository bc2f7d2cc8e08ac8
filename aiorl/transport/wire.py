"""Message envelopes.

A message is a list of ZMQ frames. The first frame is a msgpack array, the
*header*::

    [PROTOCOL_VERSION, kind, request_id, op, meta]

``kind`` says what the message is (a request, a reply, an error reply, a one-way
message or a pushed event), ``request_id`` pairs replies with requests (0 for
messages that expect none), ``op`` names the operation and ``meta`` is a small
msgpack value. The remaining frames are the payload: a pickle and its
out-of-band buffers (see `aiorl.transport.serialization`), or raw bytes.

A BATCH message carries several messages to the same peer in one ZMQ message
(an endpoint batches what it sends to one peer within one event-loop turn):
its meta is the list of frame counts, and the frames that follow are the
messages' frames (each starting with its own header), in order. Batches do not
nest.

A PACKED message carries the frames of one message (a single message or a BATCH)
as one frame: its meta lists their lengths, and its one payload frame is their
concatenation. Every frame of a multipart message costs the receiver a socket-option
read (``RCVMORE``, ~1-3 us in pyzmq) and the sender a send call; a batch of 500 small
calls or P2P messages paid that 500 times. An endpoint packs what it sends when a
message has at least `PACK_MIN_FRAMES` frames, all of them small; large frames
keep travelling by reference (zero-copy), unpacked. PACKED messages do not nest.

Nothing here unpickles: headers are msgpack, which cannot execute code.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack

from aiorl.errors import ProtocolError

__all__ = [
    "MAX_BATCH_MESSAGES", "MAX_FRAME_BYTES", "PACK_MIN_FRAMES", "PROTOCOL_VERSION", "RESUME", "Header",
    "Kind", "decode_fields", "decode_header", "encode_batch", "encode_header", "join_frames", "oversized", "pack",
    "split_batch", "split_frames", "unpack",
]

# 2: errors travel as data, typed control messages, one tensor reducer (pickles name it by path).
# 3: PACKED messages.
PROTOCOL_VERSION = 3
#: The one op the transport sends itself: a client whose lane broke says it is back, on its
#: ZMQ link, so that the server sends what it held for it (aiorl.transport.parked).
RESUME = "transport.resume"

#: Headers larger than this are rejected before they are parsed.
MAX_HEADER_BYTES = 1 << 20
#: A BATCH holds at most this many messages: what endpoints send (a longer burst leaves as
#: several batches). A receiver refuses a longer one whole: a million messages in one BATCH
#: would hold its event loop for seconds in one turn, long enough to silence its heartbeats.
MAX_BATCH_MESSAGES = 64
#: A message of at least this many frames is packed into one (when its frames are small).
PACK_MIN_FRAMES = 3
#: Frames from this size on are never packed: ZMQ sends them by reference, without a copy.
PACK_MAX_FRAME_BYTES = 64 * 1024
#: At most this many bytes are packed into one frame (the copy must stay cheap).
PACK_MAX_BYTES = 1 << 20
#: A frame larger than this travels as pieces of at most this size (a SPLIT message, see
#: above). 64 MiB takes well under a second to encrypt, send and decrypt under CURVE even on
#: a slow core or a 1 Gb/s link: far inside the 3 s ZMTP heartbeat timeout. A 64 MB tensor
#: still travels as one frame. ``AIORL_MAX_FRAME_BYTES`` lowers it (tests move a moderate
#: payload through the split path with it); it is read once, at import.
MAX_FRAME_BYTES = max(1, int(os.environ.get("AIORL_MAX_FRAME_BYTES", 64 << 20)))


class Kind(enum.IntEnum):
    REQUEST = 1  #: expects a REPLY or ERROR with the same request id
    REPLY = 2
    ERROR = 3  #: meta is aiorl.errors.to_wire data (type, message, traceback); no payload
    ONEWAY = 4  #: no reply
    EVENT = 5  #: pushed by a server to a client that subscribed
    BATCH = 6  #: several messages in one: meta lists each one's frame count (see below)
    PACKED = 7  #: one message's frames as one frame: meta lists their lengths (see below)
    SPLIT = 8  #: one message with frames over MAX_FRAME_BYTES in pieces (see above)


_KINDS = frozenset(int(k) for k in Kind)


class Header(NamedTuple):
    kind: int  # a Kind value; plain int on the hot path (IntEnum lookups cost ~1 us each)
    request_id: int
    op: str
    meta: Any


_packb = msgpack.Packer(use_bin_type=True).pack
_new_tuple = tuple.__new__


def encode_header(kind: int, request_id: int, op: str, meta: Any = None) -> bytes:
    if op.__class__ is not str:  # an op enum (a str subclass): msgpack packs those slowly
        op = str.__str__(op)
    header: bytes = _packb((PROTOCOL_VERSION, kind, request_id, op, meta))
    return header


def _shown(value: Any) -> str:
    """A header field in an error message: an int as is, anything else by its type only
    (a field may be a megabyte-long map)."""
    return repr(value) if value.__class__ is int else f"of type {type(value).__name__}"


_unpackb = msgpack.unpackb
#: The classes of a header's version, kind, request id and op.
_FIELD_TYPES = (int, int, int, str)


def decode_fields(frame: bytes | memoryview) -> tuple[int, int, str, Any]:
    """`decode_header` as a plain tuple ``(kind, request_id, op, meta)``, for the paths
    every message takes (a tuple unpacks faster than a `Header`, and no `Header` is made)."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(frame)} bytes exceeds the {MAX_HEADER_BYTES} limit")
    try:
        fields = _unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable header: {exc}") from None
    if fields.__class__ is not list or len(fields) != 5:
        raise ProtocolError("header must be a 5-element msgpack array")
    version, kind, request_id, op, meta = fields
    # One comparison for a well-formed header; the checks below name what is wrong.
    if ((version.__class__, kind.__class__, request_id.__class__, op.__class__) == _FIELD_TYPES
            and version == PROTOCOL_VERSION and kind in _KINDS):
        return kind, request_id, op, meta
    if version.__class__ is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {_shown(version)} is not supported (this side "
                            f"speaks {PROTOCOL_VERSION})")
    # Exact class checks: msgpack gives int and str; a map or a list (unhashable: ``in``
    # would raise TypeError), a float or a bool is malformed, and so is a header with one.
    if kind.__class__ is not int or kind not in _KINDS:
        raise ProtocolError(f"unknown message kind {_shown(kind)}")
    if request_id.__class__ is not int or op.__class__ is not str:
        raise ProtocolError("header request id must be an int and op a string")
    return kind, request_id, op, meta


def decode_header(frame: bytes | memoryview) -> Header:
    """Parse a header frame, raising [`ProtocolError`][aiorl.ProtocolError] on anything
    malformed."""
    # tuple.__new__ directly: a NamedTuple's own __new__ is an extra Python frame per message.
    return _new_tuple(Header, decode_fields(frame))


def encode_batch(messages: list[list[Any]]) -> list[Any]:
    """Frames of one BATCH message holding ``messages`` (each a list of frames)."""
    frames: list[Any] = [encode_header(Kind.BATCH, 0, "", [len(m) for m in messages])]
    for m in messages:
        frames.extend(m)
    return frames


def split_batch(counts: Any, frames: list[Any]) -> list[list[Any]]:
    """The messages inside a BATCH (``frames`` = what follows its header)."""
    if isinstance(counts, list) and len(counts) > MAX_BATCH_MESSAGES:
        raise ProtocolError(f"a BATCH of {len(counts)} messages (at most {MAX_BATCH_MESSAGES})")
    if (not isinstance(counts, list) or not all(isinstance(c, int) and c > 0 for c in counts)
            or sum(counts) != len(frames)):
        raise ProtocolError("BATCH frame counts do not match its frames")
    out, pos = [], 0
    for c in counts:
        out.append(frames[pos:pos + c])
        pos += c
    return out


def pack(frames: Sequence[Any]) -> list[Any] | None:
    """The two frames of one PACKED message carrying ``frames``, or None when packing does
    not pay (a large frame, too many bytes in all, or a buffer that is not contiguous)."""
    lengths: list[int] = []
    buffers: list[Any] = []
    total = 0
    for f in frames:
        if f.__class__ is not bytes:
            view = memoryview(f)
            if not view.c_contiguous:
                return None
            f = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        n = len(f)
        if n >= PACK_MAX_FRAME_BYTES:
            return None
        total += n
        lengths.append(n)
        buffers.append(f)
    if total > PACK_MAX_BYTES:
        return None
    return [encode_header(Kind.PACKED, 0, "", lengths), b"".join(buffers)]


def unpack(lengths: Any, frames: list[Any]) -> list[bytes]:
    """The frames inside a PACKED message (``frames`` = what follows its header)."""
    if (len(frames) != 1 or not isinstance(lengths, list)
            or not all(isinstance(n, int) and n >= 0 for n in lengths)):
        raise ProtocolError("PACKED message must list its frame lengths and carry one frame")
    body = frames[0]
    if sum(lengths) != len(body):
        raise ProtocolError("PACKED frame lengths do not add up to its payload")
    out, pos = [], 0
    for n in lengths:
        out.append(bytes(body[pos:pos + n]))
        pos += n
    return out


def _nbytes(frame: Any) -> int:
    return len(frame) if frame.__class__ is bytes else memoryview(frame).nbytes


def oversized(frames: Sequence[Any], start: int = 0) -> bool:
    """Whether any of ``frames[start:]`` is larger than `MAX_FRAME_BYTES` (O(frames), no copy)."""
    limit = MAX_FRAME_BYTES
    # Inline and without an index: this runs for every message an endpoint sends.
    for f in frames[start:] if start else frames:
        if (len(f) if f.__class__ is bytes else memoryview(f).nbytes) > limit:
            return True
    return False


def split_frames(frames: Sequence[Any]) -> list[Any]:
    """The frames of one SPLIT message carrying ``frames``: each frame larger than
    `MAX_FRAME_BYTES` as pieces of at most that size, views of it (not copies)."""
    limit = MAX_FRAME_BYTES
    counts: list[int] = []
    out: list[Any] = []
    for f in frames:
        n = _nbytes(f)
        if n <= limit:
            counts.append(1)
            out.append(f)
            continue
        view = memoryview(f)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")  # raises for a non-contiguous buffer, as sending it would
        pieces = range(0, n, limit)
        counts.append(len(pieces))
        out.extend(view[at:at + limit] for at in pieces)
    return [encode_header(Kind.SPLIT, 0, "", counts), *out]


def join_frames(counts: Any, frames: list[Any]) -> list[Any]:
    """The frames of the message inside a SPLIT message (``frames`` = what follows its
    header): pieces joined into one buffer per original frame (one copy), others as they
    are. `ProtocolError` when ``counts`` does not describe ``frames``."""
    if (not isinstance(counts, list) or not counts
            or not all(c.__class__ is int and c > 0 for c in counts)
            or sum(counts) != len(frames)):
        raise ProtocolError("SPLIT piece counts do not match its frames")
    out: list[Any] = []
    pos = 0
    for c in counts:
        if c == 1:
            out.append(frames[pos])
        else:
            pieces = frames[pos:pos + c]
            whole = bytearray(sum(len(p) for p in pieces))
            at = 0
            for p in pieces:
                n = len(p)
                whole[at:at + n] = p
                at += n
            out.append(whole)
        pos += c
    return out
