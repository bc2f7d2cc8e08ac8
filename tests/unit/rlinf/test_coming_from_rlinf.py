"""docs/coming-from-rlinf.md, ``rlinf.scheduler`` name by name: every name RLinf's scheduler
exports has a row, every row says same / different / absent, and what a row says of
``Worker``, ``WorkerGroup`` and ``Cluster`` members matches aiorl's classes."""

from __future__ import annotations

import re

import pytest

import aiorl
from tests._paths import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

PAGE = REPO_ROOT / "docs" / "coming-from-rlinf.md"

#: ``rlinf/scheduler/__init__.py``'s ``__all__`` (RLinf 3842a4a5; the same at 50adc21a).
RLINF_SCHEDULER_ALL = [
    "AcceleratorUtil", "AcceleratorType", "HardwareInfo", "FrankaHWInfo", "YAMHWInfo",
    "Turtle2HWInfo", "CollectiveGroupOptions", "Cluster", "ClusterConfig", "ComponentPlacement",
    "PlacementStrategy", "FlexiblePlacementStrategy", "NodePlacementStrategy",
    "PackedPlacementStrategy", "Worker", "WorkerAddress", "WorkerGroupFuncResult", "WorkerInfo",
    "Channel", "ChannelWorker", "WeightedItem",
]


def rows() -> list[tuple[str, str, str]]:
    text = PAGE.read_text()
    start = text.index("### `rlinf.scheduler`, name by name")
    table = text[start:text.index("\n### ", start + 1)]
    found = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            found.append((cells[0], cells[1], cells[2]))
    return found


def names_in(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_every_exported_name_has_a_row_with_a_verdict():
    table = rows()
    assert table
    assert {verdict for _, verdict, _ in table} <= {"same", "different", "absent"}
    first_cells = " ".join(name for name, _, _ in table)
    missing = [n for n in RLINF_SCHEDULER_ALL if f"`{n}`" not in first_cells
               and not re.search(rf"`{n}[,(`]", first_cells)]
    assert not missing, missing
    for name, verdict, why in table:
        assert verdict == "same" or why, f"{name}: a {verdict} row says how or why"


@pytest.mark.parametrize("owner", ["Worker", "WorkerGroup", "Cluster"])
def test_member_rows_match_aiorl(owner):
    cls = getattr(aiorl, owner)
    checked = 0
    for cell, verdict, _ in rows():
        for ref in names_in(cell):
            match = re.fullmatch(rf"{owner}\.(\w+)(\(.*\))?", ref.split("(")[0] + "")
            if not match:
                continue
            member = match.group(1)
            if member.startswith("_"):
                continue
            checked += 1
            if verdict == "same":
                assert hasattr(cls, member), f"{owner}.{member} is marked same but aiorl lacks it"
            elif verdict == "absent":
                assert not hasattr(cls, member), f"{owner}.{member} is marked absent but exists"
    assert checked
