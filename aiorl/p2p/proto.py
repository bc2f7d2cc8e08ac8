"""Wire vocabulary and tunables of the p2p engine.

Op names, message kinds and payload-path tags are part of the wire format: both ends
of a pair must agree on them. The thresholds decide which path a payload takes
(`aiorl.p2p.sender` documents the choice).

Control message ``p2p.data``, meta ``[src, kind, head, bufdesc, cudadesc]``: ``bufdesc``
is ``None`` or a CPU path's descriptor (first item its tag: ``FRAMES``, ``SHM``,
``CMA``), ``cudadesc`` ``None`` or a CUDA path's (``NCCL``, ``IPC``, ``HOST``, ``NOTHING``).
``p2p.batch``, meta ``[src, [[kind, head, bufdesc], ...]]``, one frame per message.
"""

from __future__ import annotations

import os
from typing import Final

from aiorl.protocol.p2p_relay import P2P_VIA

OP_DATA: Final = "p2p.data"  # sender -> receiver, one-way: one message (control + inline payload)
OP_BATCH: Final = "p2p.batch"  # sender -> receiver, one-way: several small messages, in order
OP_ACK: Final = "p2p.ack"  # receiver -> sender, one-way: a shared segment is free again
OP_DROP: Final = "p2p.drop"  # sender -> receiver, one-way: forget a segment (the sender closed it)
OP_HELLO: Final = "p2p.hello"  # sender -> receiver, request: can you map my segments? your GPUs?
OP_DONE: Final = "p2p.done"  # receiver -> sender, one-way: a pulled payload was read (or not)
OP_CUDA: Final = "p2p.cuda"  # sender -> receiver, one-way: NCCL "go", CUDA IPC share dropped
#: node agent -> receiver, one-way: a ``p2p.data``/``p2p.batch`` relayed for a sender beyond
#: the direct-connection budget (`aiorl.p2p.p2p_relay`); meta ``[src_identity, op, meta]``.
OP_VIA: Final = P2P_VIA

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

# Message kinds: a pickled object, one CPU tensor, one CUDA tensor.
K_OBJ: Final = 0
K_CPU: Final = 1
K_CUDA: Final = 2

# CPU payload path tags (bufdesc[0]).
FRAMES: Final = 0
SHM: Final = 1
CMA: Final = 2

# CUDA payload path tags (cudadesc[0]); NOTHING: every CUDA tensor of the message is empty;
# HOST: small CUDA tensors staged through pinned host memory, in the message's last frame.
NCCL: Final = 0
IPC: Final = 1
NOTHING: Final = 2
HOST: Final = 3
