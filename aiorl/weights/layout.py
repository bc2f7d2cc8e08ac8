"""Where each tensor of a published shard lives inside a version slot, and its buckets.

A shard's tensors are laid end to end (each at a 64-byte aligned offset) in one flat byte
range, the *slot*. The layout is fixed by the first publish of a publisher: every later
version has the same names, dtypes and shapes, which is what lets a subscriber copy
straight into its own tensors without any per-version metadata.

*Buckets* cut the slot into byte ranges of at most ``bucket_bytes`` (tensors are packed
whole into a bucket while they fit; a bigger tensor is split). A bucket is the unit that
crosses the network to another node's relay, so that bucket k+1 is on the wire while the
relay copies bucket k into its node's segment.

The layout itself (`aiorl.protocol.weights.Layout`) is plain data that travels to the
directory and to subscribers; this module computes it from a state dict and checks a
state dict against it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiorl.protocol.weights import Layout, TensorSpec
from aiorl.transport.shared_memory import align

__all__ = ["DEFAULT_BUCKET_BYTES", "check_layout", "layout_of", "tensor_bytes"]

#: Default bucket size: large enough that a bucket's per-request cost is negligible, small
#: enough that bucket k+1 is on the wire while a relay copies bucket k.
DEFAULT_BUCKET_BYTES = 256 << 20


def layout_of(state_dict: Mapping[str, Any], bucket_bytes: int) -> Layout:
    """The layout of ``state_dict`` (names in its iteration order)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    specs: list[TensorSpec] = []
    offset = 0
    for name, tensor in _tensors(state_dict):
        nbytes = tensor.numel() * tensor.element_size()
        specs.append(TensorSpec(name, _dtype_name(tensor), tuple(tensor.shape), offset, nbytes))
        offset = align(offset + nbytes)
    return Layout(tuple(specs), max(offset, 1), _buckets(specs, bucket_bytes))


def check_layout(layout: Layout, state_dict: Mapping[str, Any]) -> None:
    """Raise ValueError unless ``state_dict`` has exactly ``layout``'s tensors."""
    given = {name: t for name, t in _tensors(state_dict)}
    if set(given) != {s.name for s in layout.tensors}:
        missing = sorted({s.name for s in layout.tensors} - set(given))
        extra = sorted(set(given) - {s.name for s in layout.tensors})
        raise ValueError(
            "a publisher's tensors are fixed by its first publish; "
            f"missing {missing[:5]}, new {extra[:5]}")
    for spec in layout.tensors:
        t = given[spec.name]
        if _dtype_name(t) != spec.dtype or tuple(t.shape) != spec.shape:
            raise ValueError(
                f"tensor {spec.name!r} changed from {spec.dtype}{list(spec.shape)} to "
                f"{_dtype_name(t)}{list(t.shape)} since the first publish")


def _tensors(state_dict: Mapping[str, Any]) -> list[tuple[str, Any]]:
    import torch

    if not isinstance(state_dict, Mapping):
        raise TypeError(f"a state dict must be a mapping of names to tensors, "
                        f"got {type(state_dict).__name__}")
    out = []
    for name, tensor in state_dict.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} must map a str to a torch.Tensor, "
                            f"got {type(tensor).__name__}")
        out.append((name, tensor))
    return out


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _buckets(specs: list[TensorSpec], bucket_bytes: int) -> tuple[tuple[int, int], ...]:
    """Byte ranges of at most ``bucket_bytes``, cut at tensor boundaries where possible."""
    out: list[tuple[int, int]] = []
    start: int | None = None
    end = 0
    for spec in specs:
        if spec.nbytes == 0:
            continue
        first, last = spec.offset, spec.offset + spec.nbytes
        if start is not None and last - start > bucket_bytes:
            out.append((start, end))
            start = None
        if start is None:
            start = first
        while last - start > bucket_bytes:  # a tensor bigger than a bucket is split
            out.append((start, start + bucket_bytes))
            start += bucket_bytes
        end = last
    if start is not None:
        out.append((start, end))
    return tuple(out)


def tensor_bytes(tensor: Any) -> Any:
    """A flat uint8 numpy view of a contiguous CPU tensor's bytes (any dtype, bf16 included)."""
    import torch

    return tensor.detach().reshape(-1).view(torch.uint8).numpy()
