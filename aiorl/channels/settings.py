"""The channels' settings: how far clients and channel workers batch, pipeline, prefetch
and hold.

None of these is part of the wire format (`aiorl.protocol.channels`): each end reads a
message whatever the other's values are, so they can change without a protocol change.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CREDIT_WINDOW",
    "INLINE_MAX",
    "LENT_HOLD_MAX",
    "MAX_BATCH_BYTES",
    "MAX_BATCH_OPS",
    "MAX_INLINE_BYTES",
    "PREFETCH_IDLE",
    "PREFETCH_MAX",
    "SHARED_WINDOW",
]

#: Pickles up to this size travel inline in the message header instead of as a frame.
INLINE_MAX: Final = 32 * 1024
#: A batch is sent early once its inline bytes reach this (headers are capped at 1 MiB) ...
MAX_INLINE_BYTES: Final = 256 * 1024
#: ... or once it holds this many operations ...
MAX_BATCH_OPS: Final = 1024
#: ... or this many bytes in frames, so one message stays a reasonable size.
MAX_BATCH_BYTES: Final = 8 << 20

#: The most credits one client holds per queue (an unbounded queue grants this many;
#: a bounded one at most its free room). A producer runs at most this far ahead.
CREDIT_WINDOW: Final = 4096
#: The most items a streaming consumer prefetches per queue.
PREFETCH_MAX: Final = 256
#: Prefetched items a consumer has not asked for within this many seconds go back
#: to their queue, so an idle consumer does not hold items others are waiting for.
PREFETCH_IDLE: Final = 0.005
#: A queue counts as *shared* (prefetch refused) for this long after a second process took
#: from it: prefetching alternately would make each consumer wait for the other's items.
SHARED_WINDOW: Final = 1.0
#: The longest the channel worker holds another process's gets while one process holds
#: prefetched items of the queue (it answers in milliseconds unless its loop is stuck or it
#: died); after this, the gets are served and a late give-back may reach them out of order.
LENT_HOLD_MAX: Final = 2.0
