"""``aiorl slurm`` on a real Slurm: the sbatch template runs, and nothing is left afterwards.

The ``slurm`` fixture runs Debian's ``slurm-wlm`` on this machine: ``slurmctld`` and one
``slurmd`` (one node: this machine) in the foreground, with ``AuthType=auth/none`` and a
``slurm.conf`` generated into a temporary directory that holds every file they write
(state, spool, logs); ``SLURM_CONF`` points the client commands at it. The fixture stops
both and removes the directory. Without ``slurmctld`` (``apt-get install slurm-wlm``), or
when not root (``slurmd`` starts job steps as their user), those tests skip.

Jobs run with ``TMPDIR`` set to a directory of the test, so the private directories of the
launcher and the node helpers land there and the test can check that none is left; every
process of a job carries ``SLURM_JOB_ID`` in its environment (workers inherit it from their
node agent), which is how the test finds them all, then checks that none outlives the job.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil
import pytest

from aiorl.cli.slurm import accelerator_options
from tests._paths import REPO_ROOT
from tests._processes import gone_within

ROOT = REPO_ROOT
EXAMPLE = ROOT / "examples" / "slurm"

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------------------- without Slurm
@pytest.mark.timeout(30)
def test_accelerators_follow_what_slurm_gave_the_job() -> None:
    # Slurm's CUDA_VISIBLE_DEVICES: the agent counts (and maps) those devices itself.
    assert accelerator_options({"CUDA_VISIBLE_DEVICES": "2,3"}, None, 8) == ([], None)
    # aiorl slurm --accelerators N wins.
    assert accelerator_options({"CUDA_VISIBLE_DEVICES": "0"}, 4, 8) == (
        ["--accelerators", "4"], None)
    # GPUs counted by Slurm without CUDA_VISIBLE_DEVICES (not NVIDIA): declared.
    assert accelerator_options({"SLURM_GPUS_ON_NODE": "2"}, None, 0) == (
        ["--accelerators", "2"], None)
    # The node has GPUs but the job asked for none: they are other jobs'.
    options, note = accelerator_options({}, None, 8)
    assert options == ["--accelerators", "0"] and note and "gave this job none" in note
    # A CPU node: nothing to say.
    assert accelerator_options({}, None, 0) == ([], None)


@pytest.mark.timeout(60)
def test_aiorl_slurm_outside_an_allocation_says_so() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run([sys.executable, "-m", "aiorl.cli.main", "slurm", "--", "true"],
                            env=env, capture_output=True, text=True, timeout=50)
    assert result.returncode == 2
    assert "inside a Slurm allocation" in result.stderr


# ---------------------------------------------------------------------------- the fixture
@dataclass
class LocalSlurm:
    """A running slurmctld + slurmd, and how to submit jobs to them."""

    directory: pathlib.Path
    env: dict[str, str]  # SLURM_CONF, and the PATH that finds this venv's aiorl and python
    job_tmp: pathlib.Path  # TMPDIR of every job

    def run(self, *command: str, timeout: float = 30) -> str:
        result = subprocess.run(list(command), env=self.env, capture_output=True, text=True,
                                timeout=timeout)
        assert result.returncode == 0, f"{command}: {result.stderr}"
        return result.stdout

    def queued(self, job: str | None = None) -> list[str]:
        """Job ids still pending, running or completing."""
        return self.run("squeue", "-h", "-o", "%i", *(["-j", job] if job else [])).split()

    def node_state(self, node: str) -> str:
        """``sinfo``'s state of ``node`` ("" while slurmctld does not answer yet)."""
        result = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], env=self.env,
                                capture_output=True, text=True, timeout=30)
        return result.stdout.strip() if result.returncode == 0 else ""

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((self.directory / "log").glob("*")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _slurm_conf(directory: pathlib.Path, node: str) -> str:
    return textwrap.dedent(f"""\
        ClusterName=aiorltest
        SlurmctldHost={node}(127.0.0.1)
        SlurmctldPort={_free_port()}
        SlurmdPort={_free_port()}
        # No munge: this Slurm accepts only what this machine sends it.
        AuthType=auth/none
        CredType=cred/none
        SlurmUser=root
        SlurmdUser=root
        StateSaveLocation={directory}/state
        SlurmdSpoolDir={directory}/spool
        SlurmctldPidFile={directory}/slurmctld.pid
        SlurmdPidFile={directory}/slurmd.pid
        SlurmctldLogFile={directory}/log/slurmctld.log
        SlurmdLogFile={directory}/log/slurmd.log
        PlugStackConfig={directory}/plugstack.conf
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        SchedulerType=sched/builtin
        SelectType=select/cons_tres
        SelectTypeParameters=CR_Core
        MpiDefault=none
        ReturnToService=2
        JobCompType=jobcomp/none
        AccountingStorageType=accounting_storage/none
        JobAcctGatherType=jobacct_gather/none
        # KillWait stays at its default (30 s): the teardown must fit in what sites allow.
        NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
        PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
        """)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def slurm() -> Iterator[LocalSlurm]:
    # This venv first (the jobs run its aiorl and python); the daemons live in /usr/sbin.
    path = f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    missing = [c for c in ("slurmctld", "slurmd", "sbatch", "salloc", "srun", "squeue", "scancel")
               if shutil.which(c, path=path) is None]
    if missing:
        pytest.skip(f"Slurm is not installed (no {', '.join(missing)}): apt-get install "
                    "slurm-wlm to run these tests")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to start job steps")
    directory = pathlib.Path(tempfile.mkdtemp(prefix="aiorl-test-slurm-"))
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        for sub in ("state", "spool", "log", "jobtmp"):
            (directory / sub).mkdir()
        node = socket.gethostname().split(".")[0]
        conf = directory / "slurm.conf"
        conf.write_text(_slurm_conf(directory, node))
        (directory / "plugstack.conf").write_text("")  # no SPANK plugins
        # The jobs' environment: that PATH, a TMPDIR of ours, nothing of an aiorl or Slurm
        # session this test may itself run in.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("AIORL_", "SLURM_")) and k != "XDG_RUNTIME_DIR"}
        env.update(SLURM_CONF=str(conf), TMPDIR=str(directory / "jobtmp"), PATH=path)
        local = LocalSlurm(directory, env, directory / "jobtmp")
        for daemon in (["slurmctld", "-D", "-i"], ["slurmd", "-D"]):
            with open(directory / "log" / f"{daemon[0]}.stderr", "wb") as err:
                daemons.append(subprocess.Popen([shutil.which(daemon[0], path=path) or daemon[0],
                                                 *daemon[1:], "-f", str(conf)], env=env,
                                                stdout=err, stderr=err))
        _wait_until(lambda: any(d.poll() is not None for d in daemons)
                    or local.node_state(node) == "idle", 30, "the node to be idle")
        assert all(d.poll() is None for d in daemons), f"a Slurm daemon exited\n{local.logs()}"
        yield local
        jobs = local.queued()
        if jobs:
            local.run("scancel", *jobs)
            _wait_until(lambda: not local.queued(), 60, "cancelled jobs to end")
    finally:
        for daemon in reversed(daemons):
            _stop(daemon)
        shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------------------- checks
def job_processes(job: str) -> list[psutil.Process]:
    """Every live process of Slurm job ``job`` (found by SLURM_JOB_ID in its environment)."""
    found = []
    for p in psutil.process_iter():
        try:
            if (p.status() != psutil.STATUS_ZOMBIE
                    and p.environ().get("SLURM_JOB_ID") == job):
                found.append(p)
        except (psutil.Error, OSError):
            pass  # gone, or a kernel thread
    return found


def left_files(slurm: LocalSlurm) -> list[str]:
    """What aiorl left in the jobs' TMPDIR (torch's own cache directory is not aiorl's)."""
    return sorted(p.name for p in slurm.job_tmp.iterdir() if p.name.startswith("aiorl"))


def describe(processes: list[psutil.Process]) -> str:
    lines = []
    for p in processes:
        try:
            lines.append(f"{p.pid}: {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            pass
    return "\n".join(lines)


def submit(slurm: LocalSlurm, script: pathlib.Path, workdir: pathlib.Path,
           output: pathlib.Path, *, wait: bool) -> subprocess.CompletedProcess[str]:
    # -o on the command line overrides the template's #SBATCH --output.
    command = ["sbatch", "--parsable", "-D", str(workdir), "-o", str(output), str(script)]
    return subprocess.run(command[:1] + (["--wait"] if wait else []) + command[1:],
                          env=slurm.env, capture_output=True, text=True, timeout=200)


# ---------------------------------------------------------------------------- the tests
def test_the_sbatch_template_runs_a_group_and_leaves_nothing(
        slurm: LocalSlurm, tmp_path: pathlib.Path) -> None:
    output = tmp_path / "train.out"
    result = submit(slurm, EXAMPLE / "train.sbatch", EXAMPLE, output, wait=True)
    text = output.read_text() if output.exists() else ""
    assert result.returncode == 0, f"{result.stderr}\n{text}\n{slurm.logs()}"
    job = result.stdout.strip().split(";")[0]
    assert "registry tcp://" in text and "1 node agent(s) joined" in text, text
    assert "rank 1 on " in text, text
    assert "2 ranks on 1 node(s) answered; sum 3" in text, text
    assert ("stopped the agents step (srun exit code 0) and the registry step (srun exit "
            "code 0)") in text, text
    # The launcher waited for every step to end before the job ended: nothing is left.
    _wait_until(lambda: not job_processes(job), 10, "the job's processes to end")
    assert left_files(slurm) == []


#: A driver that launches a group, says where its workers and key are, then waits: for
#: scancel, or for SIGUSR1 (then it ends normally).
HOLD_DRIVER = """\
import os, signal, sys, time
import aiorl

class Hold(aiorl.Worker):
    def pid(self):
        return os.getpid()

def usr1(signum, frame):
    print("the driver got SIGUSR1", flush=True)
    sys.exit(0)

signal.signal(signal.SIGUSR1, usr1)
with aiorl.Cluster() as cluster:
    group = Hold.create_group().launch(cluster, num_workers=2, name="hold")
    print("WORKERS", *group.pid().wait(120), flush=True)
    print("KEY", os.environ["AIORL_KEY_FILE"], flush=True)
    time.sleep(600)
"""


def start_holding_job(slurm: LocalSlurm, tmp_path: pathlib.Path) -> tuple[str, pathlib.Path]:
    """Submit HOLD_DRIVER under aiorl slurm; return its job id and output file once its
    group has answered."""
    (tmp_path / "hold.py").write_text(HOLD_DRIVER)
    (tmp_path / "hold.sbatch").write_text("#!/bin/bash\nexec aiorl slurm -- python hold.py\n")
    output = tmp_path / "hold.out"
    result = submit(slurm, tmp_path / "hold.sbatch", tmp_path, output, wait=False)
    assert result.returncode == 0, result.stderr
    job = result.stdout.strip().split(";")[0]

    def holding() -> bool:
        text = output.read_text() if output.exists() else ""
        assert job in slurm.queued(job), f"the job ended early:\n{text}"
        return "KEY " in text

    _wait_until(holding, 150, "the job's group to answer")
    return job, output


def test_scancel_stops_every_process_and_removes_every_file(
        slurm: LocalSlurm, tmp_path: pathlib.Path) -> None:
    job, output = start_holding_job(slurm, tmp_path)
    lines = output.read_text().splitlines()
    workers = {int(p) for p in next(ln for ln in lines if ln.startswith("WORKERS")).split()[1:]}
    key_file = pathlib.Path(next(ln for ln in lines if ln.startswith("KEY ")).split(" ", 1)[1])

    # While the job runs: its key files are private, and every part of it runs.
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    for directory in slurm.job_tmp.glob(f"aiorl-slurm-{job}-*"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert stat.S_IMODE((directory / "cluster.key").stat().st_mode) == 0o600
    assert len(left_files(slurm)) == 3  # the launcher's, the registry's and the agent's
    running = job_processes(job)
    commands = describe(running)
    for part in ("aiorl slurm", "aiorl.cli.slurm registry", "aiorl.cli.slurm agent",
                 "aiorl.registry.service", "aiorl.node.agent", "aiorl.node.zygote", "hold.py"):
        assert part in commands, f"{part} is not running:\n{commands}"
    assert workers <= {p.pid for p in running}

    started = time.monotonic()
    slurm.run("scancel", job)
    _wait_until(lambda: not slurm.queued(job), 60, "the cancelled job to end")
    took = time.monotonic() - started
    assert gone_within([p.pid for p in running], 10), describe(job_processes(job))
    assert job_processes(job) == []
    text = output.read_text()
    assert left_files(slurm) == [], f"{text}\n{slurm.logs()}"
    # The launcher cleaned up on SIGTERM, not SIGKILL after KillWait (30 s).
    assert "SIGTERM received" in text and "stopped the agents step" in text, text
    assert took < 25, f"the teardown took {took:.1f} s\n{text}"


def test_a_signal_for_the_batch_shell_reaches_the_driver(
        slurm: LocalSlurm, tmp_path: pathlib.Path) -> None:
    # What `#SBATCH --signal=B:USR1@60` sends before the time limit; the launcher (exec'd
    # by the script) passes it to the driver, which here ends, and the job ends normally.
    job, output = start_holding_job(slurm, tmp_path)
    slurm.run("scancel", "--batch", "--signal=USR1", job)
    _wait_until(lambda: not slurm.queued(job), 60, "the job to end")
    text = output.read_text()
    assert "the driver got SIGUSR1" in text and "the command exited with code 0" in text, text
    _wait_until(lambda: not job_processes(job), 10, "the job's processes to end")
    assert left_files(slurm) == []


def test_salloc_runs_the_driver_where_salloc_runs(slurm: LocalSlurm) -> None:
    # Under salloc the launcher and the driver run where salloc runs (a login node; here
    # the same machine), outside the allocation; the registry and agents run in it.
    result = subprocess.run(
        ["salloc", "--nodes=1", "aiorl", "slurm", "--", "python", str(EXAMPLE / "train.py")],
        env=slurm.env, capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "2 ranks on 1 node(s) answered; sum 3" in result.stdout, result.stdout
    job = next(word for line in result.stderr.splitlines() if "Granted job allocation" in line
               for word in line.split() if word.isdigit())
    _wait_until(lambda: not job_processes(job), 10, "the job's processes to end")
    assert left_files(slurm) == []


def test_scancel_of_an_salloc_job_stops_the_driver_outside_it(
        slurm: LocalSlurm, tmp_path: pathlib.Path) -> None:
    # Slurm signals nothing outside the allocation, where salloc runs the launcher and the
    # driver: the launcher sees its steps end and stops the driver itself.
    (tmp_path / "hold.py").write_text(HOLD_DRIVER)
    output = tmp_path / "salloc.out"
    with open(output, "wb") as out:
        salloc = subprocess.Popen(
            ["salloc", "--nodes=1", "aiorl", "slurm", "--", "python", "hold.py"],
            cwd=tmp_path, env=slurm.env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_until(lambda: salloc.poll() is not None or "KEY " in output.read_text(), 150,
                    "the job's group to answer")
        text = output.read_text()
        assert salloc.poll() is None, text
        job = next(word for line in text.splitlines() if "Granted job allocation" in line
                   for word in line.split() if word.isdigit())
        running = job_processes(job)
        assert "hold.py" in describe(running)
        slurm.run("scancel", job)
        assert salloc.wait(60) == 1  # the launcher's status: the cluster went away
    finally:
        if salloc.poll() is None:
            salloc.kill()
            salloc.wait()
    text = output.read_text()
    assert "the agents step ended while the command ran" in text or (
        "the registry step ended while the command ran" in text), text
    assert gone_within([p.pid for p in running], 10), describe(job_processes(job))
    assert left_files(slurm) == []
