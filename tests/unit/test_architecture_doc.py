"""docs/architecture.md draws the layers; pyproject.toml's import-linter contract is the order.

The drawing is for readers, the contract is what `make lint` enforces: this test keeps the two
the same list, so the page cannot drift from the code's real layering.
"""

from __future__ import annotations

import re

from tests._paths import REPO_ROOT


def _contract_layers() -> list[str]:
    text = (REPO_ROOT / "pyproject.toml").read_text()
    block = re.search(r'name = "aiorl layers".*?layers = \[(.*?)\]', text, re.S)
    assert block, "pyproject.toml has no 'aiorl layers' contract"
    return re.findall(r'"([^"]+)"', block.group(1))


def _drawn_layers() -> list[str]:
    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    drawing = re.search(r"## The layers\n\n```\n(.*?)```", text, re.S)
    assert drawing, "docs/architecture.md has no drawing under '## The layers'"
    names = []
    for line in drawing.group(1).splitlines():
        if line.startswith(" ") and line.strip() and not line.startswith("   "):
            names.append(re.split(r"\s{2,}", line.strip())[0])
    return names


def test_the_drawn_layers_are_the_contracts_layers_in_order() -> None:
    assert _drawn_layers() == _contract_layers()
