"""The channel messages (aiorl.protocol.channels): every message survives its wire form, a
malformed field is refused naming it, a refused entry fails alone, and the fast readers
accept exactly what the field-by-field checks accept. In-process, no cluster."""

from __future__ import annotations

import math
from typing import Any

import pytest

from aiorl.errors import ProtocolError
from aiorl.protocol import channels as chan
from aiorl.protocol.channels import (
    REPLIES,
    Answer,
    Credit,
    QueueInfo,
    Refused,
    Request,
    Route,
    Statistics,
    read_answers,
    read_items,
    read_requests,
)
from aiorl.protocol.ops import ChannelOp

REQUESTS: list[tuple[Request, int]] = [  # (request, the frames it may own)
    (Request(chan.PUT_CREDITED, 7, "default", 1.5, b"pickle"), 0),
    (Request(chan.PUT, 8, b"\x92\x01\x02", 0, 3), 3),
    (Request(chan.PUT_NOWAIT, 9, "q", 2, b""), 0),
    (Request(chan.GET, 10, "q", 0, 0), 0),
    (Request(chan.GET_BATCH, 11, "q", 64.0, 0), 0),
    (Request(chan.PREFETCH, 12, "q", 256, 0), 0),
    (Request(chan.PEEK, 13, "q", -1, 0), 0),
    (Request(chan.ROUTE, 14, b"key", 3, 0), 0),
    (Request(chan.UNGET, 0, "q", [[1.0, 4], [2.0, 5]], [b"a", 2]), 2),
    (Request(chan.STATS, 15, "", 0, 0), 0),
    (Request(chan.DRAINED, 0, "q", 0, 0), 0),
]
ANSWERS: list[Answer] = [
    Answer(3, chan.ITEMS, [[b"inline", 1.0, 1], [2, 0.5, 2]]),
    Answer(4, chan.PEEKED, []),
    Answer(0, chan.CREDIT, ["q", 64, 2]),
    Answer(5, chan.OK, None),
    Answer(6, chan.FULL, None),
    Answer(7, chan.ERROR, "ValueError: no"),
]
REPLY_MESSAGES: list[Any] = [
    Credit("q", 4096, 0), Credit(b"\x01", 0, 7),
    Statistics({"q": (3, 4.5, 0, 1, 2, 0), b"k": (0, 0.0, 8, 0, 0, 0)}), Statistics({}),
    QueueInfo(3, 8), Route(2),
]


def test_the_wire_names_and_numbers_stay() -> None:
    """Both ends of a channel upgrade together, but the bytes did not change with the
    types: the op names and the numbers of the kinds and statuses are the ones before."""
    assert (str(ChannelOp.OPS), str(ChannelOp.DONE)) == ("chan.ops", "chan.done")
    assert (chan.PUT, chan.GET_BATCH, chan.UNGET, chan.PUT_CREDITED, chan.DRAINED) == (
        0, 4, 6, 9, 14)
    assert (chan.OK, chan.ERROR, chan.ITEMS, chan.CREDIT, chan.NO_PREFETCH) == (0, 4, 5, 6, 8)
    assert Request(chan.PUT, 1, "q", 1.0, b"x").to_wire() == (0, 1, "q", 1.0, b"x")
    assert Answer(1, chan.OK, None).to_wire() == (1, 0, None)


@pytest.mark.parametrize("request_, frames", REQUESTS, ids=lambda r: str(getattr(r, "kind", r)))
def test_every_request_survives_its_wire_form(request_: Request, frames: int) -> None:
    wire = request_.to_wire()
    assert Request.from_wire(wire, frames) == request_
    assert Request.from_wire(list(wire), frames) == request_  # msgpack gives lists
    assert read_requests([list(wire)], frames) == [list(wire)]  # the entry itself, checked


@pytest.mark.parametrize("answer", ANSWERS, ids=lambda a: str(a.status))
def test_every_answer_survives_its_wire_form(answer: Answer) -> None:
    assert Answer.from_wire(answer.to_wire()) == answer
    assert read_answers([list(answer.to_wire())]) == [list(answer.to_wire())]


@pytest.mark.parametrize("message", REPLY_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_reply_survives_its_wire_form(message: Any) -> None:
    assert type(message).from_wire(message.to_wire()) == message


@pytest.mark.parametrize("entry, frames, field", [
    ([chan.PUT, 1, "q", "heavy", b"x"], 0, "chan.ops.number"),
    ([chan.PUT, 1, "q", math.nan, b"x"], 0, "chan.ops.number"),
    ([chan.PUT, 1, "q", -1.0, b"x"], 0, "chan.ops.number"),
    ([chan.PUT, 1, "q", True, b"x"], 0, "chan.ops.number"),
    ([chan.PUT, 1, "q", 1.0, 3], 2, "chan.ops.payload"),  # owns more frames than sent
    ([chan.PUT, 1, "q", 1.0, "text"], 0, "chan.ops.payload"),
    ([chan.PUT, 1, ["q"], 1.0, b"x"], 0, "chan.ops.queue"),
    ([chan.PUT, -1, "q", 1.0, b"x"], 0, "chan.ops.token"),
    ([chan.PUT, "1", "q", 1.0, b"x"], 0, "chan.ops.token"),
    ([99, 1, "q", 1.0, b"x"], 0, "chan.ops.kind"),
    ([[0], 1, "q", 1.0, b"x"], 0, "chan.ops.kind"),
    ([chan.GET_BATCH, 1, "q", 0.0, 0], 0, "chan.ops.number"),
    ([chan.GET, 1, "q", 0, b"x"], 0, "chan.ops.payload"),
    ([chan.GET, 1, "q", 5, 0], 0, "chan.ops.number"),
    ([chan.PREFETCH, 1, "q", -2, 0], 0, "chan.ops.number"),
    ([chan.PEEK, 1, "q", -2, 0], 0, "chan.ops.number"),
    ([chan.UNGET, 0, "q", [[1.0, 4]], [b"a", b"b"]], 0, "chan.ops.payload"),
    ([chan.UNGET, 0, "q", [[1.0]], [b"a"]], 0, "chan.ops.number"),
    ([chan.UNGET, 0, "q", [[1.0, 4]], [2]], 1, "chan.ops.payload"),
    ([chan.PUT, 1, "q", 1.0], 0, "chan.ops: expected a list of 5 fields, got 4"),
    ({"kind": chan.PUT}, 0, "chan.ops: expected a list of 5 fields, got dict"),
])
def test_a_malformed_request_is_refused_naming_the_field(entry: Any, frames: int,
                                                         field: str) -> None:
    with pytest.raises(ProtocolError, match=field.replace(".", r"\.")):
        Request.from_wire(entry, frames)
    [refused] = read_requests([entry], frames)
    assert isinstance(refused, Refused) and field in str(refused.error)


@pytest.mark.parametrize("entry, field", [
    ([1, 99, None], "chan.done.status"),
    ([-1, chan.OK, None], "chan.done.token"),
    ([1, chan.ITEMS, {"a": 1}], "chan.done.info"),
    ([1, chan.ERROR, None], "chan.done.info"),
    ([1, chan.FULL, "why"], "chan.done.info"),
    ([0, chan.CREDIT, ["q", -1, 0]], "chan.done.info.granted"),
    ([0, chan.CREDIT, [None, 1, 0]], "chan.done.info.queue"),
    ([1, chan.OK], "chan.done: expected a list of 3 fields, got 2"),
])
def test_a_malformed_answer_is_refused_naming_the_field(entry: Any, field: str) -> None:
    with pytest.raises(ProtocolError, match=field.replace(".", r"\.")):
        Answer.from_wire(entry)
    [refused] = read_answers([entry])
    assert isinstance(refused, Refused) and field in str(refused.error)


@pytest.mark.parametrize("message, meta, field", [
    (Credit, ["q", -1, 0], "chan.done.info.granted"),
    (Credit, [1, 1, 0], "chan.done.info.queue"),
    (Statistics, {"q": [1, 2.0, 0, 0, 0]}, "chan.done.info: expected a list of 6 fields"),
    (Statistics, {"q": [1, "2", 0, 0, 0, 0]}, "chan.done.info.weight"),
    (Statistics, [], "chan.done.info"),
    (QueueInfo, [1, -8], "chan.done.info.maxsize"),
    (Route, "2", "chan.done.info"),
])
def test_a_malformed_reply_is_refused_naming_the_field(message: Any, meta: Any,
                                                       field: str) -> None:
    with pytest.raises(ProtocolError, match=field.replace(".", r"\.")):
        message.from_wire(meta)


def test_a_refused_request_fails_alone_and_keeps_its_token() -> None:
    """The channel worker answers the refused entry ERROR and serves the others; the
    frames an entry before it owns are counted, those of the refused one are not."""
    good = [chan.PUT, 1, "q", 1.0, 2]
    bad = [chan.PUT, 2, "q", "heavy", b"x"]
    last = [chan.PUT, 3, "q", 1.0, 1]
    first, refused, third = read_requests([good, bad, last], 3)
    assert first is good and third is last
    assert isinstance(refused, Refused) and refused.token == 2
    [no_token] = read_requests([[chan.DRAINED, 0, "q", 1, 0]], 0)  # token 0: nothing to answer
    assert isinstance(no_token, Refused) and no_token.token is None
    [too_many] = read_requests([good, last], 2)[1:]  # good owns both frames
    assert isinstance(too_many, Refused)


def test_a_message_that_is_not_a_list_is_refused() -> None:
    with pytest.raises(ProtocolError, match="chan.ops"):
        read_requests({"kind": 0}, 0)
    with pytest.raises(ProtocolError, match="chan.done"):
        read_answers(None)


def test_items_are_read_with_their_frames_and_checked() -> None:
    frames = [b"f1", b"f2", b"f3"]
    items, pos = read_items([[b"inline", 1.0, 1], [2, 0.5, 2], [1, 0, 3]], frames, 0)
    assert items == [(b"inline", (1.0, 1), ()), (2, (0.5, 2), [b"f1", b"f2"]),
                     (1, (0, 3), [b"f3"])]
    assert pos == 3
    with pytest.raises(ProtocolError, match=r"chan\.done\.info"):
        read_items([[4, 1.0, 1]], frames, 0)  # owns more frames than there are
    with pytest.raises(ProtocolError, match=r"chan\.done\.info"):
        read_items([[b"x", "1.0", 1]], frames, 0)
    with pytest.raises(ProtocolError, match=r"chan\.done\.info"):
        read_items([[b"x", 1.0]], frames, 0)


def test_every_kind_with_an_ok_reply_has_its_type() -> None:
    assert REPLIES == {chan.STATS: Statistics, chan.INFO: QueueInfo, chan.ROUTE: Route}


def test_the_fast_reader_accepts_exactly_what_the_checks_accept() -> None:
    """`read_requests` checks the common entries in one chain of tests and hands the rest
    to the field-by-field checks: for every mix of kind, number and payload, both agree."""
    for kind in [*sorted(chan.KINDS), 99, True, 1.0]:
        for number in [0, 0.0, 2.5, -1, True, "1", None]:
            for payload in [b"x", 1, 2, 0, "s", None, 1.0]:
                entry = [kind, 5, "q", number, payload]
                try:
                    expected: Any = Request.from_wire(entry, 1).to_wire()
                except ProtocolError:
                    expected = None
                [got] = read_requests([entry], 1)
                assert (None if isinstance(got, Refused) else tuple(got)) == expected, entry
