"""``DriverSession``: this driver's registration with a registry.

It starts the driver's runtime (an event loop on a private I/O thread), registers the
driver and keeps it alive with heartbeats, follows the live node list, remembers the
groups this driver launched (restored if the registry restarts) and, on close, closes what
it owns and unregisters. It implements `Session`, which is all that
groups and channels see of the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from aiorl.errors import RegistryUnavailable
from aiorl.placement import ClusterSpec
from aiorl.protocol.ops import DriverOp
from aiorl.protocol.registry import DriverInfo, GroupSpec, root_of
from aiorl.runtime import Runtime, set_current_runtime, spec_from_nodes
from aiorl.transport import security
from aiorl.util.collector import tune_collector

__all__ = ["DriverSession", "probe_tcp", "tune_driver_collector"]

log = logging.getLogger("aiorl.cluster")

#: One registration attempt waits this long for the registry's answer; attempts go on until
#: the Cluster's ``timeout`` while the registry is silent but no handshake broke off.
REGISTER_ATTEMPT_S = 10.0
#: Handshakes in a row that break off before registering gives up on a key mismatch (libzmq
#: retries every 0.1 s: about a second; a registry restarting mid-handshake breaks one or two).
KEY_MISMATCH_HANDSHAKES = 5
#: While the registry does not answer, its TCP port is probed every half second; refused for
#: this long in a row, nothing listens there: a registry still starting binds its port within
#: this (and is then waited for), a wrong port fails here instead of after the Cluster's
#: ``timeout``.
REFUSED_GIVE_UP_S = 3.0
#: How long one probe waits for its connection: a host that does not answer (a slow or lossy
#: network) is waited for, as an accepted connection is.
PROBE_CONNECT_S = 0.5

_collector_tuned = False


async def probe_tcp(address: str, within: float = PROBE_CONNECT_S) -> str:
    """What a plain TCP connect to ``address`` (``tcp://HOST:PORT``) meets: ``"refused"``
    (the host answered that nothing listens on that port), ``"accepted"``, or ``"silent"``
    (no answer within ``within`` seconds, a host unreachable or a name that does not resolve
    yet: each may still come right). Any other address (``ipc://``) is ``"silent"``.

    The registry speaks ZMQ, whose connects retry in silence: without this a wrong port looked
    exactly like a registry still starting, and a driver waited its whole timeout.

    Example:
        ```python
        await probe_tcp("tcp://127.0.0.1:1")   # 'refused'
        ```
    """
    if not address.startswith("tcp://"):
        return "silent"
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        _reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port)), within)
    except ConnectionRefusedError:
        return "refused"
    except (OSError, TimeoutError, asyncio.TimeoutError, ValueError):
        return "silent"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return "accepted"


def tune_driver_collector() -> bool:
    """Tune the driver's garbage collector (`aiorl.util.collector.tune_collector`:
    its heap frozen, a higher young threshold) once per process; returns whether it did.

    Every call in flight keeps a few small objects alive until its answer, so with
    Python's settings a busy driver spent ~1 µs of its ~10 µs of CPU per call in
    collections that walked the pending calls, and each full collection walked every
    object of the process (torch alone is ~200k). Workers do the same after the zygote's
    imports. ``AIORL_GC_FREEZE=0`` opts out.
    """
    global _collector_tuned
    if _collector_tuned:
        return False
    _collector_tuned = True
    return tune_collector(collect_first=True)


class DriverSession:
    """See the module docstring. Build it, then `wait_for_nodes`; `close` once."""

    def __init__(self, registry_address: str, keys: security.ClusterKeys | None,
                 cluster_cfg: Mapping[str, Any], *, host: str | None, log_to_driver: bool,
                 timeout: float) -> None:
        self.registry_address = registry_address
        #: The credentials this driver authenticates with (None: ``--insecure``).
        self.keys = keys
        self.driver_id = f"driver-{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        #: Groups this driver launched and has not closed: name -> create_group request.
        self.groups: dict[str, GroupSpec] = {}
        #: Print workers' output here, each line prefixed with the worker's name.
        self.log_to_driver = log_to_driver
        self._cfg = cluster_cfg
        self._nodes: list[dict[str, Any]] = []
        self._nodes_changed = threading.Condition()
        tune_driver_collector()
        self.runtime = Runtime.start_in_thread(
            registry_address, "driver", keys=keys, **({"host": host} if host else {}))
        self.runtime.submit(self.runtime.endpoint.handle, DriverOp.WORKER_OUTPUT, _print_output)
        set_current_runtime(self.runtime)
        self.runtime.run_sync(self._register(timeout), timeout=timeout + REGISTER_ATTEMPT_S)

    # ------------------------------------------------------------------ registration
    def _driver_info(self) -> DriverInfo:
        return DriverInfo(self.driver_id, os.getpid(), os.uname().nodename,
                          self.runtime.endpoint.address)

    async def _register(self, timeout: float) -> None:
        """Register with the registry, waiting up to ``timeout`` for one that is still starting
        (a job script often starts the registry and the driver together; on a loaded machine
        its start takes seconds). Handshakes that keep breaking off mean a key mismatch, not a
        slow start: that fails after one attempt instead of waiting out ``timeout``."""
        reg = self.runtime.registry
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        refused_since: float | None = None  # since when every probe of the port was refused
        while True:
            attempt = min(REGISTER_ATTEMPT_S, max(deadline - loop.time(), 0.1))
            request = asyncio.ensure_future(
                reg.register_driver(self._driver_info(), timeout=attempt))
            while not request.done():  # a key mismatch shows within a second: say it then
                await asyncio.wait({request}, timeout=0.5)
                if request.done():
                    break
                if self.runtime.endpoint.handshakes_breaking(
                        reg.address) >= KEY_MISMATCH_HANDSHAKES:
                    request.cancel()
                elif await probe_tcp(reg.address) == "refused":
                    refused_since = loop.time() if refused_since is None else refused_since
                    if loop.time() - refused_since >= REFUSED_GIVE_UP_S:
                        request.cancel()
                else:
                    refused_since = None
            try:
                lease = await request
                break
            except (RegistryUnavailable, asyncio.CancelledError) as exc:
                if refused_since is not None and loop.time() - refused_since >= REFUSED_GIVE_UP_S:
                    raise RegistryUnavailable(
                        f"nothing listens at {reg.address}: every connection was refused for "
                        f"{REFUSED_GIVE_UP_S:g} s, so no registry runs on that port. Check the "
                        "host and port (aiorl-registry prints its address when it starts), or "
                        "omit registry= for an embedded cluster") from exc
                broken = self.runtime.endpoint.handshakes_breaking(reg.address)
                if broken:  # something answers there, and drops us at the handshake
                    raise RegistryUnavailable(
                        f"{reg.address} answers but drops this driver at the handshake ({broken} "
                        "time(s)): this process's key is not that cluster's (check key_file= or "
                        "$AIORL_KEY_FILE: every process needs the registry's key file)") from exc
                if loop.time() + 0.1 >= deadline:
                    raise RegistryUnavailable(
                        f"no answer from {reg.address} within {timeout:g} s and no handshake "
                        "either: is a registry running at that address (and reachable from "
                        "here)?") from exc
                log.warning("no answer from the registry at %s yet; waiting up to %.0f s more "
                            "(Cluster(timeout=...))", self.registry_address,
                            deadline - loop.time())
        reg.start_heartbeats(self.driver_id, lease.heartbeat_interval, self._reregister,
                             expiry=lease.expiry)
        await reg.watch_nodes(self._on_nodes)

    async def _reregister(self) -> None:
        """The registry restarted: register again, restore our groups, renew our watches.

        Each group is restored with the workers we believe alive: the registry keeps them
        until their agents report them again and declares dead those no agent reports (they
        died with their agent while the registry was down), so that news reaches us and
        their callers instead of nobody (docs/failures.md, invariant 35)."""
        reg = self.runtime.registry
        await reg.register_driver(self._driver_info())
        for spec in list(self.groups.values()):
            alive = tuple(record for name, record in reg.known.items()
                          if root_of(name) == spec.group and not record.state.is_final)
            await reg.create_group(dataclasses.replace(spec, restore=True, workers=alive))
        await reg.resubscribe()
        log.warning("the registry at %s did not know this driver (it restarted, or it declared "
                    "the driver dead after missed heartbeats): registered again, with %d "
                    "group(s)", self.registry_address, len(self.groups))

    # ------------------------------------------------------------------ nodes
    def _on_nodes(self, nodes: list[dict[str, Any]]) -> None:
        with self._nodes_changed:
            self._nodes = sorted(nodes, key=lambda n: n["node_rank"])
            self._nodes_changed.notify_all()

    def wait_for_nodes(self, wanted: int, timeout: float,
                       check: Callable[[], None] | None = None) -> None:
        """Block until ``wanted`` node agents have joined; report progress every 5 s.

        ``check`` runs on every wake-up and may raise (an embedded child that died).
        """
        deadline = time.monotonic() + timeout
        next_report = time.monotonic() + 5
        with self._nodes_changed:
            while len(self._nodes) < wanted:
                if time.monotonic() >= next_report:  # long waits show progress
                    log.warning("waiting for node agents at %s: %d of %d joined",
                                self.registry_address, len(self._nodes), wanted)
                    next_report += 5
                if check is not None:
                    check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RegistryUnavailable(
                        f"only {len(self._nodes)} of {wanted} node agents joined the registry at "
                        f"{self.registry_address} within {timeout:g} s")
                self._nodes_changed.wait(min(left, 0.1))

    def _node_list(self) -> list[dict[str, Any]]:
        with self._nodes_changed:
            return list(self._nodes)

    @property
    def spec(self) -> ClusterSpec:
        """A [`ClusterSpec`][aiorl.placement.ClusterSpec] of the live nodes (and configured node
        groups)."""
        return spec_from_nodes(self._node_list(), self._cfg)

    # ------------------------------------------------------------------ shutdown
    def close(self, close_owned_groups: bool, reason: str | None = None,
              registry_alive: bool = True) -> None:
        """Close the groups this driver owns (when asked), unregister, stop the runtime.

        ``reason`` is what later operations raise ([`ClusterClosedError`][aiorl.ClusterClosedError])
        and pending ones fail with; with ``registry_alive=False`` (it died), or a registry that
        answers no heartbeat (it is down or cut off: a lost head node), nothing is asked of
        the registry, so closing takes no registry timeout: the registry's expiry tears this
        driver's groups down, should it come back."""
        runtime = self.runtime
        if registry_alive and not runtime.registry.answering():
            log.info("closing without asking the registry at %s, which answers no heartbeat",
                     self.registry_address)
            registry_alive = False
        try:
            if registry_alive and close_owned_groups:
                runtime.run_sync(self._close_owned_groups(), timeout=10)
            if registry_alive:
                runtime.run_sync(runtime.registry.unregister_driver(self.driver_id, timeout=2),
                                 timeout=3)
        except Exception as exc:  # the registry may be gone already: its expiry cleans up
            log.debug("unregistering driver %s: %s", self.driver_id, exc)
        runtime.stop(reason)

    async def _close_owned_groups(self) -> None:
        status = await self.runtime.registry.status(timeout=5)
        for g in status.groups:
            if g.owner == self.driver_id:
                await self.runtime.registry.close_group(g.name, timeout=5)


def _print_output(msg: Any) -> None:
    """Show a batch of a worker's output lines on the driver's stderr."""
    meta = msg.meta
    if not isinstance(meta, dict) or not isinstance(meta.get("lines"), list):
        return
    prefix = f"({meta.get('name')} pid={meta.get('pid')}) "
    sys.stderr.write("".join(prefix + str(line) + "\n" for line in meta["lines"]))
    sys.stderr.flush()
