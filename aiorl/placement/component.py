"""``cluster.component_placement``: one placement rule per component (or component list)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiorl.errors import PlacementError
from aiorl.placement.spec import ClusterSpec, cluster_section
from aiorl.placement.strategies import Placement, RankStringPlacementStrategy, resolve_spec

__all__ = ["ComponentPlacement"]


class ComponentPlacement:
    """The placements that ``cluster.component_placement`` describes.

    Each key names one component, or several joined by commas (``actor,inference``);
    each value is a placement string (or int), or a mapping
    ``{node_group: LABEL[,LABEL...], placement: STRING}``. Components named by one key
    share one rule and one strategy object.

    Every rule is checked against the cluster when the object is built, so a bad
    config fails before any process starts.

    Args:
        cfg: the whole config (with a top-level ``cluster`` key) or the ``cluster``
            section itself; a dict or an omegaconf ``DictConfig``. A missing
            ``component_placement`` means no components.
        cluster_or_spec: a [`ClusterSpec`][aiorl.placement.ClusterSpec], an object with a ``.spec``
            (a live ``Cluster``), or ``None`` to build the spec from ``cfg``. When the given
            spec declares no node groups and ``cfg`` does, the config's groups are
            used, so that a spec built from counts alone still resolves labels.

    Raises:
        PlacementError: a malformed key or value, a component named twice, an unknown
            node group, or any placement rule broken.
    """

    def __init__(self, cfg: Mapping[str, Any] | None, cluster_or_spec: Any = None) -> None:
        section = cluster_section(cfg)
        if cluster_or_spec is None:
            spec = ClusterSpec.from_config(section)
        else:
            spec = resolve_spec(cluster_or_spec)
            if not spec.node_groups and section.get("node_groups"):
                spec = spec.with_node_groups(section["node_groups"])
            if spec.profiling is None and section.get("profiling") is not None:
                spec = spec.with_profiling(section["profiling"])
        self._spec = spec
        self._config = cfg
        raw = section.get("component_placement") or {}
        if not isinstance(raw, dict):
            raise PlacementError(
                f"cluster.component_placement must be a mapping of component names to "
                f"placements, got {raw!r}"
            )
        self._keys: dict[str, RankStringPlacementStrategy] = {}
        self._key_of: dict[str, str] = {}
        self._placements: dict[str, list[Placement]] = {}
        for key, value in raw.items():
            key_text = str(key).strip()
            names = [n.strip() for n in key_text.split(",")]
            if not key_text or any(not n for n in names):
                raise PlacementError(f"component_placement key {key!r} has an empty component name")
            for name in names:
                if name in self._key_of:
                    raise PlacementError(
                        f"component {name!r} is placed twice: by {self._key_of[name]!r} and "
                        f"by {key_text!r}"
                    )
            strategy = self._strategy_for(key_text, value)
            self._keys[key_text] = strategy
            self._placements[key_text] = strategy.get_placement(spec)
            for name in names:
                self._key_of[name] = key_text

    @staticmethod
    def _strategy_for(key: str, value: Any) -> RankStringPlacementStrategy:
        context = f"component {key!r}"
        if isinstance(value, Mapping):
            unknown = sorted(str(k) for k in value if k not in ("node_group", "placement"))
            if unknown:
                raise PlacementError(
                    f"{context}: unknown key(s) {', '.join(unknown)}; expected node_group "
                    "and placement"
                )
            if value.get("placement") is None:
                raise PlacementError(f"{context}: missing placement")
            node_group = value.get("node_group")
            return RankStringPlacementStrategy(
                value["placement"],
                node_group=None if node_group is None else node_group,
                context=context,
            )
        if value is None:
            raise PlacementError(f"{context}: missing placement")
        return RankStringPlacementStrategy(value, context=context)

    # -- queries -----------------------------------------------------------------------

    @property
    def spec(self) -> ClusterSpec:
        """The cluster description the placements were computed for."""
        return self._spec

    @property
    def components(self) -> list[str]:
        """Every component name, comma-joined keys split, in config order."""
        return list(self._key_of)

    @property
    def keys(self) -> list[str]:
        """The ``component_placement`` keys as written (``"actor,inference"``), in order."""
        return list(self._keys)

    def _key(self, component: str) -> str:
        if component in self._key_of:
            return self._key_of[component]
        if component in self._keys:  # a whole key such as "actor,inference" also works
            return component
        raise PlacementError(
            f"unknown component {component!r}; components: {', '.join(self._key_of) or 'none'}"
        )

    def has_component(self, component: str) -> bool:
        """Whether ``component_placement`` places ``component``."""
        return component in self._key_of or component in self._keys

    def get_strategy(self, component: str, required: bool = True) -> Any:
        """The strategy of ``component``; components of one key share the object.

        With ``required=False`` an unknown component gives ``None`` instead of raising
        [`PlacementError`][aiorl.PlacementError] (RLinf's signature)."""
        if not required and not self.has_component(component):
            return None
        return self._keys[self._key(component)]

    def get_hardware_ranks(self, component: str) -> list[int]:
        """The resource ranks ``component``'s placement string uses, ascending, in the
        numbering of its node group(s) (``0-3:0-7,6-7`` gives ``[0, 1, 2, 3, 6, 7]``)."""
        placements = self._placements[self._key(component)]
        return sorted({r for p in placements for r in p.resource_ranks})

    def get_world_size(self, component: str) -> int:
        """The number of processes of ``component``."""
        return len(self._placements[self._key(component)])

    def get_placement(self, component: str) -> list[Placement]:
        """The placements of ``component``'s processes, sorted by rank."""
        return self._keys[self._key(component)].get_placement(self._spec)

    def get_node_group_labels(self, component: str) -> list[str]:
        """The node group(s) whose resources ``component``'s placement string counts."""
        return list(self._keys[self._key(component)].node_group_labels)

    def __repr__(self) -> str:
        rules = ", ".join(f"{k}: {s.placement!r}" for k, s in self._keys.items())
        return f"ComponentPlacement({{{rules}}}, spec={self._spec!r})"
