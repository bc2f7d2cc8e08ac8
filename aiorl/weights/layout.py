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
state dict against it. A `TensorPlan` is what a publish or a pull does per tensor besides
copying it, done once per layout: a model of 1,000 tensors would otherwise spend more time
checking and slicing than copying.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from aiorl.cuda.bulk_copy import dtype_groups
from aiorl.cuda.tensors import typed_view
from aiorl.p2p.message import dtype_of
from aiorl.protocol.weights import Layout, TensorSpec
from aiorl.transport.shared_memory import align

__all__ = ["DEFAULT_BUCKET_BYTES", "TensorPlan", "check_into", "check_layout", "check_types",
           "layout_of", "plan_of"]

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


def check_types(state_dict: Mapping[str, Any]) -> None:
    """Raise TypeError unless ``state_dict`` is a mapping of names to tensors."""
    _tensors(state_dict)


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


class TensorPlan:
    """A layout's tensors as torch objects, resolved once: a state dict is checked against
    it with one comparison per tensor, and copied into or out of a slot with one fused
    copy per dtype (`aiorl.cuda.bulk_copy.copy_grouped`) between the state dict's tensors
    and typed views of the slot made once per slot (`places`): host slots here, GPU
    slots in `aiorl.weights.cuda`."""

    def __init__(self, layout: Layout) -> None:
        import torch

        self.layout = layout
        self._names = [spec.name for spec in layout.tensors]
        self._expected = [(dtype_of(spec.dtype), torch.Size(spec.shape))
                          for spec in layout.tensors]
        #: The indices of the tensors that have bytes (an empty tensor copies nothing) ...
        self._copied = [i for i, spec in enumerate(layout.tensors) if spec.nbytes]
        #: ... and their names, in slot order (what a GPU slot copies: `aiorl.weights.cuda`).
        self.copied_names = [self._names[i] for i in self._copied]
        #: `dtype_groups` of the copied tensors, for `copy_grouped`.
        self.groups = dtype_groups([layout.tensors[i].dtype for i in self._copied])

    def sources(self, state_dict: Mapping[str, Any]) -> list[Any]:
        """The tensors of ``state_dict`` to copy, in slot order; the `check_layout` error
        unless it has exactly the layout's names, dtypes and shapes."""
        found = self._take(state_dict, exact=True)
        if found is None:
            check_layout(self.layout, state_dict)
            raise ValueError("the state dict does not match its publisher's layout")
        return found

    def destinations(self, into: Mapping[str, Any]) -> list[Any]:
        """The tensors of ``into`` to copy into, in slot order; a `KeyError` or `ValueError`
        naming the tensor unless it has every tensor of the layout with its dtype and shape
        (more tensors are allowed)."""
        found = self._take(into, exact=False)
        if found is None:
            check_into(self.layout, into)
            raise ValueError("into does not match the published layout")
        return found

    def _take(self, tensors: Mapping[str, Any], exact: bool) -> list[Any] | None:
        try:
            found = [tensors[name] for name in self._names]
            if exact and len(tensors) != len(found):
                return None
            for t, (dtype, shape) in zip(found, self._expected, strict=True):
                if t.dtype is not dtype or t.shape != shape:
                    return None
        except (KeyError, AttributeError, TypeError):
            return None
        return [found[i] for i in self._copied]

    def places(self, slot: Any) -> list[Any]:
        """Each copied tensor's place in ``slot`` (a flat uint8 tensor of the slot's bytes) as
        a tensor of its dtype and shape, in the order of `sources`."""
        out = []
        for i in self._copied:
            spec = self.layout.tensors[i]
            out.append(typed_view(slot, spec.offset, spec.nbytes, self._expected[i][0],
                                  spec.shape))
        return out

    def host_places(self, owner: Any, slot: int, host_slot: Any) -> list[Any]:
        """`places` in ``host_slot``, the uint8 array of slot ``slot`` of ``owner`` (a
        `aiorl.weights.segment.VersionedSegment` or ``SegmentReader``), made once and kept
        in the owner's ``kept``: they live as long as its mapping, and no longer."""
        places: list[Any] | None = owner.kept.get((self, slot))
        if places is None:
            import torch

            if any(plan is not self for plan, _ in owner.kept):
                owner.kept.clear()  # another layout's views: it is not read any more
            with warnings.catch_warnings():  # a reader's mapping is read-only: only read
                warnings.simplefilter("ignore", UserWarning)
                base = torch.from_numpy(host_slot)
            places = owner.kept[(self, slot)] = self.places(base)
        return places


#: Plans of recent layouts, by the layout's id (each holds its layout, so the id is not reused
#: while kept). A subscriber reads the same `Layout` object for the same content
#: (`aiorl.protocol.weights.Layout.read`), so one plan serves every pull.
_plans: dict[int, TensorPlan] = {}
_PLANS_KEPT = 16


def plan_of(layout: Layout) -> TensorPlan:
    """The `TensorPlan` of ``layout``, made once per layout object."""
    plan = _plans.get(id(layout))
    if plan is None or plan.layout is not layout:
        if len(_plans) >= _PLANS_KEPT:
            del _plans[next(iter(_plans))]
        plan = _plans[id(layout)] = TensorPlan(layout)
    return plan


def check_into(layout: Layout, into: Mapping[str, Any]) -> None:
    """Raise unless ``into`` has every tensor of ``layout``, with the same dtype and shape."""
    missing = [spec.name for spec in layout.tensors if spec.name not in into]
    if missing:
        raise KeyError(f"into has no tensor for published {missing[:5]}")
    for spec in layout.tensors:
        t = into[spec.name]
        dtype = str(getattr(t, "dtype", "")).removeprefix("torch.")
        if dtype != spec.dtype or tuple(getattr(t, "shape", ())) != spec.shape:
            raise ValueError(f"into[{spec.name!r}] is {dtype}{list(getattr(t, 'shape', []))}; "
                             f"the published tensor is {spec.dtype}{list(spec.shape)}")
