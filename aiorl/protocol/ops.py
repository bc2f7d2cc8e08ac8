"""Every operation name and worker state that crosses a socket, as ``str`` enums.

The values are the wire strings (unchanged from the untyped protocol), so an
enum member can be sent as is and a received string is converted with
``RegistryOp(s)``. Code outside `aiorl.protocol` and `aiorl.registry`
names operations only through these enums: a typo becomes an AttributeError
at import, not a request the peer does not understand.
"""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10: the same behaviour for our use (value as str, str() gives the value)

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)

__all__ = ["AgentOp", "BroadcastOp", "ChannelOp", "DirectoryOp", "DriverOp", "P2POp",
           "RegistryEvent", "RegistryOp", "WeightsOp", "WorkerOp", "WorkerState"]


class RegistryOp(StrEnum):
    """Requests served by the registry (see `aiorl.protocol.registry.SCHEMA`)."""

    REGISTER_NODE = "register_node"
    UNREGISTER_NODE = "unregister_node"
    REGISTER_DRIVER = "register_driver"
    UNREGISTER_DRIVER = "unregister_driver"
    HEARTBEAT = "heartbeat"
    CREATE_GROUP = "create_group"
    CLOSE_GROUP = "close_group"
    WORKER_STATE = "worker_state"
    WORKER_EXITED = "worker_exited"
    LOOKUP = "lookup"
    LOOKUP_GROUP = "lookup_group"
    WATCH = "watch"
    UNWATCH = "unwatch"
    NODES = "nodes"
    STATUS = "status"
    PING = "ping"


class RegistryEvent(StrEnum):
    """Events the registry pushes to watchers."""

    WORKER = "worker"
    NODES = "nodes"


class AgentOp(StrEnum):
    """Requests and one-way messages served by a node agent."""

    SPAWN = "spawn"
    KILL_GROUP = "kill_group"
    KILL_WORKERS = "kill_workers"
    FREE_PORT = "free_port"
    #: Answered with the agent's status: its workers by state, what its relay dropped.
    PING = "ping"
    WORKER_READY = "worker_ready"
    #: A group call to this node's ranks, answered once for all of them (protocol/call_relay.py).
    RELAY_CALL = "relay_call"
    #: One-way: a p2p message to forward toward a worker of some node (protocol/p2p_relay.py).
    RELAY_P2P = "relay_p2p"
    #: A driver's packed working directory for this node's cache (protocol/working_dir.py).
    WORKING_DIR = "working_dir"


class WorkerOp(StrEnum):
    """Messages served by a worker process's control plane."""

    CALL = "call"
    REGISTRY_RESTARTED = "registry_restarted"
    #: ``aiorl doctor`` / ``aiorl trace``: a snapshot, a trace pull, tracing on or off
    #: (aiorl/actors/inspection.py); served by workers and by drivers.
    INSPECT = "inspect"


class DriverOp(StrEnum):
    """One-way messages a driver receives from node agents."""

    WORKER_OUTPUT = "worker_output"


class WorkerState(StrEnum):
    """A worker's state in the registry, in the order a healthy worker passes through them."""

    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    DEAD = "dead"

    @property
    def is_final(self) -> bool:
        """Dead and failed workers never come back (a new process gets a new pid)."""
        return self in (WorkerState.FAILED, WorkerState.DEAD)


class DirectoryOp(StrEnum):
    """Requests a weight name's directory serves, each the name of its method (their
    messages: `aiorl.protocol.weights.SCHEMA`)."""

    REGISTER_PUBLISHER = "register_publisher"
    ANNOUNCE = "announce"
    HOST_PULL = "host_pull"
    RESTORE_RELAY = "restore_relay"
    GPU_SUBSCRIBE = "gpu_subscribe"
    ANNOUNCE_GPU = "announce_gpu"
    POLL = "poll"


class WeightsOp(StrEnum):
    """Messages weights processes send each other, served by every process's weights service."""

    #: A relay's request for one bucket of one version of a shard
    #: (`aiorl.protocol.weights.FetchBucket`).
    FETCH = "weights.fetch"
    #: Directory -> a GPU publisher, one-way: whether some subscriber reads the shard from
    #: host memory (`aiorl.protocol.weights.HostNotice`; docs/weights.md, "CUDA").
    HOST = "weights.host"
    #: A GPU representative asks a publisher to include it in its rounds.
    GPU_JOIN = "weights.gpu.join"
    #: Publisher -> member: take part in round n (version, members, rendezvous store).
    GPU_ROUND = "weights.gpu.round"
    #: Publisher -> member: round n ended, intact or not.
    GPU_END = "weights.gpu.end"


class BroadcastOp(StrEnum):
    """Messages members of a broadcast send each other, served by every worker process's
    broadcaster (``aiorl.collective``; their messages: `aiorl.protocol.broadcast`)."""

    #: Parent -> member, one-way: a broadcast's payload (`BroadcastData`).
    BCAST = "coll.bcast"
    #: Member -> source, one-way: the member called and holds the object (`BroadcastAck`).
    ACK = "coll.ack"
    #: Source -> members, one-way: the broadcast completes or fails everywhere (`BroadcastDone`).
    DONE = "coll.done"
    #: Reader -> segment owner, one-way: the reader's views are gone (`SegmentRelease`).
    RELEASE = "coll.release"
    #: Source -> member, request with no fields: which GPU do you use? (`GpuInfo`; CUDA
    #: payloads only.)
    GPU = "coll.gpu"
    #: Representative -> member on its GPU, one-way: CUDA IPC handles of its copy
    #: (`IpcHandles`).
    IPC = "coll.ipc"


class P2POp(StrEnum):
    """Messages the two ends of a point-to-point pair send each other, served by every
    process's p2p engine (``aiorl.p2p``; their messages: `aiorl.protocol.p2p`)."""

    #: Sender -> receiver, one-way: one message, its control and inline payload (`data_from_wire`).
    DATA = "p2p.data"
    #: Sender -> receiver, one-way: several small messages, in order (`batch_from_wire`).
    BATCH = "p2p.batch"
    #: Receiver -> sender, one-way: a shared segment is free again (`SegmentAck`).
    ACK = "p2p.ack"
    #: Sender -> receiver, one-way: forget a shared segment, the sender closed it (`SegmentDrop`).
    DROP = "p2p.drop"
    #: Sender -> receiver, request: can you map my segments, read my memory, which GPU do you
    #: use? (`Hello`, answered by `HelloReply`.)
    HELLO = "p2p.hello"
    #: Receiver -> sender, one-way: a pulled payload was read, or not; an NCCL handshake
    #: (`TransferDone`).
    DONE = "p2p.done"
    #: Sender -> receiver, one-way: an NCCL "go", a CUDA IPC share or event dropped
    #: (`cuda_control_from_wire`).
    CUDA = "p2p.cuda"
    #: Node agent -> receiver, one-way: a ``p2p.data``/``p2p.batch`` relayed for a sender beyond
    #: the direct-connection budget (`aiorl.protocol.p2p_relay.ViaP2P`).
    VIA = "p2p.via"
    #: Receiver -> sender, relayed: the bytes the receiver consumed, its grant
    #: (`aiorl.protocol.p2p_relay`).
    CREDIT = "p2p.credit"
    #: Receiver -> sender, one-way: receives took that many more of the sender's messages,
    #: the direct pair's window grant (`Taken`, ``aiorl.p2p.window``).
    TAKEN = "p2p.taken"
    #: Node agent -> sender, relayed: a message of the pair could not be handed to its
    #: receiver (no worker of that node serves the address); the pair fails with the reason.
    UNDELIVERED = "p2p.undelivered"


class ChannelOp(StrEnum):
    """The two messages of a channel (`aiorl.protocol.channels`)."""

    #: Client -> channel worker, one-way: a batch of requests.
    OPS = "chan.ops"
    #: Channel worker -> client, an event: a batch of answers.
    DONE = "chan.done"
