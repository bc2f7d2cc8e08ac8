"""Wire vocabulary and tunables of the p2p engine (:mod:`aiorl.actors.p2p`).

Op names, message kinds and payload-path tags are part of the wire format: both
ends of a pair must agree on them. The thresholds decide which path a payload takes.
"""

from __future__ import annotations

import os

OP_DATA = "p2p.data"  # sender -> receiver, one-way: one message (control + inline payload)
OP_BATCH = "p2p.batch"  # sender -> receiver, one-way: several small messages, in order
OP_ACK = "p2p.ack"  # receiver -> sender, one-way: a shared segment is free again
OP_DROP = "p2p.drop"  # sender -> receiver, one-way: forget a segment (the sender closed it)
OP_HELLO = "p2p.hello"  # sender -> receiver, request: can you map my segments? your GPUs?
OP_DONE = "p2p.done"  # receiver -> sender, one-way: a CUDA IPC copy finished (or failed)

#: Pickled buffers smaller than this stay inside the pickle stream (one copy beats one frame).
INBAND_MAX = 64 * 1024
#: Messages whose out-of-band CPU bytes reach this go through shared memory on one node.
SHM_MIN = 256 * 1024
#: ``send_tensor`` payloads from this size are pulled by the receiver with one copy (CMA).
#: ``AIORL_P2P_CMA=0`` turns that path off (shared memory is used instead).
CMA_MIN = 1 << 20
_CMA_ENABLED = os.environ.get("AIORL_P2P_CMA", "1") != "0"
#: Bulk bytes travel as frames of at most this size when they go through ZMQ.
CHUNK = 1 << 20
#: Small messages sent in the same loop iteration travel together, up to this many ...
BATCH_MAX_MSGS = 256
#: ... or this many bytes (each message is one frame smaller than ``_TRACK_MIN``).
BATCH_MAX_BYTES = 256 * 1024
#: pyzmq copies frames smaller than this anyway, so only larger ones need a tracker.
_TRACK_MIN = 64 * 1024
#: How long one registry lookup of a peer waits before it is retried (it waits for ever).
_RESOLVE_RETRY_S = 30.0

K_OBJ, K_CPU, K_CUDA = 0, 1, 2  # message kinds: pickled object, one CPU tensor, one CUDA tensor
_FRAMES, _SHM, _CMA = 0, 1, 2  # where CPU bytes travel
_NCCL, _IPC, _NOTHING = 0, 1, 2  # how CUDA tensors travel (_NOTHING: all are empty)
