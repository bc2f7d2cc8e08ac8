"""aiorl: an asyncio-native actor runtime for distributed RL and LLM post-training."""

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
    PeerLostError,
    PlacementError,
    ProtocolError,
    QueueEmpty,
    QueueFull,
    RegistryUnavailable,
    RemoteError,
    WorkerInitError,
)
from aiorl.names import WorkerAddress, WorkerInfo

__version__ = "0.1.0"

__all__ = [
    "AiorlError",
    "AsyncChannelWork",
    "AsyncCollWork",
    "AsyncFuncWork",
    "AsyncWork",
    "Cluster",
    "MappingThread",
    "PollResult",
    "PollingWorker",
    "Worker",
    "WorkerGroup",
    "AuthenticationError",
    "Channel",
    "PeerLostError",
    "PlacementError",
    "ProtocolError",
    "QueueEmpty",
    "QueueFull",
    "RegistryUnavailable",
    "RemoteError",
    "WorkerAddress",
    "WorkerInfo",
    "WorkerInitError",
]
