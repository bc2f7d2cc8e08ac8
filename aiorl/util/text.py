"""Plain-text rendering shared by the command line and the demo's display."""

from __future__ import annotations

from typing import Any

__all__ = ["format_table"]


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """Render rows as an aligned plain-text table with a header rule."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join([line, rule, *body])
