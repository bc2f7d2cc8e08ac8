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
itself. `EmbeddedProcesses.stop` removes it; a file left by a killed driver is
removed by the next `running_embedded_clusters` that finds its process gone.

The session directory names its owner too: ``owner.json`` inside it holds the driver's pid,
the process's start time and pid namespace. A driver killed by SIGTERM or SIGKILL cannot
remove its directory (key file, sockets, worker logs); the next embedded cluster this user
starts on the machine does (`remove_abandoned_sessions`): only directories of this
user (mode 0700, not links) whose owner file names a process that is gone. A live owner's
directory, one without an owner file, and one whose owner ran in another pid namespace are
never touched.

The registry is watched too: its stdout is a pipe of which it holds the only write end, so
end-of-file there means it exited (`EmbeddedProcesses.on_registry_exit`); the Cluster
then closes itself instead of leaving calls to wait for workers nobody reports.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiorl.errors import AuthenticationError, RegistryUnavailable
from aiorl.runtime import Runtime
from aiorl.transport import security
from aiorl.util.processes import pid_alive, process_start_time, python_module_command
from aiorl.util.threads import unblocked

__all__ = [
    "OWNER_FILE", "EmbeddedClusterFile", "EmbeddedProcesses", "remove_abandoned_sessions",
    "running_embedded_clusters",
]

log = logging.getLogger("aiorl.cluster")

#: How long stopping waits for each embedded process after SIGTERM, and again after SIGKILL.
STOP_WAIT_S = 5.0

#: The prefix of an embedded cluster's session directory (under the user's runtime dir).
SESSION_PREFIX = "aiorl-"
#: The file in a session directory naming the driver that owns it (see the module docstring).
OWNER_FILE = "owner.json"


class EmbeddedProcesses:
    """Start the registry and ``num_nodes`` agents; `stop` stops them and cleans up."""

    def __init__(self, num_nodes: int, accelerators_per_node: int | None, insecure: bool) -> None:
        self.children: list[subprocess.Popen[bytes]] = []
        remove_abandoned_sessions()  # a killed driver could not remove its own
        self.session_dir = security.make_private_directory(SESSION_PREFIX)
        self.keys = None if insecure else security.ClusterKeys.generate("plain")
        self.runtime_file: str | None = None
        try:
            _write_owner(self.session_dir)
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
        # The daemons take SIGTERM and SIGINT whichever thread starts them (a mask is
        # inherited across exec; aiorl's own threads block both: aiorl.util.threads).
        with unblocked():
            return self._start_daemons(num_nodes, accelerators_per_node)

    def _start_daemons(self, num_nodes: int, accelerators_per_node: int | None) -> str:
        env = {k: v for k, v in os.environ.items()
               if k not in (security.ENV_PUBLIC, security.ENV_SECRET, security.ENV_KEY_FILE,
                            security.ENV_MECHANISM)}
        key_args = ["--insecure"]
        if self.keys is not None:
            self.keys.save(self.key_file)
            key_args = ["--key-file", self.key_file]
        registry = subprocess.Popen(
            python_module_command(
                "aiorl.registry.service", "--host", self.ipc_location, "--port", "0",
                "--print-address", "--log-level", "WARNING", "--exit-on-stdin-close", *key_args),
            stdout=subprocess.PIPE, stdin=subprocess.PIPE, env=env,
            # Sessions of their own, here and for the agents: a Ctrl-C in the terminal goes
            # to the driver alone, which stops the groups, then these, in order. In the
            # terminal's process group they got it too and the registry exited first, so the
            # driver reported the registry's end as a failure while it was stopping.
            start_new_session=True,
        )
        self.children.append(registry)
        assert registry.stdout is not None
        line = registry.stdout.readline().decode().strip()
        if not line.startswith("AIORL_REGISTRY="):
            raise RegistryUnavailable(f"the embedded registry did not start (said {line!r})")
        address = line.split("=", 1)[1]
        for rank in range(num_nodes):
            cmd = [*python_module_command("aiorl.node.agent"), "--registry", address,
                   "--host", "127.0.0.1", "--ipc-dir", self.session_dir, *key_args,
                   "--node-rank", str(rank), "--exit-on-stdin-close",
                   "--log-level", "WARNING",
                   "--log-dir", os.path.join(self.session_dir, f"node{rank}")]
            if accelerators_per_node is not None:
                cmd += ["--accelerators", str(accelerators_per_node)]
            self.children.append(
                subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env,
                                 start_new_session=True))
        return address

    def on_registry_exit(self, runtime: Runtime, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on ``runtime``'s loop once the registry process has exited:
        end-of-file on its stdout, whose only write end it holds. Nothing is polled."""
        stream = self.children[0].stdout
        assert stream is not None
        fd = stream.fileno()
        loop = runtime.loop

        def readable() -> None:
            try:
                data = os.read(fd, 4096)
            except OSError:
                data = b""
            if not data:  # (anything it prints is read and dropped)
                loop.remove_reader(fd)
                callback()

        def forget() -> None:  # before stop() closes the pipe
            loop.remove_reader(fd)

        def install() -> None:
            loop.add_reader(fd, readable)
            runtime.on_close(forget)

        runtime.submit(install)

    def registry_exit(self) -> str:
        """How the registry process ended, in words (it has exited or is exiting)."""
        registry = self.children[0]
        try:
            code = registry.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return f"(pid {registry.pid}) stopped answering"
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else (
            f"exited with code {code}")
        return f"(pid {registry.pid}) {how}"

    def check_alive(self) -> None:
        """Raise [`RegistryUnavailable`][aiorl.RegistryUnavailable] if a child exited (during
        startup)."""
        for child in self.children:
            if child.poll() is not None:
                raise RegistryUnavailable(
                    f"an embedded aiorl process exited with code {child.returncode} during startup")

    def stop(self) -> None:
        """Stop the agents (they kill their workers and unregister), then the registry;
        remove the session directory (``AIORL_KEEP_LOGS=1`` keeps the logs, never the key).

        Bounded: a child gets `STOP_WAIT_S` after SIGTERM, then SIGKILL and as long again;
        one that is still there (stuck in the kernel) is named in a warning and left to die
        on its own, so that closing a Cluster never hangs on it."""
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
                    child.wait(timeout=STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    child.kill()
                    try:
                        child.wait(timeout=STOP_WAIT_S)
                    except subprocess.TimeoutExpired:
                        log.warning("aiorl: embedded process %d did not exit %g s after "
                                    "SIGKILL; leaving it", child.pid, STOP_WAIT_S)
                for stream in (child.stdin, child.stdout):
                    if stream:
                        stream.close()
        if os.environ.get("AIORL_KEEP_LOGS") == "1":
            for kept in (self.key_file, os.path.join(self.session_dir, OWNER_FILE)):
                with contextlib.suppress(FileNotFoundError):  # (kept logs have no owner)
                    os.unlink(kept)
        else:
            shutil.rmtree(self.session_dir, ignore_errors=True)


# ---------------------------------------------------------------------------- session dirs
def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _write_owner(session_dir: str) -> None:
    """Name this process as ``session_dir``'s owner (written whole, then renamed in place)."""
    pid = os.getpid()
    owner = {"pid": pid, "start": process_start_time(pid), "pidns": _pid_namespace(),
             "keep_logs": os.environ.get("AIORL_KEEP_LOGS") == "1"}
    partial = os.path.join(session_dir, OWNER_FILE + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(owner, f)
    os.replace(partial, os.path.join(session_dir, OWNER_FILE))


def _read_owner(path: str) -> dict[str, Any] | None:
    """The owner record of ``path`` if it is a session directory of this user: a directory
    (not a link) of our uid, mode 0700, holding a regular ``owner.json`` of ours."""
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return None
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            meta = os.fstat(f.fileno())
            if not stat.S_ISREG(meta.st_mode) or meta.st_uid != os.getuid():
                return None
            owner = json.loads(f.read(4096))
    except (OSError, ValueError):
        return None
    if not isinstance(owner, dict):
        return None
    pid, start = owner.get("pid"), owner.get("start")
    if type(pid) is not int or not 0 < pid < 1 << 31 or not (start is None or type(start) is int):
        return None
    return owner


def _owner_gone(owner: dict[str, Any]) -> bool:
    """Whether the process an owner record names has ended (False when we cannot tell)."""
    if owner.get("pidns") != _pid_namespace():
        return False  # another pid namespace (a container sharing /tmp): its pids are not ours
    pid = owner["pid"]
    if not pid_alive(pid):
        return True
    start = owner.get("start")
    now = process_start_time(pid)
    return start is not None and now is not None and now != start  # the pid was reused


def remove_abandoned_sessions(base: str | None = None) -> list[str]:
    """Remove the session directories of this user's embedded clusters whose driver is gone
    (killed: it could not clean up); returns the paths removed.

    Only directories named ``aiorl-*`` in ``base`` (default: the user's runtime directory)
    that `_read_owner` accepts and whose owner has ended. One kept with
    ``AIORL_KEEP_LOGS=1`` loses its key and owner file, not its logs.

    Example:
        ```python
        remove_abandoned_sessions()   # what every embedded aiorl.Cluster() does first
        ```
    """
    base = base or security.runtime_base()
    try:
        names = [n for n in os.listdir(base) if n.startswith(SESSION_PREFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(base, name)
        owner = _read_owner(path)
        if owner is None or not _owner_gone(owner):
            continue
        if owner.get("keep_logs") is True:
            for secret in ("cluster.key", OWNER_FILE):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(path, secret))
        else:
            shutil.rmtree(path, ignore_errors=True)
        log.info("removed %s, left by driver pid %s, which is gone", path, owner["pid"])
        removed.append(path)
    return removed


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
