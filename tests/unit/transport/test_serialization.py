"""The tensor codec of `aiorl.transport.serialization`: every dtype and shape back as sent,
from every kind of frame a receiver holds (the pickle's own bytes, read-only frames,
writable frames at any offset), without a copy where the frame may be written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiorl.transport import serialization

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
          *([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])]
SHAPES = [(), (0, 3), (3, 4), (70_000,)]  # the last one out of band (>= 64 KiB for any dtype)


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    values = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) % 100 - 7
    if dtype.is_complex:
        return torch.complex(values, -values).to(dtype)
    return values.to(dtype)


def as_received(frames: list, kind: str) -> list:
    """The frames as a receiver holds them: ``bytes`` (ZMQ), or writable memoryviews that
    start at an odd address inside a larger buffer (a lane's large message), or uint8
    arrays at an odd offset (a shared-memory segment's slices)."""
    if kind == "bytes":
        return [bytes(f) for f in frames]
    out = []
    for f in frames:
        raw = memoryview(f).cast("B")
        holder = bytearray(raw.nbytes + 3)
        holder[3:] = raw
        if kind == "array":
            out.append(np.frombuffer(holder, dtype=np.uint8)[3:])
        else:
            out.append(memoryview(holder)[3:])
    return out


@pytest.mark.parametrize("kind", ["bytes", "odd offset", "array"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_shape_comes_back_as_sent(dtype: torch.dtype, kind: str) -> None:
    sent = {f"t{i}": sample(dtype, shape) for i, shape in enumerate(SHAPES)}
    got = serialization.loads(as_received(serialization.dumps(sent), kind))
    for name, t in sent.items():
        back = got[name]
        assert back.dtype == t.dtype and back.shape == t.shape, name
        # Bit for bit (float8 has no equality of its own).
        assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_a_large_tensor_views_a_writable_frame_and_is_copied_from_a_read_only_one() -> None:
    t = torch.arange(70_000, dtype=torch.float32)
    frames = serialization.dumps(t)
    assert len(frames) == 2  # out of band
    for kind in ("odd offset", "array"):
        writable = as_received(frames, kind)
        got = serialization.loads(writable)
        start = np.frombuffer(writable[1], dtype=np.uint8).ctypes.data
        assert got.data_ptr() == start  # no copy: the tensor is the frame's memory
        got[0] = 5.0
        assert np.frombuffer(writable[1], dtype=np.float32)[0] == 5.0
    read_only = as_received(frames, "bytes")
    copied = serialization.loads(read_only)
    copied[0] = 5.0  # writable, and the frame is untouched
    assert np.frombuffer(read_only[1], dtype=np.float32)[0] == 0.0


def test_views_gradients_and_parameters_keep_what_they_mean() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j])
    grad = torch.ones(3, requires_grad=True)
    param = torch.nn.Parameter(torch.full((2, 2), 3.0))
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    sent = {"conj": z.conj(), "neg": torch.tensor([1.0, -2.0])._neg_view(), "grad": grad,
            "param": param, "frozen": frozen}
    got = serialization.loads(as_received(serialization.dumps(sent), "bytes"))
    assert torch.equal(got["conj"], z.conj().resolve_conj()) and not got["conj"].is_conj()
    assert torch.equal(got["neg"], torch.tensor([-1.0, 2.0]))
    assert got["grad"].requires_grad and torch.equal(got["grad"].detach(), grad.detach())
    assert isinstance(got["param"], torch.nn.Parameter) and got["param"].requires_grad
    assert isinstance(got["frozen"], torch.nn.Parameter) and not got["frozen"].requires_grad


def test_strict_encoding_refuses_a_strided_tensor_and_plain_encoding_keeps_its_strides() -> None:
    strided = torch.arange(12.0).reshape(3, 4).t()
    with pytest.raises(ValueError, match="non-contiguous"):
        serialization.encode({"w": strided}, strict=True)
    back = serialization.loads(serialization.dumps(strided))
    assert torch.equal(back, strided) and back.stride() == strided.stride()
