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

from aiorl import placement as placement  # the submodule, as aiorl.placement
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
from aiorl.errors import (
    AiorlError,
    AuthenticationError,
    ConflictError,
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
)
from aiorl.names import WorkerAddress, WorkerInfo

__version__ = "0.1.0"

__all__ = [
    "AiorlError",
    "AsyncChannelWork",
    "AsyncCollWork",
    "AsyncFuncWork",
    "AsyncWork",
    "AuthenticationError",
    "Channel",
    "Cluster",
    "ConflictError",
    "GroupExistsError",
    "GroupNotFoundError",
    "MappingThread",
    "NodeRankTakenError",
    "NotFoundError",
    "PeerLostError",
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
]
