"""``EmbeddedProcesses``: a registry and node agents run as children of this process.

What ``Cluster()`` without a registry address starts, like ``ray.init()``. Every socket of
an embedded cluster is a Unix socket in a private session directory (mode 0700): only this
user can bind or connect there, which is what authenticates each server to its clients; a
fresh PLAIN secret, handed to the children in a 0600 key file (never in their environment,
which every process they start would inherit), is checked on top (docs/security.md).

The children exit when this process dies, however it dies: each reads EOF on a stdin pipe
from us (a parent-death signal would follow the creating thread, not the process).

So that ``aiorl status`` can find a running embedded cluster, each one is announced in a
*runtime file*, ``<runtime dir>/aiorl-clusters-<uid>/<driver pid>-<session>.json`` (the directory
0700, the file 0600; the runtime dir is ``$XDG_RUNTIME_DIR`` or the temporary directory):
the registry's address, the session directory and the path of its key file, never the key
itself. :meth:`EmbeddedProcesses.stop` removes it; a file left by a killed driver is
removed by the next :func:`running_embedded_clusters` that finds its process gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from aiorl.errors import AuthenticationError, RegistryUnavailable
from aiorl.transport import security
from aiorl.util.processes import pid_alive

__all__ = ["EmbeddedClusterFile", "EmbeddedProcesses", "running_embedded_clusters"]

log = logging.getLogger("aiorl.cluster")


class EmbeddedProcesses:
    """Start the registry and ``num_nodes`` agents; :meth:`stop` stops them and cleans up."""

    def __init__(self, num_nodes: int, accelerators_per_node: int | None, insecure: bool) -> None:
        self.children: list[subprocess.Popen[bytes]] = []
        self.session_dir = security.make_private_directory("aiorl-")
        self.keys = None if insecure else security.ClusterKeys.generate("plain")
        self.runtime_file: str | None = None
        try:
            self.registry_address = self._start(num_nodes, accelerators_per_node)
            self.runtime_file = _announce(EmbeddedClusterFile(
                self.registry_address, self.session_dir,
                self.key_file if self.keys is not None else None, os.getpid(), time.time()))
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
        if self.runtime_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.runtime_file)
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


# ---------------------------------------------------------------------------- runtime files
@dataclass(frozen=True)
class EmbeddedClusterFile:
    """What a runtime file says about one running embedded cluster.

    Example (what ``aiorl status`` does)::

        for found in running_embedded_clusters():
            print(found.pid, found.registry)
    """

    #: The registry's address (``ipc://<session dir>/...``).
    registry: str
    #: The cluster's private directory; clients bind their own sockets there.
    session_dir: str
    #: The 0600 file holding the cluster's keys (None: an ``AIORL_INSECURE=1`` cluster).
    key_file: str | None
    #: The driver process that owns the cluster.
    pid: int
    #: When the cluster started (seconds since the epoch).
    started: float


def runtime_files_dir() -> str:
    """The per-user directory of runtime files (not created here)."""
    return os.path.join(security.runtime_base(), f"aiorl-clusters-{os.getuid()}")


def _announce(found: EmbeddedClusterFile) -> str | None:
    """Write ``found``'s runtime file (0600, in a 0700 directory of this user); returns its
    path, or None when the directory is not private (then ``aiorl status`` needs
    ``--registry``, and nothing is written where others could read or replace it)."""
    directory = runtime_files_dir()
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        security.check_private_directory(directory)
    except (OSError, AuthenticationError) as exc:
        log.warning("not announcing the embedded cluster to `aiorl status`: %s", exc)
        return None
    # One process may run several clusters: the session directory's name tells them apart.
    path = os.path.join(directory, f"{found.pid}-{os.path.basename(found.session_dir)}.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(found.__dict__, f)
    return path


def running_embedded_clusters() -> list[EmbeddedClusterFile]:
    """This user's running embedded clusters, newest first; removes files whose driver
    is gone (a killed driver cannot remove its own)."""
    directory = runtime_files_dir()
    try:
        security.check_private_directory(directory)
        names = os.listdir(directory)
    except (OSError, AuthenticationError):
        return []
    found: list[EmbeddedClusterFile] = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                entry = EmbeddedClusterFile(**json.load(f))
        except (OSError, ValueError, TypeError):
            continue  # being written, or not ours: leave it
        if pid_alive(entry.pid) and os.path.isdir(entry.session_dir):
            found.append(entry)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return sorted(found, key=lambda e: e.started, reverse=True)
