"""Placement: which process of a worker group runs on which node and resource.

Pure logic over a static [`ClusterSpec`][aiorl.placement.ClusterSpec]; nothing here starts processes
or imports torch, zmq or omegaconf, so the node agent can import it cheaply and
``aiorl plan`` can check a config on any machine. See ``docs/placement.md``.

Typical use::

    spec = ClusterSpec(num_nodes=2, accelerators_per_node=8)
    cp = ComponentPlacement({"cluster": {"component_placement": {"actor": "0-15"}}}, spec)
    cp.get_world_size("actor")          # 16
    cp.get_placement("actor")[9]        # node 1, visible accelerator "1"

    PackedPlacementStrategy(0, 7, num_hardware_per_process=2).get_placement(spec)
"""

from __future__ import annotations

from aiorl.errors import PlacementError
from aiorl.placement.component import ComponentPlacement
from aiorl.placement.hardware import (
    HARDWARE_KINDS,
    CustomHardwareConfig,
    FrankaConfig,
    HardwareConfig,
    HardwareType,
    NodeHardware,
    get_hardware_type,
    hardware_types,
    register_hardware,
)
from aiorl.placement.model_parallel import (
    HybridComponentPlacement,
    ModelParallelComponentPlacement,
    PlacementMode,
)
from aiorl.placement.profiling import ProfilerLaunch, ProfilingConfig, parse_profiling
from aiorl.placement.ranks import format_ranks, parse_rank_config
from aiorl.placement.render import render_placements, render_plan
from aiorl.placement.spec import (
    RESERVED_GROUP_LABELS,
    ClusterSpec,
    EnvConfig,
    NodeGroup,
)
from aiorl.placement.strategies import (
    FlexiblePlacementStrategy,
    NodePlacementStrategy,
    PackedPlacementStrategy,
    Placement,
    PlacementStrategy,
    RankStringPlacementStrategy,
    default_placement_strategy,
)

__all__ = [
    "HARDWARE_KINDS",
    "RESERVED_GROUP_LABELS",
    "ClusterSpec",
    "ComponentPlacement",
    "CustomHardwareConfig",
    "EnvConfig",
    "FlexiblePlacementStrategy",
    "FrankaConfig",
    "HardwareConfig",
    "HardwareType",
    "HybridComponentPlacement",
    "ModelParallelComponentPlacement",
    "NodeGroup",
    "NodeHardware",
    "NodePlacementStrategy",
    "PackedPlacementStrategy",
    "Placement",
    "PlacementError",
    "PlacementMode",
    "PlacementStrategy",
    "ProfilerLaunch",
    "ProfilingConfig",
    "RankStringPlacementStrategy",
    "default_placement_strategy",
    "format_ranks",
    "get_hardware_type",
    "hardware_types",
    "parse_profiling",
    "parse_rank_config",
    "register_hardware",
    "render_placements",
    "render_plan",
]
