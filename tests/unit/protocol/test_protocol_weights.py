"""The weights directory's messages (aiorl.protocol.weights): every request and reply
survives its wire form, a malformed field is refused naming it, and every op has its
types and its directory method. In-process, no cluster."""

from __future__ import annotations

from typing import Any

import pytest

from aiorl.errors import ProtocolError
from aiorl.protocol.ops import DirectoryOp
from aiorl.protocol.weights import (
    SCHEMA,
    Ack,
    Announce,
    AnnounceGpu,
    AnnounceReply,
    CudaExport,
    FetchBucket,
    GpuSubscribe,
    HostNotice,
    HostPull,
    HostWanted,
    Layout,
    NodeView,
    Poll,
    PublisherRegistered,
    RegisterPublisher,
    RelayJob,
    RestoreRelay,
    SegmentRef,
    ShardSource,
    TensorSpec,
)

REF = SegmentRef(1234, 7, 8192, 4096)
LAYOUT = Layout((TensorSpec("w", "float32", (2, 3), 0, 24), TensorSpec("b", "bfloat16", (), 64, 2)),
                66, ((0, 24), (64, 66)))
EXPORT = CudaExport("GPU-a", ((print, (1, b"handle")),))
SOURCE = ShardSource(0, "trainer:0", "tcp://10.0.0.1:5000", REF, {3: 0, 4: 1}, EXPORT, {4})

MESSAGES: list[Any] = [
    RegisterPublisher(SOURCE, 2, "node-0", LAYOUT),
    PublisherRegistered(None), PublisherRegistered(7),
    Announce("trainer:0", 1, 5, 1), Announce("rollout:2", 0, 5, 0, REF, "node-1"),
    AnnounceReply(), AnnounceReply(HostWanted(True, "abc", 3)),
    HostPull("rollout:0", "node-0"),
    RestoreRelay("rollout:1", "node-1", 0, REF, {5: 1}, SegmentRef(99, 3, 8192, 4096)),
    GpuSubscribe("rollout:0", "node-0", "GPU-b"),
    AnnounceGpu("rollout:0", "node-0", "GPU-b", 0, 9, 1, REF, EXPORT),
    Poll("rollout:0", "node-0", -1, 10.0, "abc"),
    NodeView(None, (), (), (), None, 0, "abc"),
    NodeView(4, (SOURCE,), (LAYOUT,), (RelayJob(0, 4, SOURCE),), "shard 1: gone", 12, "abc",
             (None, SOURCE), (SOURCE,)),
    HostNotice("policy", 0, HostWanted(False, "abc", 9)),
    FetchBucket("policy", 0, 4, 0, 1 << 20),
    Ack(),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_its_wire_form(message: Any) -> None:
    assert type(message).from_wire(message.to_wire()) == message


@pytest.mark.parametrize("message, key, value, field", [
    (Announce("trainer:0", 1, 5, 1), "slot", 2, "announce.slot"),
    (Announce("trainer:0", 1, 5, 1), "worker", "trainer", "announce.worker"),
    (Poll("rollout:0", "node-0", -1, 10.0), "wait_s", "soon", "poll.wait_s"),
    (RegisterPublisher(SOURCE, 2, "node-0", LAYOUT), "num_shards", 0,
     "register_publisher.num_shards"),
    (FetchBucket("policy", 0, 4, 10, 20), "end", 5, "weights.fetch.end"),
])
def test_a_malformed_field_is_refused_naming_it(message: Any, key: str, value: Any,
                                                field: str) -> None:
    meta = message.to_wire()
    meta[key] = value
    with pytest.raises(ProtocolError, match=field.replace(".", r"\.")):
        type(message).from_wire(meta)


def test_a_layout_bucket_beyond_the_slot_is_refused() -> None:
    meta = LAYOUT.to_wire()
    meta["buckets"] = [[0, 100]]
    with pytest.raises(ProtocolError, match="buckets"):
        Layout.from_wire(meta)


def test_every_directory_op_has_its_types_and_its_directory_method() -> None:
    from aiorl.weights.directory import WeightDirectory

    assert set(SCHEMA) == set(DirectoryOp)
    for op, (request, _reply) in SCHEMA.items():
        assert request.op == op
        assert callable(getattr(WeightDirectory, op.value))
