"""Sessions: what groups and channels need to know about the cluster they launch into.

A `Session` is the driver's [`Cluster`][aiorl.Cluster] or, inside a worker process,
a `WorkerSession`. Groups and channels depend on this protocol only, never on the
``cluster`` layer above them, so that a worker can launch groups and host channels with
the same code as the driver.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from aiorl.placement import ClusterSpec
from aiorl.protocol.registry import GroupSpec
from aiorl.runtime.runtime import Runtime, current_runtime

__all__ = ["Session", "WorkerSession", "spec_from_nodes"]


class Session(Protocol):
    """The cluster as seen by the code that launches groups and channels."""

    @property
    def runtime(self) -> Runtime:
        """The runtime whose loop, endpoint and registry client the launched groups use."""

    @property
    def registry_address(self) -> str:
        """The registry's address, handed to launched workers."""

    @property
    def driver_id(self) -> str:
        """The driver that owns launched groups (they are torn down when it goes)."""

    @property
    def groups(self) -> dict[str, GroupSpec]:
        """Groups launched through this session and not closed: name -> create_group request;
        the driver restores them if the registry restarts."""

    @property
    def log_to_driver(self) -> bool:
        """Whether launched workers stream their output to this process."""

    @property
    def spec(self) -> ClusterSpec: ...

    def _node_list(self) -> list[dict[str, Any]]: ...


def spec_from_nodes(nodes: Sequence[Mapping[str, Any]], cluster_cfg: Mapping[str, Any]) -> ClusterSpec:
    """A [`ClusterSpec`][aiorl.placement.ClusterSpec] of live ``nodes`` and the configured node
    groups."""
    hw_groups = list(cluster_cfg.get("node_groups") or [])
    return ClusterSpec(
        len(nodes),
        accelerators_per_node=[int(n.get("num_accelerators", 0)) for n in nodes],
        node_groups=hw_groups or None,
        profiling=cluster_cfg.get("profiling"),
    )


class WorkerSession:
    """The cluster as seen from inside a worker process: enough to launch groups there.

    It shares the worker's runtime (no new thread or registration); groups it
    launches are owned by the driver that owns the worker, so they are torn down
    with that driver's groups. Call `refresh` (on the runtime loop) before
    reading `spec`.
    """

    log_to_driver = False

    def __init__(self, runtime: Runtime, registry_address: str, driver_id: str) -> None:
        self.runtime = runtime
        self.registry_address = registry_address
        self.driver_id = driver_id
        self._nodes: list[dict[str, Any]] = []
        self.groups: dict[str, GroupSpec] = {}

    @classmethod
    def current(cls) -> WorkerSession:
        """The session of the worker process this runs in."""
        runtime = current_runtime()
        if runtime is None or "AIORL_REGISTRY" not in os.environ:
            raise RuntimeError("WorkerSession.current() works only inside an aiorl worker process")
        return cls(runtime, os.environ["AIORL_REGISTRY"], os.environ.get("AIORL_DRIVER_ID", ""))

    async def refresh(self) -> None:
        """Fetch the live node list."""
        self._nodes = [n.to_wire() for n in await self.runtime.registry.nodes()]

    def _node_list(self) -> list[dict[str, Any]]:
        return list(self._nodes)

    @property
    def nodes(self) -> list[dict[str, Any]]:
        return self._node_list()

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    @property
    def spec(self) -> ClusterSpec:
        return spec_from_nodes(self._nodes, {})


if TYPE_CHECKING:
    _check: Session = WorkerSession.__new__(WorkerSession)
