"""The wire protocol between channel handles and the channel worker.

Both directions carry *batches*: whatever a process issued to one channel during
one turn of its event loop travels as one ZMQ message, which is what lets small
items move at the one-way message rate instead of one round trip per item.

Client to channel worker: a one-way message, op `OPS`::

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

Channel worker to client: a pushed event, op `DONE`, sent once per loop
turn per client (split when the inline bytes grow large)::

    meta   = [[token, status, info], ...]
    frames = the payload frames of every answer, concatenated

``info`` is, for status ``ITEMS`` (the answer to a get), one ``[payload, weight,
seq]`` triple per item (one for ``GET``/``GET_NOWAIT``, several for ``GET_BATCH``),
with ``payload`` as above and ``seq`` the item's place in its queue (``PEEKED`` likewise); for ``STATS`` a map queue
name -> counters; for ``INFO`` ``[qsize, maxsize]``; for ``ROUTE`` a replica rank; for
``ERROR`` the message.

Queue names (*keys*) travel as ``str`` when they are strings, the common case, and
otherwise as bytes: the key's msgpack form (tuples as arrays, other objects as
their pickle in an extension type), so equal keys of the plain types meet in one
queue; see `aiorl.channels.handle.wire_key`.

Every parked operation is answered exactly once: with its result, or with
``CANCELLED`` after a ``CANCEL`` found it still parked. A ``CANCEL`` that finds
nothing (the answer is already on its way) is not answered.

Credits (pipelined puts)
    The channel worker grants each client, per queue, *credits*: room it
    promises to accept items into. A client holding a credit sends its put as
    ``PUT_CREDITED`` at once, without waiting for an earlier put's answer; such a
    put is never answered on its own (only with ``ERROR`` if it is malformed): its
    work completes when a ``CREDIT`` report counts it ``admitted`` (a client's
    credited puts enter their queue in the order sent, so the count names them). Grants travel as answers
    with token 0 and status ``CREDIT``, ``info = [queue_name, granted, admitted]``:
    ``granted`` new credits, and ``admitted`` credited puts that entered the queue
    since the last report (what ``FLUSH`` and a lost channel worker are judged by).
    Credits are granted only for free room (``maxsize``), so a full queue grants
    none and puts wait as uncredited ``PUT``s again. ``FLUSH`` is answered once no
    credited put of that client is still waiting for room.

Prefetch (streaming gets)
    A client whose gets follow each other closely sends ``PREFETCH`` entries for
    items already queued: they take nothing when the queue is empty (never
    waiting, so they cannot take items that arrive for other getters), and what
    they bring is kept for the client's next gets. A client that received
    prefetched items *holds* the queue's prefetch until it says ``DRAINED`` (each of
    those items went to one of its gets, or back with an ``UNGET`` sent before).
    Items given back return to the head of the queue; so that they can never reach
    another process after a newer item did, the channel worker holds the gets of
    every other process (``GET``, ``GET_BATCH``, ``GET_NOWAIT``) while one process
    holds prefetched items, at most `LENT_HOLD_MAX` seconds, and refuses
    ``PREFETCH`` (``NO_PREFETCH``) on a queue that a second process took from within
    `SHARED_WINDOW` seconds. One consumer streams with prefetch; several take one
    request each, and each sees every producer's items in put order.
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
PUT_CREDITED = 9  #: a put the client already completed with a credit (see Credits)
FLUSH = 10  #: answered once every earlier credited put of this client is in its queue
#: up to ``number`` items already queued, at once (never waits); answered ``ITEMS``,
#: possibly none
PREFETCH = 11
#: which replica of a distributed channel holds key ``queue_name`` (sent to replica 0,
#: the one authority, which assigns a new key to the replica on node ``number``, the
#: asking process's node, falling back to replica 0); answered ``OK`` with the rank
ROUTE = 12
#: up to ``number`` queued items (all if negative) copied, not taken; answered ``PEEKED``
PEEK = 13
#: this client holds no prefetched item of queue ``queue_name`` any more (all served to its
#: gets, or given back with an ``UNGET`` sent before); never answered (see Prefetch)
DRAINED = 14

# answer statuses
OK = 0
FULL = 1
EMPTY = 2
CANCELLED = 3
ERROR = 4
ITEMS = 5  #: a successful get; its own status so frames can be skipped without knowing the op
CREDIT = 6  #: a credit grant (token 0): ``[queue_name, granted, admitted]``
PEEKED = 7  #: the answer to ``PEEK``: items as for ``ITEMS``, still queued (never re-queued)
#: the answer to a ``PREFETCH`` while another process also takes from the queue: no items,
#: and prefetch no more for `SHARED_WINDOW` seconds
NO_PREFETCH = 8

#: Pickles up to this size travel inline in the message header instead of as a frame.
INLINE_MAX = 32 * 1024
#: A batch is sent early once its inline bytes reach this (headers are capped at 1 MiB) ...
MAX_INLINE_BYTES = 256 * 1024
#: ... or once it holds this many operations ...
MAX_BATCH_OPS = 1024
#: ... or this many bytes in frames, so one message stays a reasonable size.
MAX_BATCH_BYTES = 8 << 20

#: The most credits one client holds per queue (an unbounded queue grants this many;
#: a bounded one at most its free room). A producer runs at most this far ahead.
CREDIT_WINDOW = 4096
#: The most items a streaming consumer prefetches per queue.
PREFETCH_MAX = 256
#: Prefetched items a consumer has not asked for within this many seconds go back
#: to their queue, so an idle consumer does not hold items others are waiting for.
PREFETCH_IDLE = 0.005
#: A queue counts as *shared* (prefetch refused) for this long after a second process took
#: from it: prefetching alternately would make each consumer wait for the other's items.
SHARED_WINDOW = 1.0
#: The longest the channel worker holds another process's gets while one process holds
#: prefetched items of the queue (it answers in milliseconds unless its loop is stuck or it
#: died); after this, the gets are served and a late give-back may reach them out of order.
LENT_HOLD_MAX = 2.0
