"""RLinf drop-in, item 5: typed hardware configs and ClusterConfig-style queries.

Two groups with robots on one node, used by real workers, are in tests/system/test_rlinf_e2e.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from aiorl.placement import (
    ClusterSpec,
    CustomHardwareConfig,
    FrankaConfig,
    HardwareConfig,
    PlacementError,
    RankStringPlacementStrategy,
    get_hardware_type,
    register_hardware,
)

pytestmark = pytest.mark.timeout(10)


@register_hardware("TestGripper", kind="robot")
@dataclass
class GripperConfig(HardwareConfig):
    port: str  # required
    force: float = 10.0


def _spec(*groups: dict, num_nodes: int = 4) -> ClusterSpec:
    return ClusterSpec.from_config({"num_nodes": num_nodes, "node_groups": list(groups)})


RLINF_EXAMPLE = [
    {"label": "a800", "node_ranks": "0-1", "env_configs": [
        {"node_ranks": "0-1", "python_interpreter_path": "/opt/a800/bin/python3",
         "env_vars": [{"GLOO_SOCKET_IFNAME": "eth0"}]}]},
    {"label": "franka", "node_ranks": "2,3", "hardware": {"type": "Franka", "configs": [
        {"node_rank": 2, "robot_ip": "10.10.10.1", "camera_serials": ["322142001230"],
         "disable_validate": True},
        {"node_rank": 3, "robot_ip": "10.10.10.2", "camera_serials": ["322142001231"],
         "disable_validate": True}]}},
]


def test_rlinf_cluster_config_queries() -> None:
    spec = _spec(*RLINF_EXAMPLE)
    a800, franka = spec.get_node_group("a800"), spec.get_node_group("franka")
    assert a800.hardware is None and a800.node_ranks == [0, 1]
    assert a800.get_node_env_vars(0) == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert a800.get_node_python_interpreter_path(1) == "/opt/a800/bin/python3"
    assert spec.get_node_python_interpreter_path_by_rank(0) == ["/opt/a800/bin/python3"]
    assert spec.get_node_hw_configs_by_rank(0) == []
    assert franka.hardware is not None and franka.hardware.type == "Franka"
    assert franka.hardware.kind == "robot"
    [unit] = spec.get_node_hw_configs_by_rank(2)
    assert isinstance(unit, FrankaConfig)
    assert (unit.node_rank, unit.robot_ip, unit.camera_serials) == (2, "10.10.10.1",
                                                                     ["322142001230"])
    assert unit.camera_type == "realsense"  # the schema's default
    assert spec.get_node_labels_by_rank(2) == ["franka"]
    assert spec.get_node_labels_by_rank(1) == ["a800"]
    assert spec.get_node_labels_by_rank(99) == []


def test_registry() -> None:
    franka = get_hardware_type("franka")  # any case
    assert franka is not None and franka.name == "Franka" and franka.required_fields == [
        "node_rank"]
    gripper = get_hardware_type("testgripper")
    assert gripper is not None and gripper.required_fields == ["node_rank", "port"]
    spec = _spec({"label": "g", "node_ranks": 1, "hardware": {"type": "TestGripper", "configs": [
        {"node_rank": 1, "port": "/dev/ttyUSB0"}]}})
    [unit] = spec.get_node_hw_configs_by_rank(1)
    assert isinstance(unit, GripperConfig) and unit.force == 10.0
    with pytest.raises(PlacementError, match="already registered"):
        register_hardware("testGRIPPER")(GripperConfig)
    with pytest.raises(PlacementError, match="hardware kind 'arm' is unknown"):
        register_hardware("Other", kind="arm")
    # Types nobody registered stay usable as custom hardware with free-form fields.
    custom = _spec({"label": "cam", "node_ranks": 0, "hardware": {"type": "camera", "configs": [
        {"node_rank": 0, "serial": "abc"}]}})
    [cam] = custom.get_node_hw_configs_by_rank(0)
    assert isinstance(cam, CustomHardwareConfig) and cam.to_dict() == {"node_rank": 0,
                                                                       "serial": "abc"}
    assert custom.get_node_group("cam").hardware.kind == "custom"


@pytest.mark.parametrize(
    ("hardware", "fragment"),
    [
        ({"type": "Franka", "configs": [{"robot_ip": "10.0.0.1"}]},
         "Hardware configs entry 0 needs a node_rank"),
        ({"type": "TestGripper", "configs": [{"node_rank": 0}]},
         "Missing fields '['port']' detected in cluster node_group hardware yaml config. "
         "Only got: dict_keys(['node_rank']). Hardware type 'TestGripper' requires "
         "node_rank, port"),
        ({"type": "Franka", "configs": [{"node_rank": 0, "unknown_field": 1}]},
         "Hardware type 'Franka' has no field unknown_field"),
        ({"type": "Franka", "configs": [{"node_rank": 0, "robot_ip": "not-an-ip"}]},
         "'robot_ip' in a Franka config must be an IP address"),
        ({"type": "Franka", "configs": ["BAD"]},
         "hardware configs entry 0 must be a mapping with a node_rank"),
        ({"type": "Franka", "configs": [{"node_rank": 1}]},
         "node_rank 1 in hardware config must be within node_ranks [0]"),
        ({"type": "TestGripper", "count": 1}, "Missing fields '['port']'"),
        ({"type": "Franka", "configs": [{"node_rank": 0, "robot_ip": "10.0.0.1"},
                                        {"node_rank": 0, "robot_ip": "10.0.0.1"}]},
         "is given twice on node 0; each entry is one unit"),
    ],
)
def test_invalid_hardware(hardware: dict, fragment: str) -> None:
    with pytest.raises(PlacementError) as info:
        _spec({"label": "robots", "node_ranks": 0, "hardware": hardware})
    assert fragment in str(info.value)
    assert "node group 'robots'" in str(info.value)


def test_invalid_groups() -> None:
    with pytest.raises(PlacementError, match="node_groups entry 0 must be a node group"):
        ClusterSpec.from_config({"num_nodes": 1, "node_groups": ["train"]})
    with pytest.raises(PlacementError, match="ignore_hardware .* cannot be combined"):
        _spec({"label": "r", "node_ranks": 0, "ignore_hardware": True,
               "hardware": {"type": "Franka", "count": 1}})


def test_same_robot_type_in_two_groups_on_one_node() -> None:
    # RLinf refuses this at parse time; aiorl numbers the node's robots across groups.
    spec = _spec(
        {"label": "left", "node_ranks": 0, "hardware": {"type": "Franka", "configs": [
            {"node_rank": 0, "robot_ip": "10.0.0.1"}]}},
        {"label": "right", "node_ranks": "0,1", "hardware": {"type": "Franka", "configs": [
            {"node_rank": 0, "robot_ip": "10.0.0.2"}, {"node_rank": 1, "robot_ip": "10.0.0.3"}]}},
        {"label": "both", "node_ranks": 0, "hardware": {"type": "Franka", "configs": [
            {"node_rank": 0, "robot_ip": "10.0.0.1"}]}},
    )
    together = RankStringPlacementStrategy("0-2", node_group="left,right").get_placement(spec)
    assert [(p.node_rank, p.hardware_ranks, p.node_group_label) for p in together] == [
        (0, [0], "left"), (0, [1], "right"), (1, [0], "right")]
    # The same robot declared by two groups is one unit: using both groups is an overlap.
    with pytest.raises(PlacementError, match="both contain Franka 0 of node 0"):
        RankStringPlacementStrategy("0-1", node_group="left,both").get_placement(spec)


def test_count_form_units_are_the_nodes_units() -> None:
    # Anonymous units (count) are like accelerators: two groups count the same ones.
    spec = _spec({"label": "a", "node_ranks": 0, "hardware": {"type": "arm", "count": 2}},
                 {"label": "b", "node_ranks": 0, "hardware": {"type": "arm", "count": 1}})
    with pytest.raises(PlacementError, match="both contain arm 0 of node 0"):
        RankStringPlacementStrategy("0-2", node_group="a,b").get_placement(spec)


def test_ignore_hardware_counts_nodes() -> None:
    spec = ClusterSpec.from_config({"num_nodes": 2, "accelerators_per_node": 8, "node_groups": [
        {"label": "cpu", "node_ranks": "0-1", "ignore_hardware": True}]})
    placements = RankStringPlacementStrategy("0-1", node_group="cpu").get_placement(spec)
    assert [(p.node_rank, p.hardware_type, p.visible_accelerators) for p in placements] == [
        (0, "node", []), (1, "node", [])]
