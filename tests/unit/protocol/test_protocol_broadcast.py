"""The broadcast messages (aiorl.protocol.broadcast): every message survives its wire form
through msgpack, the wire keeps its positional layout, and a malformed field is refused
naming it. In-process, no cluster."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from aiorl.errors import ProtocolError
from aiorl.protocol.broadcast import (
    FRAMES,
    SHM,
    BroadcastAck,
    BroadcastData,
    BroadcastDone,
    CudaPlan,
    FramedBuffers,
    GpuInfo,
    IpcHandles,
    SegmentRelease,
    SharedBuffers,
)
from aiorl.protocol.ops import BroadcastOp

SET = "0123456789abcdef0123"
FRAMED = FramedBuffers((3 << 20, 0), (3, 1))
SHARED = SharedBuffers(4242, 17, 8 << 20, 3, (0, 4096), (4000, 1 << 20), "tcp://10.0.0.1:5000")
CUDA = CudaPlan("feedfacefeedfaceface", ("10.0.0.1", 29500), ("g:0", "g:2"), 1,
                {"g:1": "g:0", "g:3": "g:2"}, (("float32", (2, 3)), ("bfloat16", ())))
DATA = BroadcastData(SET, 7, "g:0", "tcp://10.0.0.1:5000", 0, None, SHARED, None, ())

MESSAGES: list[Any] = [
    DATA,
    BroadcastData(SET, 0, "g:0", "ipc:///tmp/g0", 1, ["float32", [4], False], FRAMED, None,
                  ("g:5", "g:6")),
    BroadcastData(SET, 1, "g:0", "tcp://10.0.0.1:5000", 2, ["float32", [2, 3], True], None,
                  CUDA, ()),
    BroadcastData(SET, 2, "g:0", "tcp://10.0.0.1:5000", 0, None, None,
                  CudaPlan("feedfacefeedfaceface", None, ("g:0",), 0, {}, ()), ()),
    BroadcastAck(SET, 7, "g:3", None), BroadcastAck(SET, 7, "g:3", "ValueError: no"),
    BroadcastDone(SET, 7, None), BroadcastDone(SET, 7, "worker g:3 could not take it"),
    SegmentRelease(3, "g:1"),
    GpuInfo(0, "GPU-1234"), GpuInfo(-1, None),
    IpcHandles(SET, 7),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_its_wire_form(message: Any) -> None:
    wire = msgpack.unpackb(msgpack.packb(message.to_wire()), strict_map_key=False)
    assert type(message).from_wire(wire) == message


def test_the_wire_keeps_its_positional_layout() -> None:
    """Both ends of a broadcast read fields by position: the layout is the wire format."""
    assert [o.value for o in BroadcastOp] == [
        "coll.bcast", "coll.ack", "coll.done", "coll.release", "coll.gpu", "coll.ipc"]
    assert FRAMED.to_wire() == [FRAMES, [3 << 20, 0], [3, 1]]
    assert SHARED.to_wire() == [SHM, 4242, 17, 8 << 20, 3, [0, 4096], [4000, 1 << 20],
                                "tcp://10.0.0.1:5000"]
    assert CUDA.to_wire() == ["feedfacefeedfaceface", ["10.0.0.1", 29500], ["g:0", "g:2"], 1,
                              {"g:1": "g:0", "g:3": "g:2"},
                              [["float32", [2, 3]], ["bfloat16", []]]]
    assert DATA.to_wire() == [SET, 7, "g:0", "tcp://10.0.0.1:5000", 0, None, SHARED.to_wire(),
                              None, []]
    assert BroadcastAck(SET, 7, "g:3", None).to_wire() == [SET, 7, "g:3", None]
    assert BroadcastDone(SET, 7, "why").to_wire() == [SET, 7, "why"]
    assert SegmentRelease(3, "g:1").to_wire() == [3, "g:1"]
    assert IpcHandles(SET, 7).to_wire() == [SET, 7]
    assert GpuInfo(0, "GPU-1").to_wire() == {"index": 0, "uuid": "GPU-1"}


def _with(wire: list[Any], index: int, value: Any) -> list[Any]:
    return [*wire[:index], value, *wire[index + 1:]]


@pytest.mark.parametrize("cls, meta, field", [
    (BroadcastData, _with(DATA.to_wire(), 1, -1), r"coll\.bcast\.seq"),
    (BroadcastData, _with(DATA.to_wire(), 1, True), r"coll\.bcast\.seq"),
    (BroadcastData, _with(DATA.to_wire(), 0, ""), r"coll\.bcast\.set_id"),
    (BroadcastData, _with(DATA.to_wire(), 2, 5), r"coll\.bcast\.src"),
    (BroadcastData, _with(DATA.to_wire(), 4, "obj"), r"coll\.bcast\.kind"),
    (BroadcastData, _with(DATA.to_wire(), 5, "head"), r"coll\.bcast\.head"),
    (BroadcastData, _with(DATA.to_wire(), 6, [9, 1, 2]), r"coll\.bcast\.buffers"),
    (BroadcastData, _with(DATA.to_wire(), 6, {"tag": 0}), r"coll\.bcast\.buffers"),
    (BroadcastData, _with(DATA.to_wire(), 6, [FRAMES, [10], [1, 1]]),
     r"coll\.bcast\.buffers\.counts"),
    (BroadcastData, _with(DATA.to_wire(), 6, [FRAMES, [10], [0]]),
     r"coll\.bcast\.buffers\.counts"),
    (BroadcastData, _with(DATA.to_wire(), 6, _with(SHARED.to_wire(), 3, 4096)),
     r"coll\.bcast\.buffers\.sizes"),
    (BroadcastData, _with(DATA.to_wire(), 6, _with(SHARED.to_wire(), 1, 0)),
     r"coll\.bcast\.buffers\.pid"),
    (BroadcastData, _with(DATA.to_wire(), 6, _with(SHARED.to_wire(), 5, [0])),
     r"coll\.bcast\.buffers\.offsets"),
    (BroadcastData, _with(DATA.to_wire(), 6, SHARED.to_wire()[:-1]), r"coll\.bcast\.buffers"),
    (BroadcastData, _with(DATA.to_wire(), 7, _with(CUDA.to_wire(), 3, 2)),
     r"coll\.bcast\.cuda\.root"),
    (BroadcastData, _with(DATA.to_wire(), 7, _with(CUDA.to_wire(), 2, [])),
     r"coll\.bcast\.cuda\.reps"),
    (BroadcastData, _with(DATA.to_wire(), 7, _with(CUDA.to_wire(), 1, ["h", 70000])),
     r"coll\.bcast\.cuda\.store\.port"),
    (BroadcastData, _with(DATA.to_wire(), 7, _with(CUDA.to_wire(), 4, {"g:1": 0})),
     r"coll\.bcast\.cuda\.followers"),
    (BroadcastData, _with(DATA.to_wire(), 7, _with(CUDA.to_wire(), 5, [["float32", [-1]]])),
     r"coll\.bcast\.cuda\.specs\[0\]\.shape"),
    (BroadcastData, _with(DATA.to_wire(), 8, ["g:1", 2]), r"coll\.bcast\.children"),
    (BroadcastData, DATA.to_wire()[:-1], r"coll\.bcast: expected a list of 9 fields"),
    (BroadcastData, {"set_id": SET}, r"coll\.bcast: expected a list"),
    (BroadcastAck, [SET, 7, "g:3", 404], r"coll\.ack\.error"),
    (BroadcastAck, [SET, 7, "", None], r"coll\.ack\.member"),
    (BroadcastDone, [SET, "7", None], r"coll\.done\.seq"),
    (BroadcastDone, [SET, 7], r"coll\.done: expected a list of 3 fields"),
    (SegmentRelease, [-3, "g:1"], r"coll\.release\.seg_id"),
    (SegmentRelease, None, r"coll\.release: expected a list"),
    (GpuInfo, {"index": "0", "uuid": None}, r"coll\.gpu reply\.index"),
    (GpuInfo, {"index": 0, "uuid": 5}, r"coll\.gpu reply\.uuid"),
    (GpuInfo, [0, None], r"coll\.gpu reply: expected a map"),
    (IpcHandles, [SET, None], r"coll\.ipc\.seq"),
])
def test_a_malformed_field_is_refused_naming_it(cls: Any, meta: Any, field: str) -> None:
    with pytest.raises(ProtocolError, match=field):
        cls.from_wire(meta)
