"""RLinf drop-in, item 6: placement extras, planned without processes.

``isolate_gpu=False`` and node placement over two groups in real workers are in
tests/system/test_rlinf_e2e.py.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from aiorl.placement import (
    ClusterSpec,
    ComponentPlacement,
    FlexiblePlacementStrategy,
    HybridComponentPlacement,
    ModelParallelComponentPlacement,
    NodePlacementStrategy,
    PackedPlacementStrategy,
    PlacementError,
    PlacementMode,
)

pytestmark = pytest.mark.timeout(10)

SPEC = ClusterSpec(2, 4, node_groups=[
    {"label": "a", "node_ranks": 1},
    {"label": "b", "node_ranks": 0},
    {"label": "ab", "node_ranks": "0-1"},
])


def test_get_hardware_ranks_and_rlinf_queries() -> None:
    cp = ComponentPlacement({"cluster": {"component_placement": {
        "actor,inference": "0-1:0-3,3-5,6-7:7-10", "env": "all"}}}, SPEC)
    assert cp.get_hardware_ranks("actor") == [0, 1, 3, 4, 5, 6, 7]
    assert cp.get_hardware_ranks("inference") == cp.get_hardware_ranks("actor")
    assert cp.get_hardware_ranks("env") == list(range(8))
    assert cp.has_component("env") and not cp.has_component("reward")
    assert cp.get_strategy("reward", required=False) is None
    with pytest.raises(PlacementError, match="unknown component 'reward'"):
        cp.get_strategy("reward")
    with pytest.raises(PlacementError, match="unknown component 'reward'"):
        cp.get_hardware_ranks("reward")
    assert HybridComponentPlacement({"cluster": {"component_placement": {"x": "0"}}},
                                    SPEC).placement_mode is PlacementMode.HYBRID


def test_isolate_accelerator_false() -> None:
    shared = PackedPlacementStrategy(5, 6).get_placement(SPEC, isolate_accelerator=False)
    assert [(p.node_rank, p.hardware_ranks, p.visible_accelerators, p.launch_local_rank)
            for p in shared] == [(1, [1], ["0", "1", "2", "3"], 1),
                                 (1, [2], ["0", "1", "2", "3"], 2)]
    own = PackedPlacementStrategy(5, 6).get_placement(SPEC)
    assert [(p.visible_accelerators, p.launch_local_rank) for p in own] == [(["1"], 0),
                                                                           (["2"], 1)]
    # Whole-node processes have no device id: LOCAL_RANK stays their local index.
    [node] = NodePlacementStrategy([1]).get_placement(SPEC, isolate_accelerator=False)
    assert (node.visible_accelerators, node.launch_local_rank) == ([], 0)


def test_flexible_sorts_like_rlinf() -> None:
    strategy = FlexiblePlacementStrategy([[7, 6], [1], [3, 2]])
    assert strategy.hardware_ranks_list == [[1], [2, 3], [6, 7]]
    placements = strategy.get_placement(SPEC)
    assert [(p.rank, p.node_rank, p.hardware_ranks) for p in placements] == [
        (0, 0, [1]), (1, 0, [2, 3]), (2, 1, [2, 3])]


def test_node_placement_across_groups() -> None:
    # Entries index the listed groups' nodes: a = [1], b = [0] -> 0 is node 1, 1 is node 0.
    placements = NodePlacementStrategy([0, 1, 1], node_group_label=["a", "b"]).get_placement(SPEC)
    assert [(p.node_rank, p.node_group_label, p.local_rank, p.local_world_size)
            for p in placements] == [(1, "a", 0, 1), (0, "b", 0, 2), (0, "b", 1, 2)]
    assert [p.node_rank for p in NodePlacementStrategy([1, 0]).get_placement(SPEC)] == [1, 0]
    with pytest.raises(PlacementError, match="'a' and 'ab' both contain node 1"):
        NodePlacementStrategy([0], node_group="a,ab").get_placement(SPEC)
    with pytest.raises(PlacementError, match="node rank 2 is out of range; node group"):
        NodePlacementStrategy([2], node_group="a,b").get_placement(SPEC)
    with pytest.raises(PlacementError, match="not both"):
        NodePlacementStrategy([0], node_group="a", node_group_label="b")


def _mp(placement: dict[str, Any], *, actor_tp: int = 1, rollout_tp: int = 1,
        gpus: int = 8, **extra: Any) -> ModelParallelComponentPlacement:
    cluster = {"num_nodes": 1, "accelerators_per_node": gpus, "component_placement": placement,
               **extra.pop("cluster", {})}
    return ModelParallelComponentPlacement({
        "cluster": cluster,
        "actor": {"model": {"tensor_model_parallel_size": actor_tp}},
        "rollout": {"tensor_parallel_size": rollout_tp}, **extra})


def test_model_parallel_collocated() -> None:
    mp = _mp({"actor,rollout,reward": "0-7"}, actor_tp=4, rollout_tp=2)
    assert mp.is_collocated and not mp.is_pipeline
    assert mp.get_world_size("actor") == 8 and mp.get_world_size("rollout") == 4
    assert mp.reward_world_size == 8 and mp.get_world_size("reward") == 8
    # strided so one rollout engine's GPUs sit inside one actor TP group
    assert [p.hardware_ranks for p in mp.get_placement("rollout")] == [[0, 2], [1, 3], [4, 6],
                                                                        [5, 7]]
    assert (mp.actor_dp_size, mp.rollout_dp_size) == (2, 4)
    assert isinstance(mp.get_strategy("rollout"), PackedPlacementStrategy)


def test_model_parallel_disaggregated_and_auto() -> None:
    mp = _mp({"actor": "0-3", "rollout,reward": "4-5", "inference": "6-7"}, rollout_tp=2)
    assert mp.is_disaggregated and mp.has_dedicated_inference
    assert [p.hardware_ranks for p in mp.get_placement("rollout")] == [[4, 5]]
    assert mp.get_world_size("inference") == 2
    # reward takes no part in choosing the mode: its GPUs may be anyone's
    assert [p.hardware_ranks for p in mp.get_placement("reward")] == [[4], [5]]
    auto = _mp({"actor": "0-1", "rollout": "2-5", "inference": "6-7", "reward": "2-5"},
               cluster={"auto_scheduler": True})
    assert auto.is_auto and auto.get_world_size("actor") == 8  # the actor spans every GPU


@pytest.mark.parametrize(
    ("placement", "kwargs", "fragment"),
    [
        ({"rollout,reward": "0-3"}, {}, "Actor GPUs must be specified"),
        ({"actor,reward": "0-3"}, {}, "Rollout GPUs must be specified"),
        # RLinf requires reward in every mode, and checks it before anything else
        ({"actor,rollout": "0-3"}, {}, "Reward GPUs must be specified"),
        ({"actor": "0-3", "rollout": "4-7"}, {}, "Reward GPUs must be specified"),
        ({"actor": "0-3", "rollout": "4-5", "inference": "6-7"},
         {"cluster": {"auto_scheduler": True}}, "Reward GPUs must be specified"),
        ({"actor": "0-1,3-4", "rollout": "5-6"}, {}, "Reward GPUs must be specified"),
        ({"actor": "0-1,3-4", "rollout,reward": "5-6"}, {},
         "Actor GPUs [0, 1, 3, 4] must be continuous"),
        ({"actor,reward": "0-3", "rollout": "2-5"}, {},
         "does not match either the collocated mode"),
        ({"actor,rollout,inference,reward": "0-3"}, {},
         "Inference GPUs must not be specified in collocated mode"),
        ({"actor,rollout,reward": "0-3"}, {"actor_tp": 8},
         "Actor TP size 8 must be less than or equal"),
        ({"actor,rollout,reward": "0-3"}, {"rollout_tp": 8},
         "Rollout TP size 8 must be less than"),
        ({"actor,rollout,reward": "0-5"}, {"actor_tp": 3, "rollout_tp": 2},
         "Actor TP size (3) must be divisible by Rollout TP size (2)"),
        ({"actor": "0-3", "rollout,reward": "4-5", "inference": "6-7"},
         {"algorithm": {"recompute_logprobs": False}}, "recompute_logprobs has been set to false"),
        ({"actor": "2-3", "rollout,reward": "4-7"}, {"cluster": {"auto_scheduler": True}},
         "AUTO mode requires components to be placed in the order"),
        ({"actor,rollout,reward": "0-3"}, {"cluster": {"auto_scheduler": True}},
         "AUTO mode is a more advanced version of disaggregated mode"),
    ],
)
def test_model_parallel_errors(placement: dict, kwargs: dict, fragment: str) -> None:
    with pytest.raises(PlacementError, match=re.escape(fragment)):
        _mp(placement, **kwargs)
