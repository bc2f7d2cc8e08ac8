"""The per-process runtime: the event loop and its thread, the endpoint and registry client,
peers, and ``AsyncWork``, the awaitable every remote operation returns.

Layer: above ``registry``; below ``cuda``, ``group``, ``p2p`` and everything built on them.
"""

from aiorl.runtime.runtime import Runtime, current_runtime, describe_death, set_current_runtime
from aiorl.runtime.session import Session, WorkerSession, spec_from_nodes
from aiorl.runtime.work import AsyncChannelWork, AsyncCollWork, AsyncFuncWork, AsyncWork

__all__ = [
    "AsyncChannelWork",
    "AsyncCollWork",
    "AsyncFuncWork",
    "AsyncWork",
    "Runtime",
    "Session",
    "WorkerSession",
    "current_runtime",
    "describe_death",
    "set_current_runtime",
    "spec_from_nodes",
]
