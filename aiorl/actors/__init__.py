"""Workers, groups and the per-process runtime (the layer above the transport)."""

from aiorl.actors.async_work import AsyncChannelWork, AsyncCollWork, AsyncFuncWork, AsyncWork
from aiorl.actors.group import WorkerGroup, WorkerGroupBuilder
from aiorl.actors.worker import Worker

__all__ = [
    "AsyncChannelWork",
    "AsyncCollWork",
    "AsyncFuncWork",
    "AsyncWork",
    "Worker",
    "WorkerGroup",
    "WorkerGroupBuilder",
]
