"""``working_dir``: a driver's packed working directory, offered to a node agent.

The driver sends `WorkingDirOffer` first without the archive: an agent that has the
digest in its cache answers ``cached=True`` and nothing more travels (a second job with the
same code sends a few bytes per node). Otherwise the driver sends the offer again with the
archive as its one frame; the agent checks it against the digest, unpacks it into its cache
and answers ``cached=True``. A `SpawnRequest`
then names the digest (``working_dir``), and the agent refuses one it does not hold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only (postponed)

from aiorl.protocol.fields import Fields

__all__ = ["MAX_ARCHIVE_BYTES", "WorkingDirOffer", "WorkingDirReply", "check_digest"]

#: The largest archive an agent accepts (the driver's own limit is usually far lower).
MAX_ARCHIVE_BYTES = 4 << 30

_DIGEST = re.compile(r"[0-9a-f]{64}")


def check_digest(value: str) -> str:
    """``value`` if it is a SHA-256 digest in lowercase hex (a cache entry's name); it becomes
    a path on the node, so nothing else may pass."""
    if not _DIGEST.fullmatch(value):
        raise ValueError(f"expected a SHA-256 digest (64 lowercase hex digits), got {value[:80]!r}")
    return value


@dataclass(frozen=True, slots=True)
class WorkingDirOffer:
    """``working_dir``: the driver offers the directory of digest ``digest`` (``size``
    bytes packed, ``unpacked`` bytes of files); with the archive as frame 0, or without it to
    ask whether the node has it already."""

    digest: str
    size: int
    unpacked: int

    def to_wire(self) -> dict[str, Any]:
        return {"digest": self.digest, "size": self.size, "unpacked": self.unpacked}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        f = Fields(meta, "working_dir")
        return cls(f.checked("digest", check_digest),
                   f.integer("size", lo=0, hi=MAX_ARCHIVE_BYTES),
                   f.integer("unpacked", lo=0, hi=MAX_ARCHIVE_BYTES))


@dataclass(frozen=True, slots=True)
class WorkingDirReply:
    """The answer to ``working_dir``: whether the node holds the directory now."""

    cached: bool

    def to_wire(self) -> dict[str, Any]:
        return {"cached": self.cached}

    @classmethod
    def from_wire(cls, meta: Any) -> Self:
        return cls(Fields(meta, "working_dir reply").flag("cached"))
