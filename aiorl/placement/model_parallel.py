"""RLinf's placements for model-parallel RL: actor, rollout, inference and reward on GPUs.

`ModelParallelComponentPlacement` reads the same ``component_placement`` as
[`ComponentPlacement`][aiorl.placement.ComponentPlacement] and then decides, from which GPUs the
components share, how the processes are laid out (RLinf's ``rlinf.utils.placement``):

Actor, rollout and reward must all be placed (RLinf's rule, in every mode); reward
gets one process per GPU and does not take part in choosing the mode.

* **collocated**: actor and rollout use the same GPUs. The actor gets one process per
  GPU; each rollout process takes ``rollout.tensor_parallel_size`` GPUs, strided by
  ``actor_tp / rollout_tp`` so a rollout engine's GPUs are the ones one actor TP group
  holds (weights then move by CUDA IPC). No inference component is allowed.
* **disaggregated**: no two components share a GPU. Each rollout data-parallel replica
  gets its GPUs packed; actor and inference one process per GPU.
* **auto** (``cluster.auto_scheduler: true``): disaggregated, laid out actor -> rollout
  -> inference over the whole cluster; the actor is placed on every GPU.

Tensor/pipeline sizes come from ``actor.model.tensor_model_parallel_size``,
``actor.model.pipeline_model_parallel_size``, ``actor.model.context_parallel_size``,
``rollout.tensor_parallel_size``, ``rollout.pipeline_parallel_size`` and
``inference.model.*`` (defaulting to the actor's), all 1 when absent.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from typing import Any

from aiorl.errors import PlacementError
from aiorl.placement.component import ComponentPlacement
from aiorl.placement.spec import to_plain
from aiorl.placement.strategies import PackedPlacementStrategy, Placement, PlacementStrategy

__all__ = ["HybridComponentPlacement", "ModelParallelComponentPlacement", "PlacementMode"]

log = logging.getLogger("aiorl.placement")


class PlacementMode(enum.Enum):
    """How the components of a model-parallel job share the GPUs."""

    COLLOCATED = enum.auto()
    DISAGGREGATED = enum.auto()
    HYBRID = enum.auto()
    AUTO = enum.auto()


class HybridComponentPlacement(ComponentPlacement):
    """A [`ComponentPlacement`][aiorl.placement.ComponentPlacement] that says so: components on any
    sets of GPUs."""

    placement_mode = PlacementMode.HYBRID


def _get(cfg: Mapping[str, Any], path: str, default: Any) -> Any:
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return default if node is None else node


class ModelParallelComponentPlacement(ComponentPlacement):
    """See the module docstring.

    Args:
        cfg: the whole config: ``cluster`` (with ``component_placement``), ``actor``,
            ``rollout`` and optionally ``inference``, ``algorithm``.
        cluster_or_spec: as for [`ComponentPlacement`][aiorl.placement.ComponentPlacement].

    Raises:
        PlacementError: actor, rollout or reward missing (reward is required in every
            mode, as in RLinf), a component's GPUs not continuous, a
            layout that is neither collocated nor disaggregated, a TP size larger than
            its component's GPUs, an actor TP not divisible by the rollout TP
            (collocated), inference placed while ``algorithm.recompute_logprobs`` is
            false, or an auto layout out of actor -> rollout -> inference order.
    """

    placement_mode: PlacementMode

    def __init__(self, cfg: Mapping[str, Any], cluster_or_spec: Any = None) -> None:
        super().__init__(cfg, cluster_or_spec)
        self._cfg = to_plain(cfg)
        self._overrides: dict[str, PlacementStrategy] = {}
        self._actor_gpus = self._gpus("actor")
        self._rollout_gpus = self._gpus("rollout")
        self._inference_gpus = self._gpus("inference")
        self._reward_gpus = self._gpus("reward")
        self._cluster_num_gpus = self.spec.num_accelerators
        if self._actor_gpus is None:
            raise PlacementError("Actor GPUs must be specified in the component_placement config.")
        if self._rollout_gpus is None:
            raise PlacementError(
                "Rollout GPUs must be specified in the component_placement config.")
        # RLinf requires a reward placement in every mode (collocated, disaggregated,
        # auto), before any other check; reward GPUs take no part in choosing the mode.
        if self._reward_gpus is None:
            raise PlacementError(
                "Reward GPUs must be specified in the component_placement config.")
        for name, gpus in (("Actor", self._actor_gpus), ("Rollout", self._rollout_gpus),
                           ("Inference", self._inference_gpus)):
            if gpus is not None and gpus != list(range(gpus[0], gpus[-1] + 1)):
                raise PlacementError(f"{name} GPUs {gpus} must be continuous.")
        if self._is_auto():
            self.placement_mode = PlacementMode.AUTO
        elif self._actor_gpus == self._rollout_gpus:
            if self._inference_gpus is not None:
                raise PlacementError("Inference GPUs must not be specified in collocated mode.")
            self.placement_mode = PlacementMode.COLLOCATED
        elif self._is_disaggregated():
            if self._inference_gpus is not None:
                self._check_inference()
            self.placement_mode = PlacementMode.DISAGGREGATED
        else:
            raise PlacementError(
                "The specified placement does not match either the collocated mode (all the "
                "components use the same GPUs) or the disaggregated mode (all the components "
                f"use completely different GPUs), but got actor {self._actor_gpus}, rollout "
                f"{self._rollout_gpus}, inference {self._inference_gpus}")
        log.info("model-parallel placement in %s mode", self.placement_mode.name.lower())
        if self.actor_tp_size > self.actor_world_size:
            raise PlacementError(
                f"Actor TP size {self.actor_tp_size} must be less than or equal to Actor world "
                f"size {self.actor_world_size}.")
        if self.rollout_tp_size > self.rollout_world_size:
            raise PlacementError(
                f"Rollout TP size {self.rollout_tp_size} must be less than or equal to Rollout "
                f"world size {self.rollout_world_size}.")
        self._generate_placements()

    # -- mode detection --------------------------------------------------------------

    def _gpus(self, component: str) -> list[int] | None:
        return self.get_hardware_ranks(component) if self.has_component(component) else None

    def _is_disaggregated(self) -> bool:
        sets = [set(g) for g in (self._actor_gpus, self._rollout_gpus, self._inference_gpus)
                if g is not None]
        return all(a.isdisjoint(b) for i, a in enumerate(sets) for b in sets[i + 1:])

    def _is_auto(self) -> bool:
        if not _get(self._cfg, "cluster.auto_scheduler", False):
            return False
        if not self._is_disaggregated():
            raise PlacementError(
                "AUTO mode is a more advanced version of disaggregated mode, so it must satisfy "
                "the requirements of disaggregated mode.")
        actor, rollout, inference = self._actor_gpus, self._rollout_gpus, self._inference_gpus
        assert actor is not None and rollout is not None
        last = inference if inference is not None else rollout
        in_order = actor[0] == 0 and actor[-1] == rollout[0] - 1 and (
            inference is None or rollout[-1] == inference[0] - 1
        ) and last[-1] == self._cluster_num_gpus - 1
        if not in_order:
            raise PlacementError(
                "AUTO mode requires components to be placed in the order of actor -> rollout "
                "-> inference, covering every GPU of the cluster.")
        return True

    def _check_inference(self) -> None:
        if self.inference_tp_size > self.inference_world_size:
            raise PlacementError(
                f"Inference TP size {self.inference_tp_size} must be less than or equal to "
                f"Inference world size {self.inference_world_size}.")
        if not _get(self._cfg, "algorithm.recompute_logprobs", True):
            raise PlacementError(
                "algorithm.recompute_logprobs has been set to false, which disables inference. "
                f"So inference GPUs {self._inference_gpus} must not be specified.")

    # -- layouts -----------------------------------------------------------------------

    def _packed(self, component: str, gpus: list[int], per_process: int = 1,
                stride: int = 1) -> None:
        self._overrides[component] = PackedPlacementStrategy(
            gpus[0], gpus[-1], num_hardware_per_process=per_process, stride=stride,
            node_group=self.get_node_group_labels(component))

    def _generate_placements(self) -> None:
        actor, rollout = self._actor_gpus, self._rollout_gpus
        assert actor is not None and rollout is not None
        if self.placement_mode is PlacementMode.COLLOCATED:
            self._packed("actor", actor)
            if self.actor_tp_size > self.rollout_tp_size:
                if self.actor_tp_size % self.rollout_tp_size:
                    raise PlacementError(
                        f"Actor TP size ({self.actor_tp_size}) must be divisible by Rollout TP "
                        f"size ({self.rollout_tp_size})")
                stride = self.actor_tp_size // self.rollout_tp_size
            else:
                stride = 1
            self._packed("rollout", rollout, self.rollout_tp_size, stride)
        else:
            if self.placement_mode is PlacementMode.AUTO:
                self._overrides["actor"] = PackedPlacementStrategy(
                    0, self._cluster_num_gpus - 1, node_group=self.get_node_group_labels("actor"))
                if _get(self._cfg, "cluster.use_pre_process_policy", False):
                    if (actor[-1] - actor[0] + 1) % self.rollout_tp_size:
                        raise PlacementError(
                            f"use_pre_process_policy: the actor's {len(actor)} GPUs must be a "
                            f"multiple of the rollout TP size {self.rollout_tp_size}")
                    rollout = list(range(actor[-1] + 1)) + rollout
                    self._rollout_gpus = rollout
            else:
                self._packed("actor", actor)
            self._packed("rollout", rollout, len(rollout) // self.rollout_dp_size)
            if self._inference_gpus is not None:
                self._packed("inference", self._inference_gpus)
        if self._reward_gpus:
            self._packed("reward", self._reward_gpus)

    # -- strategies: the generated layouts replace the placement strings ---------------

    def get_strategy(self, component: str, required: bool = True) -> Any:
        if component in self._overrides:
            return self._overrides[component]
        return super().get_strategy(component, required)

    def get_placement(self, component: str) -> list[Placement]:
        if component in self._overrides:
            return self._overrides[component].get_placement(self.spec)
        return super().get_placement(component)

    def get_world_size(self, component: str) -> int:
        if component in self._overrides:
            return len(self.get_placement(component))
        return super().get_world_size(component)

    # -- RLinf's queries -----------------------------------------------------------------

    @property
    def is_collocated(self) -> bool:
        return self.placement_mode is PlacementMode.COLLOCATED

    @property
    def is_disaggregated(self) -> bool:
        return self.placement_mode is PlacementMode.DISAGGREGATED

    @property
    def is_auto(self) -> bool:
        return self.placement_mode is PlacementMode.AUTO

    @property
    def is_pipeline(self) -> bool:
        return self.is_disaggregated or self.is_auto

    @property
    def has_dedicated_inference(self) -> bool:
        return self.is_pipeline and self._inference_gpus is not None

    @property
    def actor_tp_size(self) -> int:
        return int(_get(self._cfg, "actor.model.tensor_model_parallel_size", 1))

    @property
    def actor_pp_size(self) -> int:
        return int(_get(self._cfg, "actor.model.pipeline_model_parallel_size", 1))

    @property
    def actor_world_size(self) -> int:
        return len(self._actor_gpus or [])

    @property
    def actor_dp_size(self) -> int:
        cp = int(_get(self._cfg, "actor.model.context_parallel_size", 1))
        return self.actor_world_size // (self.actor_tp_size * cp * self.actor_pp_size)

    @property
    def inference_tp_size(self) -> int:
        return int(_get(self._cfg, "inference.model.tensor_model_parallel_size",
                        self.actor_tp_size))

    @property
    def inference_pp_size(self) -> int:
        return int(_get(self._cfg, "inference.model.pipeline_model_parallel_size",
                        self.actor_pp_size))

    @property
    def inference_world_size(self) -> int:
        return len(self._inference_gpus or [])

    @property
    def inference_dp_size(self) -> int:
        return self.inference_world_size // (self.inference_tp_size * self.inference_pp_size)

    @property
    def rollout_tp_size(self) -> int:
        return int(_get(self._cfg, "rollout.tensor_parallel_size", 1))

    @property
    def rollout_world_size(self) -> int:
        return len(self._rollout_gpus or [])

    @property
    def rollout_dp_size(self) -> int:
        pp = int(_get(self._cfg, "rollout.pipeline_parallel_size", 1))
        return self.rollout_world_size // (self.rollout_tp_size * pp)

    @property
    def reward_world_size(self) -> int:
        return len(self._reward_gpus or [])
