"""Payload paths of the p2p engine, in order of preference (see `base`).

CPU bytes: CMA (a ``send_tensor`` pulled by the receiver), shared memory, then ZMQ
frames (always fits). CUDA tensors: small ones inline through pinned host memory
(any receiver), CUDA IPC (same physical GPU), then NCCL. A new
path is a module defining a `PathSpec` and one line below.
"""

from __future__ import annotations

from aiorl.p2p.paths import cma, cuda_host, cuda_ipc, frames, nccl, shm
from aiorl.p2p.paths.base import PathSpec

__all__ = ["CPU_PATHS", "CUDA_PATHS", "PATHS", "RELAYED_PATHS", "PathSpec"]

PATHS: tuple[PathSpec, ...] = (
    cma.PATH,
    shm.PATH,
    frames.PATH,
    cuda_host.PATH,
    cuda_ipc.PATH,
    nccl.PATH,
)

CPU_PATHS: tuple[PathSpec, ...] = tuple(p for p in PATHS if not p.cuda)
CUDA_PATHS: tuple[PathSpec, ...] = tuple(p for p in PATHS if p.cuda)

#: The paths of a Sender relayed through node agents (`aiorl.p2p.p2p_relay`): those that need no
#: set-up question and send nothing back to the sender (a relayed pair has no connection).
RELAYED_PATHS: tuple[PathSpec, ...] = (frames.PATH, cuda_host.PATH)
