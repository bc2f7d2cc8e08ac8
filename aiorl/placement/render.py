"""Text grids of placements, for ``aiorl plan`` and for logs.

One grid per node group: a row per node, a column per resource on the node, each
cell the process ranks placed there (``.`` = unused resource, blank = the node has
no such resource).
"""

from __future__ import annotations

from collections.abc import Sequence

from aiorl.placement.component import ComponentPlacement
from aiorl.placement.profiling import ProfilingConfig
from aiorl.placement.ranks import format_ranks
from aiorl.placement.spec import ACCELERATOR, NODE, ClusterSpec
from aiorl.placement.strategies import Placement

__all__ = ["render_placements", "render_plan"]


def _kind_text(kind: str, spec: ClusterSpec) -> str:
    if kind == ACCELERATOR:
        return f"{spec.accelerator_type} accelerators"
    if kind == NODE:
        return "whole nodes"
    return f"{kind} hardware"


def _nodes(ranks: Sequence[int]) -> str:
    return f"node{'s' if len(ranks) != 1 else ''} {format_ranks(ranks)}"


def _column_name(kind: str, index: int, spec: ClusterSpec) -> str:
    if kind == ACCELERATOR:
        return f"{spec.accelerator_type}:{index}"
    if kind == NODE:
        return "node"
    return f"{kind}:{index}"


def _table(rows: list[list[str]], indent: str) -> list[str]:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return [
        indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def render_placements(
    spec: ClusterSpec,
    node_group_labels: Sequence[str],
    placements: Sequence[Placement],
    title: str,
) -> str:
    """Render ``placements`` (of one strategy over ``node_group_labels``) as text.

    The first line is ``title: N processes on node group(s) ..., kinds, used/total
    resources``; then one grid per node group, then the environment each group sets.
    """
    groups = [spec.get_node_group(label) for label in node_group_labels]
    used: dict[tuple[str, int, int], list[int]] = {}
    for p in placements:
        for h in p.hardware_ranks:
            used.setdefault((p.node_group_label, p.node_rank, h), []).append(p.rank)
    total = sum(len(g.resources(spec)) for g in groups)
    # A NodePlacementStrategy counts whole nodes even in an accelerator group; draw what
    # the placements say, not what the group would offer to a placement string.
    kinds = {g.label: g.resource_kind(spec) for g in groups}
    for p in placements:
        kinds[p.node_group_label] = p.hardware_type
    kind_list = list(dict.fromkeys(kinds[g.label] for g in groups))
    labels = ", ".join(repr(g.label) for g in groups)
    noun = "node group" if len(groups) == 1 else "node groups"
    n = len(placements)
    lines = [
        f"{title}: {n} process{'es' if n != 1 else ''} on {noun} {labels} "
        f"({' + '.join(_kind_text(k, spec) for k in kind_list)}), "
        f"{len(used)} of {total} resources used"
    ]
    for group in groups:
        kind = kinds[group.label]
        if kind == NODE:
            per_node = {node: [(node, 0)] for node in group.node_ranks}
        else:
            per_node = {node: [] for node in group.node_ranks}
            for node, index in group.resources(spec):
                per_node[node].append((node, index))
        width = max((len(v) for v in per_node.values()), default=0)
        if width == 0:
            continue
        if len(groups) > 1:
            lines.append(f"  node group {group.label!r}:")
        indent = "    " if len(groups) > 1 else "  "
        rows = [[""] + [_column_name(kind, i, spec) for i in range(width)]]
        for node, resources in per_node.items():
            if not resources:
                continue
            row = [f"node {node}"]
            for i in range(width):
                if i >= len(resources):
                    row.append("")
                    continue
                ranks = used.get((group.label, node, resources[i][1]))
                row.append(format_ranks(ranks) if ranks else ".")
            rows.append(row)
        lines.extend(_table(rows, indent))
        nodes_used = sorted({p.node_rank for p in placements if p.node_group_label == group.label})
        for env in group.env_configs:
            on = [node for node in env.node_ranks if node in nodes_used]
            if on and env.env_vars:
                assigns = " ".join(f"{k}={v}" for k, v in env.env_vars.items())
                lines.append(f"{indent}env on {_nodes(on)}: {assigns}")
    return "\n".join(lines)


def render_plan(component_placement: ComponentPlacement) -> str:
    """Render every rule of a [`ComponentPlacement`][aiorl.placement.ComponentPlacement], after a
    cluster summary line."""
    spec = component_placement.spec
    out = [f"cluster: {spec.describe()}"]
    groups = spec.node_groups
    if groups:
        out.append(
            "node groups: "
            + "; ".join(
                f"{g.label} = {_nodes(g.node_ranks)}, {_kind_text(g.resource_kind(spec), spec)}"
                for g in groups
            )
        )
    if spec.profiling is not None:
        out.append(f"profiling: {_profiling_text(spec.profiling)}")
    for group in groups:
        if group.profiling is not None:
            out.append(f"profiling on node group {group.label}: "
                       f"{_profiling_text(group.profiling)}")
    if not component_placement.keys:
        out.append("")
        out.append("no components: cluster.component_placement is empty")
    for key in component_placement.keys:
        strategy = component_placement.get_strategy(key)
        placements = component_placement.get_placement(key)
        out.append("")
        out.append(
            render_placements(
                spec,
                strategy.node_group_labels,
                placements,
                f"{key} [{strategy.placement}]",
            )
        )
        profiled = sorted({
            f"{name} under {p.profiling.backend}"
            for name in key.split(",") for p in placements
            if p.profiling is not None and p.profiling.profiles(name.strip())
        })
        if profiled:
            out.append(f"  profiled: {', '.join(profiled)}")
    return "\n".join(out)


def _profiling_text(config: ProfilingConfig) -> str:
    """``nsys for worker groups actor, rollout, steps 5,10, reports in /out``."""
    if not config.enabled:
        return f"{config.backend}, disabled"
    if config.worker_groups is not None:
        who = f"worker groups {', '.join(config.worker_groups)}"
    else:
        who = "every worker group" if config.applies_to_all else "no worker group"
    steps = "every step" if config.steps is None else "steps " + ",".join(map(str, config.steps))
    where = config.output_dir or "the temporary directory"
    return f"{config.backend} for {who}, {steps}, reports in {where}"
