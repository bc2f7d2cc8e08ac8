"""Static cluster description: [`ClusterSpec`][aiorl.placement.ClusterSpec], `NodeGroup`,
`EnvConfig`.

A [`ClusterSpec`][aiorl.placement.ClusterSpec] says how many nodes there are, how many accelerators
each has, and which node groups are declared. It starts nothing; placement is computed
from it alone, so plans can be checked on a laptop (``aiorl plan``) and the live
``Cluster`` hands the same object to the strategies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiorl.errors import PlacementError
from aiorl.placement.hardware import NodeHardware, build_hardware_config
from aiorl.placement.profiling import ProfilingConfig, parse_profiling
from aiorl.placement.ranks import format_ranks, parse_rank_config, rank_out_of_range_message

__all__ = [
    "ACCELERATOR",
    "NODE",
    "RESERVED_GROUP_LABELS",
    "ClusterSpec",
    "EnvConfig",
    "NodeGroup",
    "to_plain",
]

#: ``Placement.hardware_type`` of a process placed on accelerators.
ACCELERATOR = "accelerator"
#: ``Placement.hardware_type`` of a process placed on a whole node.
NODE = "node"
#: Labels the scheduler defines itself; users may not declare groups with them.
RESERVED_GROUP_LABELS = ("cluster", "node")


def to_plain(obj: Any) -> Any:
    """Turn mappings and sequences (e.g. omegaconf ``DictConfig``/``ListConfig``) into
    plain ``dict``/``list``, recursively.

    Done by duck typing instead of ``OmegaConf.to_container`` so that this module never
    imports omegaconf: the node agent imports placement and must start fast. Reading
    values through the ``Mapping`` interface resolves omegaconf interpolations.
    """
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        return [to_plain(v) for v in obj]
    return obj


def _check_keys(cfg: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    # Unknown keys are nearly always typos ("node_rank" for "node_ranks"); silently
    # ignoring them would place processes somewhere the user did not ask for.
    unknown = sorted(str(k) for k in cfg if k not in allowed)
    if unknown:
        raise PlacementError(
            f"{where}: unknown key(s) {', '.join(unknown)}; expected {', '.join(allowed)}"
        )


def _ranks(text: Any, where: str) -> list[int]:
    """Node ranks: ``parse_rank_config`` with ``where`` prefixed to any error message."""
    try:
        return parse_rank_config(text, rank_type="node")
    except PlacementError as exc:
        raise PlacementError(f"{where}: {exc}") from None


@dataclass
class EnvConfig:
    """Environment for processes on some nodes of a node group.

    Attributes:
        node_ranks: global node ranks this entry applies to (a subset of the group's).
        env_vars: variables set in every process the group places on those nodes.
        python_interpreter_path: the interpreter to run there, if not the default
            (kept for the runtime; placement only carries it).
    """

    node_ranks: list[int]
    env_vars: dict[str, str] = field(default_factory=dict)
    python_interpreter_path: str | None = None

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], where: str = "env_configs entry") -> EnvConfig:
        """Build from ``{node_ranks, env_vars, python_interpreter_path}``.

        ``env_vars`` is either a mapping ``{KEY: value}`` or RLinf's list of one-key
        mappings (an entry with several keys is refused, as in RLinf). Values become
        strings; a key given twice in one entry is an error.
        """
        cfg = to_plain(cfg)
        if not isinstance(cfg, dict):
            raise PlacementError(f"{where}: expected a mapping, got {cfg!r}")
        _check_keys(cfg, ("node_ranks", "env_vars", "python_interpreter_path"), where)
        if "node_ranks" not in cfg:
            raise PlacementError(f"{where}: missing node_ranks")
        node_ranks = _ranks(cfg["node_ranks"], f"{where} node_ranks")
        raw = cfg.get("env_vars") or {}
        items: list[tuple[Any, Any]] = []
        if isinstance(raw, dict):
            items.extend(raw.items())
        elif isinstance(raw, list):
            for entry in raw:
                if not isinstance(entry, dict):
                    raise PlacementError(
                        f"{where}: Each node env_var must be a dict in config. But got "
                        f"{type(entry)}: {entry}; write each variable as a list item "
                        "'- KEY: value'"
                    )
                if len(entry) != 1:
                    raise PlacementError(
                        f"{where}: Each node env_var dict must contain exactly one key-value "
                        f"pair. But got: {entry}; write each variable as its own list item "
                        "'- KEY: value'"
                    )
                items.extend(entry.items())
        else:
            raise PlacementError(
                f"{where}: env_vars must be a mapping or a list of mappings, got {raw!r}"
            )
        env: dict[str, str] = {}
        for key, value in items:
            if not isinstance(key, str) or not key or "=" in key:
                raise PlacementError(f"{where}: {key!r} is not a valid environment variable name")
            if value is None:
                raise PlacementError(f"{where}: environment variable {key} has no value")
            if key in env:
                raise PlacementError(f"{where}: environment variable {key} is set twice")
            env[key] = str(value)
        interpreter = cfg.get("python_interpreter_path")
        return cls(
            node_ranks=node_ranks,
            env_vars=env,
            python_interpreter_path=None if interpreter is None else str(interpreter),
        )


@dataclass
class NodeGroup:
    """A labelled set of nodes and the kind of resource they offer.

    What a *resource* of the group is (the unit that placement strings count):

    1. ``hardware_type`` set: that hardware (e.g. robots), ``hardware_per_node[n]``
       units on node ``n``;
    2. else, when ``per_node`` is false and the group's nodes have accelerators: the
       accelerators;
    3. else: the nodes themselves, one resource per node.

    Resources are numbered from 0 within the group: nodes in ascending rank order,
    and within a node by local index. The reserved group ``node`` is a ``per_node``
    group over every node; ``cluster`` is an ordinary group over every node.

    Attributes:
        label: the name used in ``component_placement`` (no ``,`` or ``:``).
        node_ranks: global node ranks in the group, ascending. A rank string such as
            ``"0-3"`` is accepted and parsed.
        hardware_type: the custom hardware type, or ``None`` for accelerators/nodes.
        hardware_per_node: units of ``hardware_type`` on each node of the group.
        hardware_configs: per node, the config entry of each unit, in unit order, when
            the group was declared in RLinf's ``configs`` form (empty otherwise).
        env_configs: environment per subset of the group's nodes; entries may not
            overlap. Dicts are accepted and converted.
        per_node: count nodes as the resources even when accelerators exist (RLinf's
            ``ignore_hardware``).
        hardware: the typed view of the hardware: one config object per unit, built
            from the schema registered for ``hardware_type`` (set when the group is
            built; see `aiorl.placement.hardware`).
        profiling: this group's ``profiling:`` section; it applies to every worker placed
            through the group and takes precedence over the cluster-level section.
    """

    label: str
    node_ranks: list[int]
    hardware_type: str | None = None
    hardware_per_node: dict[int, int] = field(default_factory=dict)
    hardware_configs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    env_configs: list[EnvConfig] = field(default_factory=list)
    per_node: bool = False
    hardware: NodeHardware | None = None
    profiling: ProfilingConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label.strip():
            raise PlacementError(f"node group label {self.label!r} must be a non-empty string")
        self.label = self.label.strip()
        # ',' joins several labels in one node_group value and ':' separates ranks, so a
        # label holding either could never be referred to unambiguously.
        if any(c in self.label for c in ",: \t"):
            raise PlacementError(
                f"node group label {self.label!r} may not contain ',', ':' or whitespace"
            )
        where = f"node group {self.label!r}"
        self.node_ranks = _ranks(self.node_ranks, f"{where} node_ranks")
        members = set(self.node_ranks)
        if self.hardware_type is not None:
            if not isinstance(self.hardware_type, str) or not self.hardware_type.strip():
                raise PlacementError(f"{where}: hardware type must be a non-empty string")
            if self.hardware_type.strip().lower() in (ACCELERATOR, NODE):
                # These two names are what Placement.hardware_type reports for the
                # built-in kinds; a custom type with the same name would be ambiguous.
                raise PlacementError(
                    f"{where}: hardware type {self.hardware_type!r} is reserved; omit "
                    "'hardware' to place on accelerators or nodes"
                )
            counts = {int(n): int(c) for n, c in dict(self.hardware_per_node).items()}
            for n, c in counts.items():
                if n not in members:
                    raise PlacementError(
                        f"node_rank {n} in hardware config must be within node_ranks "
                        f"{self.node_ranks} in node group '{self.label}'."
                    )
                if c < 0:
                    raise PlacementError(f"{where}: negative hardware count {c} on node {n}")
            self.hardware_per_node = {n: counts.get(n, 0) for n in self.node_ranks}
            if sum(self.hardware_per_node.values()) == 0:
                raise PlacementError(f"{where}: hardware {self.hardware_type!r} has no units")
            self.hardware = self._typed_hardware(where)
        elif self.hardware_per_node or self.hardware_configs:
            raise PlacementError(f"{where}: hardware units given without a hardware type")
        if self.per_node and self.hardware_type is not None:
            raise PlacementError(
                f"{where}: ignore_hardware (whole nodes as resources) cannot be combined "
                "with hardware"
            )
        envs = [
            e if isinstance(e, EnvConfig) else EnvConfig.from_config(e, f"{where} env_configs")
            for e in self.env_configs
        ]
        covered: dict[int, int] = {}
        for i, env in enumerate(envs):
            for n in env.node_ranks:
                if n not in members:
                    raise PlacementError(
                        f"{where}: env_configs entry {i} names node {n}, which is not in the "
                        f"group's node_ranks {format_ranks(self.node_ranks)}"
                    )
                if n in covered:
                    raise PlacementError(
                        f"{where}: env_configs entries {covered[n]} and {i} both cover node {n}; "
                        "entries must not overlap"
                    )
                covered[n] = i
        self.env_configs = envs

    def _typed_hardware(self, where: str) -> NodeHardware:
        """One config object per unit, checked against the type's schema; identical
        entries on one node are one robot declared twice, which is refused."""
        assert self.hardware_type is not None
        configs = []
        for n in self.node_ranks:
            raw_units = self.hardware_configs.get(n) or [
                {"node_rank": n} for _ in range(self.hardware_per_node.get(n, 0))
            ]
            seen: set[tuple[tuple[str, str], ...]] = set()
            for raw in raw_units:
                config = build_hardware_config(
                    self.hardware_type, raw, f"{where} hardware config on node {n}"
                )
                key = _unit_key(config.to_dict())
                if self.hardware_configs and key in seen:
                    raise PlacementError(
                        f"{_duplicate_configs_text(self.hardware_configs)}{where}: {raw!r} is "
                        f"given twice on node {n}; each entry is one unit"
                    )
                seen.add(key)
                configs.append(config)
        return NodeHardware(self.hardware_type, configs)

    def unit_keys(self, node_rank: int) -> list[tuple[Any, ...]]:
        """What identifies each of this group's hardware units on ``node_rank``, in unit
        order: the config itself (RLinf's ``configs`` form: two groups naming the same
        robot share it), or the unit's position (``count`` form: anonymous units, like
        accelerators, are the node's units 0..count-1 in every group)."""
        if self.hardware is None:
            return []
        if self.hardware_configs:
            return [_unit_key(c.to_dict()) for c in self.hardware.on_node(node_rank)]
        return [("#", i) for i in range(self.hardware_per_node.get(node_rank, 0))]

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> NodeGroup:
        """Build from one ``cluster.node_groups`` entry.

        Shape: ``{label, node_ranks, hardware?, env_configs?}`` where ``hardware`` is
        ``{type, count}`` (``count`` units on every node of the group) or RLinf's
        ``{type, configs: [{node_rank, ...}, ...]}`` (each entry is one unit on its node).
        """
        cfg = to_plain(cfg)
        if not isinstance(cfg, dict):
            raise PlacementError(
                f"Each node yaml config must be a dictionary. But got {type(cfg)}: {cfg}; "
                "a node group is a mapping with a label and node_ranks"
            )
        label = cfg.get("label")
        where = f"node group {label!r}"
        if label is None:
            raise PlacementError(f"node group {cfg!r}: missing label")
        # YAML reads an unquoted `label: 4090` as an int; the label is still meant as text.
        label = str(label)
        _check_keys(
            cfg,
            ("label", "node_ranks", "hardware", "env_configs", "ignore_hardware", "profiling"),
            where,
        )
        if "node_ranks" not in cfg:
            raise PlacementError(f"{where}: missing node_ranks")
        node_ranks = _ranks(cfg["node_ranks"], f"{where} node_ranks")
        hw_type: str | None = None
        per_node: dict[int, int] = {}
        configs: dict[int, list[dict[str, Any]]] = {}
        hardware = cfg.get("hardware")
        if hardware is not None:
            if not isinstance(hardware, dict):
                raise PlacementError(f"{where}: hardware must be a mapping, got {hardware!r}")
            _check_keys(hardware, ("type", "count", "configs"), f"{where} hardware")
            if not hardware.get("type"):
                raise PlacementError(f"{where}: hardware needs a type")
            hw_type = str(hardware["type"])
            has_count = hardware.get("count") is not None
            has_configs = hardware.get("configs") is not None
            if has_count == has_configs:
                raise PlacementError(
                    f"{where}: hardware needs exactly one of 'count' (units per node) "
                    "or 'configs' (one entry per unit, each with a node_rank)"
                )
            if has_count:
                count = hardware["count"]
                if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                    raise PlacementError(
                        f"{where}: hardware count must be a positive integer, got {count!r}"
                    )
                per_node = {n: count for n in node_ranks}
            else:
                units = hardware["configs"]
                if not isinstance(units, list) or not units:
                    raise PlacementError(f"{where}: hardware configs must be a non-empty list")
                for i, unit in enumerate(units):
                    if not isinstance(unit, dict):
                        raise PlacementError(
                            f"{where}: Each hardware config must be a dictionary. But got "
                            f"{type(unit)}: {unit}; hardware configs entry {i} must be a "
                            "mapping with a node_rank"
                        )
                    if "node_rank" not in unit:
                        raise PlacementError(
                            f"{where}: Missing fields '['node_rank']' detected in cluster "
                            f"node_group hardware yaml config. Only got: {unit.keys()}. "
                            f"Hardware configs entry {i} needs a node_rank"
                        )
                    n = unit["node_rank"]
                    if isinstance(n, bool) or not isinstance(n, int):
                        raise PlacementError(
                            f"{where}: hardware configs entry {i}: node_rank must be an "
                            f"integer, got {n!r}"
                        )
                    per_node[n] = per_node.get(n, 0) + 1
                    configs.setdefault(n, []).append(unit)
        return cls(
            label=label,
            node_ranks=node_ranks,
            hardware_type=hw_type,
            hardware_per_node=per_node,
            hardware_configs=configs,
            env_configs=list(cfg.get("env_configs") or []),
            per_node=_flag(cfg.get("ignore_hardware", False), f"{where} ignore_hardware"),
            profiling=parse_profiling(
                cfg.get("profiling"), f"{where} profiling", applies_to_all=True
            ),
        )

    @property
    def reserved(self) -> bool:
        """Whether this is one of the scheduler's own groups (``cluster``, ``node``)."""
        return self.label in RESERVED_GROUP_LABELS

    def resource_kind(self, spec: ClusterSpec) -> str:
        """The kind of resource: ``hardware_type``, ``"accelerator"`` or ``"node"``."""
        if self.hardware_type is not None:
            return self.hardware_type
        if not self.per_node and any(spec.accelerators_on(n) for n in self.node_ranks):
            return ACCELERATOR
        return NODE

    def resources(self, spec: ClusterSpec) -> list[tuple[int, int]]:
        """The group's resources as ``(node_rank, local_index)``, in resource-rank order.

        The position in the returned list is the resource rank that placement strings
        use for this group. A node resource has local index 0.
        """
        kind = self.resource_kind(spec)
        out: list[tuple[int, int]] = []
        for n in self.node_ranks:
            if kind == NODE:
                count = 1
            elif kind == ACCELERATOR:
                count = spec.accelerators_on(n)
            else:
                out.extend(
                    (n, spec.hardware_unit_index(kind, n, key, default=i))
                    for i, key in enumerate(self.unit_keys(n))
                )
                continue
            out.extend((n, i) for i in range(count))
        return out

    def env_for(self, node_rank: int) -> dict[str, str]:
        """The environment variables this group sets on ``node_rank`` (a new dict)."""
        for env in self.env_configs:
            if node_rank in env.node_ranks:
                return dict(env.env_vars)
        return {}

    def python_interpreter_for(self, node_rank: int) -> str | None:
        """The interpreter configured for ``node_rank``, or ``None`` for the default."""
        for env in self.env_configs:
            if node_rank in env.node_ranks:
                return env.python_interpreter_path
        return None

    # RLinf's names for the two queries above.
    get_node_env_vars = env_for
    get_node_python_interpreter_path = python_interpreter_for

    def get_node_hw_configs(self, node_rank: int) -> list[Any]:
        """The typed configs of this group's hardware units on ``node_rank``."""
        return self.hardware.on_node(node_rank) if self.hardware is not None else []


def _duplicate_configs_text(configs: Mapping[int, list[dict[str, Any]]]) -> str:
    """RLinf's message for duplicate hardware entries: the text, then every entry of the
    group as YAML (each ends with a newline)."""
    import yaml  # omegaconf's dependency; imported only on this error path

    dumps = [yaml.dump(dict(c), sort_keys=False) for units in configs.values() for c in units]
    return "Duplicate hardware configs found in node hardware config: \n" + "\n".join(dumps)


def _unit_key(config: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), repr(v)) for k, v in config.items()))


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise PlacementError(f"{where}: expected true or false, got {value!r}")
    return value


class ClusterSpec:
    """A static description of a cluster: nodes, accelerators and node groups.

    Args:
        num_nodes: number of nodes, ranked ``0..num_nodes-1``.
        accelerators_per_node: accelerators on every node (an int), or one count per
            node (a list of ``num_nodes`` ints).
        node_groups: user node groups, as `NodeGroup` objects or
            ``cluster.node_groups`` dicts. Labels must be unique and not reserved;
            their nodes must exist.
        accelerator_type: the accelerator family, e.g. ``"cuda"``; informational.

    The reserved groups are always available through
    [`get_node_group`][aiorl.placement.ClusterSpec.get_node_group]: ``cluster`` (every node;
    accelerators, or nodes when there are none) and ``node`` (every node; one resource per node).

    Raises:
        PlacementError: any of the above is violated.
    """

    def __init__(
        self,
        num_nodes: int,
        accelerators_per_node: int | Sequence[int] = 0,
        node_groups: Sequence[NodeGroup | Mapping[str, Any]] | None = None,
        accelerator_type: str = "cuda",
        profiling: ProfilingConfig | Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise PlacementError(
                f"'num_nodes' must be a positive integer. But got {num_nodes} of type "
                f"{type(num_nodes)}."
            )
        self.num_nodes = num_nodes
        if isinstance(accelerators_per_node, bool):
            raise PlacementError("accelerators_per_node must be an int or a list of ints")
        if isinstance(accelerators_per_node, int):
            per_node = [accelerators_per_node] * num_nodes
        else:
            per_node = [int(a) for a in accelerators_per_node]
            if len(per_node) != num_nodes:
                raise PlacementError(
                    f"accelerators_per_node lists {len(per_node)} nodes, but num_nodes is "
                    f"{num_nodes}"
                )
        if any(a < 0 for a in per_node):
            raise PlacementError(f"accelerators_per_node must be >= 0, got {per_node}")
        self._accelerators = per_node
        self.accelerator_type = accelerator_type
        self._groups: dict[str, NodeGroup] = {}
        for g in node_groups or ():
            group = g if isinstance(g, NodeGroup) else NodeGroup.from_config(g)
            if group.label in RESERVED_GROUP_LABELS:
                raise PlacementError(
                    f"node group label {group.label!r} is reserved (reserved labels: "
                    f"{', '.join(RESERVED_GROUP_LABELS)}); choose another label"
                )
            if group.label in self._groups:
                raise PlacementError(f"node group label {group.label!r} is declared twice")
            self._check_node_ranks(group, g, num_nodes)
            self._groups[group.label] = group
        self.profiling: ProfilingConfig | None = (
            profiling if isinstance(profiling, ProfilingConfig) or profiling is None
            else parse_profiling(to_plain(profiling))
        )
        # Node-local numbering of custom hardware units across every group: two groups
        # declaring robots on one node number them 0, 1, ... together, so groups used
        # side by side never hand one index to two different robots.
        self._hardware_units: dict[tuple[str, int], list[tuple[Any, ...]]] = {}
        for group in self._groups.values():
            if group.hardware_type is None:
                continue
            for n in group.node_ranks:
                units = self._hardware_units.setdefault((group.hardware_type.lower(), n), [])
                units.extend(k for k in group.unit_keys(n) if k not in units)

    @staticmethod
    def _check_node_ranks(group: NodeGroup, given: Any, num_nodes: int) -> None:
        """Every node of ``group`` exists; RLinf's message quotes the ranks as written."""
        outside = [n for n in group.node_ranks if n >= num_nodes]
        if not outside:
            return
        text: Any = format_ranks(group.node_ranks)
        if isinstance(given, Mapping) and given.get("node_ranks") is not None:
            text = to_plain(given["node_ranks"])
        everyone = list(range(num_nodes))
        detail = rank_out_of_range_message(text, everyone, "node") or (
            f"Rank {outside[0]} must be within the available node ranks {everyone}."
        )
        raise PlacementError(
            f"Error parsing node_ranks {text} in node group '{group.label}'. {detail} "
            f"The cluster has {num_nodes} node(s) (0-{num_nodes - 1})"
        )

    def hardware_unit_index(self, hardware_type: str, node_rank: int, key: tuple[Any, ...],
                            default: int) -> int:
        """The node-local index of the hardware unit identified by ``key`` (see
        `NodeGroup.unit_keys`); ``default`` for a group this spec does not hold."""
        units = self._hardware_units.get((hardware_type.lower(), node_rank), [])
        return units.index(key) if key in units else default

    # -- construction from config ------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        cluster_cfg: Mapping[str, Any] | None,
        accelerators_per_node: int | Sequence[int] | None = None,
        *,
        num_nodes: int | None = None,
        accelerator_type: str | None = None,
    ) -> ClusterSpec:
        """Build from a ``cluster:`` section (dict or omegaconf ``DictConfig``).

        Args:
            cluster_cfg: the ``cluster:`` section itself, or a whole config holding it
                under a top-level ``cluster`` key. Reads ``num_nodes`` (default 1),
                ``node_groups``, and, when the arguments below are ``None``,
                ``accelerators_per_node`` (default 0) and ``accelerator_type``
                (default ``"cuda"``). ``component_placement`` is ignored here.
            accelerators_per_node: overrides the config's value.
            num_nodes: overrides the config's ``num_nodes``.
            accelerator_type: overrides the config's value.
        """
        cfg = cluster_section(cluster_cfg)
        if num_nodes is None:
            num_nodes = cfg.get("num_nodes", 1)
        if accelerators_per_node is None:
            accelerators_per_node = cfg.get("accelerators_per_node", 0)
        if accelerator_type is None:
            accelerator_type = str(cfg.get("accelerator_type", "cuda"))
        groups = cfg.get("node_groups") or []
        if not isinstance(groups, list):
            raise PlacementError(f"cluster.node_groups must be a list, got {groups!r}")
        for i, group in enumerate(groups):
            if not isinstance(group, Mapping):
                raise PlacementError(
                    f"Each node yaml config must be a dictionary. But got {type(group)}: "
                    f"{group}; cluster.node_groups entry {i} must be a node group with a "
                    "label and node_ranks"
                )
        return cls(
            num_nodes=num_nodes,
            accelerators_per_node=accelerators_per_node,
            node_groups=groups,
            accelerator_type=accelerator_type,
            profiling=parse_profiling(cfg.get("profiling")),
        )

    def with_node_groups(self, node_groups: Sequence[NodeGroup | Mapping[str, Any]]) -> ClusterSpec:
        """A copy of this spec with ``node_groups`` replacing its user node groups."""
        return ClusterSpec(
            self.num_nodes, list(self._accelerators), node_groups, self.accelerator_type,
            self.profiling,
        )

    def with_profiling(self, profiling: ProfilingConfig | Mapping[str, Any] | None) -> ClusterSpec:
        """A copy of this spec with ``profiling`` as its cluster-level profiling section."""
        return ClusterSpec(
            self.num_nodes, list(self._accelerators), self.node_groups, self.accelerator_type,
            profiling,
        )

    # -- queries -----------------------------------------------------------------------

    @property
    def accelerators_per_node(self) -> list[int]:
        """Accelerator count of each node, indexed by node rank (a copy)."""
        return list(self._accelerators)

    @property
    def num_accelerators(self) -> int:
        """Total accelerators in the cluster."""
        return sum(self._accelerators)

    def accelerators_on(self, node_rank: int) -> int:
        """Number of accelerators on ``node_rank``."""
        if not 0 <= node_rank < self.num_nodes:
            raise PlacementError(
                f"node rank {node_rank} is out of range; the cluster has {self.num_nodes} "
                f"node(s) (0-{self.num_nodes - 1})"
            )
        return self._accelerators[node_rank]

    @property
    def node_groups(self) -> list[NodeGroup]:
        """The user-declared node groups, in declaration order (reserved ones excluded)."""
        return list(self._groups.values())

    @property
    def node_group_labels(self) -> list[str]:
        """Every label [`get_node_group`][aiorl.placement.ClusterSpec.get_node_group] accepts:
        reserved first, then user groups."""
        return [*RESERVED_GROUP_LABELS, *self._groups]

    def get_node_group(self, label: str) -> NodeGroup:
        """The node group called ``label``, including the reserved ``cluster`` and ``node``.

        Raises:
            PlacementError: no such group; the message lists the known labels.
        """
        label = str(label).strip()
        if label in self._groups:
            return self._groups[label]
        everyone = list(range(self.num_nodes))
        if label == "cluster":
            return NodeGroup(label="cluster", node_ranks=everyone)
        if label == "node":
            return NodeGroup(label="node", node_ranks=everyone, per_node=True)
        raise PlacementError(
            f"unknown node group {label!r}; known node groups: {', '.join(self.node_group_labels)}"
        )

    # -- RLinf's ClusterConfig queries -------------------------------------------------

    def get_node_labels_by_rank(self, node_rank: int) -> list[str]:
        """The labels of the user node groups that contain ``node_rank`` (declaration
        order; ``[]`` for a node in none, or a rank outside the cluster)."""
        return [g.label for g in self._groups.values() if node_rank in g.node_ranks]

    def get_node_hw_configs_by_rank(self, node_rank: int) -> list[Any]:
        """The typed hardware configs every user group declares on ``node_rank``."""
        return [c for g in self._groups.values() for c in g.get_node_hw_configs(node_rank)]

    def get_node_python_interpreter_path_by_rank(self, node_rank: int) -> list[str]:
        """The interpreters the groups containing ``node_rank`` configure for it."""
        paths = (g.python_interpreter_for(node_rank) for g in self._groups.values()
                 if node_rank in g.node_ranks)
        return [p for p in paths if p is not None]

    def profiling_for(self, node_group_label: str) -> ProfilingConfig | None:
        """The profiling section for workers placed through ``node_group_label``: the
        group's own, else the cluster's."""
        group = self._groups.get(node_group_label)
        if group is not None and group.profiling is not None:
            return group.profiling
        return self.profiling

    def describe(self) -> str:
        """One line such as ``2 nodes, 8 cuda accelerators per node (16 in all)``."""
        nodes = f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''}"
        accs = self._accelerators
        if len(set(accs)) == 1:
            acc = f"{accs[0]} {self.accelerator_type} accelerator{'s' if accs[0] != 1 else ''} per node"
        else:
            acc = f"{self.accelerator_type} accelerators per node {accs}"
        return f"{nodes}, {acc} ({self.num_accelerators} in all)"

    def __repr__(self) -> str:
        return (
            f"ClusterSpec(num_nodes={self.num_nodes}, accelerators_per_node="
            f"{self._accelerators}, node_groups={self.node_groups!r}, "
            f"accelerator_type={self.accelerator_type!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return (
            self.num_nodes == other.num_nodes
            and self._accelerators == other._accelerators
            and self.accelerator_type == other.accelerator_type
            and self._groups == other._groups
            and self.profiling == other.profiling
        )

    __hash__ = None  # type: ignore[assignment]  # mutable groups; equality is by value


def cluster_section(cfg: Any) -> dict[str, Any]:
    """Return the ``cluster:`` section of ``cfg`` as a plain dict.

    ``cfg`` is the section itself or a whole config with a top-level ``cluster`` key
    (a cluster section never has a key of that name, so the two cannot be confused).
    ``None`` gives ``{}``.
    """
    if cfg is None:
        return {}
    if not isinstance(cfg, Mapping):
        raise PlacementError(f"expected a cluster config mapping, got {type(cfg).__name__}")
    inner = cfg.get("cluster")
    if isinstance(inner, Mapping):
        cfg = inner
    plain = to_plain(cfg)
    assert isinstance(plain, dict)
    return plain
