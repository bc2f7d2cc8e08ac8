"""`aiorl.transport.shared_memory.copy_into`: the bytes of any contiguous buffer into a
writable one of the same length (what the shared-memory, broadcast and recv_tensor paths
copy with)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiorl.transport.shared_memory import copy_into

pytestmark = pytest.mark.timeout(30)


def test_copies_bytes_whatever_the_formats() -> None:
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dst = np.zeros(64, dtype=np.uint8)
    copy_into(dst[8:56], src.numpy())  # a 2-D float array into a byte slice
    assert dst[:8].sum() == 0 and dst[56:].sum() == 0
    assert torch.equal(torch.from_numpy(dst[8:56].copy()).view(torch.float32).reshape(3, 4), src)
    into = bytearray(48)
    copy_into(memoryview(into), memoryview(dst)[8:56])  # memoryviews, a bytearray
    assert bytes(into) == dst[8:56].tobytes()
    flags = np.zeros(4, dtype=np.bool_)
    copy_into(flags, b"\x01\x00\x01\x00")  # read-only bytes into a bool array
    assert flags.tolist() == [True, False, True, False]


def test_refuses_a_length_mismatch_and_a_read_only_destination() -> None:
    with pytest.raises(ValueError, match="12 bytes into a buffer of 8"):
        copy_into(bytearray(8), bytes(12))
    with pytest.raises(TypeError):
        copy_into(b"12345678", bytes(8))
