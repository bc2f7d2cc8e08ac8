"""torch's modules seen as ``Any``, for the CUDA calls its stubs do not describe."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["untyped"]


def untyped(module: str) -> Any:
    """A torch module as ``Any``: torch's stubs leave ``Event``, ``Stream``, ``TCPStore``
    and the IPC reductions untyped or unexported."""
    return importlib.import_module(module)
