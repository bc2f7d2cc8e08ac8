"""The zygote: a warm process that forks worker processes on request.

Importing torch costs about a second of CPU; forking a process that already
imported it costs about 15 ms. The node agent starts one zygote, which imports
torch, zmq and the worker runtime once and then forks a child per worker.

Rules that keep this safe:

* The zygote stays single-threaded and never creates a ZMQ context or touches
  CUDA: a fork copies only the calling thread, so locks held by other threads
  (or a CUDA context) would be broken in the child. A preload module
  (``AIORL_ZYGOTE_PRELOAD``) that initialises CUDA is detected after its import:
  the zygote says so on the agent's stderr and from then on starts every worker
  as a fresh interpreter (fork + exec, as for a profiled worker) instead of
  handing it a broken CUDA state.
* Every child calls ``setsid()`` (its own process group, so the agent can kill
  it and anything it started with one ``killpg``) and sets
  ``PR_SET_PDEATHSIG=SIGKILL`` so it dies with the zygote; the zygote does the
  same toward the agent. Killing the agent therefore kills every worker.

The agent and the zygote talk over a socketpair with length-prefixed pickles:
both are processes of the same node agent, so nothing crosses a trust boundary.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import traceback
from typing import TYPE_CHECKING, Any, NamedTuple

from aiorl.node.launch_env import merge_environment
from aiorl.protocol.spawn import WorkerSpawn
from aiorl.util.processes import python_module_command
from aiorl.util.threads import SHIELDED

if TYPE_CHECKING:
    from aiorl.transport.security import ClusterKeys


class _Session(NamedTuple):
    """What the agent tells its zygote once for every worker: the cluster's keys (None:
    insecure) and where workers bind. They travel on this private channel so that no
    worker finds the secret in its environment."""

    keys: ClusterKeys | None
    listen: str

__all__ = ["working_directory_last", "read_message", "set_parent_death_signal",
           "write_message"]

_LEN = struct.Struct("!I")
PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the stdin/heartbeat watches still end orphans


def encode_message(obj: Any) -> bytes:
    """One message as it travels on the agent-zygote channel: its length, then its pickle."""
    data = pickle.dumps(obj, protocol=5)
    return _LEN.pack(len(data)) + data


def write_message(sock: socket.socket, obj: Any) -> None:
    """Write one message on a blocking socket (a non-blocking one: ``loop.sock_sendall``)."""
    sock.sendall(encode_message(obj))


def read_message(sock: socket.socket) -> Any:
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    body = _recv_exact(sock, n)
    if body is None:
        return None
    return pickle.loads(body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None once the other side is gone. A peer that exits with unread
    data in its buffer resets the connection instead of closing it: the same news (this
    is what made closing a cluster log a ConnectionResetError traceback)."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (never initialises it to find out)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def _preload() -> str | None:
    """Import what every worker needs, once here instead of once per worker.

    Returns the preload module after whose import CUDA was initialised (None: it was not).
    A forked child of a process holding a CUDA context cannot use CUDA (PyTorch calls it a
    "bad fork" and refuses), so such a zygote must not fork workers.
    """
    import cloudpickle  # noqa: F401
    import msgpack  # noqa: F401
    import torch  # noqa: F401
    import uvloop  # noqa: F401

    try:
        # The first optimizer a worker builds imports torch._dynamo (~1 s of CPU each time);
        # paying it once here saves it in every worker that trains.
        import torch._dynamo  # noqa: F401
    except Exception:
        pass

    import aiorl.actors.worker_process  # noqa: F401

    if _cuda_initialized():
        return "aiorl.actors.worker_process"
    # Users' own heavy imports (a model library, an environment), shared by every worker.
    for name in filter(None, os.environ.get("AIORL_ZYGOTE_PRELOAD", "").split(",")):
        importlib.import_module(name.strip())
        if _cuda_initialized():
            return name.strip()
    return None


def _refuse_fork_message(culprit: str) -> str:
    return (
        f"aiorl zygote: importing {culprit!r} (AIORL_ZYGOTE_PRELOAD) initialised CUDA; a "
        "worker forked from this process could not use its GPU, so every worker of this "
        "node starts as a fresh interpreter instead (slower to start). Remove the module "
        "from AIORL_ZYGOTE_PRELOAD, or make it initialise CUDA lazily, to fork again."
    )


def _child(
    spec: WorkerSpawn,
    session: _Session,
    channel: socket.socket,
    parent_pid: int,
    exec_always: bool = False,
) -> None:
    """Runs in the forked child: detach, redirect output, become the worker."""
    code = 1
    try:
        os.setsid()
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != parent_pid:  # the zygote died between fork and prctl
            os._exit(1)
        channel.close()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        # O_NOFOLLOW: a link at the log's name is refused, never written through.
        log_fd = os.open(spec.log_path,
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        by_exec = exec_always or _needs_exec(spec)  # before the worker's env: it compares
        os.environ.update(merge_environment(spec.launch.env, os.environ))
        _extend_sys_path(spec.launch.env.get("PYTHONPATH", ""))
        if spec.launch.cwd is not None:  # a shipped working directory, when the driver asked
            os.chdir(spec.launch.cwd)
        if by_exec:
            code = _exec_worker(spec, session)  # returns only if exec failed
            return
        from aiorl.actors import worker_process

        code = worker_process.run(spec, keys=session.keys, listen=session.listen)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _extend_sys_path(pythonpath: str) -> None:
    """Make a ``PYTHONPATH`` from the launch environment importable in this forked child.

    The interpreter reads ``PYTHONPATH`` only when it starts, and a forked worker never
    starts: without this, ``env_configs: [{PYTHONPATH: /opt/ext}]`` would show in
    ``os.environ`` and import nothing. New entries go where the interpreter puts them:
    first, before the standard library (the zygote has no script-directory entry ahead of
    them, `working_directory_last`)."""
    new = [e for e in dict.fromkeys(pythonpath.split(os.pathsep)) if e and e not in sys.path]
    sys.path[0:0] = new


def working_directory_last() -> None:
    """Put the directory this process started in last on ``sys.path``.

    The node agent starts the zygote (and an exec'd worker) in its own working directory,
    which for an embedded cluster is the driver's, without that directory on ``sys.path``
    (`aiorl.util.processes.python_module_command`): first, a ``json.py``, a package named
    like an installed one, or any folder named ``aiorl`` lying there shadowed the installed
    module in every worker. Last, modules that exist only there still import (a driver
    started from a REPL ships no entry for it), and installed ones win. The driver's own
    entries are appended after it when a worker loads its class
    (`aiorl.actors.worker_process`). Call before importing user code."""
    here = os.getcwd()
    entries = [e for e in sys.path if e and os.path.abspath(e) == here]
    if not entries:
        sys.path.append(here)
    elif sys.path[-1] not in entries:
        for e in entries:
            sys.path.remove(e)
        sys.path.append(entries[0])


#: Settings torch reads once, when it is imported: a worker that gives one a value other
#: than the zygote's (which imported torch already) cannot be forked. Forked anyway, a
#: worker asking for ``backend:cudaMallocAsync`` failed its first CUDA allocation with
#: "Allocator backend parsed at runtime != allocator backend parsed at load time".
READ_WHEN_TORCH_LOADS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _needs_exec(spec: WorkerSpawn) -> bool:
    """A worker under a profiler, with an interpreter other than ours, or with a setting torch
    read when this zygote imported it, must start as a new program; naming this very
    interpreter (RLinf configs often do) still forks."""
    interpreter = spec.launch.python_interpreter
    other = interpreter is not None and (
        os.path.realpath(interpreter) != os.path.realpath(sys.executable))
    env = spec.launch.env
    torch_settings = "torch" in sys.modules and any(
        name in env and env[name] != os.environ.get(name) for name in READ_WHEN_TORCH_LOADS)
    return bool(spec.launch.launcher) or other or torch_settings


def _exec_worker(spec: WorkerSpawn, session: _Session) -> int:
    """Replace this forked child with ``launcher... python -m aiorl.node.exec_worker FD``.

    Everything the worker needs travels in a memfd inherited as ``FD`` (see
    `aiorl.node.exec_worker`). Returns only when exec fails: the reason goes to the
    worker's log, whose last lines reach the driver with the exit code (127, as a shell
    reports a missing program)."""
    launch = spec.launch
    fd = os.memfd_create("aiorl-worker-spawn", 0)
    data = pickle.dumps((spec, session.keys, session.listen), protocol=5)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    os.set_inheritable(fd, True)
    output_dir = os.environ.get("AIORL_PROFILE_OUTPUT_DIR")
    if launch.launcher and output_dir:
        os.makedirs(output_dir, exist_ok=True)  # nsys does not create it
    argv = [*launch.launcher, *python_module_command(
        "aiorl.node.exec_worker", str(fd), interpreter=launch.python_interpreter)]
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"aiorl: cannot start worker {spec.name} as {' '.join(argv[:-1])} ...: "
              f"{argv[0]!r}: {exc.strerror or exc} (is it installed and on the node's PATH?)",
              file=sys.stderr, flush=True)
    return 127


def serve(channel: socket.socket, parent_pid: int) -> None:
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:
        return
    # Whatever thread of the agent started us, this thread, and every worker forked from
    # it, takes SIGINT and SIGTERM (a mask survives exec and fork).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SHIELDED)
    cuda_culprit = _preload()
    if cuda_culprit is not None:
        print(_refuse_fork_message(cuda_culprit), file=sys.stderr, flush=True)
    # Children inherit a frozen heap: their collections skip these ~200k objects, and
    # leaving them untouched keeps the pages shared with the zygote (no copy-on-write).
    gc.freeze()
    write_message(channel, ("ready", os.getpid()))

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler must exist for the wakeup fd
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sel = selectors.DefaultSelector()
    sel.register(channel, selectors.EVENT_READ, "channel")
    sel.register(wake_r, selectors.EVENT_READ, "signal")
    my_pid = os.getpid()
    session: _Session | None = None  # no worker starts before the agent said how
    while True:
        for key, _ in sel.select():
            if key.data == "signal":
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                _reap(channel)
                continue
            msg = read_message(channel)
            if msg is None:
                return  # the agent is gone; PDEATHSIG takes our children with us
            if msg[0] == "session":  # sent once, before any spawn
                session = _Session(msg[1], msg[2])
                continue
            op, spawn_id, spec = msg
            if op != "spawn":
                continue
            if session is None:
                write_message(channel, ("spawn_failed", spawn_id, "the agent sent no session"))
                continue
            try:
                pid = os.fork()
            except OSError as exc:
                write_message(channel, ("spawn_failed", spawn_id, repr(exc)))
                continue
            if pid == 0:
                _child(spec, session, channel, my_pid, exec_always=cuda_culprit is not None)
            write_message(channel, ("spawned", spawn_id, pid))


def _reap(channel: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        write_message(channel, ("exited", pid, status))


def main() -> None:
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    channel = socket.socket(fileno=fd)
    try:
        serve(channel, parent_pid)
    except (KeyboardInterrupt, SystemExit, BrokenPipeError):
        pass


if __name__ == "__main__":
    # Installed modules win over what lies in the working directory, which stays importable
    # (before any user code is imported: the preload, the worker class).
    working_directory_last()
    main()
