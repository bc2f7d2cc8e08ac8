"""The wire protocol between channel handles and the channel worker.

Both directions carry *batches*: whatever a process issued to one channel during
one turn of its event loop travels as one ZMQ message, which is what lets small
items move at the one-way message rate instead of one round trip per item.

Client to channel worker: a one-way message, op :data:`OPS`::

    meta   = [[kind, token, queue_name, number, payload], ...]   # one entry per operation
    frames = the payload frames of every entry, concatenated

``token`` is unique per client process and names the operation in the answer;
``number`` is the item's weight (puts) or the batch weight (``GET_BATCH``).
``payload`` is the item itself when it is small: its pickle, as msgpack bytes
*inline* in the header (no frame of its own, which is what makes small items
cheap); otherwise the number of frames the item owns in ``frames`` (its pickle
and its out-of-band buffers, e.g. tensor data, sent zero-copy). Operations
without an item have payload 0. Queue name, weight, token and item travel in
the same entry, so two concurrent operations can never be paired with each
other's data.

Channel worker to client: a pushed event, op :data:`DONE`, sent once per loop
turn per client (split when the inline bytes grow large)::

    meta   = [[token, status, info], ...]
    frames = the payload frames of every answer, concatenated

``info`` is, for status ``ITEMS`` (the answer to a get), one ``[payload, weight,
seq]`` triple per item (one for ``GET``/``GET_NOWAIT``, several for ``GET_BATCH``),
with ``payload`` as above and ``seq`` the item's place in its queue; for ``STATS`` a map queue name -> counters; for ``INFO``
``[qsize, maxsize]``; for ``ERROR`` the message.

Every parked operation is answered exactly once: with its result, or with
``CANCELLED`` after a ``CANCEL`` found it still parked. A ``CANCEL`` that finds
nothing (the answer is already on its way) is not answered.
"""

from __future__ import annotations

__all__ = ["DONE", "OPS"]

OPS = "chan.ops"
DONE = "chan.done"

# operation kinds
PUT = 0
PUT_NOWAIT = 1
GET = 2
GET_NOWAIT = 3
GET_BATCH = 4
CANCEL = 5  #: withdraw the parked operation named by ``token``
#: items a cancelled get received late, returned to their places in their queue;
#: ``number`` is the list of their ``[weight, seq]`` and ``payload`` the list of their payloads
UNGET = 6
STATS = 7
INFO = 8

# answer statuses
OK = 0
FULL = 1
EMPTY = 2
CANCELLED = 3
ERROR = 4
ITEMS = 5  #: a successful get; its own status so frames can be skipped without knowing the op

#: Pickles up to this size travel inline in the message header instead of as a frame.
INLINE_MAX = 32 * 1024
#: A batch is sent early once its inline bytes reach this (headers are capped at 1 MiB) ...
MAX_INLINE_BYTES = 256 * 1024
#: ... or once it holds this many operations ...
MAX_BATCH_OPS = 1024
#: ... or this many bytes in frames, so one message stays a reasonable size.
MAX_BATCH_BYTES = 8 << 20
