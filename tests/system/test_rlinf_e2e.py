"""RLinf drop-in, end to end: one embedded cluster, real worker processes reading their
environment, for every item of issue 14 that involves processes.

* item 3: ``env_configs`` path lists are prepended to the node's (default ``append``),
  replaced under ``AIORL_PATH_ENV_MERGE_MODE=override``; other variables replaced;
* item 4: a profiled group starts under ``nsys`` (a stand-in on ``PATH`` that records
  its argv and environment, then execs the rest); a missing profiler fails the launch
  with its name;
* item 5: two node groups declaring robots on one node are used together;
* item 6: ``isolate_gpu=False`` shows every accelerator with ``LOCAL_RANK`` = device id;
  node placement across two node groups; ``python_interpreter_path`` honoured (another
  interpreter is exec'd, the node's own still forks);
* item 7: ``worker_info_list``; ``AIORL_EXT_MODULE``'s ``register()`` runs once per worker
  process, before the worker is built.

One cluster for all of them keeps the module near ten seconds on two busy cores.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import aiorl
from aiorl.placement import ComponentPlacement, NodePlacementStrategy, PackedPlacementStrategy

pytestmark = pytest.mark.timeout(120)

NSYS_STAND_IN = f"""#!{sys.executable}
# Stand-in for Nsight Systems: records how it was called, then runs the command after the
# options (what `nsys profile` does, minus the profiling).
import json, os, sys
args = sys.argv[1:]
assert args[0] == "profile", args
i = 1
while args[i].startswith("-"):
    i += 2 if len(args[i]) == 2 else 1  # "-o VALUE" or "--name=value"
record = {{"argv": sys.argv, "env": {{k: os.environ.get(k) for k in
          ("AIORL_PROFILER", "AIORL_PROFILE_STEPS", "AIORL_WORKER_NAME")}}}}
with open(os.path.join(os.environ["NSYS_RECORD_DIR"], f"nsys-{{os.getpid()}}.json"), "w") as f:
    json.dump(record, f)
os.execvp(args[i], args[i:])
"""

EXT_MODULE = """
import os
REGISTERED = []

def register():
    REGISTERED.append(os.getpid())
    with open(os.environ["EXT_MARKER_FILE"], "a") as f:
        f.write(f"{os.getpid()}\\n")
"""


PYTHON_WRAPPER = f"""#!/bin/sh
# Another "interpreter" (a venv's python, say): marks the environment, runs ours.
export VIA_WRAPPER=1
exec {sys.executable} "$@"
"""


class Probe(aiorl.Worker):
    def env(self, key: str) -> str | None:
        return os.environ.get(key)

    def cmdline(self) -> str:
        # How the interpreter was started (/proc/self/cmdline now shows the worker's title).
        import sys

        return " ".join(sys.orig_argv)

    def ext_registrations(self) -> list[int]:
        import rlinf_test_ext  # registered by AIORL_EXT_MODULE before this class was built

        return list(rlinf_test_ext.REGISTERED)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[aiorl.Cluster, Path]]:
    tmp = tmp_path_factory.mktemp("rlinf")
    (tmp / "bin").mkdir()
    nsys = tmp / "bin" / "nsys"
    nsys.write_text(NSYS_STAND_IN)
    nsys.chmod(0o755)
    (tmp / "ext").mkdir()
    (tmp / "ext" / "rlinf_test_ext.py").write_text(EXT_MODULE)
    (tmp / "records").mkdir()
    wrapper = tmp / "bin" / "python-wrapper"
    wrapper.write_text(PYTHON_WRAPPER)
    wrapper.chmod(0o755)
    cfg = {"cluster": {
        "num_nodes": 2,
        "accelerators_per_node": 4,
        "node_groups": [
            {"label": "train", "node_ranks": 0, "env_configs": [{
                "node_ranks": 0, "python_interpreter_path": sys.executable, "env_vars": [
                {"PATH": str(tmp / "bin")},
                {"PYTHONPATH": str(tmp / "ext")},
                {"LD_LIBRARY_PATH": "/opt/cuda/lib64:/tmp/aiorl-inherited-lib"},
                {"RLINF_STYLE_MARKER": "replaced"},
                {"AIORL_EXT_MODULE": "rlinf_test_ext"},
                {"EXT_MARKER_FILE": str(tmp / "ext-marker")},
                {"NSYS_RECORD_DIR": str(tmp / "records")},
            ]}]},
            {"label": "over", "node_ranks": 1, "env_configs": [{"node_ranks": 1, "env_vars": [
                {"LD_LIBRARY_PATH": "/opt/cuda/lib64"},
                {"AIORL_PATH_ENV_MERGE_MODE": "override"},
            ]}]},
            {"label": "franka_a", "node_ranks": 1, "hardware": {"type": "Franka", "configs": [
                {"node_rank": 1, "robot_ip": "10.0.0.1", "disable_validate": True}]}},
            {"label": "franka_b", "node_ranks": 1, "hardware": {"type": "Franka", "configs": [
                {"node_rank": 1, "robot_ip": "10.0.0.2", "disable_validate": True}]}},
            {"label": "venv", "node_ranks": 1, "env_configs": [
                {"node_ranks": 1, "python_interpreter_path": str(wrapper)}]},
            {"label": "rocm", "node_ranks": 1,
             "profiling": {"backend": "rocprof-sys", "args": {"F": "true"}}},
        ],
        "profiling": {"backend": "nsys", "worker_groups": ["profiled"], "steps": [3],
                      "output_dir": str(tmp / "reports"), "options": {"t": "cuda,nvtx"}},
        "component_placement": {"env": {"node_group": "franka_a,franka_b", "placement": "0-1"}},
    }}
    with pytest.MonkeyPatch.context() as mp:  # what the node agents inherit
        mp.setenv("LD_LIBRARY_PATH", "/tmp/aiorl-inherited-lib:/usr/lib/aiorl-base")
        mp.setenv("RLINF_STYLE_MARKER", "inherited")
        mp.delenv("AIORL_PATH_ENV_MERGE_MODE", raising=False)
        cluster = aiorl.Cluster(cfg)
    try:
        yield cluster, tmp
    finally:
        cluster.close()


def _on(group: str, nodes: list[int]) -> NodePlacementStrategy:
    return NodePlacementStrategy(nodes, node_group=group)


def test_env_configs_merge_path_lists(setup: tuple[aiorl.Cluster, Path]) -> None:
    cluster, tmp = setup
    both = Probe.create_group().launch(cluster, _on("train,over", [0, 1]), name="env-merge")
    ld = both.env("LD_LIBRARY_PATH").wait()
    # append (the default): launch entries first, then the node's, each once
    assert ld[0] == "/opt/cuda/lib64:/tmp/aiorl-inherited-lib:/usr/lib/aiorl-base"
    # override, asked for in the group's env_configs: replaced
    assert ld[1] == "/opt/cuda/lib64"
    assert both.env("RLINF_STYLE_MARKER").wait() == ["replaced", "inherited"]
    path = both.env("PATH").wait()[0].split(os.pathsep)
    assert path[0] == str(tmp / "bin") and len(path) > 1
    assert both.env("NODE_GROUP_LABEL").wait() == ["train", "over"]  # multi-group node placement
    assert [i.node_rank for i in both.worker_info_list] == [0, 1]


def test_profiled_group_runs_under_nsys(setup: tuple[aiorl.Cluster, Path]) -> None:
    cluster, tmp = setup
    group = Probe.create_group().launch(cluster, _on("train", [0]), name="profiled")
    assert group.env("AIORL_PROFILE_STEPS").wait() == ["3"]
    info = group.worker_info_list[0]
    [record_file] = (tmp / "records").glob("nsys-*.json")
    record = json.loads(record_file.read_text())
    argv = record["argv"]
    assert argv[1:4] == ["profile", "-t", "cuda,nvtx"]
    # steps given: nsys gets a capture range so cudaProfilerStart/Stop gate the capture
    assert "--capture-range=cudaProfilerApi" in argv and "--capture-range-end=stop" in argv
    assert argv[argv.index("-o") + 1] == str(tmp / "reports" / "aiorl_profile_profiled_0_%p")
    assert argv[-3:-1] == ["-m", "aiorl.node.exec_worker"]
    assert record["env"] == {"AIORL_PROFILER": "nsys", "AIORL_PROFILE_STEPS": "3",
                             "AIORL_WORKER_NAME": "profiled:0"}
    assert f"nsys-{info.pid}.json" == record_file.name  # the stand-in exec'd the worker
    assert (tmp / "reports").is_dir()
    # Groups the section does not name are forked from the zygote as usual.
    plain = Probe.create_group().launch(cluster, _on("train", [0]), name="unprofiled")
    assert plain.env("AIORL_PROFILER").wait() == [None]
    assert len(list((tmp / "records").glob("nsys-*.json"))) == 1


def test_python_interpreter_path(setup: tuple[aiorl.Cluster, Path]) -> None:
    cluster, _ = setup
    other = Probe.create_group().launch(cluster, _on("venv", [0]), name="venv-python")
    assert other.env("VIA_WRAPPER").wait() == ["1"]
    assert "-m aiorl.node.exec_worker" in other.cmdline().wait()[0]
    # Naming the interpreter the node already runs (RLinf configs do) still forks.
    same = Probe.create_group().launch(cluster, _on("train", [0]), name="same-python")
    assert "aiorl.node.zygote" in same.cmdline().wait()[0]


def test_missing_profiler_fails_the_launch(setup: tuple[aiorl.Cluster, Path]) -> None:
    cluster, _ = setup
    group = Probe.create_group().launch(cluster, _on("rocm", [0]), name="rocm-job")
    with pytest.raises(aiorl.WorkerInitError) as info:
        group.env("PATH").wait(timeout=60)
    assert "rocprof-sys-python" in str(info.value)


def test_two_robot_groups_on_one_node_work_together(setup: tuple[aiorl.Cluster, Path]) -> None:
    cluster, _ = setup
    placement = ComponentPlacement(
        {"cluster": {"component_placement": {
            "env": {"node_group": "franka_a,franka_b", "placement": "0-1"}}}}, cluster)
    assert placement.get_hardware_ranks("env") == [0, 1]
    group = Probe.create_group().launch(cluster, placement.get_strategy("env"), name="robots")
    infos = group.worker_info_list
    assert [(i.node_rank, i.hardware_ranks) for i in infos] == [(1, [0]), (1, [1])]
    assert group.env("NODE_GROUP_LABEL").wait() == ["franka_a", "franka_b"]
    robots = cluster.spec.get_node_hw_configs_by_rank(1)
    assert [r.robot_ip for r in robots] == ["10.0.0.1", "10.0.0.2"]


def test_isolate_gpu_false_shows_every_device(setup: tuple[aiorl.Cluster, Path]) -> None:
    cluster, _ = setup
    shared = Probe.create_group().launch(
        cluster, PackedPlacementStrategy(1, 2), name="shared-gpus", isolate_gpu=False)
    assert shared.env("CUDA_VISIBLE_DEVICES").wait() == ["0,1,2,3", "0,1,2,3"]
    assert shared.env("LOCAL_RANK").wait() == ["1", "2"]  # the real device ids
    isolated = Probe.create_group().launch(cluster, PackedPlacementStrategy(1, 2),
                                           name="own-gpus")
    assert isolated.env("CUDA_VISIBLE_DEVICES").wait() == ["1", "2"]
    assert isolated.env("LOCAL_RANK").wait() == ["0", "1"]
    assert [i.available_accelerators for i in shared.worker_info_list] == [[0, 1, 2, 3]] * 2


def test_ext_module_registers_once_per_worker(setup: tuple[aiorl.Cluster, Path]) -> None:
    cluster, tmp = setup
    group = Probe.create_group().launch(cluster, _on("train", [0, 0]), name="ext")
    pids = [i.pid for i in group.worker_info_list]
    assert group.ext_registrations().wait() == [[pids[0]], [pids[1]]]
    group.ext_registrations().wait()
    marker_pids = [int(line) for line in (tmp / "ext-marker").read_text().split()]
    assert set(pids) <= set(marker_pids)
    assert all(marker_pids.count(pid) == 1 for pid in pids)  # once per process


def test_ext_module_without_register_fails(setup: tuple[aiorl.Cluster, Path]) -> None:
    cluster, _ = setup
    group = Probe.create_group().launch(cluster, _on("train", [0]), name="ext-bad",
                                        env={"AIORL_EXT_MODULE": "json"})
    with pytest.raises(aiorl.WorkerInitError) as info:
        group.env("PATH").wait(timeout=60)
    assert "AIORL_EXT_MODULE module 'json' has no register() function" in str(info.value)
