"""The channel messages: what channel handles and a channel worker send each other.

Both directions carry *batches*: whatever a process issued to one channel during one turn
of its event loop travels as one ZMQ message, which is what lets small items move at the
one-way message rate instead of one round trip per item.

Client to channel worker: a one-way message, op ``ChannelOp.OPS``::

    meta   = [Request, ...]                   # one entry per operation
    frames = the payload frames of every entry, concatenated

A `Request` names its operation ``kind`` (`PUT`, `GET`, ...), a ``token`` unique per client
process that names the operation in the answer, the ``queue`` (the queue's key) and a
``number``: the item's weight (puts), the batch weight (`GET_BATCH`), a count
(`PREFETCH`, `PEEK`) or the asking process's node (`ROUTE`). Its ``payload`` is the item
itself when it is small: its pickle, as msgpack bytes *inline* in the header (no frame of
its own, which is what makes small items cheap); otherwise the number of frames the item
owns in ``frames`` (its pickle and its out-of-band buffers, e.g. tensor data, sent
zero-copy). Operations without an item have payload 0. Queue, weight, token and item
travel in the same entry, so two concurrent operations can never be paired with each
other's data.

Channel worker to client: a pushed event, op ``ChannelOp.DONE``, sent once per loop turn
per client (split when the inline bytes grow large)::

    meta   = [Answer, ...]
    frames = the payload frames of every answer, concatenated

An `Answer` carries the ``token`` it answers, a ``status`` and its ``info``: for `ITEMS`
(the answer to a get) one `ItemEntry` ``[payload, weight, seq]`` per item (one for `GET`
and `GET_NOWAIT`, several for `GET_BATCH` and `PREFETCH`), with ``payload`` as above and
``seq`` the item's place in its queue (`PEEKED` likewise); for `CREDIT` a `Credit`; for
`ERROR` the message; for `OK` the reply of the request's kind (`REPLIES`: `Statistics`
for `STATS`, `QueueInfo` for `INFO`, `Route` for `ROUTE`; nothing for the others).

Queue keys travel as ``str`` when they are strings, the common case, and otherwise as
bytes: the key's msgpack form (tuples as arrays, other objects as their pickle in an
extension type), so equal keys of the plain types meet in one queue;
``aiorl.channels.items.wire_key`` makes them.

Every parked operation is answered exactly once: with its result, or with `CANCELLED`
after a `CANCEL` found it still parked. A `CANCEL` that finds nothing (the answer is
already on its way) is not answered.

Credits (pipelined puts)
    The channel worker grants each client, per queue, *credits*: room it promises to
    accept items into. A client holding a credit sends its put as `PUT_CREDITED` at once,
    without waiting for an earlier put's answer; such a put is never answered on its own
    (only with `ERROR` if it is malformed): its work completes when a `CREDIT` report
    counts it ``admitted`` (a client's credited puts enter their queue in the order sent,
    so the count names them). Grants travel as answers with token 0 and status `CREDIT`:
    ``granted`` new credits, and ``admitted`` credited puts that entered the queue since
    the last report (what `FLUSH` and a lost channel worker are judged by). Credits are
    granted only for free room (``maxsize``), so a full queue grants none and puts wait as
    uncredited `PUT` requests again. `FLUSH` is answered once no credited put of that
    client is still waiting for room.

Prefetch (streaming gets)
    A client whose gets follow each other closely sends `PREFETCH` requests for items
    already queued: they take nothing when the queue is empty (never waiting, so they
    cannot take items that arrive for other getters), and what they bring is kept for the
    client's next gets. A client that received prefetched items *holds* the queue's
    prefetch until it says `DRAINED` (each of those items went to one of its gets, or back
    with an `UNGET` sent before). Items given back return to the head of the queue; so
    that they can never reach another process after a newer item did, the channel worker
    holds the gets of every other process (`GET`, `GET_BATCH`, `GET_NOWAIT`) while one
    process holds prefetched items (for a bounded time), and refuses `PREFETCH`
    (`NO_PREFETCH`) on a queue that a second process took from recently. One consumer
    streams with prefetch; several take one request each, and each sees every producer's
    items in put order. How long those holds and windows last is a setting, not protocol
    (``aiorl.channels.settings``).

Checks
    Every field is checked on the way in, and a malformed one raises
    [`ProtocolError`][aiorl.ProtocolError] naming it (``chan.ops.number: ...``). A channel
    worker answers a malformed request with `ERROR` and serves the rest of the batch; a
    client fails the operation a malformed answer names. The reference form of each
    message is its dataclass (`Request`, `Answer`, ...) with ``to_wire``/``from_wire``.
    The per-item path does not build one per item: a request or an answer costs a few
    hundred nanoseconds as a dataclass, a fifth of a channel worker's whole work for an
    item. There, `request_entry` and `answer_entry` write the wire form, and
    `read_requests`, `read_answers` and `read_items` read a whole message, checking the
    common entries with one chain of type tests each and handing every other entry to
    the checks ``from_wire`` uses, which name the field that fails; they hand back the
    entries they received (no copy per item), or `Refused` in the place of one that fails.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeAlias

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only (postponed)

from aiorl.errors import ProtocolError
from aiorl.protocol.ops import ChannelOp

__all__ = [
    "CANCEL",
    "CANCELLED",
    "CREDIT",
    "DRAINED",
    "EMPTY",
    "ERROR",
    "FLUSH",
    "FULL",
    "GET",
    "GET_BATCH",
    "GET_NOWAIT",
    "INFO",
    "ITEMS",
    "KINDS",
    "NO_PREFETCH",
    "OK",
    "PEEK",
    "PEEKED",
    "PREFETCH",
    "PUT",
    "PUT_CREDITED",
    "PUT_NOWAIT",
    "REPLIES",
    "ROUTE",
    "STATS",
    "STATUSES",
    "UNGET",
    "Answer",
    "AnswerFields",
    "Checked",
    "Counters",
    "Credit",
    "CreditFields",
    "ItemEntry",
    "QueueInfo",
    "QueueKey",
    "Received",
    "Refused",
    "Request",
    "RequestFields",
    "Route",
    "Statistics",
    "answer_entry",
    "credit_entry",
    "read_answers",
    "read_items",
    "read_requests",
    "request_entry",
]

#: A queue's key as it travels and as the channel worker stores it.
QueueKey: TypeAlias = str | bytes
#: One item of an `ITEMS` or `PEEKED` answer: ``(payload, weight, seq)``.
ItemEntry: TypeAlias = tuple[bytes | int, float, int]

# ---------------------------------------------------------------------- request kinds
# Plain ints, not an IntEnum: they are compared several times per item, and an enum
# member's attribute lookup costs about three times a module constant's.
PUT: Final = 0
PUT_NOWAIT: Final = 1
GET: Final = 2
GET_NOWAIT: Final = 3
GET_BATCH: Final = 4
#: Withdraw the parked operation named by ``token``.
CANCEL: Final = 5
#: Items a cancelled get received late, returned to their places in their queue;
#: ``number`` is the list of their ``[weight, seq]`` and ``payload`` the list of their
#: payloads.
UNGET: Final = 6
STATS: Final = 7
INFO: Final = 8
#: A put the client already completed with a credit (see Credits).
PUT_CREDITED: Final = 9
#: Answered once every earlier credited put of this client is in its queue.
FLUSH: Final = 10
#: Up to ``number`` items already queued, at once (never waits); answered `ITEMS`,
#: possibly none.
PREFETCH: Final = 11
#: Which replica of a distributed channel holds key ``queue`` (sent to replica 0, the one
#: authority, which assigns a new key to the replica on node ``number``, the asking
#: process's node, falling back to replica 0); answered `OK` with a `Route`.
ROUTE: Final = 12
#: Up to ``number`` queued items (all if negative) copied, not taken; answered `PEEKED`.
PEEK: Final = 13
#: This client holds no prefetched item of ``queue`` any more (all served to its gets, or
#: given back with an `UNGET` sent before); never answered (see Prefetch).
DRAINED: Final = 14
#: Every request kind.
KINDS: Final = frozenset(range(15))

# ---------------------------------------------------------------------- answer statuses
OK: Final = 0
FULL: Final = 1
EMPTY: Final = 2
CANCELLED: Final = 3
ERROR: Final = 4
#: A successful get: its own status, so frames can be skipped without knowing the request.
ITEMS: Final = 5
#: A credit grant (token 0), with a `Credit`.
CREDIT: Final = 6
#: The answer to `PEEK`: items as for `ITEMS`, still queued (never re-queued).
PEEKED: Final = 7
#: The answer to a `PREFETCH` while another process also takes from the queue: no items,
#: and no prefetching for a while.
NO_PREFETCH: Final = 8
#: Every answer status.
STATUSES: Final = frozenset(range(9))

_OPS: Final = str(ChannelOp.OPS)
_DONE: Final = str(ChannelOp.DONE)
#: The integers msgpack carries.
_MIN_INT: Final = -(2**63)
_MAX_INT: Final = 2**64 - 1
_MAX_COUNT: Final = 2**31 - 1
#: Kinds whose ``number`` is a weight, and whose ``payload`` is an item.
_PUTS: Final = frozenset((PUT, PUT_NOWAIT, PUT_CREDITED))
#: Kinds whose ``number`` is an integer (a count or a node); they carry no item.
_COUNTS: Final = {PREFETCH: 0, ROUTE: 0, PEEK: -1}  # kind -> the lowest ``number``
#: Kinds whose ``number`` and ``payload`` are both 0.
_BARE_KINDS: Final = frozenset((GET, GET_NOWAIT, CANCEL, STATS, INFO, FLUSH, DRAINED))
#: Statuses whose answer carries nothing.
_BARE: Final = frozenset((FULL, EMPTY, CANCELLED, NO_PREFETCH))
_INF: Final = math.inf


def _error(message: str, key: str, why: str) -> ProtocolError:
    return ProtocolError(f"{message}.{key}: {why}")


def _entry(value: object, n: int, message: str) -> list[Any] | tuple[Any, ...]:
    if value.__class__ is not list and value.__class__ is not tuple:
        raise ProtocolError(f"{message}: expected a list of {n} fields, got "
                            f"{type(value).__name__}")
    if len(value) != n:
        raise ProtocolError(f"{message}: expected a list of {n} fields, got {len(value)}")
    return value


def _weight(value: object, message: str, key: str) -> float:
    """A finite number >= 0 (an int or a float, not a bool)."""
    if value.__class__ is not float and value.__class__ is not int:
        raise _error(message, key, f"expected a weight, got {type(value).__name__}")
    if not 0.0 <= value < math.inf:  # NaN fails too
        raise _error(message, key, f"expected a finite weight >= 0, got {value!r}")
    return value


def _integer(value: object, message: str, key: str, lo: int, hi: int = _MAX_INT) -> int:
    if value.__class__ is not int or not lo <= value <= hi:
        raise _error(message, key, f"expected an integer in [{lo}, {hi}], got {value!r:.40}")
    return value


def _key(value: object, message: str, key: str) -> QueueKey:
    if value.__class__ is not str and value.__class__ is not bytes:
        raise _error(message, key, f"expected a queue key (str or bytes), got "
                     f"{type(value).__name__}")
    return value


def _payload(value: object, frames_left: int, message: str, key: str) -> int:
    """An item's payload: inline bytes, or how many of the frames it owns. Returns that
    number (0 for bytes)."""
    if value.__class__ is bytes:
        return 0
    if value.__class__ is not int or not 1 <= value <= frames_left:
        raise _error(message, key, f"expected inline bytes or a frame count in "
                     f"[1, {frames_left}], got {value!r:.40}")
    return value


# ---------------------------------------------------------------------- the per-item messages
#: A `Request` as it travels: ``(kind, token, queue, number, payload)``.
RequestFields: TypeAlias = tuple[int, int, QueueKey, Any, Any]
#: An `Answer` as it travels: ``(token, status, info)``.
AnswerFields: TypeAlias = tuple[int, int, Any]
#: An entry a reader checked, as it was received (the list itself: no copy per item); its
#: fields are in the order of `RequestFields` or `AnswerFields`.
Checked: TypeAlias = Sequence[Any]
#: One item of an `ITEMS` or `PEEKED` answer as `read_items` gives it:
#: ``(payload, (weight, seq), frames)``, ``frames`` the item's own (none when inline).
Received: TypeAlias = tuple[bytes | int, tuple[float, int], Sequence[Any]]


@dataclass(frozen=True, slots=True)
class Refused:
    """An entry of a message that failed its checks, in its place: the token it names
    (None: no awaited operation, nothing to answer or fail) and why."""

    token: int | None
    error: ProtocolError


@dataclass(frozen=True, slots=True)
class Request:
    """One operation a client sends a channel worker: an entry of a ``chan.ops`` message.

    ``number`` and ``payload`` depend on ``kind``: a weight and an item for puts
    (``payload`` inline bytes or the number of frames the item owns), a batch weight
    above 0 for `GET_BATCH`, a count or a node for `PREFETCH`, `PEEK` and `ROUTE`, the
    items' places and payloads for `UNGET`, and 0 and 0 for the others.
    """

    kind: int
    token: int
    queue: QueueKey
    number: Any
    payload: Any

    def to_wire(self) -> RequestFields:
        return request_entry(self.kind, self.token, self.queue, self.number, self.payload)

    @classmethod
    def from_wire(cls, entry: object, frames_left: int) -> Self:
        """The request of ``entry``, whose item may own up to ``frames_left`` frames."""
        return cls(*_check_request(entry, frames_left))


def request_entry(kind: int, token: int, queue: QueueKey, number: Any,
                  payload: Any) -> RequestFields:
    """`Request.to_wire` without building the `Request` (a client sends one per item)."""
    return (kind, token, queue, number, payload)


def read_requests(meta: object, nframes: int) -> list[Checked | Refused]:
    """The requests of a ``chan.ops`` message with ``nframes`` frames, in order, each
    checked as `Request.from_wire` checks one; an entry that fails is `Refused` in its
    place, so that only its operation fails."""
    if meta.__class__ is not list and meta.__class__ is not tuple:
        raise ProtocolError(f"{_OPS}: expected a list of requests, got {type(meta).__name__}")
    out: list[Checked | Refused] = []
    left = nframes  # frames not owned by an earlier entry
    for entry in meta:
        # Puts and the requests without arguments (a get) in one chain of tests, the rest
        # by `_check_request`, which also says what is wrong with an entry refused here.
        if (entry.__class__ is list or entry.__class__ is tuple) and len(entry) == 5:
            kind, token, queue, number, payload = entry
            if (kind.__class__ is int and token.__class__ is int and token >= 0
                    and (queue.__class__ is str or queue.__class__ is bytes)):
                if kind in _PUTS:
                    if ((number.__class__ is float or number.__class__ is int)
                            and 0 <= number < _INF):
                        if payload.__class__ is bytes:
                            out.append(entry)
                            continue
                        if payload.__class__ is int and 0 < payload <= left:
                            left -= payload
                            out.append(entry)
                            continue
                elif kind in _BARE_KINDS and number == 0 and payload == 0:
                    out.append(entry)
                    continue
        try:
            fields = _check_request(entry, left)
        except ProtocolError as exc:
            out.append(Refused(_token(entry, 5, 1), exc))
            continue
        left -= _frames_owned(fields)
        out.append(fields)
    return out


def _token(entry: object, n: int, at: int) -> int | None:
    """The token (field ``at`` of ``n``) of an entry that failed its checks, if it names an
    awaited operation (0 names none)."""
    if (entry.__class__ is list or entry.__class__ is tuple) and len(entry) == n:
        token = entry[at]
        if token.__class__ is int and token > 0:
            return int(token)
    return None


def _check_request(entry: object, frames_left: int) -> Checked:
    """Request ``entry`` with each field checked; raises ProtocolError naming the first that
    is wrong."""
    fields = _entry(entry, 5, _OPS)
    kind, token, queue, number, payload = fields
    if kind.__class__ is not int or kind not in KINDS:
        raise _error(_OPS, "kind", f"unknown request kind {kind!r:.40}")
    _integer(token, _OPS, "token", 0)
    _key(queue, _OPS, "queue")
    if kind in _PUTS:
        _weight(number, _OPS, "number")
        _payload(payload, frames_left, _OPS, "payload")
    elif kind == GET_BATCH:
        if not _weight(number, _OPS, "number") > 0:
            raise _error(_OPS, "number", f"a batch weight must be > 0, got {number!r}")
        _nothing(payload, "payload")
    elif kind in _COUNTS:
        _integer(number, _OPS, "number", _COUNTS[kind], _MAX_COUNT)
        _nothing(payload, "payload")
    elif kind == UNGET:
        _unget(number, payload, frames_left)
    else:
        _nothing(number, "number")
        _nothing(payload, "payload")
    return fields


def _frames_owned(fields: Checked) -> int:
    """How many of the message's frames a checked request owns."""
    payload = fields[4]
    if fields[0] == UNGET:
        return sum(p for p in payload if p.__class__ is int)
    return payload if payload.__class__ is int else 0


def _nothing(value: object, key: str) -> None:
    if value != 0:
        raise _error(_OPS, key, f"this request kind carries none (0), got {value!r:.40}")


def _unget(places: object, payloads: object, frames_left: int) -> None:
    """The items of an `UNGET`: ``places`` their ``[weight, seq]``, ``payloads`` theirs."""
    if places.__class__ is not list and places.__class__ is not tuple:
        raise _error(_OPS, "number", f"expected the items' places, got {type(places).__name__}")
    if payloads.__class__ is not list and payloads.__class__ is not tuple:
        raise _error(_OPS, "payload", f"expected the items' payloads, got "
                     f"{type(payloads).__name__}")
    if len(places) != len(payloads):
        raise _error(_OPS, "payload", f"{len(payloads)} payloads for {len(places)} places")
    for place in places:
        weight, seq = _entry(place, 2, f"{_OPS}.number")
        _weight(weight, _OPS, "number")
        _integer(seq, _OPS, "number", 0)
    for payload in payloads:
        frames_left -= _payload(payload, frames_left, _OPS, "payload")


@dataclass(frozen=True, slots=True)
class Answer:
    """One answer a channel worker sends a client: an entry of a ``chan.done`` message.

    ``info`` depends on ``status``: a list of `ItemEntry` for `ITEMS` and `PEEKED` (their
    frames follow in order; `read_items` reads them), a `Credit`'s wire form for `CREDIT`,
    the message for `ERROR`, nothing for `FULL`, `EMPTY`, `CANCELLED` and `NO_PREFETCH`,
    all of which ``from_wire`` checks; and for `OK` the reply of the request's kind
    (`REPLIES`, read with its ``from_wire``), which only the asking client can tell apart.
    """

    token: int
    status: int
    info: Any

    def to_wire(self) -> AnswerFields:
        return answer_entry(self.token, self.status, self.info)

    @classmethod
    def from_wire(cls, entry: object) -> Self:
        return cls(*_check_answer(entry))


def answer_entry(token: int, status: int, info: Any) -> AnswerFields:
    """`Answer.to_wire` without building the `Answer` (a channel worker sends one per get)."""
    return (token, status, info)


def read_answers(meta: object) -> list[Checked | Refused]:
    """The answers of a ``chan.done`` message, in order, each checked as `Answer.from_wire`
    checks one; an entry that fails is `Refused` in its place. The items of `ITEMS` and
    `PEEKED` answers are checked as `read_items` reads them with their frames."""
    if meta.__class__ is not list and meta.__class__ is not tuple:
        raise ProtocolError(f"{_DONE}: expected a list of answers, got {type(meta).__name__}")
    out: list[Checked | Refused] = []
    for entry in meta:
        if (entry.__class__ is list or entry.__class__ is tuple) and len(entry) == 3:
            token, status, info = entry
            if token.__class__ is int and token >= 0 and status.__class__ is int:
                if status == ITEMS or status == PEEKED:
                    if info.__class__ is list or info.__class__ is tuple:
                        out.append(entry)
                        continue
                elif status == CREDIT:
                    if ((info.__class__ is list or info.__class__ is tuple) and len(info) == 3
                            and (info[0].__class__ is str or info[0].__class__ is bytes)
                            and info[1].__class__ is int and 0 <= info[1] <= _MAX_COUNT
                            and info[2].__class__ is int and 0 <= info[2] <= _MAX_COUNT):
                        out.append(entry)
                        continue
                elif status == OK or (info is None if status in _BARE else status == ERROR
                                      and info.__class__ is str):
                    out.append(entry)
                    continue
        try:
            out.append(_check_answer(entry))
        except ProtocolError as exc:
            out.append(Refused(_token(entry, 3, 0), exc))
    return out


def _check_answer(entry: object) -> Checked:
    fields = _entry(entry, 3, _DONE)
    token, status, info = fields
    _integer(token, _DONE, "token", 0)
    if status.__class__ is not int or status not in STATUSES:
        raise _error(_DONE, "status", f"unknown answer status {status!r:.40}")
    if status == ITEMS or status == PEEKED:
        if info.__class__ is not list and info.__class__ is not tuple:
            raise _error(_DONE, "info", f"expected a list of items, got {type(info).__name__}")
    elif status == CREDIT:
        Credit.from_wire(info)
    elif status == ERROR:
        if info.__class__ is not str:
            raise _error(_DONE, "info", f"expected an error message, got {type(info).__name__}")
    elif status in _BARE and info is not None:
        raise _error(_DONE, "info", f"this status carries nothing, got {type(info).__name__}")
    return fields


def read_items(info: list[Any] | tuple[Any, ...], frames: Sequence[Any],
               pos: int) -> tuple[list[Received], int]:
    """The items of an `ITEMS` or `PEEKED` answer (``info``), each with its frames from
    ``frames[pos:]``, and the position of the next answer's frames."""
    items: list[Received] = []
    end = len(frames)
    for item in info:
        if (item.__class__ is list or item.__class__ is tuple) and len(item) == 3:
            payload, weight, seq = item
            if (weight.__class__ is float or weight.__class__ is int) and seq.__class__ is int:
                if payload.__class__ is bytes:
                    items.append((payload, (weight, seq), ()))
                    continue
                if payload.__class__ is int and 0 < payload <= end - pos:
                    items.append((payload, (weight, seq), frames[pos:pos + payload]))
                    pos += payload
                    continue
        raise _item_error(item, end - pos)
    return items, pos


def _item_error(item: object, frames_left: int) -> ProtocolError:
    """What is wrong with an `ItemEntry` `read_items` refused."""
    try:
        payload, weight, seq = _entry(item, 3, f"{_DONE}.info")
        _payload(payload, frames_left, _DONE, "info")
        _weight(weight, _DONE, "info")
        _integer(seq, _DONE, "info", _MIN_INT)
    except ProtocolError as exc:
        return exc
    return _error(_DONE, "info", f"an item was refused: {item!r:.60}")


# ---------------------------------------------------------------------- what answers carry
@dataclass(frozen=True, slots=True)
class Credit:
    """A `CREDIT` answer's info: ``granted`` new credits for ``queue``, and ``admitted``
    credited puts that entered it since the last report (see Credits)."""

    queue: QueueKey
    granted: int
    admitted: int

    def to_wire(self) -> CreditFields:
        return credit_entry(self.queue, self.granted, self.admitted)

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        message = f"{_DONE}.info"
        queue, granted, admitted = _entry(meta, 3, message)
        return cls(_key(queue, message, "queue"),
                   _integer(granted, message, "granted", 0, _MAX_COUNT),
                   _integer(admitted, message, "admitted", 0, _MAX_COUNT))


#: A `Credit` as it travels: ``(queue, granted, admitted)``.
CreditFields: TypeAlias = tuple[QueueKey, int, int]


def credit_entry(queue: QueueKey, granted: int, admitted: int) -> CreditFields:
    """`Credit.to_wire` without building the `Credit` (a channel worker sends one per client,
    queue and loop turn in which puts entered it)."""
    return (queue, granted, admitted)


#: One queue's counters in a `Statistics`: qsize, weight, maxsize, waiting putters,
#: waiting getters, reserved (the fields of ``aiorl.channels.QueueStats``).
Counters: TypeAlias = tuple[int, float, int, int, int, int]


@dataclass(frozen=True, slots=True)
class Statistics:
    """The reply to `STATS`: each queue's `Counters`."""

    queues: dict[QueueKey, Counters]

    def to_wire(self) -> dict[QueueKey, list[Any]]:
        return {queue: list(counters) for queue, counters in self.queues.items()}

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        message = f"{_DONE}.info"
        if not isinstance(meta, dict):
            raise _error(_DONE, "info", f"expected a map of queues, got {type(meta).__name__}")
        queues: dict[QueueKey, Counters] = {}
        for queue, counters in meta.items():
            qsize, weight, maxsize, putters, getters, reserved = _entry(counters, 6, message)
            queues[_key(queue, message, "queue")] = (
                _integer(qsize, message, "qsize", 0), float(_weight(weight, message, "weight")),
                _integer(maxsize, message, "maxsize", 0),
                _integer(putters, message, "waiting_putters", 0),
                _integer(getters, message, "waiting_getters", 0),
                _integer(reserved, message, "reserved", 0))
        return cls(queues)


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """The reply to `INFO`: the queue's size now and its bound (0: unbounded)."""

    qsize: int
    maxsize: int

    def to_wire(self) -> tuple[int, int]:
        return (self.qsize, self.maxsize)

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        message = f"{_DONE}.info"
        qsize, maxsize = _entry(meta, 2, message)
        return cls(_integer(qsize, message, "qsize", 0), _integer(maxsize, message, "maxsize", 0))


@dataclass(frozen=True, slots=True)
class Route:
    """The reply to `ROUTE`: the replica that holds the key."""

    rank: int

    def to_wire(self) -> int:
        return self.rank

    @classmethod
    def from_wire(cls, meta: object) -> Self:
        return cls(_integer(meta, _DONE, "info", 0, _MAX_COUNT))


#: The reply each request kind's `OK` answer carries (the others carry nothing).
REPLIES: Final[dict[int, type[Statistics] | type[QueueInfo] | type[Route]]] = {
    STATS: Statistics, INFO: QueueInfo, ROUTE: Route,
}
