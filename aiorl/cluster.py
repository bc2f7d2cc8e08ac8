"""``Cluster``: the driver's handle on a set of nodes.

Embedded mode (no registry address anywhere): start a registry and
``num_nodes`` node agents as child processes on loopback, owned by this
``Cluster`` and stopped by :meth:`Cluster.close` with every worker they
spawned. Attach mode (``registry=``, ``$AIORL_REGISTRY`` or
``cluster_cfg.cluster.registry``): join a running registry and wait until
``num_nodes`` agents have joined.

Either way the driver registers itself and sends heartbeats; if it dies, the
registry tears down the groups it launched.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref
from typing import Any

from aiorl.errors import RegistryUnavailable
from aiorl.placement import ClusterSpec
from aiorl.protocol.registry import DriverInfo, GroupSpec
from aiorl.runtime import Runtime, set_current_runtime, spec_from_nodes
from aiorl.transport import security

__all__ = ["Cluster"]

log = logging.getLogger("aiorl.cluster")

_live_clusters: weakref.WeakSet[Cluster] = weakref.WeakSet()


def _close_all_at_exit() -> None:
    for cluster in list(_live_clusters):
        try:
            cluster.close()
        except Exception:
            pass


atexit.register(_close_all_at_exit)


class Cluster:
    """See the module docstring. Usable as ``with Cluster() as c`` and ``async with``."""

    def __init__(
        self,
        cluster_cfg: Any = None,
        *,
        registry: str | None = None,
        num_nodes: int | None = None,
        accelerators_per_node: int | None = None,
        key_file: str | None = None,
        log_to_driver: bool = True,
        timeout: float = 60.0,
    ) -> None:
        self._cfg = _cluster_section(cluster_cfg)
        self._closed = False
        self._children: list[subprocess.Popen[bytes]] = []
        self._nodes: list[dict[str, Any]] = []
        self._nodes_changed = threading.Condition()
        #: Groups this driver launched and has not closed: name -> create_group request.
        self.groups: dict[str, GroupSpec] = {}
        self.driver_id = f"driver-{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        address = registry or os.environ.get("AIORL_REGISTRY") or self._cfg.get("registry")
        wanted = num_nodes if num_nodes is not None else self._cfg.get("num_nodes")
        self.embedded = not address
        if accelerators_per_node is None:
            accelerators_per_node = self._cfg.get("accelerators_per_node")
        insecure = os.environ.get(security.ENV_INSECURE) == "1"
        try:
            if self.embedded:
                # Every socket of an embedded cluster is a Unix socket in this directory
                # (mode 0700): only this user can bind or connect there, which is what
                # authenticates each server to its clients; a fresh PLAIN secret, handed to
                # the processes in a 0600 key file, is checked on top (see security.py).
                self.session_dir = security.make_private_directory("aiorl-")
                self.keys = None if insecure else security.ClusterKeys.generate("plain")
                address = self._start_embedded(int(wanted or 1), accelerators_per_node)
            else:
                self.keys = security.ClusterKeys.load(key_file) if key_file else (
                    security.keys_from_environment())
            self.registry_address: str = str(address)
            self.runtime = Runtime.start_in_thread(
                self.registry_address, "driver", keys=self.keys,
                **({"host": self._ipc_location} if self.embedded else {}))
            #: Print workers' output here, each line prefixed with the worker's name.
            self.log_to_driver = log_to_driver
            self.runtime.call_soon(self.runtime.endpoint.handle, "worker_output", _print_output)
            set_current_runtime(self.runtime)
            _live_clusters.add(self)
            self.runtime.run_sync(self._attach(), timeout=timeout)
            self._wait_for_nodes(int(wanted or 1), timeout)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ startup
    @property
    def _ipc_location(self) -> str:
        return f"ipc://{self.session_dir}"

    @property
    def _key_file(self) -> str:
        return os.path.join(self.session_dir, "cluster.key")

    def _start_embedded(self, num_nodes: int, accelerators_per_node: int | None) -> str:
        # The children learn the secret from a file only this user can read, never from
        # their environment (which every process they start would inherit).
        env = {k: v for k, v in os.environ.items()
               if k not in (security.ENV_PUBLIC, security.ENV_SECRET, security.ENV_KEY_FILE,
                            security.ENV_MECHANISM)}
        key_args = ["--insecure"]
        if self.keys is not None:
            self.keys.save(self._key_file)
            key_args = ["--key-file", self._key_file]
        registry = subprocess.Popen(
            [sys.executable, "-m", "aiorl.registry.service", "--host", self._ipc_location,
             "--port", "0", "--print-address", "--log-level", "WARNING", "--exit-on-stdin-close",
             *key_args],
            # stdin stays open as a pipe: when this process dies, however, the registry
            # reads EOF and exits (a thread-bound parent-death signal would not do).
            stdout=subprocess.PIPE, stdin=subprocess.PIPE, env=env,
        )
        self._children.append(registry)
        assert registry.stdout is not None
        line = registry.stdout.readline().decode().strip()
        if not line.startswith("AIORL_REGISTRY="):
            raise RegistryUnavailable(f"the embedded registry did not start (said {line!r})")
        address = line.split("=", 1)[1]
        for rank in range(num_nodes):
            cmd = [sys.executable, "-m", "aiorl.node.agent", "--registry", address,
                   "--host", "127.0.0.1", "--ipc-dir", self.session_dir, *key_args,
                   "--node-rank", str(rank), "--exit-on-stdin-close",
                   "--log-level", "WARNING",
                   "--log-dir", os.path.join(self.session_dir, f"node{rank}")]
            if accelerators_per_node is not None:
                cmd += ["--accelerators", str(accelerators_per_node)]
            # stdin stays open as a pipe: when this process dies, the agent reads EOF and exits.
            agent = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
            self._children.append(agent)
        return address

    async def _attach(self) -> None:
        reg = self.runtime.registry
        lease = await reg.register_driver(self._driver_info(), timeout=10)
        reg.start_heartbeats(self.driver_id, lease.heartbeat_interval, self._reregister)
        await reg.watch_nodes(self._on_nodes)

    def _driver_info(self) -> DriverInfo:
        return DriverInfo(self.driver_id, os.getpid(), os.uname().nodename,
                          self.runtime.endpoint.address)

    async def _reregister(self) -> None:
        """The registry restarted: register again, restore our groups, renew our watches."""
        reg = self.runtime.registry
        await reg.register_driver(self._driver_info())
        for spec in list(self.groups.values()):
            await reg.create_group(dataclasses.replace(spec, restore=True))
        await reg.resubscribe()
        log.warning("re-registered with the restarted registry at %s", self.registry_address)

    def _on_nodes(self, nodes: list[dict[str, Any]]) -> None:
        with self._nodes_changed:
            self._nodes = sorted(nodes, key=lambda n: n["node_rank"])
            self._nodes_changed.notify_all()

    def _wait_for_nodes(self, wanted: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        next_report = time.monotonic() + 5
        with self._nodes_changed:
            while len(self._nodes) < wanted:
                if time.monotonic() >= next_report:  # long waits show progress
                    log.warning("waiting for node agents at %s: %d of %d joined",
                                self.registry_address, len(self._nodes), wanted)
                    next_report += 5
                for child in self._children:
                    if child.poll() is not None:
                        raise RegistryUnavailable(
                            f"an embedded aiorl process exited with code {child.returncode} during startup")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RegistryUnavailable(
                        f"only {len(self._nodes)} of {wanted} node agents joined the registry at "
                        f"{self.registry_address} within {timeout:g} s")
                self._nodes_changed.wait(min(left, 0.1))

    # ------------------------------------------------------------------ inventory
    def _node_list(self) -> list[dict[str, Any]]:
        with self._nodes_changed:
            return list(self._nodes)

    @property
    def nodes(self) -> list[dict[str, Any]]:
        """Live nodes, ordered by node rank (id, ip, hostname, cpus, accelerators, ...)."""
        return self._node_list()

    @property
    def num_nodes(self) -> int:
        return len(self._node_list())

    @property
    def num_accelerators(self) -> int:
        return sum(int(n.get("num_accelerators", 0)) for n in self._node_list())

    @property
    def spec(self) -> ClusterSpec:
        """A :class:`~aiorl.placement.ClusterSpec` of the live nodes (and configured node groups)."""
        return spec_from_nodes(self._node_list(), self._cfg)

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop everything this Cluster started (and, in attach mode, its groups)."""
        if self._closed:
            return
        self._closed = True
        _live_clusters.discard(self)
        runtime = getattr(self, "runtime", None)
        if runtime is not None:
            try:
                if not self.embedded:
                    runtime.run_sync(self._close_owned_groups(), timeout=10)
                runtime.run_sync(runtime.registry.unregister_driver(self.driver_id, timeout=2),
                                 timeout=3)
            except Exception:
                pass
            runtime.stop()
        # Agents first (they kill their workers and unregister), then the registry.
        agents, registry = self._children[1:], self._children[:1]
        for batch in (agents, registry):
            for child in batch:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            for child in batch:
                try:
                    child.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                for stream in (child.stdin, child.stdout):
                    if stream:
                        stream.close()
        session_dir = getattr(self, "session_dir", None)
        if session_dir:
            if os.environ.get("AIORL_KEEP_LOGS") == "1":
                # Worker logs live here; a clean close removes them unless asked to keep
                # them, but never leaves the secret behind.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._key_file)
            else:
                shutil.rmtree(session_dir, ignore_errors=True)

    async def _close_owned_groups(self) -> None:
        status = await self.runtime.registry.status(timeout=5)
        for g in status.groups:
            if g.owner == self.driver_id:
                await self.runtime.registry.close_group(g.name, timeout=5)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> Cluster:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def __repr__(self) -> str:
        mode = "embedded" if self.embedded else "attached"
        return f"<Cluster {mode} {self.registry_address} nodes={self.num_nodes}>"


def _print_output(msg: Any) -> None:
    """Show a batch of a worker's output lines on the driver's stderr."""
    meta = msg.meta
    if not isinstance(meta, dict) or not isinstance(meta.get("lines"), list):
        return
    prefix = f"({meta.get('name')} pid={meta.get('pid')}) "
    sys.stderr.write("".join(prefix + str(line) + "\n" for line in meta["lines"]))
    sys.stderr.flush()


def _cluster_section(cfg: Any) -> dict[str, Any]:
    """The ``cluster:`` section of a config (DictConfig or dict), as a plain dict."""
    if cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:
        pass
    if not isinstance(cfg, dict):
        raise TypeError(f"cluster_cfg must be a dict or DictConfig, got {type(cfg).__name__}")
    section = cfg.get("cluster", cfg)
    return dict(section) if isinstance(section, dict) else {}
