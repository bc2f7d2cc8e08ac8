"""Payload path: CPU bytes as ~1 MiB zero-copy frames of the control message itself.

Always applicable (any node, no set-up), so it is the last CPU path tried. One ZMQ
message is delivered atomically, so frames of two messages cannot interleave. The
send completes when ZMQ has released the frames (one huge frame costs page faults in
libzmq, hence the chunks: ``shared/PERF-NOTES.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from aiorl.errors import PeerLostError, ProtocolError
from aiorl.p2p.message import InMessage, OutMessage, PostedRecv
from aiorl.p2p.paths.base import (
    Destination,
    PathHost,
    PathSpec,
    PathStatistics,
    Placed,
    watch_completion,
)
from aiorl.p2p.proto import CHUNK, FRAMES, TRACK_MIN
from aiorl.transport.zerocopy import Tracker, tracked_frame


class FramesSend:
    """Frames toward one destination (stateless: nothing to probe, pool or acknowledge)."""

    acks: ClassVar[str | None] = None

    def __init__(self, host: PathHost) -> None:
        self.host = host
        self.settled = True

    @classmethod
    def create(cls, host: PathHost, dest: Destination) -> FramesSend:
        return cls(host)

    def wants(self, msg: OutMessage) -> bool:
        return False

    def ask(self, msg: OutMessage) -> dict[str, Any] | None:
        return None

    def on_hello(self, reply: Mapping[str, Any]) -> None:
        pass

    def fits(self, msg: OutMessage) -> bool:
        return True

    def place(self, msg: OutMessage, frames: list[Any]) -> Placed:
        trackers: list[Tracker] = []
        desc = place_frames(msg.bufs, frames, trackers)
        if not trackers:
            return Placed(desc)
        return Placed(desc, watch_completion(self.host, lambda: all(t.done for t in trackers)))

    def on_ack(self, meta: Sequence[Any]) -> bool:
        return False

    def lost(self, exc: PeerLostError | LookupError) -> None:
        pass  # the Sender fails its pending sends; ZMQ lets go of the frames on close

    def close(self) -> None:
        pass

    def statistics(self) -> PathStatistics:
        return PathStatistics(usable=True)


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
    return [FRAMES, sizes, counts]


class FramesRecv:
    """Frames from one source: the message's data frames are its buffers' chunks."""

    control: ClassVar[str | None] = None

    def __init__(self, source: str) -> None:
        self.source = source

    @classmethod
    def create(cls, host: PathHost, source: str) -> FramesRecv:
        return cls(source)

    def answer(self, ask: Mapping[str, Any], reply: dict[str, Any]) -> None:
        pass

    def accept(
        self,
        msg: InMessage,
        desc: Sequence[Any],
        frames: Sequence[Any],
        start: int,
        posted: PostedRecv | None,
    ) -> None:
        i = start
        sources = msg.sources
        for n, count in zip(desc[1], desc[2], strict=True):
            chunks = frames[i : i + count]
            if len(chunks) != count or sum(len(c) for c in chunks) != n:
                raise ProtocolError(f"p2p message from {self.source} lost payload frames")
            sources.append((n, chunks))
            i += count

    def on_control(self, meta: Sequence[Any]) -> None:
        pass

    def lost(self, exc: PeerLostError | LookupError) -> None:
        pass

    def close(self) -> None:
        pass

    def statistics(self) -> PathStatistics:
        return PathStatistics(usable=True)


PATH = PathSpec("frames", FRAMES, False, FramesSend.create, FramesRecv.create)
