"""Starting and stopping a group's processes through the node agents.

`Launcher` plans each rank's launch once (its environment and devices), keeps it in the
group's ``launches``, and asks the rank's node agent to start it: for the launch, for each
restart (the same launch, the next incarnation) and for ranks added later; it asks the
agents to stop ranks too. `ship_class` pickles the worker class and its arguments for the
agents. Everything but `ship_class` runs on the runtime loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import sysconfig
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aiorl.errors import PeerLostError, WorkerInitError
from aiorl.group import call_relay as _relay
from aiorl.group.shipping import ship_working_dir
from aiorl.group.state import GroupState
from aiorl.protocol.ops import AgentOp
from aiorl.protocol.spawn import SpawnRequest, WorkerLaunch
from aiorl.registry.client import INCARNATION_VARIABLE
from aiorl.runtime.descriptors import check_descriptors_for
from aiorl.runtime.working_dir import PackedDir
from aiorl.trace import recorder as _trace
from aiorl.transport.code import dumps_with_sources

if TYPE_CHECKING:
    from aiorl.placement import Placement

__all__ = ["Launcher", "ship_class"]

log = logging.getLogger("aiorl.group")

#: How long a node agent may take to answer a spawn request (a fork once its zygote is warm;
#: a cold zygote imports torch first, which takes seconds on a loaded machine).
SPAWN_TIMEOUT_S = 60.0
#: How long a launch waits for a node of its placement to (re)appear in the driver's node list.
NODE_WAIT_S = 10.0
#: How often a pending spawn checks that its node is still in the cluster: an agent killed
#: after it got the request never answers, and its node leaving the list is how we learn it.
NODE_CHECK_S = 0.25
#: How long a node must stay out of the list to count as gone: after a registry restart the
#: live agents take a heartbeat or two to join again.
NODE_GONE_S = 2.0


class Launcher:
    """Plans, starts and stops one group's ranks through the node agents (loop only).

    ``relay`` is the group's relayed-call path: told to split its rank lists again whenever
    ranks are planned anew.
    """

    def __init__(self, group: GroupState, relay: _relay.RelayPath) -> None:
        self.group = group
        self.relay = relay
        #: The pickled (class, args, kwargs) each spawn sends (`ship_class`).
        self.payload = b""
        #: ``launch(env=...)``: variables every rank gets, over the planned ones.
        self.extra_env: dict[str, str] = {}
        #: The driver's packed working directory, shipped to each node before a spawn there.
        self.working_dir: PackedDir | None = None
        self._master: tuple[str, int] | None = None  # MASTER_ADDR, MASTER_PORT

    def check_descriptors(self, placements: list[Placement]) -> None:
        """This process talks to each rank directly unless its calls go through the agents:
        too low a file limit is one clear error now, not a ZMQ one mid-launch."""
        nodes = {p.node_rank for p in placements}
        relayed = len(placements) >= _relay.RELAY_MIN_RANKS and len(nodes) >= 2
        check_descriptors_for(len(nodes) if relayed else len(placements),
                              f"ranks of group {self.group.name}")

    def failed(self, ranks: Sequence[int], exc: BaseException) -> None:
        """Starting ``ranks`` failed: their calls fail with a `WorkerInitError` saying why."""
        name = self.group.name
        log.error("launching ranks %s of group %s failed: %s", list(ranks), name, exc)
        err = WorkerInitError(f"{name}:*", -1, type(exc).__name__, str(exc), "", exc)
        for r in ranks:
            st = self.group.ranks[r]
            # A rank restarted meanwhile (its first process died while this launch waited
            # for an agent that never answered) is not this launch's to fail.
            if st.address is None and st.error is None and st.incarnation == 0:
                st.fail(err)

    async def wait_for_nodes(self, node_ranks: set[int]) -> None:
        """Wait (bounded) until the driver's node list holds every node a launch was planned on.

        Right after a registry restart the list is rebuilt as agents register again, so a
        node the plan saw may be missing for a moment; one gone for longer fails the launch
        with a clear error instead of a lookup failure deep in the spawn.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + NODE_WAIT_S
        while missing := node_ranks - self.group.nodes().keys():
            if loop.time() >= deadline:
                raise RuntimeError(
                    f"node(s) {sorted(missing)} of this launch's placement are not in the cluster "
                    f"(waited {NODE_WAIT_S:g} s for their agents)")
            await asyncio.sleep(0.05)

    async def plan(self, placements: list[Placement], world_size: int) -> None:
        """Build and keep each placement's launch (environment, devices): what
        `spawn` sends now and again for each restart."""
        group = self.group
        if self._master is None:
            master_node = group.nodes()[placements[0].node_rank]
            port_reply, _ = await group.runtime.endpoint.request(master_node["endpoint"],
                                                                 AgentOp.FREE_PORT, timeout=10)
            self._master = (master_node["ip"], int(port_reply["port"]))
        for p in placements:
            group.launches[p.rank] = (p.node_rank, self._launch(p, world_size))
        self.relay.forget_placement()

    def _launch(self, p: Placement, world_size: int) -> WorkerLaunch:
        """The launch of placement ``p``: its environment, devices, path and launcher."""
        assert self._master is not None
        master_ip, master_port = self._master
        group = self.group
        profiler = p.profiler_launch(group.name)  # None unless profiling selects us
        env = {
            "RANK": str(p.rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(p.launch_local_rank),
            "LOCAL_WORLD_SIZE": str(p.local_world_size),
            "NODE_LOCAL_RANK": str(p.local_rank), "NODE_LOCAL_WORLD_SIZE": str(p.local_world_size),
            "NODE_RANK": str(p.node_rank), "NODE_GROUP_LABEL": p.node_group_label,
            "MASTER_ADDR": master_ip, "MASTER_PORT": str(master_port),
            "AIORL_WORKER_NAME": f"{group.name}:{p.rank}",
            "AIORL_REGISTRY": group.session.registry_address,
            "AIORL_DRIVER_ID": group.session.driver_id,
            **({_trace.ENV: "1"} if _trace.ON else {}),  # a traced driver traces workers
            **(profiler.env if profiler else {}), **p.env, **self.extra_env,
        }
        if p.visible_accelerators:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(p.visible_accelerators)
        return WorkerLaunch(
            rank=p.rank, env=env, hardware_ranks=tuple(p.hardware_ranks),
            visible_accelerators=tuple(p.visible_accelerators),
            sys_path=self._sys_path(), log_level=logging.getLevelName(
                logging.getLogger("aiorl").getEffectiveLevel()),
            launcher=profiler.argv if profiler else (),
            python_interpreter=p.python_interpreter,
        )

    def _sys_path(self) -> tuple[str, ...]:
        """The driver's ``sys.path`` for the workers, less the entries inside a shipped
        working directory: the node's copy stands for them (first on the workers' path), and
        the driver's own path to it means nothing on another machine."""
        shipped = self.working_dir
        return tuple(x for x in sys.path if x and not (shipped and shipped.contains(x)))

    async def spawn(self, ranks: Sequence[int]) -> None:
        """Ask the node agents to start ``ranks``, each as its current incarnation."""
        group = self.group
        nodes = group.nodes()
        by_node: dict[int, list[WorkerLaunch]] = {}
        for r in ranks:
            node_rank, launch = group.launches[r]
            incarnation = group.ranks[r].incarnation
            if incarnation:
                launch = dataclasses.replace(
                    launch, env={**launch.env, INCARNATION_VARIABLE: str(incarnation)})
            by_node.setdefault(node_rank, []).append(launch)
        output_to = group.runtime.endpoint.address if getattr(group.session, "log_to_driver",
                                                              False) else None
        if not by_node.keys() <= nodes.keys():
            await self.wait_for_nodes(set(by_node))
            nodes = group.nodes()
        shipped = self.working_dir
        cls_path = f"{group.cls.__module__}.{group.cls.__qualname__}"
        for node_rank, launches in by_node.items():
            node = nodes[node_rank]
            if shipped is not None:
                await ship_working_dir(group.runtime.endpoint, node, shipped)
            request = SpawnRequest(group.name, group.session.driver_id, group.world_size,
                                   tuple(launches), cls_path,
                                   output_to, shipped.digest if shipped else None,
                                   shipped.chdir if shipped else False)
            await self._request_spawn(node, request)

    async def _request_spawn(self, node: dict[str, Any], request: SpawnRequest) -> None:
        """Send ``request`` to ``node``'s agent; fail once the node has been out of the
        cluster for ``NODE_GONE_S`` (its agent died) before it answered, instead of waiting
        for the timeout."""
        group = self.group
        reply = group.runtime.endpoint.request(node["endpoint"], AgentOp.SPAWN, request.to_wire(),
                                               [self.payload], timeout=SPAWN_TIMEOUT_S)
        missing_since: float | None = None
        while not reply.done():
            await asyncio.wait((reply,), timeout=NODE_CHECK_S)
            if reply.done():
                break
            if any(n.get("node_id") == node.get("node_id") for n in group.session._node_list()):
                missing_since = None
            elif missing_since is None:
                missing_since = time.monotonic()
            elif time.monotonic() - missing_since > NODE_GONE_S:
                reply.cancel()
                raise PeerLostError(f"node {node['node_rank']} left the cluster before its "
                                    f"agent answered the spawn of {group.name}")
        reply.result()

    def kill_ranks(self, ranks: Sequence[int]) -> None:
        """Ask the agents hosting ``ranks`` to stop them (SIGTERM, SIGKILL after 1 s)."""
        group = self.group
        nodes = group.nodes()
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(group.launches[r][0], []).append(r)
        for node_rank, node_ranks in by_node.items():
            node = nodes.get(node_rank)
            if node is None:
                continue  # its node is gone, and its workers with it
            try:
                group.runtime.endpoint.send_oneway(node["endpoint"], AgentOp.KILL_WORKERS,
                                                   {"group": group.name, "ranks": node_ranks})
            except Exception as exc:  # noqa: BLE001 - the agent may be gone as well
                log.warning("could not ask node %d to stop %s ranks %s: %s", node_rank,
                            group.name, node_ranks, exc)


def _installed(module_file: str | None) -> bool:
    if not module_file:
        return True  # builtins and extension modules are importable everywhere
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
    path = os.path.realpath(module_file)
    return any(path.startswith(os.path.realpath(r) + os.sep) for r in roots)


def ship_class(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any],
               shipped: PackedDir | None = None) -> bytes:
    """Pickle (cls, args, kwargs) for the node agents.

    A class from an installed package, or from a module inside the ``shipped`` working
    directory (importable on every node from its copy), travels by reference. A class from a user's
    script or test module travels by value (cloudpickle), so a node that lacks
    the file (or imports it under another name) can still build it. Its code keeps its
    file name and lines, and the files' source travels with it, so a remote traceback shows
    the user's file and failing line (`aiorl.transport.code`).
    """
    import cloudpickle

    module = sys.modules.get(cls.__module__)
    module_file = getattr(module, "__file__", None)
    by_value = module is not None and cls.__module__ != "__main__" and not _installed(
        module_file) and not cls.__module__.startswith("aiorl.") and not (
        shipped is not None and shipped.contains(module_file))
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return dumps_with_sources((cls, args, kwargs))
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
