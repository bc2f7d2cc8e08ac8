"""Settings read from environment variables."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["count_setting"]


def count_setting(environ: Mapping[str, str], name: str, default: int, unit: str) -> int:
    """The non-negative integer in ``environ[name]``, else ``default`` (unset or blank).

    Raises ValueError naming the variable for anything else: a typo in a tuning knob
    must not silently change what the process does. ``unit`` names what is counted in
    that message (``"a byte count"``, ``"a number of peers"``).
    """
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be {unit}, got {text!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value
