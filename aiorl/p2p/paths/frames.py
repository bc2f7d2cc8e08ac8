"""Payload path: CPU bytes as ~1 MiB zero-copy frames of the control message itself.

Always applicable (any node, no set-up), so it is the last CPU path tried. One ZMQ
message is delivered atomically, so frames of two messages cannot interleave. The
send completes when ZMQ has released the frames (one huge frame costs page faults in
libzmq, hence the chunks: ``shared/PERF-NOTES.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiorl.errors import ProtocolError
from aiorl.p2p.message import InMessage, OutMessage, PostedRecv
from aiorl.p2p.paths.base import (
    PathSpec,
    Placed,
    RecvPathBase,
    SendPathBase,
    watch_completion,
)
from aiorl.p2p.settings import CHUNK, TRACK_MIN
from aiorl.protocol.p2p import FRAMES, frames_from_wire, frames_to_wire
from aiorl.transport.zerocopy import Tracker, tracked_frame


class FramesSend(SendPathBase):
    """Frames toward one destination (stateless: nothing to probe, pool or acknowledge; the
    Sender fails its pending sends on loss, and ZMQ lets go of the frames on close)."""

    def place(self, msg: OutMessage, frames: list[Any]) -> Placed:
        trackers: list[Tracker] = []
        desc = place_frames(msg.bufs, frames, trackers)
        if not trackers:
            return Placed(desc)
        return Placed(desc, watch_completion(self.host, lambda: all(t.done for t in trackers)))


def place_frames(bufs: list[memoryview], frames: list[Any], trackers: list[Tracker]) -> list[Any]:
    """Append ``bufs`` to ``frames`` in chunks; large chunks zero-copy (their trackers too)."""
    sizes, counts = [], []
    for b in bufs:
        n = b.nbytes
        count = 0
        for off in range(0, max(n, 1), CHUNK):
            piece = b[off : off + CHUNK]
            if piece.nbytes >= TRACK_MIN:
                # Zero-copy: the send is complete only when ZMQ lets go of the memory.
                frame, tracker = tracked_frame(piece)
                trackers.append(tracker)
                frames.append(frame)
            else:
                frames.append(piece)  # pyzmq copies small frames at send time
            count += 1
        sizes.append(n)
        counts.append(count)
    return frames_to_wire(sizes, counts)


class FramesRecv(RecvPathBase):
    """Frames from one source: the message's data frames are its buffers' chunks."""

    def accept(
        self,
        msg: InMessage,
        desc: Sequence[Any],
        frames: Sequence[Any],
        start: int,
        posted: PostedRecv | None,
    ) -> None:
        sizes, counts = frames_from_wire(desc)
        i = start
        sources = msg.sources
        for n, count in zip(sizes, counts, strict=True):
            chunks = frames[i : i + count]
            if len(chunks) != count or sum(len(c) for c in chunks) != n:
                raise ProtocolError(f"p2p message from {self.source} lost payload frames")
            sources.append((n, chunks))
            i += count


PATH = PathSpec("frames", FRAMES, False, FramesSend.create, FramesRecv.create)
