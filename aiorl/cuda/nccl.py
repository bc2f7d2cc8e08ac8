"""aiorl's NCCL communicators: created under settings that report failures instead of
killing the process, set up without blocking a thread, and aborted off the event loop.

Importable without CUDA: torch is imported inside the functions that need it.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from aiorl.cuda.untyped_torch import untyped
from aiorl.util.threads import RuntimeThread

__all__ = ["NCCL_SETTINGS", "abort_in_background", "new_nccl_group"]

log = logging.getLogger("aiorl.cuda")

#: What aiorl's NCCL communicators are created under (set only while one is created, so a
#: user's own process groups keep the user's settings):
#:
#: * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: a watchdog timeout or a remote error marks the
#:   work failed; it does not tear the process down (aiorl reports ``PeerLostError``).
#: * ``TORCH_NCCL_BLOCKING_WAIT=0``: ``Work.wait`` only orders streams (aiorl never blocks
#:   a thread on NCCL; it polls).
#: * ``TORCH_NCCL_ENABLE_MONITORING=0``: no heartbeat monitor that SIGABRTs a process whose
#:   watchdog is stuck behind a dead peer.
#: * ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``: no flight-recorder dump (and its wait) on a timeout.
NCCL_SETTINGS: Mapping[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}

_env_lock = threading.Lock()


def new_nccl_group(store: Any, rank: int, size: int, device: int, timeout_s: float) -> Any:
    """An NCCL process group (the backend object) for aiorl's own use.

    Created with `NCCL_SETTINGS` in force, connected eagerly (one communicator for
    all of the group's operations, point-to-point included) and, where this torch has it,
    with a non-blocking communicator configuration: its initialisation does not block a
    thread in NCCL, so `abort_in_background` can end a set-up whose peer died.
    """
    dist = untyped("torch.distributed")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    config = getattr(opts, "config", None)
    if config is not None and hasattr(config, "blocking"):
        config.blocking = 0
    with _env_lock:
        saved = {k: os.environ.get(k) for k in NCCL_SETTINGS}
        os.environ.update(NCCL_SETTINGS)
        try:
            torch = untyped("torch")
            torch.cuda.set_device(device)
            pg = dist.ProcessGroupNCCL(store, rank, size, opts)
            # Eager: one communicator for every operation of the group (point-to-point
            # included), set up now, in the background where non-blocking.
            pg.eager_connect_single_device(torch.device("cuda", device))
            return pg
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def abort_in_background(pg: Any, what: str, keep: object = None) -> None:
    """Abort NCCL group ``pg`` on a short-lived daemon thread: ``ncclCommAbort`` may take a
    while, and the event loop (or a work thread stuck behind the dead peer) must not wait for
    it. ``keep`` (buffers NCCL kernels may still touch) stays alive until the abort returned."""
    if pg is None:
        return

    def abort(_keep_alive: object) -> None:
        for name in ("abort", "shutdown"):
            fn = getattr(pg, name, None)
            if fn is not None:
                try:
                    fn()
                    return
                except Exception:  # noqa: BLE001 - best effort: the process may be exiting
                    log.debug("NCCL %s of %s failed", name, what, exc_info=True)

    RuntimeThread(
        target=abort, args=(keep,), name=f"aiorl-nccl-abort-{what}", daemon=True
    ).start()
