"""Versioned weight publication (``aiorl.weights``): trainer ranks publish, rollout ranks pull.

``pub = self.weight_publisher("policy"); await pub.publish(model.state_dict(), version=step)``
on the trainer; ``sub = self.weight_subscriber("policy"); v = await sub.pull(into=sd)`` on
the rollouts. A pull copies one complete version (never a mix) straight out of shared
memory that the publisher wrote once per node; docs/weights.md has the design.
``host_directory(cluster, name)`` launches a weight name's directory from the driver, so
that it is restarted for the whole job (docs/failures.md).

Sits above ``collective`` and ``channels`` and below ``actors``.
"""

from __future__ import annotations

from typing import Any

from aiorl.names import WorkerInfo
from aiorl.runtime import Runtime
from aiorl.weights.layout import DEFAULT_BUCKET_BYTES
from aiorl.weights.publisher import WeightPublisher
from aiorl.weights.service import WeightsService, host_directory, weights_service
from aiorl.weights.subscriber import SubscriberStatistics, WeightSubscriber

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "SubscriberStatistics",
    "WeightPublisher",
    "WeightSubscriber",
    "host_directory",
    "weight_publications",
    "weight_publisher",
    "weight_subscriber",
    "weight_waits",
]


def weight_publisher(runtime: Runtime, info: WorkerInfo, name: str, *, shard: int = 0,
                     num_shards: int = 1,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> WeightPublisher:
    """``Worker.weight_publisher``: the publisher of shard ``shard`` of ``num_shards`` of the
    weights ``name`` in this worker (the same object on every call)."""
    service = weights_service(runtime, info)
    key = (WeightPublisher, name, shard)
    pub = service.handles.get(key)
    if pub is None:
        pub = service.handles[key] = WeightPublisher(service, name, shard, num_shards,
                                                     bucket_bytes)
    elif (pub.num_shards, pub.bucket_bytes) != (num_shards, bucket_bytes):
        raise ValueError(f"this worker already publishes shard {shard} of {name!r} with "
                         f"num_shards={pub.num_shards}, bucket_bytes={pub.bucket_bytes}")
    assert isinstance(pub, WeightPublisher)
    return pub


def weight_subscriber(runtime: Runtime, info: WorkerInfo, name: str) -> WeightSubscriber:
    """``Worker.weight_subscriber``: this worker's subscriber of the weights ``name`` (the
    same object on every call)."""
    service = weights_service(runtime, info)
    key = (WeightSubscriber, name)
    sub = service.handles.get(key)
    if sub is None:
        sub = service.handles[key] = WeightSubscriber(service, name)
    assert isinstance(sub, WeightSubscriber)
    return sub


def weight_waits(runtime: Runtime) -> list[dict[str, Any]]:
    """Every weights wait of ``runtime``'s process under way (`WeightSubscriber.waits`: a
    ``wait_for`` or a pull with no version yet), for ``aiorl doctor``; none where the process
    never subscribed (runtime loop only)."""
    service = runtime.services.get(WeightsService)
    if not isinstance(service, WeightsService):
        return []
    return [w for h in list(service.handles.values()) if isinstance(h, WeightSubscriber)
            for w in h.waits()]


def weight_publications(runtime: Runtime) -> list[dict[str, Any]]:
    """The weight shards ``runtime``'s process publishes: ``{"name", "shard", "num_shards",
    "version"}`` each (``version``: the newest it completed, None before the first). What
    ``aiorl doctor`` reads to know who can end a wait on a name: its publishers say so
    themselves, so a dead one is simply absent (runtime loop only)."""
    service = runtime.services.get(WeightsService)
    if not isinstance(service, WeightsService):
        return []
    return [{"name": h.name, "shard": h.shard, "num_shards": h.num_shards,
             "version": h.version}
            for h in list(service.handles.values()) if isinstance(h, WeightPublisher)]
