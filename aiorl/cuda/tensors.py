"""A tensor's bytes seen another way, and fresh tensors for a receive.

Importable without CUDA: torch is imported inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["allocate", "flat_u8", "reinterpret", "typed_view"]


def reinterpret(src: Any, like: Any) -> Any:
    """``src``'s bytes seen with ``like``'s dtype and shape (same byte count, both contiguous)."""
    if src.dtype == like.dtype:
        return src.reshape(like.shape)
    return flat_u8(src).view(like.dtype).reshape(like.shape)


def typed_view(flat: Any, offset: int, nbytes: int, dtype: Any, shape: Sequence[int]) -> Any:
    """``nbytes`` of the flat uint8 tensor ``flat`` from ``offset``, as a tensor of ``dtype``
    and ``shape`` (no copy)."""
    return flat[offset : offset + nbytes].view(dtype).view(tuple(shape))


def flat_u8(t: Any) -> Any:
    """A contiguous tensor's bytes as a flat uint8 tensor (transfers then only match bytes)."""
    import torch

    flat = t.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def allocate(specs: Sequence[tuple[Any, Sequence[int]]], device: int, stream: Any) -> list[Any]:
    """Fresh tensors for ``specs`` on ``device``, allocated on ``stream`` (a work thread's side
    stream: the block is not reused while that stream may still write it) and marked used
    by the device's default stream, where user code most likely reads them (so freeing one
    does not hand its memory to the next transfer while a kernel still reads it)."""
    import torch

    out = []
    with torch.cuda.device(device), torch.cuda.stream(stream):
        default = torch.cuda.default_stream(device)
        for dtype, shape in specs:
            t = torch.empty(shape, dtype=dtype, device=device)
            if t.numel():
                t.record_stream(default)
            out.append(t)
    return out
