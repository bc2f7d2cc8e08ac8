"""``EmbeddedProcesses``: a registry and node agents run as children of this process.

What ``Cluster()`` without a registry address starts, like ``ray.init()``. Every socket of
an embedded cluster is a Unix socket in a private session directory (mode 0700): only this
user can bind or connect there, which is what authenticates each server to its clients; a
fresh PLAIN secret, handed to the children in a 0600 key file (never in their environment,
which every process they start would inherit), is checked on top (docs/security.md).

The children exit when this process dies, however it dies: each reads EOF on a stdin pipe
from us (a parent-death signal would follow the creating thread, not the process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys

from aiorl.errors import RegistryUnavailable
from aiorl.transport import security

__all__ = ["EmbeddedProcesses"]

log = logging.getLogger("aiorl.cluster")


class EmbeddedProcesses:
    """Start the registry and ``num_nodes`` agents; :meth:`stop` stops them and cleans up."""

    def __init__(self, num_nodes: int, accelerators_per_node: int | None, insecure: bool) -> None:
        self.children: list[subprocess.Popen[bytes]] = []
        self.session_dir = security.make_private_directory("aiorl-")
        self.keys = None if insecure else security.ClusterKeys.generate("plain")
        try:
            self.registry_address = self._start(num_nodes, accelerators_per_node)
        except BaseException:
            self.stop()
            raise

    @property
    def ipc_location(self) -> str:
        """Where this cluster's processes bind their sockets (``ipc://<session dir>``)."""
        return f"ipc://{self.session_dir}"

    @property
    def key_file(self) -> str:
        return os.path.join(self.session_dir, "cluster.key")

    def _start(self, num_nodes: int, accelerators_per_node: int | None) -> str:
        env = {k: v for k, v in os.environ.items()
               if k not in (security.ENV_PUBLIC, security.ENV_SECRET, security.ENV_KEY_FILE,
                            security.ENV_MECHANISM)}
        key_args = ["--insecure"]
        if self.keys is not None:
            self.keys.save(self.key_file)
            key_args = ["--key-file", self.key_file]
        registry = subprocess.Popen(
            [sys.executable, "-m", "aiorl.registry.service", "--host", self.ipc_location,
             "--port", "0", "--print-address", "--log-level", "WARNING", "--exit-on-stdin-close",
             *key_args],
            stdout=subprocess.PIPE, stdin=subprocess.PIPE, env=env,
        )
        self.children.append(registry)
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
            self.children.append(
                subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env))
        return address

    def check_alive(self) -> None:
        """Raise :class:`~aiorl.RegistryUnavailable` if a child exited (during startup)."""
        for child in self.children:
            if child.poll() is not None:
                raise RegistryUnavailable(
                    f"an embedded aiorl process exited with code {child.returncode} during startup")

    def stop(self) -> None:
        """Stop the agents (they kill their workers and unregister), then the registry;
        remove the session directory (``AIORL_KEEP_LOGS=1`` keeps the logs, never the key)."""
        agents, registry = self.children[1:], self.children[:1]
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
        if os.environ.get("AIORL_KEEP_LOGS") == "1":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.key_file)
        else:
            shutil.rmtree(self.session_dir, ignore_errors=True)
