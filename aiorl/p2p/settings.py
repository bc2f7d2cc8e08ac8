"""The p2p engine's thresholds and waits: which path a payload takes, how small messages batch.

`aiorl.p2p.sender` documents the path choice these thresholds drive. They are local to each
process (a receiver reads whatever path the sender chose), so both ends need not agree on
them. ``AIORL_P2P_CMA=0`` in a worker's environment turns the CMA path off (where the
kernel's ptrace policy forbids it, or to compare paths).
"""

from __future__ import annotations

import os
from typing import Final

__all__ = [
    "BATCH_MAX_BYTES",
    "BATCH_MAX_MSGS",
    "CHUNK",
    "CMA_ENABLED",
    "CMA_MIN",
    "HELLO_TIMEOUT_S",
    "INBAND_MAX",
    "INLINE_MAX",
    "RESOLVE_RETRY_S",
    "SHM_MIN",
    "TRACK_MIN",
]

#: Pickled buffers smaller than this stay inside the pickle stream (one copy beats one frame).
INBAND_MAX: Final = 64 * 1024
#: A message travels inline (batched, no payload path) when its one frame is below this.
INLINE_MAX: Final = 64 * 1024
#: Messages whose out-of-band CPU bytes reach this go through shared memory on one node.
SHM_MIN: Final = 256 * 1024
#: ``send_tensor`` payloads from this size are pulled by the receiver with one copy (CMA).
CMA_MIN: Final = 1 << 20
#: ``AIORL_P2P_CMA=0`` turns the CMA path off (shared memory is used instead).
CMA_ENABLED: Final = os.environ.get("AIORL_P2P_CMA", "1") != "0"
#: Bulk bytes travel as frames of at most this size when they go through ZMQ.
CHUNK: Final = 1 << 20
#: Small messages sent in the same loop iteration travel together, up to this many ...
BATCH_MAX_MSGS: Final = 256
#: ... or this many bytes (each message is one frame smaller than ``INLINE_MAX``).
BATCH_MAX_BYTES: Final = 256 * 1024
#: pyzmq copies frames smaller than this anyway, so only larger ones need a tracker.
TRACK_MIN: Final = 64 * 1024
#: How long one registry lookup of a peer waits before it is retried (it waits for ever).
RESOLVE_RETRY_S: Final = 30.0
#: How long the one-time same-node set-up request (``p2p.hello``) may take.
HELLO_TIMEOUT_S: Final = 30.0
