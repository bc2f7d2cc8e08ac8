"""aiorl: an asyncio-native actor runtime for distributed RL and LLM post-training.

The layers, bottom to top (enforced by the import-linter contracts in pyproject.toml; a module
imports only from its own layer or lower ones, and ``a | b`` siblings never import each other):

    errors | names | util          the exception tree, worker names, plain helpers
    transport | placement | protocol   ZMQ wire and codec; placement planning; typed messages
    registry                        the registry service and its client
    runtime                         one event loop per process, AsyncWork, peers, sessions
    group | p2p                     worker groups (fan-out calls); point-to-point engine
    channels                        weighted FIFO queues hosted by channel workers
    actors                          Worker, the worker process, the polling lifecycle
    cluster | node                  the driver's Cluster; the node agent and zygote
    demo                            the CartPole demo
    cli                             the ``aiorl`` command
"""

import importlib
from typing import TYPE_CHECKING, Any

from aiorl.errors import (
    AddressError,
    AiorlError,
    AuthenticationError,
    ClusterClosedError,
    ConflictError,
    ConnectionLostError,
    GroupExistsError,
    GroupNotFoundError,
    NodeRankTakenError,
    NotFoundError,
    PeerLostError,
    PlacementError,
    ProtocolError,
    QueueEmpty,
    QueueFull,
    RegistryError,
    RegistryUnavailable,
    RemoteError,
    WaitTimeout,
    WorkerInitError,
    WorkerNotFoundError,
    WorkingDirError,
)
from aiorl.names import WorkerAddress, WorkerInfo
from aiorl.trace import mark, span

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from aiorl import placement as placement
    from aiorl import weights as weights
    from aiorl.actors import (
        AsyncChannelWork,
        AsyncCollWork,
        AsyncFuncWork,
        AsyncWork,
        Worker,
        WorkerGroup,
    )
    from aiorl.actors.mapping import MappingThread
    from aiorl.actors.polling import PollingWorker, PollResult
    from aiorl.channels import Channel
    from aiorl.cluster import Cluster
    from aiorl.group.group_events import EventKind, GroupEvent
    from aiorl.group.per_rank import PerRank
    from aiorl.runtime.working_dir import WorkingDir

# The runtime's names are imported on first use (PEP 562), not with the package: the registry
# and node agent processes import ``aiorl.registry``/``aiorl.node``, which runs this file, and
# must not pay for torch and the whole actor stack at start-up (~0.3 s each, measured).
_LAZY = {
    "placement": ("aiorl.placement", None),
    "weights": ("aiorl.weights", None),
    "AsyncChannelWork": ("aiorl.actors", "AsyncChannelWork"),
    "AsyncCollWork": ("aiorl.actors", "AsyncCollWork"),
    "AsyncFuncWork": ("aiorl.actors", "AsyncFuncWork"),
    "AsyncWork": ("aiorl.actors", "AsyncWork"),
    "Worker": ("aiorl.actors", "Worker"),
    "WorkerGroup": ("aiorl.actors", "WorkerGroup"),
    "MappingThread": ("aiorl.actors.mapping", "MappingThread"),
    "PollingWorker": ("aiorl.actors.polling", "PollingWorker"),
    "PollResult": ("aiorl.actors.polling", "PollResult"),
    "Channel": ("aiorl.channels", "Channel"),
    "Cluster": ("aiorl.cluster", "Cluster"),
    "EventKind": ("aiorl.group.group_events", "EventKind"),
    "GroupEvent": ("aiorl.group.group_events", "GroupEvent"),
    "PerRank": ("aiorl.group.per_rank", "PerRank"),
    "WorkingDir": ("aiorl.runtime.working_dir", "WorkingDir"),
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'aiorl' has no attribute {name!r}")
    from aiorl.util.threads import blocked

    # SIGINT and SIGTERM blocked: a thread pool started by this import (numpy's OpenBLAS, via
    # the weights modules) never takes them from the main thread (aiorl.util.threads).
    with blocked():
        module = importlib.import_module(target[0])
    value = module if target[1] is None else getattr(module, target[1])
    globals()[name] = value  # once resolved, a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__version__ = "0.1.0"

__all__ = [
    "AddressError",
    "AiorlError",
    "AsyncChannelWork",
    "AsyncCollWork",
    "AsyncFuncWork",
    "AsyncWork",
    "AuthenticationError",
    "Channel",
    "Cluster",
    "ClusterClosedError",
    "ConflictError",
    "ConnectionLostError",
    "EventKind",
    "GroupEvent",
    "GroupExistsError",
    "GroupNotFoundError",
    "MappingThread",
    "NodeRankTakenError",
    "NotFoundError",
    "PeerLostError",
    "PerRank",
    "PlacementError",
    "PollResult",
    "PollingWorker",
    "ProtocolError",
    "QueueEmpty",
    "QueueFull",
    "RegistryError",
    "RegistryUnavailable",
    "RemoteError",
    "WaitTimeout",
    "Worker",
    "WorkerAddress",
    "WorkerGroup",
    "WorkerInfo",
    "WorkerInitError",
    "WorkerNotFoundError",
    "WorkingDir",
    "WorkingDirError",
    "mark",
    "span",
]
