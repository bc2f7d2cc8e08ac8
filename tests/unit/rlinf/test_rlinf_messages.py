"""RLinf drop-in, the last mile: error messages in RLinf's words.

RLinf's own tests match on the text of these errors (``pytest.raises(...,
match=...)``), so aiorl raises them with RLinf's sentence, written with aiorl's values
(its f-string shape: ``type(x)``, lists and sets as Python prints them), before
aiorl's own hints. Each case below is RLinf's test input and the full sentence from
RLinf's source: ``rlinf/scheduler/placement/{flexible,component_placement}.py``,
``rlinf/scheduler/cluster/{config,utils}.py``, ``rlinf/scheduler/hardware/hardware.py``
and ``rlinf/scheduler/hardware/accelerators/{accelerator,nvidia_gpu,amd_gpu}.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from aiorl.placement import (
    ClusterSpec,
    FlexiblePlacementStrategy,
    HybridComponentPlacement,
    ModelParallelComponentPlacement,
    PlacementError,
)

pytestmark = pytest.mark.timeout(10)


def _cluster(**section: Any) -> ClusterSpec:
    return ClusterSpec.from_config({"component_placement": {}, **section})


def _franka(configs: list[Any], node_ranks: str = "0", num_nodes: int = 1,
            label: str = "robots") -> ClusterSpec:
    return _cluster(num_nodes=num_nodes, node_groups=[
        {"label": label, "node_ranks": node_ranks,
         "hardware": {"type": "Franka", "configs": configs}}])


def _env_vars(env_vars: list[Any]) -> ClusterSpec:
    return _cluster(num_nodes=1, node_groups=[{"label": "train", "node_ranks": "0", "env_configs": [
        {"node_ranks": "0", "env_vars": env_vars}]}])


def _hybrid(placement: str, gpus: int) -> HybridComponentPlacement:
    return HybridComponentPlacement({"cluster": {
        "num_nodes": 1, "accelerators_per_node": gpus, "component_placement": {"actor": placement}}})


def _profiling(section: dict[str, Any]) -> ClusterSpec:
    return _cluster(num_nodes=1, profiling=section)


ROBOT = {"node_rank": 0, "robot_ip": "10.0.0.1", "disable_validate": True}
FRANKA_FIELDS = ("{'node_rank', 'robot_ip', 'camera_serials', 'camera_type', 'gripper_type', "
                 "'gripper_connection', 'controller_node_rank', 'disable_validate'}")

CASES: list[tuple[str, Callable[[], object], str]] = [
    # -- placement -----------------------------------------------------------------------
    ("cross_node_gpu_ids",
     lambda: FlexiblePlacementStrategy([[0, 4]]).get_placement(ClusterSpec(2, 4)),
     "All hardware ranks [0, 4] for a process must be on the same node. Instead, the "
     "hardware exist across node ranks {0, 1}"),
    ("empty_gpu_ids",
     lambda: FlexiblePlacementStrategy([]),
     "The hardware_ranks_list must not be empty."),
    ("duplicate_gpu_ids_in_process",
     lambda: FlexiblePlacementStrategy([[0, 0]]),
     "All hardware ranks [0, 0] for a process must be unique."),
    ("duplicate_resource_ranks",
     lambda: _hybrid("0-1,1-2", 4),
     "Duplicate resource ranks found in placement string: 0-1,1-2. Resource ranks must be "
     "unique."),
    ("non_continuous_process_ranks",
     lambda: _hybrid("0-0:0,1-1:2", 2),
     "Process ranks must be in ascending order and continuous in placement string: "
     "0-0:0,1-1:2."),
    ("duplicate_process_ranks",
     lambda: _hybrid("0-1,2-3:1-2", 4),
     "Duplicate process ranks found in placement string: 0-1,2-3:1-2. Process ranks must be "
     "unique."),
    ("reward_required",
     lambda: ModelParallelComponentPlacement({
         "cluster": {"num_nodes": 1, "accelerators_per_node": 4,
                     "component_placement": {"actor": "0-1", "rollout": "2-3"}},
         "actor": {"model": {"tensor_model_parallel_size": 2}},
         "rollout": {"tensor_parallel_size": 2}}),
     "Reward GPUs must be specified in the component_placement config."),
    # -- cluster config ------------------------------------------------------------------
    ("node_rank_out_of_range",
     lambda: _cluster(num_nodes=2, node_groups=[{"label": "a", "node_ranks": "0-3"}]),
     "Error parsing node_ranks 0-3 in node group 'a'. End rank 3 in rank config string "
     "\"0-3\" must be within the available node ranks [0, 1]."),
    ("node_rank_out_of_range_start",
     lambda: _cluster(num_nodes=2, node_groups=[{"label": "a", "node_ranks": 5}]),
     "Error parsing node_ranks 5 in node group 'a'. Start rank 5 in rank config string \"5\" "
     "must be within the available node ranks [0, 1]."),
    ("duplicate_hardware_entries",
     lambda: _franka([ROBOT, ROBOT]),
     "Duplicate hardware configs found in node hardware config: \n"
     "node_rank: 0\nrobot_ip: 10.0.0.1\ndisable_validate: true\n\n"
     "node_rank: 0\nrobot_ip: 10.0.0.1\ndisable_validate: true\n"),
    ("node_group_entry_must_be_mapping",
     lambda: _cluster(num_nodes=1, node_groups=["train"]),
     "Each node yaml config must be a dictionary. But got <class 'str'>: train"),
    ("env_var_entry_must_be_mapping",
     lambda: _env_vars(["BAD"]),
     "Each node env_var must be a dict in config. But got <class 'str'>: BAD"),
    ("env_var_entry_must_have_one_key",
     lambda: _env_vars([{"A": "1", "B": "2"}]),
     "Each node env_var dict must contain exactly one key-value pair. But got: "
     "{'A': '1', 'B': '2'}"),
    ("hardware_configs_must_be_mapping",
     lambda: _franka(["BAD"], label="robot"),
     "Each hardware config must be a dictionary. But got <class 'str'>: BAD"),
    ("hardware_node_rank_must_be_in_group",
     lambda: _franka([{**ROBOT, "node_rank": 1}], num_nodes=2, label="franka"),
     "node_rank 1 in hardware config must be within node_ranks [0] in node group 'franka'."),
    ("invalid_node_rank_format",
     lambda: _cluster(num_nodes=2, node_groups=[{"label": "train", "node_ranks": "bad-format"}]),
     'Invalid rank format bad-format for node, expected format: "a,b,c-d" or "all"'),
    ("missing_required_hardware_field",
     lambda: _franka([{"robot_ip": "10.0.0.1", "disable_validate": True}]),
     "Missing fields '['node_rank']' detected in cluster node_group hardware yaml config. "
     "Only got: dict_keys(['robot_ip', 'disable_validate'])."),
    ("unknown_hardware_field",
     lambda: _franka([{**ROBOT, "unknown_field": 1}]),
     "Unknown fields '{'unknown_field'}' detected in cluster node_group hardware yaml config. "
     f"Valid fields are: {FRANKA_FIELDS}."),
    ("num_nodes_must_be_positive",
     lambda: _cluster(num_nodes=0),
     "'num_nodes' must be a positive integer. But got 0 of type <class 'int'>."),
    # -- profiling -----------------------------------------------------------------------
    ("profiling_duplicate_range_end_options",
     lambda: _profiling({"backend": "nsight",
                         "options": {"stop-on-range-end": True, "capture-range-end": "stop"}}),
     "Nsight options must not specify both 'stop-on-range-end' and 'capture-range-end'."),
    ("profiling_duplicate_output_options",
     lambda: _profiling({"backend": "nsight", "options": {"o": "a", "output": "b"}}),
     "Nsight options must not specify both 'o' and 'output'."),
    ("profiling_options_must_be_mapping",
     lambda: _profiling({"backend": "nsight", "options": ["BAD"]}),
     "Nsight options must be a dictionary in cluster profiling config. But got "
     "<class 'list'>: ['BAD']"),
    ("profiling_duplicate_flag_and_option",
     lambda: _profiling({"backend": "nsight", "flags": ["python-backtrace"],
                         "options": {"python-backtrace": "cuda"}}),
     "Nsight flags and options must not specify the same names. Got duplicates: "
     "['python-backtrace']"),
    ("profiling_unknown_backend",
     lambda: _profiling({"backend": "unknown_backend"}),
     "Unknown profiling backend 'unknown_backend'. Known backends: "
     "['nsight', 'nsys', 'rocprof-sys', 'rocprof_sys']"),
    ("rocprof_sys_rejects_non_dict_args",
     lambda: _profiling({"backend": "rocprof_sys", "args": ["bad"]}),
     "RocprofSys args must be a dictionary in cluster profiling config. But got "
     "<class 'list'>: ['bad']"),
    ("rocprof_sys_rejects_non_dict_env",
     lambda: _profiling({"backend": "rocprof_sys", "env": ["bad"]}),
     "RocprofSys env must be a dictionary in cluster profiling config. But got "
     "<class 'list'>: ['bad']"),
]


@pytest.mark.parametrize(("make", "rlinf_text"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_rlinf_wording(make: Callable[[], object], rlinf_text: str) -> None:
    with pytest.raises(PlacementError, match=re.escape(rlinf_text)) as info:
        make()
    # RLinf raises AssertionError or ValueError; PlacementError is a ValueError, so
    # `except ValueError` code keeps working.
    assert isinstance(info.value, ValueError)


def test_node_rank_out_of_range_with_a_node_group_object() -> None:
    from aiorl.placement import NodeGroup

    with pytest.raises(PlacementError, match=re.escape(
            "Error parsing node_ranks 0-2 in node group 'a'. End rank 2 in rank config "
            "string \"0-2\" must be within the available node ranks [0, 1].")):
        ClusterSpec(2, 0, node_groups=[NodeGroup(label="a", node_ranks=[0, 1, 2])])


def test_hints_follow_rlinf_text() -> None:
    # aiorl's explanation comes after RLinf's sentence, never instead of it.
    with pytest.raises(PlacementError) as info:
        _hybrid("0-0:0,1-1:2", 2)
    text = str(info.value)
    rlinf = ("Process ranks must be in ascending order and continuous in placement string: "
             "0-0:0,1-1:2.")
    assert text.index(rlinf) < text.index("This segment must start at process rank 1, not 2")
    with pytest.raises(PlacementError) as info:
        _cluster(num_nodes=2, node_groups=[{"label": "train", "node_ranks": "bad-format"}])
    assert str(info.value).endswith(
        "'bad-format' is not a valid rank range: write a single integer such as '3' or an "
        "inclusive range such as '0-7'")


def test_rlinf_wording_from_an_omegaconf_config() -> None:
    # RLinf's tests build DictConfigs; the values print as plain Python values.
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"num_nodes": 1, "component_placement": {}, "node_groups": [
        {"label": "train", "node_ranks": "0", "env_configs": [
            {"node_ranks": "0", "env_vars": [{"A": "1", "B": "2"}]}]}]})
    with pytest.raises(PlacementError, match=re.escape(
            "Each node env_var dict must contain exactly one key-value pair. But got: "
            "{'A': '1', 'B': '2'}")):
        ClusterSpec.from_config(cfg)
    cfg = OmegaConf.create({"num_nodes": 1, "profiling": {"backend": "nsight", "options": ["BAD"]}})
    with pytest.raises(PlacementError, match=re.escape(
            "Nsight options must be a dictionary in cluster profiling config. But got "
            "<class 'list'>: ['BAD']")):
        ClusterSpec.from_config(cfg)
