"""Placement from YAML, end to end: the workers' environment and nodes match the plan."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

import aiorl
from aiorl.placement import ComponentPlacement

pytestmark = pytest.mark.timeout(120)

CONFIG = """
cluster:
  num_nodes: 2
  node_groups:
    - label: gpu
      node_ranks: 0-1
      env_configs:
        - node_ranks: 1
          env_vars:
            - PLACEMENT_TEST_FLAG: node1
  component_placement:
    actor,inference: "0-3:0-7"
    rollout:
      node_group: gpu
      placement: "4-7"
"""


class Reporter(aiorl.Worker):
    def report(self) -> dict:
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES",
                "PLACEMENT_TEST_FLAG", "NODE_RANK"]
        return {"node_rank": self.worker_info.node_rank,
                **{k: os.environ.get(k) for k in keys}}


def test_yaml_placement_matches_plan():
    cfg = OmegaConf.create(CONFIG)
    with aiorl.Cluster(cfg, num_nodes=2, accelerators_per_node=4) as cluster:
        assert cluster.num_accelerators == 8
        placement = ComponentPlacement(cfg, cluster)
        for component in ("actor", "rollout"):
            strategy = placement.get_strategy(component)
            plan = strategy.get_placement(cluster.spec)
            group = Reporter.create_group().launch(cluster, strategy, name=component)
            try:
                reports = group.report().wait(90)
            finally:
                group.close()
            assert len(reports) == placement.get_world_size(component) == len(plan)
            for p, r in zip(plan, reports, strict=True):
                assert r["node_rank"] == p.node_rank == int(r["NODE_RANK"])
                assert int(r["RANK"]) == p.rank
                assert int(r["LOCAL_RANK"]) == p.local_rank
                assert int(r["LOCAL_WORLD_SIZE"]) == p.local_world_size
                assert r["CUDA_VISIBLE_DEVICES"] == ",".join(p.visible_accelerators)
                expected_flag = "node1" if (component == "rollout" and p.node_rank == 1) else None
                assert r["PLACEMENT_TEST_FLAG"] == expected_flag
        # actor: 8 processes over accelerators 0-3 (node 0), two per accelerator.
        actor_plan = placement.get_strategy("actor").get_placement(cluster.spec)
        assert [p.visible_accelerators for p in actor_plan] == [[str(i // 2)] for i in range(8)]
        assert placement.get_strategy("actor") is placement.get_strategy("inference")


def test_invalid_placement_is_rejected_before_launch(cluster):
    with pytest.raises(aiorl.PlacementError, match="out of range"):
        Reporter.create_group().launch(
            cluster, aiorl.placement.PackedPlacementStrategy(0, 7), name="toolarge")
