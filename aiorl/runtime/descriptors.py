"""File descriptors a process needs for its peers, checked before it starts talking to them.

Each peer an `Endpoint` talks to costs a few descriptors (its DEALER's mailbox and
connection, the handshake monitor's pair), and a node agent holds more per worker it
starts. Running out half-way through a launch shows up as an obscure ZMQ error ("Too many
open files") on some later socket, far from the cause; checked at the start, it is one
clear error naming the limit, what needs it and how to raise it (docs/scale.md).
"""

from __future__ import annotations

import os

__all__ = ["DESCRIPTORS_PER_PEER", "DescriptorLimitError", "check_descriptors_for",
           "open_descriptors"]

#: Descriptors one peer of an endpoint holds, measured (tests/system/test_scale.py): the DEALER
#: (its mailbox and its connection) and the handshake monitor (a PAIR of sockets).
DESCRIPTORS_PER_PEER = 4
#: Kept free for everything else a process opens (logs, libraries, pipes).
_HEADROOM = 64


class DescriptorLimitError(OSError):
    """The process's open-file limit is too low for the peers it is about to talk to."""


def open_descriptors() -> int:
    """How many descriptors this process has open now (0 where that cannot be read)."""
    for directory in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(directory))
        except OSError:
            continue
    return 0


def check_descriptors_for(peers: int, what: str = "workers") -> None:
    """Make sure ``peers`` more peers fit under the soft ``RLIMIT_NOFILE``, with room to
    spare: raise the soft limit toward the hard one if that is what it takes (as the
    registry and the agents do at start; the soft limit is often 1,024 while the hard one
    allows far more), and raise `DescriptorLimitError` if even that is not enough."""
    try:
        import resource
    except ImportError:  # not a Unix system: nothing to check
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    needed = open_descriptors() + peers * DESCRIPTORS_PER_PEER + _HEADROOM
    if needed > soft and (hard == resource.RLIM_INFINITY or needed <= hard):
        # Only as far as needed (twice, for what comes next): descriptors above 1,024 break
        # select()-based code, so a process that does not need them does not get them.
        target = needed * 2 if hard == resource.RLIM_INFINITY else min(hard, needed * 2)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # not allowed here: the error below says what to do
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if needed > soft:
        raise DescriptorLimitError(
            f"this process may open {soft} files (ulimit -n; hard limit {hard}), and talking to "
            f"{peers} {what} needs about {needed} ({DESCRIPTORS_PER_PEER} per peer and "
            f"{open_descriptors()} open now): raise the limit (ulimit -n {max(needed * 2, 4096)}, "
            "or LimitNOFILE= in a systemd unit) before starting this process")
