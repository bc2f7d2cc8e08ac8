"""Zero-copy ZMQ frames whose release can be observed (the only raw zmq the p2p paths need).

A frame built from a buffer is sent without copying it; ZMQ keeps a reference until the
bytes are on the wire. Whoever owns the buffer must not reuse it before then: the
returned tracker's ``done`` turns true at that moment (poll it; it never blocks).
"""

from __future__ import annotations

from typing import Any, Protocol

import zmq

__all__ = ["Tracker", "tracked_frame"]


class Tracker(Protocol):
    @property
    def done(self) -> bool:
        """Whether ZMQ has let go of the frame's buffer."""
        ...


def tracked_frame(buf: Any) -> tuple[Any, Tracker]:
    """A frame over ``buf`` for a multipart send, and the tracker of its release."""
    frame = zmq.Frame(buf, track=True)
    tracker: Tracker = frame.tracker
    return frame, tracker
