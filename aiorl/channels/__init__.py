"""Channels: named, distributed, weighted FIFO queues with batching and backpressure.

A channel is hosted by a channel worker (a one-rank worker group named
``channel.<name>``; a distributed channel has one rank per node and keeps each
key on one of them) and reached by name from the driver and from any worker::

    ch = Channel.create(cluster, "rollouts", maxsize=64)      # driver
    ch = self.create_channel("rollouts")                      # inside a worker
    ch = self.connect_channel("rollouts")                     # anywhere else

    await ch.put(trajectory, weight=len(trajectory))
    batch = await ch.get_batch(4096)                         # weights sum to >= 4096

Items travel once from the producer's process to the channel worker and once from
there to the consumer's, over ZMQ, with tensors as zero-copy out-of-band frames.
See ``docs/channels.md`` for the semantics (ordering, backpressure, failure).
"""

from aiorl.channels.engine import channel_waits, held_channels
from aiorl.channels.handle import (
    Channel,
    ReplicaStatistics,
    connect_channel_from_worker,
    create_channel_from_worker,
)
from aiorl.channels.host import ChannelHost
from aiorl.channels.weighted_queue import QueuedItem, QueueStats

__all__ = [
    "Channel",
    "ChannelHost",
    "QueueStats",
    "QueuedItem",
    "ReplicaStatistics",
    "channel_waits",
    "connect_channel_from_worker",
    "create_channel_from_worker",
    "held_channels",
]
