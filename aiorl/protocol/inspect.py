"""The answer to ``inspect`` (``aiorl doctor``, ``aiorl trace``, metrics): one msgpack frame.

An answer can be large (a trace pull carries up to 200,000 spans, a snapshot every thread's
stack), far beyond what a message header may hold (`MAX_HEADER_BYTES`,
whose limit guards every process against oversized control messages). So the answer travels
as the reply's payload frame, encoded with msgpack: data only, never unpickled.
"""

from __future__ import annotations

from typing import Any

import msgpack

from aiorl.errors import ProtocolError

__all__ = ["decode_answer", "encode_answer"]


def encode_answer(data: Any) -> list[bytes]:
    """The reply frames carrying ``data`` (msgpack values: dicts, lists, str, numbers)."""
    return [msgpack.packb(data, use_bin_type=True)]


def decode_answer(frames: list[Any]) -> Any:
    """``data`` back from `encode_answer`'s frames; [`ProtocolError`][aiorl.ProtocolError] if
    malformed."""
    if len(frames) != 1:
        raise ProtocolError(f"an inspect answer is one frame, got {len(frames)}")
    try:
        return msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable inspect answer: {exc}") from None
