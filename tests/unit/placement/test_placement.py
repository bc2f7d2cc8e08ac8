"""Tests for aiorl.placement: rank strings, cluster specs, strategies, component placement."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from aiorl.errors import AiorlError
from aiorl.placement import (
    ClusterSpec,
    ComponentPlacement,
    FlexiblePlacementStrategy,
    NodeGroup,
    NodePlacementStrategy,
    PackedPlacementStrategy,
    Placement,
    PlacementError,
    RankStringPlacementStrategy,
    default_placement_strategy,
    format_ranks,
    parse_rank_config,
    render_plan,
)

pytestmark = pytest.mark.timeout(60)

# -- fixtures shared by the tables --------------------------------------------------------

SPECS: dict[str, ClusterSpec] = {
    "1x8": ClusterSpec(1, 8),
    "1x6": ClusterSpec(1, 6),
    "2x8": ClusterSpec(2, 8),
    "4x8": ClusterSpec(4, 8),
    "4x0": ClusterSpec(4, 0),
    # Heterogeneous: node 1 has no accelerators, so accelerator resources skip it.
    "het": ClusterSpec(3, [2, 0, 4]),
    "groups": ClusterSpec(
        4,
        8,
        node_groups=[
            {"label": "a", "node_ranks": "0"},
            {"label": "b", "node_ranks": "2-3"},
            {"label": "robots", "node_ranks": "1-2", "hardware": {"type": "robot", "count": 2}},
            {"label": "cams", "node_ranks": "3", "hardware": {"type": "camera", "count": 1}},
            {"label": "arms", "node_ranks": "3", "hardware": {"type": "arm", "count": 1}},
            {"label": "a_overlap", "node_ranks": "0-1"},
        ],
    ),
}


def layout(placements: list[Placement]) -> list[tuple[int, list[int]]]:
    """(node_rank, hardware_ranks) per process, in rank order."""
    assert [p.rank for p in placements] == list(range(len(placements)))
    return [(p.node_rank, p.hardware_ranks) for p in placements]


def place(text: str | int, spec: str = "1x8", node_group: str | None = None) -> list[Placement]:
    return RankStringPlacementStrategy(text, node_group=node_group).get_placement(SPECS[spec])


# -- parse_rank_config ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "available", "expected"),
    [
        ("0-3", None, [0, 1, 2, 3]),
        ("0-3,5,7-8", None, [0, 1, 2, 3, 5, 7, 8]),
        (" 7-8 , 0 ", None, [0, 7, 8]),
        ("4", None, [4]),
        (4, None, [4]),
        ("all", 3, [0, 1, 2]),
        ("ALL", [5, 2], [2, 5]),
        ([0, "2-3"], None, [0, 2, 3]),
        ("1-2", [0, 1, 2], [1, 2]),
    ],
)
def test_parse_rank_config_valid(text, available, expected) -> None:
    assert parse_rank_config(text, available) == expected


@pytest.mark.parametrize(
    ("text", "available", "fragment"),
    [
        ("", None, "empty rank string"),
        ("0-3,,5", None, "empty item"),
        ("3-1", None, "reversed"),
        ("a-b", None, "not a valid rank range"),
        ("-1", None, "not a valid rank range"),
        ("1-2-3", None, "not a valid rank range"),
        ("0-3,2", None, "rank 2 appears more than once"),
        ("all", None, "'all' needs to know"),
        ("0-4", 4, "rank 4 in '0-4' is out of range"),
        (-1, None, "negative"),
        (True, None, "not a rank"),
    ],
)
def test_parse_rank_config_invalid(text, available, fragment) -> None:
    with pytest.raises(PlacementError, match=None) as info:
        parse_rank_config(text, available)
    assert fragment in str(info.value)


def test_format_ranks_round_trip() -> None:
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert format_ranks([]) == ""
    assert parse_rank_config(format_ranks([1, 3, 4, 9])) == [1, 3, 4, 9]


def test_placement_error_is_value_error_and_aiorl_error() -> None:
    with pytest.raises(ValueError):
        place("0-2:0-3")
    with pytest.raises(AiorlError):
        place("0-2:0-3")


# -- placement strings: valid ----------------------------------------------------------------

VALID = [
    # (placement, spec, node_group, expected [(node, hardware_ranks)] per process rank)
    ("0-7", "1x8", None, [(0, [i]) for i in range(8)]),
    ("all", "1x8", None, [(0, [i]) for i in range(8)]),
    ("0-2,5,7", "1x8", None, [(0, [0]), (0, [1]), (0, [2]), (0, [5]), (0, [7])]),
    ("0-3:0-7", "1x8", None, [(0, [i // 2]) for i in range(8)]),
    ("0-7:0-3", "1x8", None, [(0, [0, 1]), (0, [2, 3]), (0, [4, 5]), (0, [6, 7])]),
    ("3", "1x8", None, [(0, [3])]),
    (3, "1x8", None, [(0, [3])]),
    ("0-3,4-7", "1x8", None, [(0, [i]) for i in range(8)]),
    ("all:0-15", "1x8", None, [(0, [i // 2]) for i in range(16)]),
    ("all:0-3", "1x8", None, [(0, [0, 1]), (0, [2, 3]), (0, [4, 5]), (0, [6, 7])]),
    ("0-7:0", "1x8", None, [(0, list(range(8)))]),
    ("0:0-2", "1x8", None, [(0, [0])] * 3),
    (
        " 0-3 , 4-5:4-7 ",
        "1x8",
        None,
        [(0, [0]), (0, [1]), (0, [2]), (0, [3])] + [(0, [4])] * 2 + [(0, [5])] * 2,
    ),
    ("0-3:0-3,4-7", "1x8", None, [(0, [i]) for i in range(8)]),
    ("0-5:0-2", "1x6", None, [(0, [0, 1]), (0, [2, 3]), (0, [4, 5])]),
    ("8-15", "2x8", None, [(1, [i]) for i in range(8)]),
    ("0-15:0-1", "2x8", None, [(0, list(range(8))), (1, list(range(8)))]),
    ("7:0-1,8-9", "2x8", None, [(0, [7]), (0, [7]), (1, [0]), (1, [1])]),
    ("all", "4x0", None, [(n, [0]) for n in range(4)]),
    ("1-2", "het", None, [(0, [1]), (2, [0])]),
    ("all", "het", None, [(0, [0]), (0, [1]), (2, [0]), (2, [1]), (2, [2]), (2, [3])]),
    ("all", "2x8", "node", [(0, [0]), (1, [0])]),
    ("0-3", "groups", "robots", [(1, [0]), (1, [1]), (2, [0]), (2, [1])]),
    ("0-1:0-3", "groups", "robots", [(1, [0])] * 2 + [(1, [1])] * 2),
    (
        "0-7,8-23",
        "groups",
        "a,b",
        [(0, [i]) for i in range(8)] + [(2, [i]) for i in range(8)] + [(3, [i]) for i in range(8)],
    ),
    ("0-1", "groups", "cams,arms", [(3, [0]), (3, [0])]),
    ("2-3", "groups", "node", [(2, [0]), (3, [0])]),
]


@pytest.mark.parametrize(("text", "spec", "group", "expected"), VALID)
def test_placement_string_valid(text, spec, group, expected) -> None:
    assert layout(place(text, spec, group)) == expected


def test_rlinf_example_exact_on_two_nodes_of_eight() -> None:
    placements = place("0-1:0-3,3-5,7-10:7-14", "2x8")
    assert len(placements) == 15
    # 0-1:0-3: two processes per accelerator.
    first = [(0, [0]), (0, [0]), (0, [1]), (0, [1])]
    # 3-5: implicit processes 4-6, one per accelerator.
    second = [(0, [3]), (0, [4]), (0, [5])]
    # 7-10:7-14: two per accelerator; resource 7 is node 0's last, 8-10 are node 1's first.
    third = [(0, [7]), (0, [7]), (1, [0]), (1, [0]), (1, [1]), (1, [1]), (1, [2]), (1, [2])]
    assert layout(placements) == first + second + third
    assert [p.local_rank for p in placements] == [*range(9), *range(6)]
    assert [p.local_world_size for p in placements] == [9] * 9 + [6] * 6
    assert [p.resource_ranks for p in placements][7:] == [[7], [7], [8], [8], [9], [9], [10], [10]]
    assert placements[9].visible_accelerators == ["0"]
    assert all(p.hardware_type == "accelerator" for p in placements)
    assert all(p.node_group_label == "cluster" for p in placements)
    assert all(p.env == {} for p in placements)


def test_node_level_placement_of_400_processes_over_4_nodes() -> None:
    placements = place("0-1:0-199,2-3:200-399", "4x8", "node")
    assert len(placements) == 400
    for p in placements:
        assert p.node_rank == p.rank // 100
        assert p.local_rank == p.rank % 100
        assert p.local_world_size == 100
        assert p.hardware_ranks == [0]
        assert p.visible_accelerators == []
        assert p.hardware_type == "node"
        assert p.node_group_label == "node"


def test_node_level_201_processes_over_2_nodes_is_an_error() -> None:
    with pytest.raises(PlacementError) as info:
        place("0-1:0-200", "4x8", "node")
    message = str(info.value)
    assert "'0-1:0-200'" in message
    assert "201 processes cannot be spread over 2 resources" in message


def test_two_node_groups_in_one_component_number_resources_consecutively() -> None:
    placements = place("6-9", "groups", "a,b")
    assert [(p.node_group_label, p.node_rank, p.hardware_ranks) for p in placements] == [
        ("a", 0, [6]),
        ("a", 0, [7]),
        ("b", 2, [0]),
        ("b", 2, [1]),
    ]
    # The listed order decides the numbering, not the node ranks.
    assert place("0", "groups", "b,a")[0].node_rank == 2


def test_custom_hardware_rlinf_configs_form() -> None:
    spec = ClusterSpec(
        3,
        8,
        node_groups=[
            {
                "label": "franka",
                "node_ranks": "1-2",
                "hardware": {
                    "type": "Franka",
                    "configs": [
                        {"node_rank": 2, "robot_ip": "10.0.0.3"},
                        {"node_rank": 1, "robot_ip": "10.0.0.1"},
                        {"node_rank": 1, "robot_ip": "10.0.0.2"},
                    ],
                },
            }
        ],
    )
    group = spec.get_node_group("franka")
    assert group.hardware_type == "Franka"
    assert group.hardware_per_node == {1: 2, 2: 1}
    assert [c["robot_ip"] for c in group.hardware_configs[1]] == ["10.0.0.1", "10.0.0.2"]
    assert group.resources(spec) == [(1, 0), (1, 1), (2, 0)]
    placements = RankStringPlacementStrategy("0-2:0-5", node_group="franka").get_placement(spec)
    assert layout(placements) == [(1, [0])] * 2 + [(1, [1])] * 2 + [(2, [0])] * 2
    assert {p.hardware_type for p in placements} == {"Franka"}
    assert all(p.visible_accelerators == [] for p in placements)


def test_env_configs_reach_the_placements_of_their_nodes() -> None:
    spec = ClusterSpec(
        4,
        2,
        node_groups=[
            {
                "label": "gpu",
                "node_ranks": "0-3",
                "env_configs": [
                    {"node_ranks": "0-1", "env_vars": [{"IFACE": "eth0"}, {"N": 3}]},
                    {
                        "node_ranks": "3",
                        "env_vars": {"IFACE": "eth1"},
                        "python_interpreter_path": "/opt/py",
                    },
                ],
            }
        ],
    )
    placements = RankStringPlacementStrategy("all", node_group="gpu").get_placement(spec)
    envs = [(p.node_rank, p.env) for p in placements[::2]]
    assert envs == [
        (0, {"IFACE": "eth0", "N": "3"}),
        (1, {"IFACE": "eth0", "N": "3"}),
        (2, {}),
        (3, {"IFACE": "eth1"}),
    ]
    group = spec.get_node_group("gpu")
    assert group.python_interpreter_for(3) == "/opt/py"
    assert group.python_interpreter_for(0) is None
    # Another group over the same nodes does not inherit the environment.
    assert all(p.env == {} for p in RankStringPlacementStrategy("all").get_placement(spec))
    # Placements hold copies: editing one does not leak into the group.
    placements[0].env["X"] = "1"
    assert "X" not in group.env_for(0)


# -- placement strings: every rule, invalid ------------------------------------------------

INVALID = [
    # (placement, spec, node_group, quoted segment, rule fragment)
    ("", "1x8", None, "''", "empty placement"),
    ("   ", "1x8", None, "''", "empty placement"),
    ("0-3,,4", "1x8", None, "'0-3,,4'", "empty segment"),
    ("a-b", "1x8", None, "'a-b'", "not a valid resource rank range"),
    ("1.5", "1x8", None, "'1.5'", "not a valid resource rank range"),
    ("-1", "1x8", None, "'-1'", "not a valid resource rank range"),
    ("0-3:x", "1x8", None, "'0-3:x'", "not a valid process rank range"),
    ("3-1", "1x8", None, "'3-1'", "reversed resource rank range"),
    ("0-3:3-1", "1x8", None, "'0-3:3-1'", "reversed process rank range"),
    ("0-3:all", "1x8", None, "'0-3:all'", "'all' is not allowed in process ranks"),
    ("0-3:", "1x8", None, "'0-3:'", "empty process ranks"),
    ("0-1:0-2:3", "1x8", None, "'0-1:0-2:3'", "too many ':'"),
    ("0-2:0-3", "1x8", None, "'0-2:0-3'", "4 processes cannot be spread over 3 resources"),
    ("0-3:0-5", "1x8", None, "'0-3:0-5'", "6 processes cannot be spread over 4 resources"),
    ("0-5:0-3", "1x8", None, "'0-5:0-3'", "6 resources cannot be divided among 4 processes"),
    ("0-3:1-4", "1x8", None, "'0-3:1-4'", "process ranks must start at 0"),
    ("all:1-4", "1x8", None, "'all:1-4'", "process ranks must start at 0"),
    ("0-3,4-7:2-5", "1x8", None, "'4-7:2-5'", "repeat ranks already placed"),
    ("0-3,4-7:6-9", "1x8", None, "'4-7:6-9'", "must start at process rank 4, not 6"),
    ("0-3,2-5", "1x8", None, "'2-5'", "overlap resource ranks 0-3"),
    ("4-5,0-3", "1x8", None, "'0-3'", "resource ranks must be ascending"),
    ("0-3,3", "1x8", None, "'3'", "overlap"),
    ("all,3", "1x8", None, "'all'", "must be the only segment"),
    ("0-8", "1x8", None, "'0-8'", "resource rank 8 is out of range"),
    ("16", "2x8", None, "'16'", "node group 'cluster' has 16 resources"),
    ("4", "4x0", None, "'4'", "declares no accelerators"),
    ("0-11:0-3", "2x8", None, "'0-11:0-3'", "process 2 would span nodes 0 and 1"),
    ("6-9:0", "2x8", None, "'6-9:0'", "would span nodes"),
    ("0-4", "groups", "robots", "'0-4'", "resource rank 4 is out of range"),
    ("0-1:0", "groups", "cams,arms", "'0-1:0'", "would span node groups 'cams' and 'arms'"),
    ("0", "groups", "nope", "", "unknown node group 'nope'"),
    ("0", "groups", "cluster,a", "", "both contain accelerator 0 of node 0"),
    ("0", "groups", "a,a", "", "lists 'a' twice"),
    ("0", "groups", "a,", "", "empty label"),
    ("4", "4x8", "node", "'4'", "node group 'node' has 4 resources"),
]


@pytest.mark.parametrize(("text", "spec", "group", "segment", "fragment"), INVALID)
def test_placement_string_invalid(text, spec, group, segment, fragment) -> None:
    with pytest.raises(PlacementError) as info:
        place(text, spec, group)
    message = str(info.value)
    assert fragment in message
    assert segment in message


def test_placement_string_table_is_large_enough() -> None:
    assert len(VALID) + len(INVALID) >= 30


def test_syntax_errors_are_raised_at_construction() -> None:
    # No cluster is needed to reject these: a config fails before anything is started.
    for text in ["0-2:0-3", "0-3:all", "4-5,0-3", "0-3,4-7:6-9", ""]:
        with pytest.raises(PlacementError):
            RankStringPlacementStrategy(text)


def test_error_message_names_component_and_whole_placement() -> None:
    with pytest.raises(PlacementError) as info:
        RankStringPlacementStrategy("0-3,0-2:0-3", context="component 'actor'")
    message = str(info.value)
    assert message.startswith("'0-2:0-3': ")
    assert "placement '0-3,0-2:0-3'" in message
    assert "component 'actor'" in message


def test_get_placement_accepts_an_object_with_spec() -> None:
    cluster = SimpleNamespace(spec=SPECS["2x8"])
    assert len(RankStringPlacementStrategy("all").get_placement(cluster)) == 16
    with pytest.raises(TypeError):
        RankStringPlacementStrategy("all").get_placement(object())


# -- ClusterSpec and NodeGroup ---------------------------------------------------------------


def test_cluster_spec_basics() -> None:
    spec = ClusterSpec(3, [2, 0, 4])
    assert spec.num_accelerators == 6
    assert [spec.accelerators_on(n) for n in range(3)] == [2, 0, 4]
    assert spec.accelerators_per_node == [2, 0, 4]
    cluster_resources = [(0, 0), (0, 1), (2, 0), (2, 1), (2, 2), (2, 3)]
    assert spec.get_node_group("cluster").resources(spec) == cluster_resources
    assert spec.get_node_group("node").resources(spec) == [(0, 0), (1, 0), (2, 0)]
    assert spec.get_node_group("node").resource_kind(spec) == "node"
    assert ClusterSpec(2).get_node_group("cluster").resource_kind(ClusterSpec(2)) == "node"
    with pytest.raises(PlacementError, match="out of range"):
        spec.accelerators_on(3)
    assert spec == ClusterSpec(3, [2, 0, 4])
    assert "2 nodes" in ClusterSpec(2, 8).describe()


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_nodes": 0}, "'num_nodes' must be a positive integer"),
        ({"num_nodes": 2, "accelerators_per_node": [8]}, "lists 1 nodes"),
        ({"num_nodes": 2, "accelerators_per_node": -1}, ">= 0"),
        ({"num_nodes": 2, "node_groups": [{"label": "cluster", "node_ranks": "0"}]}, "reserved"),
        ({"num_nodes": 2, "node_groups": [{"label": "node", "node_ranks": "0"}]}, "reserved"),
        (
            {"num_nodes": 2, "node_groups": [{"label": "a", "node_ranks": 0}] * 2},
            "declared twice",
        ),
        ({"num_nodes": 2, "node_groups": [{"label": "a", "node_ranks": "0-2"}]}, "End rank 2"),
        ({"num_nodes": 2, "node_groups": [{"label": "a"}]}, "missing node_ranks"),
        ({"num_nodes": 2, "node_groups": [{"node_ranks": "0"}]}, "missing label"),
        ({"num_nodes": 2, "node_groups": [{"label": "a,b", "node_ranks": "0"}]}, "may not contain"),
        (
            {"num_nodes": 2, "node_groups": [{"label": "a", "node_rank": "0"}]},
            "unknown key(s) node_rank",
        ),
        (
            {"num_nodes": 2, "node_groups": [{"label": "a", "node_ranks": "0-1,1"}]},
            "appears more than once",
        ),
        (
            {
                "num_nodes": 2,
                "node_groups": [{"label": "r", "node_ranks": "0", "hardware": {"type": "robot"}}],
            },
            "exactly one of 'count'",
        ),
        (
            {
                "num_nodes": 2,
                "node_groups": [
                    {"label": "r", "node_ranks": "0", "hardware": {"type": "robot", "count": 0}}
                ],
            },
            "positive integer",
        ),
        (
            {
                "num_nodes": 2,
                "node_groups": [
                    {
                        "label": "r",
                        "node_ranks": "0",
                        "hardware": {"type": "robot", "configs": [{"node_rank": 1}]},
                    }
                ],
            },
            "node_rank 1 in hardware config must be within node_ranks [0] in node group 'r'",
        ),
        (
            {
                "num_nodes": 2,
                "node_groups": [
                    {"label": "r", "node_ranks": "0", "hardware": {"type": "node", "count": 1}}
                ],
            },
            "is reserved",
        ),
        (
            {
                "num_nodes": 2,
                "node_groups": [
                    {
                        "label": "g",
                        "node_ranks": "0-1",
                        "env_configs": [{"node_ranks": "0-1"}, {"node_ranks": "1"}],
                    }
                ],
            },
            "both cover node 1",
        ),
        (
            {
                "num_nodes": 3,
                "node_groups": [
                    {"label": "g", "node_ranks": "0-1", "env_configs": [{"node_ranks": "2"}]}
                ],
            },
            "names node 2",
        ),
        (
            {
                "num_nodes": 2,
                "node_groups": [
                    {
                        "label": "g",
                        "node_ranks": "0",
                        "env_configs": [{"node_ranks": "0", "env_vars": [{"A": 1}, {"A": 2}]}],
                    }
                ],
            },
            "A is set twice",
        ),
    ],
)
def test_cluster_spec_invalid(kwargs, fragment) -> None:
    with pytest.raises(PlacementError) as info:
        ClusterSpec(**kwargs)
    assert fragment in str(info.value)


def test_cluster_spec_from_config_accepts_section_full_config_and_dictconfig() -> None:
    from omegaconf import OmegaConf

    section = {
        "num_nodes": 2,
        "node_groups": [{"label": 4090, "node_ranks": "1"}],
        "component_placement": {"actor": "0-7"},
    }
    a = ClusterSpec.from_config(section, accelerators_per_node=8)
    b = ClusterSpec.from_config({"cluster": section, "actor": {"lr": 1}}, accelerators_per_node=8)
    c = ClusterSpec.from_config(OmegaConf.create({"cluster": section}), accelerators_per_node=8)
    assert a == b == c
    assert a.num_nodes == 2 and a.num_accelerators == 16
    assert [g.label for g in a.node_groups] == ["4090"]  # YAML int labels become text
    assert ClusterSpec.from_config({"num_nodes": 3}, num_nodes=5).num_nodes == 5
    assert ClusterSpec.from_config({"accelerators_per_node": 4}).num_accelerators == 4
    assert ClusterSpec.from_config(None).num_nodes == 1


def test_node_group_accepts_rank_strings_and_reports_resources() -> None:
    group = NodeGroup(label="r", node_ranks="2-3", hardware_type="robot", hardware_per_node={2: 3})
    assert group.node_ranks == [2, 3]
    assert group.hardware_per_node == {2: 3, 3: 0}
    spec = ClusterSpec(4, 8, node_groups=[group])
    assert group.resources(spec) == [(2, 0), (2, 1), (2, 2)]
    assert group.resource_kind(spec) == "robot"


# -- strategies --------------------------------------------------------------------------------


def test_packed_with_stride() -> None:
    placements = PackedPlacementStrategy(0, 7, num_hardware_per_process=2, stride=2).get_placement(
        SPECS["1x8"]
    )
    assert [p.hardware_ranks for p in placements] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [p.visible_accelerators for p in placements][0] == ["0", "2"]


def test_packed_across_nodes() -> None:
    placements = PackedPlacementStrategy(4, 15, num_hardware_per_process=4).get_placement(
        SPECS["2x8"]
    )
    assert layout(placements) == [(0, [4, 5, 6, 7]), (1, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]
    assert [(p.local_rank, p.local_world_size) for p in placements] == [(0, 1), (0, 2), (1, 2)]


def test_packed_on_a_node_group() -> None:
    placements = PackedPlacementStrategy(0, 3, node_group="robots").get_placement(SPECS["groups"])
    assert layout(placements) == [(1, [0]), (1, [1]), (2, [0]), (2, [1])]
    assert {p.hardware_type for p in placements} == {"robot"}


@pytest.mark.parametrize(
    ("args", "kwargs", "spec", "fragment"),
    [
        ((0, 11), {"num_hardware_per_process": 3}, "2x8", "would span nodes 0 and 1"),
        ((0, 16), {}, "2x8", "end_hardware_rank 16 is out of range"),
        ((0, 6), {"num_hardware_per_process": 2}, "1x8", "7 resources cannot be split"),
        ((0, 5), {"num_hardware_per_process": 2, "stride": 2}, "1x8", "blocks of"),
        ((5, 2), {}, "1x8", "is below start_hardware_rank"),
        ((-1, 3), {}, "1x8", "start_hardware_rank must be an integer >= 0"),
        ((0, 3), {"stride": 0}, "1x8", "stride must be an integer >= 1"),
        ((0, 3), {"num_hardware_per_process": 0}, "1x8", "num_hardware_per_process"),
        ((0, 3), {"node_group": "nope"}, "1x8", "unknown node group 'nope'"),
    ],
)
def test_packed_invalid(args, kwargs, spec, fragment) -> None:
    with pytest.raises(PlacementError) as info:
        PackedPlacementStrategy(*args, **kwargs).get_placement(SPECS[spec])
    assert fragment in str(info.value)
    assert "PackedPlacementStrategy(" in str(info.value) or "unknown node group" in str(info.value)


def test_flexible() -> None:
    placements = FlexiblePlacementStrategy([[15], [0, 1], [9, 8]]).get_placement(SPECS["2x8"])
    # RLinf's order: each list sorted, processes ordered by their first resource rank.
    assert layout(placements) == [(0, [0, 1]), (1, [0, 1]), (1, [7])]
    assert placements[1].visible_accelerators == ["0", "1"]
    assert [p.local_rank for p in placements] == [0, 0, 1]


@pytest.mark.parametrize(
    ("ranks", "fragment"),
    [
        ([[7, 8]], "process 0 would span nodes 0 and 1"),
        ([[0, 1], [1, 2]], "resource rank 1 of process 1 is already used by process 0"),
        ([[0, 0]], "Resource rank 0 of process 0 is given twice"),
        ([[0], []], "process 1 has an empty resource list"),
        ([], "The hardware_ranks_list must not be empty"),
        ([[16]], "resource rank 16 of process 0 is out of range"),
        ([[-1]], "must be an integer >= 0"),
    ],
)
def test_flexible_invalid(ranks, fragment) -> None:
    with pytest.raises(PlacementError) as info:
        FlexiblePlacementStrategy(ranks).get_placement(SPECS["2x8"])
    assert fragment in str(info.value)


def test_node_strategy() -> None:
    placements = NodePlacementStrategy([0, 0, 1]).get_placement(SPECS["2x8"])
    assert layout(placements) == [(0, [0]), (0, [0]), (1, [0])]
    assert [(p.local_rank, p.local_world_size) for p in placements] == [(0, 2), (1, 2), (0, 1)]
    assert all(p.visible_accelerators == [] and p.hardware_type == "node" for p in placements)
    assert {p.node_group_label for p in placements} == {"node"}
    # With a node group, entries index the group's nodes (RLinf): robots = nodes 1-2.
    on_group = NodePlacementStrategy([1, 0], node_group="robots").get_placement(SPECS["groups"])
    assert [(p.node_rank, p.node_group_label) for p in on_group] == [(2, "robots"), (1, "robots")]


@pytest.mark.parametrize(
    ("nodes", "group", "fragment"),
    [
        ([4], None, "node rank 4 is out of range"),
        ([2], "robots", "node rank 2 is out of range; node group(s) 'robots' have 2 node(s)"),
        ([], None, "node_ranks is empty"),
        ([-1], None, "must be an integer >= 0"),
        ([0], "a,a_overlap", "both contain node 0"),
    ],
)
def test_node_strategy_invalid(nodes, group, fragment) -> None:
    with pytest.raises(PlacementError) as info:
        NodePlacementStrategy(nodes, node_group=group).get_placement(SPECS["groups"])
    assert fragment in str(info.value)


def test_default_placement_strategy() -> None:
    placements = default_placement_strategy(SPECS["2x8"]).get_placement(SPECS["2x8"])
    assert layout(placements) == [(n, [i]) for n in range(2) for i in range(8)]
    no_acc = default_placement_strategy(SPECS["4x0"]).get_placement(SPECS["4x0"])
    assert layout(no_acc) == [(0, [0])]
    assert no_acc[0].visible_accelerators == []


# -- ComponentPlacement ------------------------------------------------------------------------

CONFIG = {
    "cluster": {
        "num_nodes": 2,
        "component_placement": {
            "actor,inference": "0-1:0-3,3-5,7-10:7-14",
            "rollout": {"node_group": "node", "placement": "0-1:0-3"},
            "env": {"node_group": "robots", "placement": "all"},
            "single": 15,
        },
        "node_groups": [
            {"label": "robots", "node_ranks": "1", "hardware": {"type": "arm", "count": 2}},
        ],
    }
}


def test_component_placement_shares_one_strategy_per_key() -> None:
    cp = ComponentPlacement(CONFIG, ClusterSpec.from_config(CONFIG, accelerators_per_node=8))
    assert cp.components == ["actor", "inference", "rollout", "env", "single"]
    assert cp.keys == ["actor,inference", "rollout", "env", "single"]
    assert cp.get_strategy("actor") is cp.get_strategy("inference")
    assert cp.get_strategy("actor") is not cp.get_strategy("rollout")
    assert cp.get_world_size("actor") == cp.get_world_size("inference") == 15
    assert cp.get_placement("actor") == cp.get_placement("inference")
    assert cp.get_world_size("rollout") == 4
    assert cp.get_world_size("env") == 2
    assert cp.get_node_group_labels("env") == ["robots"]
    assert layout(cp.get_placement("single")) == [(1, [7])]


def test_component_placement_inputs() -> None:
    from omegaconf import OmegaConf

    spec = ClusterSpec(2, 8)  # no node groups: the config's groups are used
    for cfg in (CONFIG, CONFIG["cluster"], OmegaConf.create(CONFIG)):
        cp = ComponentPlacement(cfg, spec)
        assert cp.get_world_size("env") == 2
    cp = ComponentPlacement(CONFIG, SimpleNamespace(spec=spec))
    assert cp.spec.node_groups[0].label == "robots"
    # No spec: built from the config alone (0 accelerators -> nodes are the resources).
    built = ComponentPlacement({"cluster": {"num_nodes": 3, "component_placement": {"a": "all"}}})
    assert built.get_world_size("a") == 3
    assert ComponentPlacement({"cluster": {"num_nodes": 1}}, spec).components == []


@pytest.mark.parametrize(
    ("placement", "fragment"),
    [
        ({"actor": "0-3", "actor,critic": "4-7"}, "component 'actor' is placed twice"),
        ({"actor,": "0-3"}, "empty component name"),
        ({"actor": {"node_group": "node"}}, "missing placement"),
        ({"actor": None}, "missing placement"),
        ({"actor": {"placement": "0", "nodegroup": "node"}}, "unknown key(s) nodegroup"),
        ({"actor": {"placement": "0", "node_group": "gpus"}}, "unknown node group 'gpus'"),
        ({"actor": "0-3", "critic": "0-2:0-3"}, "'0-2:0-3': 4 processes cannot be spread"),
        ({"critic": "0-20"}, "component 'critic'"),
        ({"critic": [1, 2]}, "expected a string"),
    ],
)
def test_component_placement_invalid(placement, fragment) -> None:
    cfg = {"cluster": {"num_nodes": 2, "component_placement": placement}}
    with pytest.raises(PlacementError) as info:
        ComponentPlacement(cfg, ClusterSpec(2, 8))
    assert fragment in str(info.value)


def test_component_placement_unknown_component() -> None:
    cp = ComponentPlacement(CONFIG, ClusterSpec(2, 8))
    with pytest.raises(PlacementError, match="unknown component 'critic'"):
        cp.get_world_size("critic")
    assert cp.get_world_size("actor,inference") == 15  # the key itself also works


def test_render_plan_grid() -> None:
    text = render_plan(ComponentPlacement(CONFIG, ClusterSpec(2, 8)))
    lines = text.splitlines()
    assert lines[0] == "cluster: 2 nodes, 8 cuda accelerators per node (16 in all)"
    assert any(
        line.split() == ["node", "0", "0-1", "2-3", ".", "4", "5", "6", ".", "7-8"]
        for line in lines
    )
    assert any(line.split() == ["node", "1", "0", "1"] for line in lines)  # the two arms
    assert any(line.split() == ["node", "1", "2-3"] for line in lines)  # rollout, node group
    assert "actor,inference [0-1:0-3,3-5,7-10:7-14]: 15 processes" in text
