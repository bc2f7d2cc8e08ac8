"""A large lane message's own memory (aiorl/transport/large_message.py): bounded by what
arrived whatever its head announces, never past its end, and handed out in place."""

from __future__ import annotations

import os
import struct

import pytest
import torch

from aiorl.transport import large_message
from aiorl.transport.lane_queue import COPY_BELOW
from aiorl.transport.large_message import GROWTH, LargeMessage
from aiorl.transport.serialization import tensor_from_buffer

pytestmark = pytest.mark.timeout(30)


def _framed(*frames: bytes) -> bytes:
    return struct.pack(f"<I{len(frames)}Q", len(frames), *map(len, frames)) + b"".join(frames)


def _read(message: LargeMessage, data: bytes, chunk: int) -> None:
    """Feed ``data`` as reads of at most ``chunk`` bytes, as the lane does."""
    pos = 0
    while pos < len(data):
        room = message.room()
        n = min(chunk, len(room), len(data) - pos)
        room[:n] = data[pos:pos + n]
        message.have += n
        pos += n


def test_memory_grows_with_what_arrived_not_with_what_the_head_announces() -> None:
    announced = 1 << 40
    message = LargeMessage([announced - 12], announced, memoryview(b"\0" * 16_384))
    assert message.capacity <= GROWTH * 16_384 + 256 * 1024
    _read(message, b"\0" * 3_000_000, 200_000)
    assert message.have == 16_384 + 3_000_000
    assert message.capacity <= GROWTH * message.have + 256 * 1024
    assert not message.complete


def test_a_message_is_whole_in_order_and_its_large_frames_are_writable_views() -> None:
    small, large = b"head", os.urandom(3 * large_message.LARGE_MESSAGE + 7)
    data = _framed(small, large, b"x" * COPY_BELOW)
    message = LargeMessage([len(small), len(large), COPY_BELOW], len(data),
                           memoryview(data[:100]))
    _read(message, data[100:], 65_536)
    assert message.complete and message.capacity == len(data)  # never more than the message
    frames = message.frames()
    assert [bytes(f) for f in frames] == [small, large, b"x" * COPY_BELOW]
    assert type(frames[0]) is bytes  # small: copied out
    view = frames[1]
    assert isinstance(view, memoryview) and not view.readonly
    t = tensor_from_buffer(torch.uint8, (len(large),), view)
    view[0] ^= 0xFF  # the tensor is the message's memory: no copy was made
    assert int(t[0]) == large[0] ^ 0xFF
