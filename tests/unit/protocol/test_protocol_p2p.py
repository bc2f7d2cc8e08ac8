"""The point-to-point messages (aiorl.protocol.p2p): every message survives its wire form
through msgpack, the wire keeps its positional layout, and a malformed field is refused
naming it. In-process, no cluster."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from aiorl.errors import ProtocolError
from aiorl.protocol.ops import P2POp
from aiorl.protocol.p2p import (
    CMA,
    FRAMES,
    HOST,
    IPC,
    K_CPU,
    K_CUDA,
    K_OBJ,
    NCCL,
    NOTHING,
    SHM,
    CmaDesc,
    CudaInfo,
    EmptyCudaDesc,
    Hello,
    HelloReply,
    HostDesc,
    IpcDesc,
    IpcDrop,
    IpcDropEvent,
    IpcPart,
    NcclDesc,
    NcclGo,
    NcclReply,
    NewSegment,
    SegmentAck,
    SegmentDrop,
    ShmDesc,
    Taken,
    TransferDone,
    batch_from_wire,
    batch_to_wire,
    cuda_control_from_wire,
    data_from_wire,
    data_to_wire,
    frames_from_wire,
    frames_to_wire,
)

ADDR = "ipc:///tmp/aiorl/g-1"
SPECS = [["float32", [2, 3]], ["bfloat16", []]]
EXPORT = [0, b"handle", 4096, 0, b"/torch_1_2_3", 8, b"event", True]
HEAD = ["float32", [4, 4], False]
SHM_DESC = ShmDesc(3, NewSegment(4242, 17, 8 << 20, ADDR), [0, 4096], [4000, 1 << 20])
CMA_DESC = CmaDesc(7, 4242, 0x7F00_0000_1000, 4 << 20, ADDR)
IPC_DESC = IpcDesc(9, ADDR, SPECS, "GPU-1234", [IpcPart(5, EXPORT, 0, 24), IpcPart(6, None, 64, 2)],
                   2, b"event-handle")
NCCL_DESC = NcclDesc("aiorl-p2p/g:0|g:1/abcd", ["10.0.0.1", 29500], SPECS, 11, ADDR)

MESSAGES: list[Any] = [
    SHM_DESC,
    ShmDesc(3, None, [0], [10]),
    CMA_DESC,
    HostDesc(SPECS),
    EmptyCudaDesc([["float32", [0]]]),
    IPC_DESC,
    IpcDesc(9, ADDR, SPECS, "GPU-1234", [IpcPart(5, None, 0, 24)], 2, None),
    NCCL_DESC,
    NcclDesc(None, None, SPECS, 11, ADDR),
    SegmentAck("g:1", 3),
    SegmentDrop("g:0", 3),
    Taken("g:1", 12),
    TransferDone("g:1", 7, None),
    TransferDone("g:1", 7, "OSError(1, 'Operation not permitted')"),
    TransferDone("g:1", 7, NcclReply("ready")),
    TransferDone("g:1", 7, NcclReply("go", "aiorl-p2p/g:0|g:1/abcd", ["10.0.0.1", 29500])),
    TransferDone("g:1", 7, NcclReply("refuse", reason="OutOfMemoryError: CUDA out of memory")),
    Hello("g:0", ADDR, 4242),
    Hello("g:0", ADDR, 4242, cma=0x7F00_0000_1000, probe=(12, 4096), cuda=True),
    HelloReply(),
    HelloReply(cma=True, shm=False, cuda=CudaInfo("host-a/boot", 0, ("GPU-1", "GPU-2"))),
    HelloReply(cuda=CudaInfo("host-a/boot", -1, ())),
]


def _through_msgpack(wire: Any) -> Any:
    return msgpack.unpackb(msgpack.packb(wire), strict_map_key=False)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_its_wire_form(message: Any) -> None:
    assert type(message).from_wire(_through_msgpack(message.to_wire())) == message


@pytest.mark.parametrize("message", [IpcDrop("g:0", [4, 5]), IpcDropEvent("g:0", 9),
                                     NcclGo("g:0", "gid", ["10.0.0.1", 29500], 7),
                                     NcclGo("g:0", None, None, 7)], ids=lambda m: type(m).__name__)
def test_every_cuda_control_survives_its_wire_form(message: Any) -> None:
    assert cuda_control_from_wire(_through_msgpack(message.to_wire())) == message


def test_the_per_message_readers_give_back_what_was_written() -> None:
    frames = frames_to_wire([3 << 20, 0], [3, 1])
    meta = data_to_wire("g:0", K_CPU, HEAD, frames, None)
    assert data_from_wire(_through_msgpack(meta)) == ("g:0", K_CPU, HEAD, frames, None)
    assert data_from_wire(["g:0", K_OBJ, None, None, None]) == ("g:0", K_OBJ, None, None, None)
    assert data_from_wire(["g:0", K_CUDA, HEAD, None, [HOST, SPECS]])[4] == [HOST, SPECS]
    entries = [[K_OBJ, None, None], [K_CPU, HEAD, frames_to_wire([16], [1])]]
    assert batch_from_wire(_through_msgpack(batch_to_wire("g:0", entries)), 2) == ("g:0", entries)
    assert frames_from_wire(_through_msgpack(frames)) == ([3 << 20, 0], [3, 1])


def test_the_wire_keeps_its_layout() -> None:
    """Both ends read fields by position (maps for the set-up): the layout is the wire format."""
    assert [o.value for o in P2POp] == [
        "p2p.data", "p2p.batch", "p2p.ack", "p2p.drop", "p2p.hello", "p2p.done", "p2p.cuda",
        "p2p.via", "p2p.credit", "p2p.taken", "p2p.undelivered"]
    assert (K_OBJ, K_CPU, K_CUDA) == (0, 1, 2)
    assert (FRAMES, SHM, CMA) == (0, 1, 2)
    assert (NCCL, IPC, NOTHING, HOST) == (0, 1, 2, 3)
    assert data_to_wire("g:0", K_OBJ, None, None, None) == ["g:0", K_OBJ, None, None, None]
    assert batch_to_wire("g:0", [[K_OBJ, None, None]]) == ["g:0", [[K_OBJ, None, None]]]
    assert frames_to_wire([5], [1]) == [FRAMES, [5], [1]]
    assert SHM_DESC.to_wire() == [SHM, 3, [4242, 17, 8 << 20, ADDR], [0, 4096], [4000, 1 << 20]]
    assert CMA_DESC.to_wire() == [CMA, 7, 4242, 0x7F00_0000_1000, 4 << 20, ADDR]
    assert HostDesc(SPECS).to_wire() == [HOST, SPECS]
    assert EmptyCudaDesc(SPECS).to_wire() == [NOTHING, SPECS]
    assert IPC_DESC.to_wire() == [IPC, 9, ADDR, SPECS, "GPU-1234",
                                  [[5, EXPORT, 0, 24], [6, None, 64, 2]], [2, b"event-handle"]]
    assert NCCL_DESC.to_wire() == [NCCL, "aiorl-p2p/g:0|g:1/abcd", ["10.0.0.1", 29500], SPECS,
                                   11, ADDR]
    assert SegmentAck("g:1", 3).to_wire() == ["g:1", 3]
    assert SegmentDrop("g:0", 3).to_wire() == ["g:0", 3]
    assert Taken("g:1", 12).to_wire() == ["g:1", 12]
    assert TransferDone("g:1", 7, None).to_wire() == ["g:1", 7, None]
    assert TransferDone("g:1", 7, NcclReply("ready")).to_wire() == ["g:1", 7, ["ready"]]
    assert NcclReply("go", "gid", ["h", 1]).to_wire() == ["go", "gid", ["h", 1]]
    assert NcclReply("refuse", reason="no").to_wire() == ["refuse", "no"]
    assert IpcDrop("g:0", [4]).to_wire() == ["g:0", "ipc-drop", [4]]
    assert IpcDropEvent("g:0", 9).to_wire() == ["g:0", "ipc-drop-event", 9]
    assert NcclGo("g:0", "gid", ["h", 1], 7).to_wire() == ["g:0", "go", "gid", ["h", 1], 7]
    assert Hello("g:0", ADDR, 42).to_wire() == {"src": "g:0", "addr": ADDR, "pid": 42}
    assert Hello("g:0", ADDR, 42, cma=8, probe=(3, 4), cuda=True).to_wire() == {
        "src": "g:0", "addr": ADDR, "pid": 42, "cma": 8, "probe": [3, 4], "cuda": True}
    assert HelloReply().to_wire() == {}
    assert HelloReply(cma=False, shm=True, cuda=CudaInfo("h", 1, ("GPU-1",))).to_wire() == {
        "cma": False, "shm": True, "cuda": {"host": "h", "current": 1, "uuids": ["GPU-1"]}}


def test_a_batch_checks_every_entry_that_is_not_a_small_pickle() -> None:
    obj = [K_OBJ, None, None]
    assert batch_from_wire(["g:0", [obj] * 3], 3) == ("g:0", [obj] * 3)
    with pytest.raises(ProtocolError, match=r"p2p\.batch\.entries\.head"):
        batch_from_wire(["g:0", [obj, [K_CPU, None, None], obj]], 3)
    with pytest.raises(ProtocolError, match=r"p2p\.batch\.entries"):
        batch_from_wire(["g:0", [obj, obj, "obj"]], 3)


def test_a_lone_share_id_reads_as_a_list_of_one() -> None:
    assert cuda_control_from_wire(["g:0", "ipc-drop", 6]) == IpcDrop("g:0", [6])


def _with(wire: list[Any], index: int, value: Any) -> list[Any]:
    return [*wire[:index], value, *wire[index + 1:]]


DATA = ["g:0", K_CPU, HEAD, frames_to_wire([64], [1]), None]
ENTRY = [K_CPU, HEAD, frames_to_wire([64], [1])]
READERS: dict[str, Callable[[Any], Any]] = {
    "data": data_from_wire,
    "batch": lambda meta: batch_from_wire(meta, 1),
    "frames": frames_from_wire,
    "shm": ShmDesc.from_wire,
    "cma": CmaDesc.from_wire,
    "host": HostDesc.from_wire,
    "nothing": EmptyCudaDesc.from_wire,
    "ipc": IpcDesc.from_wire,
    "nccl": NcclDesc.from_wire,
    "ack": SegmentAck.from_wire,
    "drop": SegmentDrop.from_wire,
    "taken": Taken.from_wire,
    "done": TransferDone.from_wire,
    "cuda": cuda_control_from_wire,
    "hello": Hello.from_wire,
    "reply": HelloReply.from_wire,
}


@pytest.mark.parametrize("reader, meta, field", [
    ("data", DATA[:-1], r"p2p\.data: expected a list of 5 fields"),
    ("data", {"src": "g:0"}, r"p2p\.data: expected a list"),
    ("data", _with(DATA, 0, ""), r"p2p\.data\.src"),
    ("data", _with(DATA, 0, ["g:0"]), r"p2p\.data\.src"),
    ("data", _with(DATA, 1, 3), r"p2p\.data\.kind"),
    ("data", _with(DATA, 1, True), r"p2p\.data\.kind"),
    ("data", _with(DATA, 2, None), r"p2p\.data\.head"),
    ("data", ["g:0", K_OBJ, HEAD, None, None], r"p2p\.data\.head"),
    ("data", _with(DATA, 2, ["float32", [4]]), r"p2p\.data\.head"),
    ("data", _with(DATA, 2, [7, [4], False]), r"p2p\.data\.head\.dtype"),
    ("data", _with(DATA, 2, ["float32", [-4], False]), r"p2p\.data\.head\.shape"),
    ("data", _with(DATA, 2, ["float32", [4], 1]), r"p2p\.data\.head\.requires_grad"),
    ("data", _with(DATA, 3, []), r"p2p\.data\.bufdesc"),
    ("data", _with(DATA, 3, ["frames"]), r"p2p\.data\.bufdesc"),
    ("data", _with(DATA, 4, 3), r"p2p\.data\.cudadesc"),
    ("batch", ["g:0", [ENTRY, ENTRY]], r"p2p\.batch\.entries: expected a list of 1 entries"),
    ("batch", ["g:0", ENTRY], r"p2p\.batch\.entries"),
    ("batch", [5, [ENTRY]], r"p2p\.batch\.src"),
    ("batch", ["g:0", [[K_OBJ, None]]], r"p2p\.batch\.entries"),
    ("batch", ["g:0", [_with(ENTRY, 0, "1")]], r"p2p\.batch\.entries\.kind"),
    ("batch", ["g:0", [_with(ENTRY, 1, None)]], r"p2p\.batch\.entries\.head"),
    ("batch", ["g:0", [_with(ENTRY, 2, "frames")]], r"p2p\.batch\.entries\.bufdesc"),
    ("batch", ["g:0"], r"p2p\.batch: expected a list of 2 fields"),
    ("frames", [FRAMES, [10], [1, 1]], r"p2p\.data\.bufdesc\.counts"),
    ("frames", [FRAMES, [10], [0]], r"p2p\.data\.bufdesc\.sizes"),
    ("frames", [FRAMES, [-1], [1]], r"p2p\.data\.bufdesc\.sizes"),
    ("frames", [FRAMES, [10]], r"p2p\.data\.bufdesc: expected a list of 3 fields"),
    ("shm", _with(SHM_DESC.to_wire(), 1, -3), r"p2p\.data\.bufdesc\.seg_id"),
    ("shm", _with(SHM_DESC.to_wire(), 3, [0]), r"p2p\.data\.bufdesc\.offsets"),
    ("shm", _with(SHM_DESC.to_wire(), 4, ["10"]), r"p2p\.data\.bufdesc\.sizes"),
    ("shm", _with(SHM_DESC.to_wire(), 2, [0, 17, 4096, ADDR]), r"p2p\.data\.bufdesc\.new\.pid"),
    ("shm", _with(SHM_DESC.to_wire(), 2, [1, 17, 4096, None]),
     r"p2p\.data\.bufdesc\.new\.address"),
    ("shm", _with(SHM_DESC.to_wire(), 2, [1, 17]), r"p2p\.data\.bufdesc\.new: expected a list"),
    ("cma", _with(CMA_DESC.to_wire(), 1, "7"), r"p2p\.data\.bufdesc\.token"),
    ("cma", _with(CMA_DESC.to_wire(), 2, -1), r"p2p\.data\.bufdesc\.pid"),
    ("cma", _with(CMA_DESC.to_wire(), 3, 2**64), r"p2p\.data\.bufdesc\.addr"),
    ("cma", _with(CMA_DESC.to_wire(), 4, 1.5), r"p2p\.data\.bufdesc\.nbytes"),
    ("cma", _with(CMA_DESC.to_wire(), 5, ""), r"p2p\.data\.bufdesc\.address"),
    ("host", [HOST, [["float32"]]], r"p2p\.data\.cudadesc\.specs\[0\]"),
    ("host", [HOST, [["float32", [-1]]]], r"p2p\.data\.cudadesc\.specs\[0\]\.shape"),
    ("host", [HOST, [[None, [1]]]], r"p2p\.data\.cudadesc\.specs\[0\]\.dtype"),
    ("host", [HOST, [["float32", [2]], ["bfloat16", [1, 2]], ["float32", [True]]]],
     r"p2p\.data\.cudadesc\.specs\[2\]\.shape"),  # a bool is no size, after good specs
    ("nothing", [NOTHING, "float32"], r"p2p\.data\.cudadesc\.specs"),
    ("ipc", _with(IPC_DESC.to_wire(), 4, None), r"p2p\.data\.cudadesc\.uuid"),
    ("ipc", _with(IPC_DESC.to_wire(), 5, [[5, [0, 1], 0, 24]]),
     r"p2p\.data\.cudadesc\.parts\[0\]\.args"),
    ("ipc", _with(IPC_DESC.to_wire(), 5, [[5, None, -1, 24]]),
     r"p2p\.data\.cudadesc\.parts\[0\]\.offset"),
    ("ipc", _with(IPC_DESC.to_wire(), 5, [[5, None, 0, 24], [6, None, 0, 2**63]]),
     r"p2p\.data\.cudadesc\.parts\[1\]\.nbytes"),
    ("ipc", _with(IPC_DESC.to_wire(), 5, [[5, None, 0]]),
     r"p2p\.data\.cudadesc\.parts\[0\]: expected a list"),
    ("ipc", _with(IPC_DESC.to_wire(), 6, [2, "handle"]),
     r"p2p\.data\.cudadesc\.event\.handle"),
    ("ipc", _with(IPC_DESC.to_wire(), 6, [-2, None]), r"p2p\.data\.cudadesc\.event\.event_id"),
    ("nccl", _with(NCCL_DESC.to_wire(), 1, 5), r"p2p\.data\.cudadesc\.gid"),
    ("nccl", _with(NCCL_DESC.to_wire(), 2, ["h", 70000]), r"p2p\.data\.cudadesc\.store\.port"),
    ("nccl", _with(NCCL_DESC.to_wire(), 2, "h:1"), r"p2p\.data\.cudadesc\.store"),
    ("nccl", _with(NCCL_DESC.to_wire(), 4, None), r"p2p\.data\.cudadesc\.token"),
    ("ack", ["g:1", "3"], r"p2p\.ack\.seg_id"),
    ("ack", [None, 3], r"p2p\.ack\.src"),
    ("ack", ["g:1"], r"p2p\.ack: expected a list of 2 fields"),
    ("drop", ["g:0", -3], r"p2p\.drop\.seg_id"),
    ("taken", ["g:1", 0], r"p2p\.taken\.count"),  # a grant of nothing is no grant
    ("taken", ["g:1", "3"], r"p2p\.taken\.count"),
    ("taken", ["", 3], r"p2p\.taken\.src"),
    ("taken", ["g:1"], r"p2p\.taken: expected a list of 2 fields"),
    ("done", ["g:1", -7, None], r"p2p\.done\.token"),
    ("done", ["g:1", 7, 404], r"p2p\.done\.reply"),
    ("done", ["g:1", 7, ["maybe"]], r"p2p\.done\.reply\.kind"),
    ("done", ["g:1", 7, []], r"p2p\.done\.reply\.kind"),
    ("done", ["g:1", 7, ["ready", 1]], r"p2p\.done\.reply: expected a list of 1 fields"),
    ("done", ["g:1", 7, ["go", 5, None]], r"p2p\.done\.reply\.gid"),
    ("done", ["g:1", 7, ["go", "gid", ["h"]]], r"p2p\.done\.reply\.store"),
    ("done", ["g:1", 7, ["refuse", None]], r"p2p\.done\.reply\.reason"),
    ("cuda", ["g:0", "ipc-drop", ["4"]], r"p2p\.cuda\.share_ids"),
    ("cuda", ["g:0", "ipc-drop-event", None], r"p2p\.cuda\.event_id"),
    ("cuda", ["g:0", "go", "gid", None], r"p2p\.cuda: expected a list of 5 fields"),
    ("cuda", ["g:0", "go", "gid", None, "7"], r"p2p\.cuda\.token"),
    ("cuda", [b"g:0", "go", "gid", None, 7], r"p2p\.cuda\.src"),
    ("cuda", ["g:0", "ipc-keep", 4], r"p2p\.cuda\.what"),
    ("cuda", "ipc-drop", r"p2p\.cuda\.what"),
    ("hello", ["g:0", ADDR, 42], r"p2p\.hello: expected a map"),
    ("hello", {"addr": ADDR, "pid": 42}, r"p2p\.hello: missing field 'src'"),
    ("hello", {"src": "g:0", "addr": ADDR, "pid": 0}, r"p2p\.hello\.pid"),
    ("hello", {"src": "g:0", "addr": ADDR, "pid": 42, "cma": -1}, r"p2p\.hello\.cma"),
    ("hello", {"src": "g:0", "addr": ADDR, "pid": 42, "cuda": 1}, r"p2p\.hello\.cuda"),
    ("hello", {"src": "g:0", "addr": ADDR, "pid": 42, "probe": [3]}, r"p2p\.hello\.probe"),
    ("hello", {"src": "g:0", "addr": ADDR, "pid": 42, "probe": [3, "4"]},
     r"p2p\.hello\.probe\.size"),
    ("reply", {"shm": "yes"}, r"p2p\.hello reply\.shm"),
    ("reply", {"cma": 1}, r"p2p\.hello reply\.cma"),
    ("reply", {"cuda": {"host": "h", "current": 0, "uuids": [5]}},
     r"p2p\.hello reply\.cuda\.uuids"),
    ("reply", {"cuda": {"host": "h", "uuids": []}}, r"p2p\.hello reply\.cuda: missing field"),
    ("reply", None, r"p2p\.hello reply: expected a map"),
])
def test_a_malformed_field_is_refused_naming_it(reader: str, meta: Any, field: str) -> None:
    with pytest.raises(ProtocolError, match=field):
        READERS[reader](meta)
