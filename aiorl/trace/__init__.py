"""Tracing: spans of every remote operation, recorded per process, merged into one trace.

Bottom layer (imports nothing from aiorl): the runtime services record into
`aiorl.trace.recorder` behind its ``ON`` switch, and `aiorl.trace.chrome` turns the
buffers pulled from every process into one Chrome/Perfetto trace (docs/debugging.md).
"""

from aiorl.trace.recorder import (
    Span,
    disable,
    enable,
    enable_from_environment,
    mark,
    span,
)

__all__ = ["Span", "disable", "enable", "enable_from_environment", "enabled", "mark", "span"]


def enabled() -> bool:
    """Whether this process records spans now."""
    from aiorl.trace import recorder

    return recorder.ON
