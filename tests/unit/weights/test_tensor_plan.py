"""`TensorPlan`: a layout's checks and copies done once per layout, and the layouts a
subscriber reads kept by content (`Layout.read`)."""

from __future__ import annotations

import warnings

import msgpack
import numpy as np
import pytest
import torch

from aiorl.errors import ProtocolError
from aiorl.protocol.weights import Layout
from aiorl.weights.layout import TensorPlan, layout_of, plan_of
from aiorl.weights.publisher import write_tensors
from aiorl.weights.segment import SegmentReader, VersionedSegment
from aiorl.weights.subscriber import read_tensors

pytestmark = pytest.mark.timeout(60)


def model() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "half": torch.full((5,), 2.5, dtype=torch.bfloat16),
            "empty": torch.zeros(0),
            "steps": torch.tensor(7, dtype=torch.int64),
            "b": torch.arange(6, dtype=torch.float32)}


def test_sources_are_the_tensors_with_bytes_in_slot_order_and_mismatches_get_the_layouts_errors():
    sd = model()
    plan = TensorPlan(layout_of(sd, 1 << 20))
    assert [id(t) for t in plan.sources(sd)] == [id(sd[k]) for k in ("w", "half", "steps", "b")]
    with pytest.raises(ValueError, match=r"'w' changed from float32\[3, 4\] to float32\[12\]"):
        plan.sources({**sd, "w": torch.zeros(12)})
    with pytest.raises(ValueError, match="changed from bfloat16"):
        plan.sources({**sd, "half": torch.zeros(5)})
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        plan.sources({k: v for k, v in sd.items() if k != "b"})
    with pytest.raises(ValueError, match=r"new \['extra'\]"):
        plan.sources({**sd, "extra": torch.zeros(1)})
    with pytest.raises(TypeError, match="must map a str to a torch.Tensor"):
        plan.sources({**sd, "w": np.zeros((3, 4), dtype=np.float32)})


def test_destinations_may_hold_more_tensors_but_not_fewer_or_other_ones():
    sd = model()
    plan = TensorPlan(layout_of(sd, 1 << 20))
    into = {k: torch.empty_like(v) for k, v in sd.items()}
    assert len(plan.destinations({**into, "other": torch.zeros(3)})) == 4
    with pytest.raises(KeyError, match="no tensor for published"):
        plan.destinations({k: v for k, v in into.items() if k != "steps"})
    with pytest.raises(ValueError, match=r"into\['b'\] is float64\[6\]"):
        plan.destinations({**into, "b": torch.zeros(6, dtype=torch.float64)})


def test_a_version_goes_through_a_segment_and_back_with_views_made_once():
    """Strided and mixed-dtype tensors are written by the fused copies, read back from a
    read-only mapping in another object (as a subscriber maps it), equal bit for bit."""
    sd = model()
    sd["w"] = sd["w"].t().contiguous().t()  # strided: the copy follows the strides
    assert not sd["w"].is_contiguous()
    plan = plan_of(layout_of(sd, 1 << 20))
    segment = VersionedSegment(plan.layout.nbytes)
    try:
        places = plan.host_places(segment, 1, segment.slot(1))
        assert plan.host_places(segment, 1, segment.slot(1)) is places
        segment.begin_write(1, 3)
        write_tensors(plan.sources(sd), places, plan.groups)
        segment.end_write(1)
        reader = SegmentReader(segment.ref)
        into = {k: torch.full_like(v, -1) for k, v in sd.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a read-only mapping: no warning reaches users
            assert reader.read(1, 3, lambda host_slot: read_tensors(
                plan.host_places(reader, 1, host_slot), plan.destinations(into), plan.groups))
        for name, t in sd.items():
            assert torch.equal(into[name], t), name
        mapping = segment._mm
        assert mapping is not None
        del places  # the test's own reference: only the segment keeps them now
    finally:
        segment.close()
    assert mapping.closed  # the kept views went first: the mapping could close


def test_a_layout_read_twice_is_one_object_and_a_bad_one_is_still_refused():
    wire = msgpack.unpackb(msgpack.packb(layout_of(model(), 1 << 20).to_wire()))
    first = Layout.from_wire(wire)
    assert Layout.from_wire(msgpack.unpackb(msgpack.packb(wire))) is first
    assert plan_of(first) is plan_of(Layout.from_wire(wire))
    other = {**wire, "nbytes": wire["nbytes"] + 64}
    assert Layout.from_wire(other) is not first
    bad = {**wire, "tensors": [[*wire["tensors"][0][:3], -1, 4], *wire["tensors"][1:]]}
    for _ in range(2):  # a refused layout is not kept: refused again
        with pytest.raises(ProtocolError, match=r"layout.tensors\[0\]"):
            Layout.from_wire(bad)
    with pytest.raises(ProtocolError, match="layout"):  # msgpack cannot pack it: read as ever
        Layout.from_wire({**wire, "tensors": [{1, 2}]})
