"""Wire vocabulary of the collectives: op names and payload descriptor tags.

Both ends of a broadcast must agree on them. Collective traffic has its own ops (not
``p2p.data``) so that a broadcast never takes the place of a ``send`` in a pair's
point-to-point order: the two streams are independent (``docs/broadcast.md``).

``coll.bcast`` (parent -> member, one-way), meta ``[set_id, seq, src, src_address, kind, head,
bufdesc, cudadesc, children]``, frames: the pickle (kind ``K_OBJ``), then data frames.
``bufdesc`` is None, ``[FRAMES, sizes, counts]`` (the buffers' chunks follow as frames) or
``[SHM, pid, fd, size, segment id, offsets, sizes, owner address]``. ``children`` are the members
a relay passes the message on to (empty for everyone else).
"""

from __future__ import annotations

from typing import Final

OP_BCAST: Final = "coll.bcast"
#: member -> source, one-way, ``[set_id, seq, member, error or None]``: the member called the
#: broadcast and holds the object (or could not get it, and why).
OP_ACK: Final = "coll.ack"
#: source -> members, one-way, ``[set_id, seq, error or None]``: every member holds the object
#: (the broadcast completes) or one could not get it (it fails everywhere).
OP_DONE: Final = "coll.done"
#: reader -> segment owner, one-way, ``[segment id, reader]``: the reader's views are gone.
OP_RELEASE: Final = "coll.release"
#: source -> member, request: which GPU do you use? (CUDA payloads only)
OP_GPU: Final = "coll.gpu"
#: representative -> member on its GPU, one-way, ``[set_id, seq, handles]``: CUDA IPC handles of
#: the representative's copy of a CUDA payload.
OP_IPC: Final = "coll.ipc"

# bufdesc tags.
FRAMES: Final = 0
SHM: Final = 1

#: Bulk bytes travel as frames of at most this size when they go through ZMQ.
CHUNK: Final = 1 << 20
