"""The actor model: the ``Worker`` base class, the worker process that hosts one, and the
polling-worker lifecycle. ``WorkerGroup`` and ``AsyncWork`` live in lower layers
(``aiorl.group``, ``aiorl.runtime``) and are re-exported here for the actor-facing API.

Layer: above ``channels`` (a worker can create channels); below ``cluster`` and ``node``.
"""

from aiorl.actors.worker import Worker
from aiorl.group import WorkerGroup, WorkerGroupBuilder
from aiorl.runtime import AsyncChannelWork, AsyncCollWork, AsyncFuncWork, AsyncWork

__all__ = [
    "AsyncChannelWork",
    "AsyncCollWork",
    "AsyncFuncWork",
    "AsyncWork",
    "Worker",
    "WorkerGroup",
    "WorkerGroupBuilder",
]
