"""``aiorl slurm -- COMMAND``: run an aiorl job inside one Slurm allocation.

Run it in an ``sbatch`` script (``exec aiorl slurm -- python train.py``) or in an ``salloc``
shell. It starts a cluster on the allocation, runs ``COMMAND`` (the driver) against it, and
tears everything down when the command ends or the job is cancelled::

    where the script runs (sbatch: the allocation's first node; salloc: the login node)
      aiorl slurm                            the launcher (this module's main)
        srun step 1: one task on the allocation's first node
          python -m aiorl.cli.slurm registry   a node helper
            aiorl-registry                      listens on that node's address
        srun step 2: one task per node
          python -m aiorl.cli.slurm agent      a node helper
            aiorl-node                          --node-rank $SLURM_NODEID
              zygote -> workers
        COMMAND                               AIORL_REGISTRY and AIORL_KEY_FILE set, so
                                              ``aiorl.Cluster()`` attaches with no address

**Keys.** The launcher creates the cluster's key file in a private directory of its own
(``<tmp>/aiorl-slurm-<job id>-*``, mode 0700; the file 0600) and hands the key text to each
helper on the helper's standard input (srun forwards its stdin to every task): no shared
filesystem is needed and the secret is never in an environment or on a command line. Each
helper writes it into a private directory on its node, which also holds the agent's worker
logs.

**Teardown.** A helper stops its agent or registry when its standard input reaches end of
file, which srun forwards when the launcher closes the pipe, or when Slurm sends it SIGTERM;
then it removes its directory. So, when the driver exits, the launcher closes the agents'
step, then the registry's, waits for both steps to end and removes its own directory. When
the job is cancelled (``scancel``, time limit), Slurm sends SIGCONT then SIGTERM to every
process of every step and SIGKILL ``KillWait`` seconds later (30 by default): the launcher
and every helper clean up on the SIGTERM, well within that time. The agents stop their
workers themselves (SIGTERM to an agent kills its workers; workers also die with their
zygote, and the zygote with its agent). Under ``salloc`` the launcher and the driver run
outside the allocation, where Slurm signals nothing: when a step ends while the driver runs
(the allocation was revoked, a node failed), the launcher stops the driver itself.
The launcher signals an srun only as a last resort: srun answers SIGTERM by killing its
tasks with SIGKILL, which leaves their directories behind.

What is left after SIGKILL (a node that died, a teardown that outlived ``KillWait``): the
``<tmp>/aiorl-slurm-<job id>-*`` directories of that job, which a Slurm epilog can remove
(docs/deploy.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any, BinaryIO

from aiorl.errors import AuthenticationError
from aiorl.node.agent import detect_accelerators
from aiorl.transport import security
from aiorl.util.processes import python_module_command
from aiorl.util.threads import RuntimeThread

__all__ = ["accelerator_options", "add_parser", "node_address", "node_main", "run"]

#: The line ``aiorl-registry --print-address`` prints once it listens.
REGISTRY_LINE = "AIORL_REGISTRY="
#: The line ``aiorl-node`` prints once it joined the registry.
NODE_READY_LINE = "AIORL_NODE_READY="
#: Variables the launcher does not pass on: the key travels on stdin instead, a registry
#: address or node IP from the submitting shell would name the wrong machine, and
#: ``AIORL_INSECURE=1`` would make the driver refuse this cluster's keys.
_DROPPED_VARIABLES = (
    security.ENV_PUBLIC, security.ENV_SECRET, security.ENV_KEY_FILE, security.ENV_MECHANISM,
    security.ENV_INSECURE, "AIORL_REGISTRY", "AIORL_NODE_IP",
)
#: Seconds the driver gets to exit after SIGTERM, then SIGKILL.
DRIVER_GRACE_S = 5.0
#: Seconds a step gets to end after its stdin closed (helpers stop their child in <= 8 s).
STEP_GRACE_S = 10.0
#: Seconds a helper's aiorl-node or aiorl-registry gets to exit, then SIGKILL.
CHILD_GRACE_S = 8.0
#: The signals that stop the launcher and the helpers. SIGCONT, which Slurm sends before
#: SIGTERM to wake stopped processes, needs nothing: its default action only continues.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(Exception):
    """A stop signal arrived (raised by the signal handler in the main thread)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_on_stop_signals() -> None:
    """The launcher's handling: the first stop signal raises `Stopped` where the
    main thread waits (for the steps to start, for the driver to end)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        _ignore_stop_signals()
        raise Stopped(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def _ignore_stop_signals() -> None:
    """From here on, nothing interrupts the teardown: Slurm may send SIGTERM while the
    launcher is already tearing down after the driver's normal end."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class _SignalPipe:
    """A node helper's handling: stop signals arrive as bytes on a pipe, which its select
    loop reads like its other inputs. No signal ever interrupts the helper, so its teardown
    (stop the child, remove the directory) always runs to the end, whatever order the end
    of stdin and Slurm's SIGTERM come in."""

    def __init__(self) -> None:
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        # Python's C-level handler writes each caught signal's number to this fd; a
        # signal is caught when it has a Python handler, which need do nothing else.
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, frame: None)


def _say(message: str) -> None:
    print(f"aiorl slurm: {message}", file=sys.stderr, flush=True)


def _private_directory(what: str) -> str:
    """A fresh 0700 directory named after the job, so that an epilog can find it."""
    job = os.environ.get("SLURM_JOB_ID", "nojob")
    return security.make_private_directory(f"aiorl-slurm-{job}-{what}-")


def _clean_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_VARIABLES}
    env.update(extra or {})
    return env


# ============================================================================ the launcher
class _Step:
    """One ``srun`` of node helpers: its stdin carries the key (and its end, the stop),
    its stdout the helpers' ready lines, read by a thread that echoes any other line and
    sets ``ended`` when srun's output ends (every helper of the step has exited)."""

    def __init__(self, name: str, srun_options: list[str], helper_args: list[str],
                 key_text: bytes, ended: threading.Event) -> None:
        self.name = name
        self.finished = False
        self._ended = ended
        # --export=ALL: the helpers need this environment even under sbatch --export=NONE.
        command = ["srun", "--overlap", "--input=all", "--mem=0", "--export=ALL",
                   f"--job-name=aiorl-{name}", *srun_options,
                   *python_module_command("aiorl.cli.slurm", *helper_args)]
        # A session of its own: a Ctrl-C in an salloc shell reaches the launcher, which stops
        # the step by closing its stdin, not srun (whose SIGINT handling would kill it).
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=_clean_environment(), start_new_session=True)
        assert self.process.stdin is not None
        self.process.stdin.write(key_text + b"\n")  # a blank line ends the key
        self.process.stdin.flush()
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = RuntimeThread(target=self._read, name=f"aiorl-slurm-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith((REGISTRY_LINE, NODE_READY_LINE)):
                self.lines.put(line)
            else:
                print(line, flush=True)
        self.finished = True
        self.lines.put(None)  # end of file: every helper of the step has exited
        self._ended.set()

    def wait_for(self, prefix: str, count: int, deadline: float) -> list[str]:
        """The values of the first ``count`` lines starting with ``prefix``."""
        values: list[str] = []
        while len(values) < count:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"the {self.name} step did not start within the timeout "
                                   f"({len(values)} of {count} ready)") from None
            if line is None:
                code = self.process.wait()
                raise RuntimeError(f"the {self.name} step ended before it was ready (srun "
                                   f"exited with code {code}; its output is above)")
            values.append(line.split("=", 1)[1])
        return values

    def stop(self) -> int:
        """Close the step's stdin (its helpers stop their child and clean up), then wait for
        srun to end; its exit code. Only if it does not end is srun signalled, which kills
        its tasks (and leaves their directories)."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(STEP_GRACE_S)
        except subprocess.TimeoutExpired:
            _say(f"the {self.name} step did not end {STEP_GRACE_S:.0f} s after its stdin "
                 "closed: killing it")
            _end(self.process, STEP_GRACE_S)
        self._reader.join(timeout=5)
        return self.process.returncode


class SlurmLauncher:
    """The registry and node agents of one Slurm allocation, and the driver run against
    them. `start`, `run_driver`, then always `stop`."""

    def __init__(self, *, accelerators: int | None, timeout: float, log_level: str) -> None:
        self.job_id = os.environ["SLURM_JOB_ID"]
        self.num_nodes = int(os.environ.get("SLURM_JOB_NUM_NODES")
                             or os.environ.get("SLURM_NNODES") or 1)
        self.accelerators = accelerators
        self.timeout = timeout
        self.log_level = log_level
        self.directory: str | None = None
        self.steps: list[_Step] = []
        self.driver: subprocess.Popen[bytes] | None = None
        self.address = ""
        #: Set when the driver exits or a step ends, whichever comes first.
        self.ended = threading.Event()

    @property
    def key_file(self) -> str:
        assert self.directory is not None
        return os.path.join(self.directory, "cluster.key")

    def start(self) -> None:
        """Write the key, start the registry on the first node, then one agent per node;
        return once every agent has joined (or raise RuntimeError)."""
        deadline = time.monotonic() + self.timeout
        self.directory = _private_directory("driver")
        security.ClusterKeys.generate().save(self.key_file)
        with open(self.key_file, "rb") as f:
            key_text = f.read()
        common = ["--log-level", self.log_level]
        registry = _Step("registry", ["--nodes=1", "--ntasks=1", "--relative=0"],
                         ["registry", *common], key_text, self.ended)
        self.steps.append(registry)
        [self.address] = registry.wait_for(REGISTRY_LINE, 1, deadline)
        agent_args = ["agent", "--registry", self.address, "--num-nodes", str(self.num_nodes),
                      *common]
        if self.accelerators is not None:
            agent_args += ["--accelerators", str(self.accelerators)]
        n = self.num_nodes
        agents = _Step("agents", [f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1"],
                       agent_args, key_text, self.ended)
        self.steps.append(agents)
        agents.wait_for(NODE_READY_LINE, n, deadline)
        _say(f"job {self.job_id}: registry {self.address}, {n} node agent(s) joined")

    def run_driver(self, command: Sequence[str]) -> int:
        """Run ``command`` with the cluster's address and key file; its exit status."""
        env = _clean_environment({"AIORL_REGISTRY": self.address,
                                  security.ENV_KEY_FILE: self.key_file})
        driver = self.driver = subprocess.Popen(list(command), env=env)

        def watch() -> None:
            driver.wait()
            self.ended.set()

        # RuntimeThread: the signals that stop the launcher wake its main thread's wait.
        RuntimeThread(target=watch, name="aiorl-slurm-driver", daemon=True).start()
        self.ended.wait()
        code = driver.poll()
        if code is None:
            # The cluster went away under the driver: Slurm revoked the allocation (scancel
            # of an salloc job signals nothing outside the allocation, where the launcher
            # and driver run) or a node failed. The driver would wait on it forever.
            step = next(s.name for s in self.steps if s.finished)
            raise RuntimeError(f"the {step} step ended while the command ran (allocation "
                               "revoked, or a node failed): stopping the command")
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as shells say

    def forward_signal(self, signum: int, frame: FrameType | None) -> None:
        """SIGUSR1/SIGUSR2 (``sbatch --signal=B:USR1@60``: time is running out) go to the
        driver, which may checkpoint; the launcher itself carries on."""
        if self.driver is not None and self.driver.poll() is None:
            self.driver.send_signal(signum)

    def stop(self) -> str:
        """Stop the driver if it still runs, then the agents, then the registry (agents
        unregister from a live registry); remove the key's directory. Says what it did."""
        if self.driver is not None and self.driver.poll() is None:
            _end(self.driver, DRIVER_GRACE_S)
        ended = [f"the {step.name} step (srun exit code {step.stop()})"
                 for step in reversed(self.steps)]
        said = f"stopped {' and '.join(ended) or 'nothing'}"
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            said += f"; removed {self.directory}"
        return said


def run(args: argparse.Namespace) -> int:
    """``aiorl slurm``: returns the driver's exit status (128 + N when a signal N stopped
    the job; 1 when the cluster did not start or went away under the driver; 2 on a usage
    error)."""
    command = list(args.program)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("error: aiorl slurm needs a command: aiorl slurm -- python train.py",
              file=sys.stderr)
        return 2
    if not os.environ.get("SLURM_JOB_ID"):
        print("error: aiorl slurm runs inside a Slurm allocation (an sbatch script or an "
              "salloc shell): SLURM_JOB_ID is not set", file=sys.stderr)
        return 2
    if shutil.which("srun") is None:
        print("error: srun is not on PATH", file=sys.stderr)
        return 2
    launcher = SlurmLauncher(accelerators=args.accelerators, timeout=args.timeout,
                             log_level=args.log_level)
    _raise_on_stop_signals()
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, launcher.forward_signal)
    code = 1
    try:
        launcher.start()
        code = launcher.run_driver(command)
        _say(f"the command exited with code {code}; stopping the cluster")
    except Stopped as stop:
        _say(f"{stop} received; stopping the command and the cluster")
        code = 128 + stop.signum
    except (RuntimeError, OSError) as exc:
        _say(f"error: {exc}")
    finally:
        _ignore_stop_signals()
        _say(launcher.stop())
    return code


def add_parser(subparsers: Any) -> None:
    """Add the ``slurm`` subcommand to the ``aiorl`` command."""
    parser = subparsers.add_parser(
        "slurm", help="run a command against an aiorl cluster on this Slurm allocation",
        description="Inside an sbatch script or an salloc shell: start aiorl-registry on the "
                    "allocation's first node and one aiorl-node per node (srun), run COMMAND "
                    "with AIORL_REGISTRY and AIORL_KEY_FILE set, and stop everything when it "
                    "ends or the job is cancelled. See docs/deploy.md, section Slurm.")
    parser.add_argument("--accelerators", type=int, default=None, metavar="N",
                        help="declare N accelerators on every node (default: the GPUs Slurm "
                             "gave this job on each node, from CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for the registry and every node agent")
    parser.add_argument("--log-level", default="WARNING",
                        help="log level of aiorl-registry and aiorl-node (default WARNING)")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the driver to run, e.g. -- python train.py")
    parser.set_defaults(func=run)


# ============================================================================ node helpers
def accelerator_options(env: Mapping[str, str], declared: int | None,
                        detected: int) -> tuple[list[str], str | None]:
    """The ``aiorl-node`` options that give an agent the accelerators Slurm gave this job on
    its node, and a note to print (or None).

    ``declared`` is ``aiorl slurm --accelerators``; ``detected`` what the agent would find on
    its own without ``CUDA_VISIBLE_DEVICES`` (the ``/dev/nvidia*`` devices).

    Example:
        ```python
        accelerator_options({"CUDA_VISIBLE_DEVICES": "2,3"}, None, 8)  # ([], None): 2 GPUs
        ```
    """
    if declared is not None:
        return ["--accelerators", str(declared)], None
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [], None  # set by Slurm for the step's GPUs: the agent counts and maps these
    on_node = env.get("SLURM_GPUS_ON_NODE", "")
    if on_node.isdigit() and int(on_node) > 0:  # GPUs without CUDA_VISIBLE_DEVICES (not NVIDIA)
        return ["--accelerators", on_node], None
    if detected:
        # The job asked Slurm for no GPUs: those on the node belong to other jobs.
        return ["--accelerators", "0"], (
            f"this node has {detected} GPU(s) but Slurm gave this job none "
            "(no CUDA_VISIBLE_DEVICES): the agent declares 0; request GPUs from Slurm "
            "(--gpus-per-node) or pass aiorl slurm --accelerators N")
    return [], None


def node_address() -> str:
    """This node's address as the job's other nodes (and the driver) reach it: the
    hostname's, unless that is a loopback address (``/etc/hosts`` on some distributions
    says so), then the first one ``hostname -I`` lists; loopback only when there is no
    other. (``AIORL_NODE_IP`` is not read: from a job script it would be one value on
    every node.)"""
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = "127.0.0.1"
    if not address.startswith("127."):
        return address
    try:
        listed = subprocess.run(["hostname", "-I"], capture_output=True, text=True,
                                timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        listed = []
    ipv4 = [a for a in listed if ":" not in a and not a.startswith("127.")]
    return ipv4[0] if ipv4 else address


def _read_key_text(stdin_fd: int, signal_fd: int) -> bytes | None:
    """The key text the launcher writes first on our stdin, up to its blank line; None
    when a stop signal comes first."""
    data = b""
    with selectors.DefaultSelector() as selector:
        selector.register(stdin_fd, selectors.EVENT_READ)
        selector.register(signal_fd, selectors.EVENT_READ)
        while b"\n\n" not in data:
            ready = {key.fd for key, _ in selector.select()}
            if signal_fd in ready:
                return None
            chunk = os.read(stdin_fd, 4096)
            if not chunk:
                raise RuntimeError("stdin closed before the cluster key arrived")
            data += chunk
    return data.split(b"\n\n", 1)[0] + b"\n"


def _write_key_file(directory: str, text: bytes) -> str:
    path = os.path.join(directory, "cluster.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(text)
    security.ClusterKeys.load(path)  # what the child will do: a torn key fails here, clearly
    return path


def _child_command(args: argparse.Namespace, key_file: str, directory: str
                   ) -> tuple[list[str], dict[str, str]]:
    host = node_address()
    common = ["--key-file", key_file, "--exit-on-stdin-close", "--log-level", args.log_level]
    env = _clean_environment()
    if args.role == "registry":
        # Port 0: any free port, so two jobs sharing a node never collide.
        return python_module_command("aiorl.registry.service", "--host", host, "--port", "0",
                                     "--print-address", *common), env
    if args.num_nodes > 1 and host.startswith("127."):
        raise RuntimeError(f"{socket.gethostname()} has no address but loopback ({host}): "
                           "the job's other nodes cannot reach it")
    options, note = accelerator_options(env, args.accelerators, detect_accelerators()[0])
    if note:
        print(f"aiorl slurm: {socket.gethostname()}: {note}", file=sys.stderr, flush=True)
    rank = os.environ.get("SLURM_NODEID", "0")
    return [*python_module_command("aiorl.node.agent"), "--registry", args.registry,
            "--host", host, "--node-rank", rank, "--log-dir", os.path.join(directory, "logs"),
            *options, *common], env


def _relay(child: subprocess.Popen[bytes], stdin_fd: int, signal_fd: int,
           out: BinaryIO) -> int:
    """Copy ``child``'s stdout to ours until our stdin ends or a stop signal arrives
    (return 0: stop) or the child exits (return its code)."""
    assert child.stdout is not None
    child_fd = child.stdout.fileno()
    with selectors.DefaultSelector() as selector:
        for fd in (stdin_fd, child_fd, signal_fd):
            selector.register(fd, selectors.EVENT_READ)
        while True:
            # The timeout only bounds how late a child that closed its stdout early is seen.
            for key, _ in selector.select(timeout=1.0):
                if key.fd == signal_fd:
                    return 0  # Slurm is ending the job (scancel, time limit)
                data = os.read(key.fd, 65536)
                if key.fd == stdin_fd and not data:
                    return 0  # srun's stdin closed: the launcher is stopping (or gone)
                if key.fd == child_fd:
                    if data:
                        out.write(data)
                        out.flush()
                    else:
                        selector.unregister(child_fd)
            code = child.poll()
            if code is not None:
                return code or 1  # nobody stopped it: an error, whatever it says


def _stop_child(child: subprocess.Popen[bytes]) -> None:
    """Stop ``child`` as its embedded cluster would: close its stdin and SIGTERM it (the
    agent then kills its workers and unregisters); SIGKILL after CHILD_GRACE_S."""
    if child.poll() is None:
        with contextlib.suppress(OSError):
            if child.stdin is not None:
                child.stdin.close()
        child.terminate()
        try:
            child.wait(CHILD_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    for stream in (child.stdin, child.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def node_main(argv: Sequence[str] | None = None) -> int:
    """A node helper (one srun task): run ``aiorl-registry`` or ``aiorl-node`` on this node
    with the key from stdin, until stdin ends or a stop signal; then remove everything."""
    parser = argparse.ArgumentParser(prog="python -m aiorl.cli.slurm",
                                     description="aiorl slurm's node helper (started by srun)")
    parser.add_argument("role", choices=["registry", "agent"])
    parser.add_argument("--registry", help="agent: the registry's address")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--accelerators", type=int, default=None)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    if args.role == "agent" and not args.registry:
        parser.error("agent needs --registry")
    where = f"{socket.gethostname()}: aiorl-{'registry' if args.role == 'registry' else 'node'}"
    signals = _SignalPipe()
    directory: str | None = None
    child: subprocess.Popen[bytes] | None = None
    code = 0
    try:
        key_text = _read_key_text(sys.stdin.fileno(), signals.read_fd)
        if key_text is None:
            return 0  # stopped before it started
        directory = _private_directory(f"node{os.environ.get('SLURM_NODEID', '0')}")
        key_file = _write_key_file(directory, key_text)
        command, env = _child_command(args, key_file, directory)
        child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        code = _relay(child, sys.stdin.fileno(), signals.read_fd, sys.stdout.buffer)
        if code:
            print(f"aiorl slurm: {where}: it exited with code {code}",
                  file=sys.stderr, flush=True)
    except (RuntimeError, OSError, AuthenticationError) as exc:
        print(f"aiorl slurm: {where}: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        if child is not None:
            _stop_child(child)
        if directory is not None:
            _remove_directory(directory)
    return code


def _remove_directory(directory: str) -> None:
    """Remove a helper's directory; ``AIORL_KEEP_LOGS=1`` keeps the worker logs (never the
    key), as it does for an embedded cluster."""
    if os.environ.get("AIORL_KEEP_LOGS") == "1":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, "cluster.key"))
        print(f"aiorl slurm: {socket.gethostname()}: worker logs kept in {directory}",
              file=sys.stderr, flush=True)
    else:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(node_main())


def _end(process: subprocess.Popen[Any], grace: float) -> None:
    """SIGTERM ``process``; SIGKILL it if it has not ended ``grace`` seconds later."""
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
