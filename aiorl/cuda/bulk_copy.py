"""Many tensors copied, or allocated, as one: what a state dict of 1,000 tensors costs.

A trainer's state dict is hundreds to thousands of tensors. Handled one at a time, each
costs several Python-level torch calls and a kernel launch, microseconds apiece (docs/gpu.md
has the figures), so for 1,000 tensors more than a GPU's copy of 1 GB itself. So everything per tensor is done once per *layout* (the dtypes and shapes, and
where each tensor lies) and kept; per message or per version only a few calls remain:

* `copy_grouped` copies a list of pairs with one ``torch._foreach_copy_`` per dtype
  (`dtype_groups`, computed once per layout): one C++ call per dtype, not a Python call
  per tensor. Same semantics as ``copy_`` per pair.
* `FlatLayout` places many tensors in one block, grouped by dtype, and hands out typed
  views of a new block in a handful of calls (``unflatten_dense_tensors`` against
  templates on the ``meta`` device made once): one allocation and one ``record_stream``
  instead of one per tensor. The tensors then share their memory's lifetime (the block
  is freed when the last view is): right for a state dict, which lives and dies whole.

Importable without CUDA; both work on CPU tensors too (the unit tests run them there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["FLAT_ALIGN", "FLAT_MIN_TENSORS", "FlatLayout", "copy_grouped", "copy_many",
           "dtype_groups"]

#: Each dtype's run of tensors in a flat block starts at a multiple of this many bytes.
FLAT_ALIGN = 256
#: A receive allocates its tensors as one block from this many tensors up; fewer are
#: allocated one by one (each then lives as long as the user keeps it, alone).
FLAT_MIN_TENSORS = 16


def dtype_groups(dtypes: Sequence[Any]) -> list[list[int]]:
    """The indices of ``dtypes`` grouped by dtype, groups in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(i)
    return list(groups.values())


def copy_grouped(dsts: Sequence[Any], srcs: Sequence[Any], groups: Sequence[Sequence[int]],
                 non_blocking: bool = True) -> None:
    """``dsts[i].copy_(srcs[i])`` for every index of ``groups`` (`dtype_groups` of the
    destinations' dtypes), with one fused call per group: queued on the current stream,
    or, with ``non_blocking=False``, each copy between host and GPU finished on return."""
    import torch

    with torch.no_grad():
        for idx in groups:
            if len(idx) == 1:
                dsts[idx[0]].copy_(srcs[idx[0]], non_blocking=non_blocking)
            else:
                torch._foreach_copy_([dsts[i] for i in idx], [srcs[i] for i in idx],
                                     non_blocking=non_blocking)


def copy_many(dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
    """``dsts[i].copy_(srcs[i])`` for each pair, one fused call per dtype (the grouping is
    computed here: keep `dtype_groups` and call `copy_grouped` when the layout repeats)."""
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_many: {len(dsts)} destinations for {len(srcs)} sources")
    copy_grouped(dsts, srcs, dtype_groups([d.dtype for d in dsts]))


class FlatLayout:
    """Where each tensor of ``specs`` (dtype, shape) lies in one flat block: the tensors of
    one dtype end to end, each dtype's run starting at a multiple of `FLAT_ALIGN`."""

    def __init__(self, specs: Sequence[tuple[Any, Sequence[int]]]) -> None:
        import torch

        self.count = len(specs)
        self.groups = dtype_groups([dtype for dtype, _ in specs])
        # Per dtype: (dtype, byte offset, element count, indices, templates on "meta").
        self._runs: list[tuple[Any, int, int, list[int], list[Any]]] = []
        offset = 0
        for idx in self.groups:
            dtype = specs[idx[0]][0]
            templates = [torch.empty(tuple(specs[i][1]), dtype=dtype, device="meta") for i in idx]
            numel = sum(t.numel() for t in templates)
            self._runs.append((dtype, offset, numel, idx, templates))
            offset += -(-numel * dtype.itemsize // FLAT_ALIGN) * FLAT_ALIGN
        self.nbytes = max(offset, 1)

    def allocate(self, device: Any) -> tuple[Any, list[Any]]:
        """``(block, tensors)``: a new uint8 block on ``device`` (on the current stream)
        and a typed view of it per spec, in spec order. The caller marks ``block`` used by
        the streams that will read the tensors (``record_stream``), once for all."""
        import torch

        unflatten = torch._C._nn.unflatten_dense_tensors
        block = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        out: list[Any] = [None] * self.count
        for dtype, offset, numel, idx, templates in self._runs:
            run = block[offset : offset + numel * dtype.itemsize].view(dtype)
            for i, view in zip(idx, unflatten(run, templates), strict=True):
                out[i] = view
        return block, out
