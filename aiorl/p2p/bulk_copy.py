"""Many tensors copied, or allocated, as one: what a state dict of 1,000 tensors costs.

A trainer's state dict is hundreds to thousands of tensors. Copied one ``copy_`` at a
time, each costs a Python call and a kernel launch (5-15 us), which for 1,000 tensors is
more than the copy of 1 GB itself on an H100 (0.7 ms). So:

* `copy_many` copies pairs of equally sized contiguous tensors with
  ``torch._foreach_copy_``: one C++ call that launches a few fused kernels for the whole
  list. Each pair is reinterpreted as the widest integer type that divides its size and
  both addresses (8, 4, 2 or 1 bytes), so the list is grouped into at most four lists of
  one dtype each (the fused kernel needs one dtype per list), and every copy moves whole
  words: bytes, not values, are copied, whatever the tensors' dtypes.
* `allocate_flat` gives many received tensors one allocation, each at an aligned offset:
  one allocator call and one ``record_stream`` instead of one per tensor. The tensors
  then share their memory's lifetime (the block is freed when the last view is): right
  for a state dict, which lives and dies as a whole.

Importable without CUDA; both work on CPU tensors too (the unit tests run them there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["FLAT_ALIGN", "FLAT_MIN_TENSORS", "allocate_flat", "copy_many", "word_view"]

#: Each tensor of a flat allocation starts at a multiple of this many bytes (the widest
#: vector load a copy kernel uses is 16 bytes; 256 keeps every start cache-line aligned).
FLAT_ALIGN = 256
#: A receive allocates its tensors as one block from this many tensors up; fewer are
#: allocated one by one (each then lives as long as the user keeps it, alone).
FLAT_MIN_TENSORS = 16

_WORDS = (8, 4, 2, 1)


def _word_dtypes() -> dict[int, Any]:
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _word(nbytes: int, *tensors: Any) -> int:
    """The widest word (8, 4, 2, 1 bytes) dividing ``nbytes`` and each tensor's byte
    offset in its storage (``Tensor.view(dtype)`` requires the offset to divide)."""
    for w in _WORDS:
        if nbytes % w == 0 and all(
            (t.storage_offset() * t.element_size()) % w == 0 and t.data_ptr() % w == 0
            for t in tensors
        ):
            return w
    return 1


def word_view(t: Any, word: int) -> Any:
    """A contiguous tensor's bytes as a flat tensor of ``word``-byte integers (no copy)."""
    import torch

    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat if word == 1 else flat.view(_word_dtypes()[word])


def copy_many(dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
    """Copy ``srcs[i]`` into ``dsts[i]`` (same byte sizes, contiguous) on the current
    stream, in a few fused kernels instead of one launch per pair.

    Bytes are copied, so a pair's dtypes may differ (a typed tensor from a slot's bytes).
    A pair with a strided tensor is copied alone, by value (`_copy_strided`). Raises
    ValueError for a pair whose byte sizes differ.
    """
    import torch

    if len(dsts) != len(srcs):
        raise ValueError(f"copy_many: {len(dsts)} destinations for {len(srcs)} sources")
    groups: dict[int, tuple[list[Any], list[Any]]] = {}
    for dst, src in zip(dsts, srcs, strict=True):
        n = dst.numel() * dst.element_size()
        if n != src.numel() * src.element_size():
            raise ValueError(
                f"copy_many: a {n}-byte destination for a "
                f"{src.numel() * src.element_size()}-byte source"
            )
        if not n:
            continue
        if not (dst.is_contiguous() and src.is_contiguous()):
            _copy_strided(dst, src)
            continue
        w = _word(n, dst, src)
        d, s = groups.setdefault(w, ([], []))
        d.append(word_view(dst, w))
        s.append(word_view(src, w))
    with torch.no_grad():
        for d, s in groups.values():
            if len(d) == 1:
                d[0].copy_(s[0], non_blocking=True)
            else:
                torch._foreach_copy_(d, s, non_blocking=True)


def _copy_strided(dst: Any, src: Any) -> None:
    """Copy one pair of which one is not contiguous: by value when the dtypes and shapes
    match, else ``src``'s bytes read as ``dst``'s dtype and shape (``src`` contiguous)."""
    import torch

    with torch.no_grad():
        if dst.dtype == src.dtype and dst.shape == src.shape:
            dst.copy_(src, non_blocking=True)
        elif src.is_contiguous():
            dst.copy_(word_view(src, 1).view(dst.dtype).view(dst.shape), non_blocking=True)
        else:
            raise ValueError(
                f"copy_many: cannot copy a strided {src.dtype} tensor into a {dst.dtype} one"
            )


def flat_offsets(nbytes: Sequence[int], align: int = FLAT_ALIGN) -> tuple[list[int], int]:
    """Each size's offset in one block (aligned to ``align``), and the block's size."""
    offsets, end = [], 0
    for n in nbytes:
        offsets.append(end)
        end += -(-n // align) * align if n else 0
    return offsets, max(end, 1)


def allocate_flat(specs: Sequence[tuple[Any, Sequence[int]]], device: Any) -> tuple[Any, list[Any]]:
    """``(block, tensors)``: one uint8 block on ``device`` holding a tensor per spec
    (dtype, shape), each at an aligned offset; empty specs get their own empty tensor.

    Allocated on the caller's current stream (a lane's); the caller marks ``block`` used
    by the streams that will read it (``record_stream``), once for all of them.
    """
    import torch

    sizes = []
    for dtype, shape in specs:
        n = dtype.itemsize
        for d in shape:
            n *= int(d)
        sizes.append(n)
    offsets, total = flat_offsets(sizes)
    block = torch.empty(total, dtype=torch.uint8, device=device)
    out = []
    for (dtype, shape), offset, n in zip(specs, offsets, sizes, strict=True):
        if not n:
            out.append(torch.empty(tuple(shape), dtype=dtype, device=device))
            continue
        out.append(block[offset : offset + n].view(dtype).view(tuple(shape)))
    return block, out
