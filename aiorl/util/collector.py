"""The garbage collector's settings in aiorl's processes: the driver and every worker.

Two settings, measured with 1,000 no-op calls in flight (README, "Performance"):

* ``gc.freeze()``: what exists when the process is set up (its imports: torch alone is
  ~200k objects) leaves the collector's sight, so a full collection no longer walks it.
* A young-generation threshold of `YOUNG_THRESHOLD` allocations instead of 700:
  each call in flight keeps a few small objects alive until its answer (a work, its
  result list, the request's callback), so with the default every 700 of them started a
  collection that walked all the calls still pending, then promoted them to older
  generations that were walked again: 0.86-1.16 µs of the driver's CPU per call and
  ~0.6 µs of a worker's went to collections. With the higher threshold most of those
  objects are freed by reference counting before any collection sees them. What it costs:
  cyclic garbage waits longer (at most that many allocations) before it is freed, and a
  young collection walks more objects when it runs (well under a millisecond).

Objects are still freed by reference counting in both cases; only a reference cycle among
frozen objects that is dropped later is never collected.
"""

from __future__ import annotations

import gc
import os

__all__ = ["ENV_GC_TUNING", "YOUNG_THRESHOLD", "tune_collector"]

#: Set to ``0`` to keep the garbage collector as Python sets it, in the driver and in the
#: workers it starts (the name is older than the threshold: it first froze the heap only).
ENV_GC_TUNING = "AIORL_GC_FREEZE"
#: Allocations (net of frees) between two young collections; Python's default is 700.
YOUNG_THRESHOLD = 10_000


def tune_collector(*, collect_first: bool) -> bool:
    """Freeze what the process holds now and raise the young generation's threshold, unless
    ``AIORL_GC_FREEZE=0``; returns whether it did.

    ``collect_first``: run a full collection before freezing, so what is garbage already
    is freed now, not frozen for ever (a forked worker skips it: its heap is the zygote's,
    collected and frozen before the fork, and a collection would copy its pages).
    """
    if os.environ.get(ENV_GC_TUNING, "1") == "0":
        return False
    if collect_first:
        gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
    return True
