"""The broadcast engine's tuning: sizes and waits that both ends need not agree on.

They shape how a broadcast moves, not what its messages mean (those are
`aiorl.protocol.broadcast`): a receiver reassembles whatever chunking the source chose.
"""

from __future__ import annotations

from typing import Final

__all__ = ["CHUNK", "RESOLVE_RETRY_S"]

#: Bulk bytes travel as frames of at most this size when they go through ZMQ.
CHUNK: Final = 1 << 20
#: How long one registry lookup of a member waits before it is retried (it waits for ever).
RESOLVE_RETRY_S: Final = 30.0
