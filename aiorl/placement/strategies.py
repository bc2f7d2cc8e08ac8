"""Placement strategies: from a [`ClusterSpec`][aiorl.placement.ClusterSpec] to one
[`Placement`][aiorl.placement.Placement] per process.

Every strategy works the same way underneath: it resolves its node group(s) into a
*resource table* (the groups' resources, numbered consecutively in the order the
groups are listed), decides which resource ranks each process gets, and hands that to
`_build`, which checks the node rule and fills in node-local ranks, visible
accelerators and environment.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiorl.errors import PlacementError
from aiorl.placement.profiling import ProfilerLaunch, ProfilingConfig
from aiorl.placement.ranks import format_ranks, parse_range
from aiorl.placement.spec import ACCELERATOR, NODE, ClusterSpec, NodeGroup

__all__ = [
    "FlexiblePlacementStrategy",
    "NodePlacementStrategy",
    "PackedPlacementStrategy",
    "Placement",
    "PlacementStrategy",
    "RankStringPlacementStrategy",
    "default_placement_strategy",
    "resolve_spec",
]


@dataclass
class Placement:
    """Where one process of a group runs.

    Attributes:
        rank: the process rank in its group, ``0..world_size-1``.
        node_rank: the global rank of the node it runs on.
        local_rank: its index among the group's processes on that node (rank order).
        local_world_size: how many of the group's processes run on that node.
        hardware_ranks: the node-local indices of its resources (accelerator indices,
            custom-hardware unit indices, or ``[0]`` for a whole-node resource).
        visible_accelerators: accelerator ids as strings (``["2", "3"]``) when the
            resources are accelerators, else empty: the value for
            ``CUDA_VISIBLE_DEVICES``.
        node_group_label: the node group its resources come from.
        hardware_type: ``"accelerator"``, ``"node"``, or the custom hardware type.
        env: environment variables the node group's ``env_configs`` set on that node.
        resource_ranks: its resources as ranks in the strategy's resource numbering
            (group-relative, consecutive across several groups); for diagnostics.
        isolate_accelerator: False when the process sees every accelerator of its node
            (``get_placement(..., isolate_accelerator=False)``); its ``LOCAL_RANK`` is
            then ``local_accelerator_rank``, the real id of its first accelerator.
        local_accelerator_rank: the node-local id of its first accelerator, -1 if none.
        python_interpreter: the interpreter the node group's ``env_configs`` name for
            its node, or None for the node agent's own.
        profiling: the profiling section that applies to its node group (the group's
            own or the cluster's); see
            [`profiler_launch`][aiorl.placement.Placement.profiler_launch].
    """

    rank: int
    node_rank: int
    local_rank: int
    local_world_size: int
    hardware_ranks: list[int]
    visible_accelerators: list[str]
    node_group_label: str
    hardware_type: str
    env: dict[str, str] = field(default_factory=dict)
    resource_ranks: list[int] = field(default_factory=list)
    isolate_accelerator: bool = True
    local_accelerator_rank: int = -1
    python_interpreter: str | None = None
    profiling: ProfilingConfig | None = None

    @property
    def launch_local_rank(self) -> int:
        """The ``LOCAL_RANK`` the process gets: its index among the group's processes on
        the node, or, when it sees every accelerator of the node, its device id."""
        if not self.isolate_accelerator and self.local_accelerator_rank >= 0:
            return self.local_accelerator_rank
        return self.local_rank

    def profiler_launch(self, group_name: str) -> ProfilerLaunch | None:
        """The profiler command and environment for rank ``rank`` of group ``group_name``,
        or None when that group is not profiled."""
        if self.profiling is None or not self.profiling.profiles(group_name):
            return None
        return self.profiling.launch(f"{group_name}:{self.rank}")


def resolve_spec(cluster_or_spec: Any) -> ClusterSpec:
    """Accept a [`ClusterSpec`][aiorl.placement.ClusterSpec] or anything with a ``.spec`` that is
    one (a live ``Cluster``)."""
    if isinstance(cluster_or_spec, ClusterSpec):
        return cluster_or_spec
    spec = getattr(cluster_or_spec, "spec", None)
    if isinstance(spec, ClusterSpec):
        return spec
    raise TypeError(
        "expected a ClusterSpec or an object with a .spec ClusterSpec (such as a Cluster), "
        f"got {type(cluster_or_spec).__name__}"
    )


def _either_label(
    node_group: str | Sequence[str] | None, node_group_label: str | Sequence[str] | None
) -> str | Sequence[str] | None:
    """``node_group`` or RLinf's name for it, ``node_group_label``; not both."""
    if node_group is not None and node_group_label is not None:
        raise PlacementError("give node_group or node_group_label (its RLinf name), not both")
    return node_group if node_group is not None else node_group_label


def _group_labels(node_group: str | Sequence[str] | None) -> list[str]:
    """Normalise a ``node_group`` argument: ``None`` -> ``["cluster"]``, ``"a,b"`` ->
    ``["a", "b"]``; reject empty and repeated labels."""
    if node_group is None:
        return ["cluster"]
    raw = str(node_group).split(",") if isinstance(node_group, (str, int)) else list(node_group)
    labels = [str(label).strip() for label in raw]
    if not labels or any(not label for label in labels):
        raise PlacementError(f"node_group {node_group!r} has an empty label")
    for label in labels:
        if labels.count(label) > 1:
            raise PlacementError(f"node_group {node_group!r} lists {label!r} twice")
    return labels


@dataclass(frozen=True)
class _Resource:
    node_rank: int
    local_index: int
    group: NodeGroup
    kind: str


def _resource_table(spec: ClusterSpec, labels: Sequence[str]) -> list[_Resource]:
    """The resources of ``labels``' groups, numbered consecutively in label order."""
    table: list[_Resource] = []
    owner: dict[tuple[str, int, int], str] = {}
    for label in labels:
        group = spec.get_node_group(label)
        kind = group.resource_kind(spec)
        for node, index in group.resources(spec):
            key = (kind, node, index)
            # Two groups over the same nodes would hand one accelerator (or robot) to
            # two processes without the user asking for sharing.
            if key in owner:
                what = "node" if kind == NODE else f"{kind} {index} of node"
                raise PlacementError(
                    f"node groups {owner[key]!r} and {label!r} both contain {what} {node}; "
                    "groups used together must not overlap"
                )
            owner[key] = label
            table.append(_Resource(node, index, group, kind))
    return table


def _describe_table(spec: ClusterSpec, labels: Sequence[str], table: Sequence[_Resource]) -> str:
    """``node group 'cluster' has 16 resources (accelerators 0-15)`` and the like."""
    kinds = sorted({r.kind for r in table})
    kind = "/".join(kinds) if kinds else "resource"
    names = " + ".join(repr(label) for label in labels)
    noun = "node group" if len(labels) == 1 else "node groups"
    if not table:
        text = f"{noun} {names} {'has' if len(labels) == 1 else 'have'} no resources"
    else:
        text = (
            f"{noun} {names} {'has' if len(labels) == 1 else 'have'} {len(table)} "
            f"resource{'s' if len(table) != 1 else ''} ({kind} ranks 0-{len(table) - 1})"
        )
    if labels == ["cluster"] and spec.num_accelerators == 0:
        text += "; the cluster declares no accelerators, so its resources are its nodes"
    return text


def _build(
    spec: ClusterSpec,
    table: Sequence[_Resource],
    assignments: Sequence[Sequence[int]],
    where: Callable[[int], str],
    isolate_accelerator: bool = True,
) -> list[Placement]:
    """Turn per-rank resource-rank lists into placements.

    Args:
        isolate_accelerator: False gives a process on accelerators every accelerator of
            its node instead of only its own (RLinf's ``isolate_accelerator``).
        assignments: ``assignments[rank]`` lists the resource ranks (indices into
            ``table``) of process ``rank``; already range-checked.
        where: gives the error-message prefix for a process rank (the segment or the
            strategy it came from).

    Raises:
        PlacementError: a process's resources lie on two nodes or in two node groups.
    """
    chosen: list[tuple[int, list[_Resource]]] = []
    for rank, res_ranks in enumerate(assignments):
        res = [table[r] for r in res_ranks]
        nodes = sorted({r.node_rank for r in res})
        if len(nodes) > 1:
            raise PlacementError(
                f"{where(rank)}: All hardware ranks {list(res_ranks)} for a process must be on "
                f"the same node. Instead, the hardware exist across node ranks "
                f"{{{', '.join(map(str, nodes))}}}; process {rank} would span nodes "
                f"{', '.join(map(str, nodes[:-1]))} and {nodes[-1]}"
            )
        groups = list(dict.fromkeys(r.group.label for r in res))
        if len(groups) > 1:
            raise PlacementError(
                f"{where(rank)}: process {rank} would span node groups "
                f"{', '.join(repr(g) for g in groups[:-1])} and {groups[-1]!r} (resource ranks "
                f"{format_ranks(res_ranks)}); a process must use one node group"
            )
        chosen.append((rank, res))
    per_node: dict[int, int] = {}
    for _, res in chosen:
        per_node[res[0].node_rank] = per_node.get(res[0].node_rank, 0) + 1
    seen: dict[int, int] = {}
    placements: list[Placement] = []
    for (rank, res), res_ranks in zip(chosen, assignments, strict=True):
        first = res[0]
        node = first.node_rank
        local_rank = seen.get(node, 0)
        seen[node] = local_rank + 1
        hardware = [r.local_index for r in res]
        visible: list[str] = []
        if first.kind == ACCELERATOR:
            every = range(spec.accelerators_on(node))
            visible = [str(i) for i in (hardware if isolate_accelerator else every)]
        placements.append(
            Placement(
                rank=rank,
                node_rank=node,
                local_rank=local_rank,
                local_world_size=per_node[node],
                hardware_ranks=hardware,
                visible_accelerators=visible,
                node_group_label=first.group.label,
                hardware_type=first.kind,
                env=first.group.env_for(node),
                resource_ranks=list(res_ranks),
                isolate_accelerator=isolate_accelerator,
                local_accelerator_rank=hardware[0] if first.kind == ACCELERATOR else -1,
                python_interpreter=first.group.python_interpreter_for(node),
                profiling=spec.profiling_for(first.group.label),
            )
        )
    return placements


class PlacementStrategy:
    """Base class: decides the placement of every process of a group.

    Subclasses implement `get_placement`. ``node_group_labels`` names the node
    groups whose resources the strategy numbers (in order).
    """

    node_group_labels: list[str]

    def get_placement(
        self, cluster_or_spec: Any, isolate_accelerator: bool = True
    ) -> list[Placement]:
        """One [`Placement`][aiorl.placement.Placement] per process, sorted by rank.

        Args:
            cluster_or_spec: a [`ClusterSpec`][aiorl.placement.ClusterSpec], or an object whose
                ``.spec`` is one.
            isolate_accelerator: True (the default) shows a process only its own
                accelerators (``CUDA_VISIBLE_DEVICES``); False shows it every accelerator
                of its node, and its ``LOCAL_RANK`` is its device id.

        Raises:
            PlacementError: the strategy does not fit the cluster.
        """
        raise NotImplementedError

    def get_world_size(self, cluster_or_spec: Any) -> int:
        """The number of processes this strategy places on ``cluster_or_spec``."""
        return len(self.get_placement(cluster_or_spec))


def _check_int(value: Any, name: str, minimum: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlacementError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


class PackedPlacementStrategy(PlacementStrategy):
    """Processes on consecutive resources ``start..end`` (inclusive), ``num`` each.

    With ``stride`` 1 process ``i`` gets resources ``start + i*num .. start + i*num +
    num - 1``. With ``stride`` ``s`` the range is cut into blocks of ``num * s``
    resources; in each block, process ``j`` (``0 <= j < s``) takes every ``s``-th
    resource starting at offset ``j``. For ``0..7``, ``num=2``, ``stride=2``:
    ``[0,2], [1,3], [4,6], [5,7]``.

    Args:
        start_hardware_rank: first resource rank (in the node group's numbering).
        end_hardware_rank: last resource rank, inclusive.
        num_hardware_per_process: resources per process.
        stride: distance between the resources of one process.
        node_group: label, ``"a,b"`` or list of labels; default ``cluster``.

    Raises:
        PlacementError: negative or reversed range, non-positive counts, a range length
            not divisible by ``num_hardware_per_process * stride`` (at construction);
            an end rank past the group's resources or a process spanning nodes (in
            `get_placement`).
    """

    def __init__(
        self,
        start_hardware_rank: int,
        end_hardware_rank: int,
        num_hardware_per_process: int = 1,
        stride: int = 1,
        node_group: str | Sequence[str] | None = None,
        *,
        node_group_label: str | Sequence[str] | None = None,
    ) -> None:
        node_group = _either_label(node_group, node_group_label)
        self.start_hardware_rank = start_hardware_rank
        self.end_hardware_rank = end_hardware_rank
        self.num_hardware_per_process = num_hardware_per_process
        self.stride = stride
        self.node_group_labels = _group_labels(node_group)
        where = repr(self)
        _check_int(start_hardware_rank, "start_hardware_rank", 0, where)
        _check_int(end_hardware_rank, "end_hardware_rank", 0, where)
        _check_int(num_hardware_per_process, "num_hardware_per_process", 1, where)
        _check_int(stride, "stride", 1, where)
        if end_hardware_rank < start_hardware_rank:
            raise PlacementError(
                f"{where}: end_hardware_rank {end_hardware_rank} is below "
                f"start_hardware_rank {start_hardware_rank}"
            )
        count = end_hardware_rank - start_hardware_rank + 1
        block = num_hardware_per_process * stride
        if count % block:
            raise PlacementError(
                f"{where}: {count} resources cannot be split into blocks of "
                f"num_hardware_per_process * stride = {block}; the range length must be a "
                "multiple of it"
            )

    def __repr__(self) -> str:
        return (
            f"PackedPlacementStrategy(start_hardware_rank={self.start_hardware_rank}, "
            f"end_hardware_rank={self.end_hardware_rank}, "
            f"num_hardware_per_process={self.num_hardware_per_process}, stride={self.stride}, "
            f"node_group={','.join(self.node_group_labels)!r})"
        )

    def get_placement(
        self, cluster_or_spec: Any, isolate_accelerator: bool = True
    ) -> list[Placement]:
        spec = resolve_spec(cluster_or_spec)
        table = _resource_table(spec, self.node_group_labels)
        if self.end_hardware_rank >= len(table):
            raise PlacementError(
                f"{self!r}: end_hardware_rank {self.end_hardware_rank} is out of range; "
                f"{_describe_table(spec, self.node_group_labels, table)}"
            )
        num, stride = self.num_hardware_per_process, self.stride
        assignments: list[list[int]] = []
        for base in range(self.start_hardware_rank, self.end_hardware_rank + 1, num * stride):
            for offset in range(stride):
                assignments.append([base + offset + i * stride for i in range(num)])
        return _build(spec, table, assignments, lambda _rank: repr(self), isolate_accelerator)


class FlexiblePlacementStrategy(PlacementStrategy):
    """Explicit resources per process: process ``i`` gets ``hardware_ranks_list[i]``.

    Ranks are in the node group's resource numbering. As in RLinf, each process's
    list is sorted, and the processes are ordered by their first resource rank:
    ``[[3, 2], [0]]`` gives rank 0 resource 0 and rank 1 resources 2 and 3.

    Args:
        hardware_ranks_list: one non-empty list of resource ranks per process.
        node_group: label, ``"a,b"`` or list of labels; default ``cluster``
            (``node_group_label`` is RLinf's name for it).

    Raises:
        PlacementError: no processes, an empty list, a negative rank, or a rank used
            twice (within or across processes) at construction; a rank past the
            group's resources or a process spanning nodes in `get_placement`.
    """

    def __init__(
        self,
        hardware_ranks_list: Sequence[Sequence[int]],
        node_group: str | Sequence[str] | None = None,
        *,
        node_group_label: str | Sequence[str] | None = None,
    ) -> None:
        self.node_group_labels = _group_labels(_either_label(node_group, node_group_label))
        try:
            lists = [list(ranks) for ranks in hardware_ranks_list]
        except TypeError:
            raise PlacementError(
                f"FlexiblePlacementStrategy: hardware_ranks_list must be a list of lists, "
                f"got {hardware_ranks_list!r}"
            ) from None
        self.hardware_ranks_list = lists
        where = repr(self)
        if not lists:
            raise PlacementError(
                f"{where}: The hardware_ranks_list must not be empty. Give one list of "
                "resource ranks per process"
            )
        owner: dict[int, int] = {}
        for proc, ranks in enumerate(lists):
            if not ranks:
                raise PlacementError(f"{where}: process {proc} has an empty resource list")
            for r in ranks:
                _check_int(r, f"resource rank of process {proc}", 0, where)
                if r in owner and owner[r] == proc:
                    raise PlacementError(
                        f"{where}: All hardware ranks {ranks} for a process must be unique. "
                        f"Resource rank {r} of process {proc} is given twice"
                    )
                if r in owner:
                    raise PlacementError(
                        f"{where}: resource rank {r} of process {proc} is already used by "
                        f"process {owner[r]}; each resource may appear once"
                    )
                owner[r] = proc
        # RLinf's order: ranks ascending within a process, processes by their first rank.
        self.hardware_ranks_list = sorted((sorted(r) for r in lists), key=lambda r: r[0])

    def __repr__(self) -> str:
        return (
            f"FlexiblePlacementStrategy({self.hardware_ranks_list!r}, "
            f"node_group={','.join(self.node_group_labels)!r})"
        )

    def get_placement(
        self, cluster_or_spec: Any, isolate_accelerator: bool = True
    ) -> list[Placement]:
        spec = resolve_spec(cluster_or_spec)
        table = _resource_table(spec, self.node_group_labels)
        for proc, ranks in enumerate(self.hardware_ranks_list):
            for r in ranks:
                if r >= len(table):
                    raise PlacementError(
                        f"{self!r}: resource rank {r} of process {proc} is out of range; "
                        f"{_describe_table(spec, self.node_group_labels, table)}"
                    )
        return _build(
            spec, table, self.hardware_ranks_list, lambda _rank: repr(self), isolate_accelerator
        )


class NodePlacementStrategy(PlacementStrategy):
    """One process per entry of ``node_ranks``, on that node, using the whole node.

    ``node_ranks`` index the nodes of the selected node groups, in the order the groups
    are listed and, within a group, by ascending node rank (RLinf's rule). Without a
    node group every node is selected, so the entries are global node ranks;
    ``NodePlacementStrategy([0, 1], node_group="a,b")`` with ``a`` = node 3 and ``b`` =
    nodes 5-6 places rank 0 on node 3 and rank 1 on node 5. Repeating an entry puts
    several processes on that node; the order given is the rank order.

    The processes get no accelerators (``visible_accelerators == []``,
    ``hardware_type == "node"``, ``hardware_ranks == [0]``); use it for CPU-side workers.
    Each process gets the environment of the group its node was selected through.

    Args:
        node_ranks: one entry per process, in rank order.
        node_group: a label, ``"a,b"`` or a list of labels whose nodes may be used;
            default ``node`` (every node). The groups must not share a node.
            ``node_group_label`` is RLinf's name for it.

    Raises:
        PlacementError: empty or negative ``node_ranks`` (at construction); an entry
            past the selected nodes, or groups that share a node (in
            `get_placement`).
    """

    def __init__(
        self,
        node_ranks: Sequence[int] | int,
        node_group: str | Sequence[str] | None = None,
        *,
        node_group_label: str | Sequence[str] | None = None,
    ) -> None:
        node_group = _either_label(node_group, node_group_label)
        self.node_group_labels = _group_labels("node" if node_group is None else node_group)
        self.node_ranks = [node_ranks] if isinstance(node_ranks, int) else list(node_ranks)
        where = repr(self)
        if not self.node_ranks:
            raise PlacementError(f"{where}: node_ranks is empty; give one node rank per process")
        for n in self.node_ranks:
            _check_int(n, "node rank", 0, where)

    def __repr__(self) -> str:
        return (
            f"NodePlacementStrategy({self.node_ranks!r}, "
            f"node_group={','.join(self.node_group_labels)!r})"
        )

    def get_placement(
        self, cluster_or_spec: Any, isolate_accelerator: bool = True
    ) -> list[Placement]:
        spec = resolve_spec(cluster_or_spec)
        # Whole nodes as the resources, whatever the groups' own resource kind.
        table: list[_Resource] = []
        owner: dict[int, str] = {}
        for label in self.node_group_labels:
            group = spec.get_node_group(label)
            for n in group.node_ranks:
                if n in owner:
                    raise PlacementError(
                        f"{self!r}: node groups {owner[n]!r} and {label!r} both contain node "
                        f"{n}; node placement across several groups needs disjoint node sets"
                    )
                owner[n] = label
                table.append(_Resource(n, 0, group, NODE))
        for n in self.node_ranks:
            if n >= len(table):
                selected = (
                    f"the cluster has {spec.num_nodes} node(s) (0-{spec.num_nodes - 1})"
                    if self.node_group_labels == ["node"]
                    else f"node group(s) {', '.join(map(repr, self.node_group_labels))} have "
                    f"{len(table)} node(s): {format_ranks(r.node_rank for r in table)}"
                )
                raise PlacementError(f"{self!r}: node rank {n} is out of range; {selected}")
        assignments = [[n] for n in self.node_ranks]
        return _build(spec, table, assignments, lambda _rank: repr(self), isolate_accelerator)


@dataclass(frozen=True)
class _Segment:
    """One ``resource_ranks[:process_ranks]`` segment; ``None`` = ``all`` / implicit."""

    text: str
    resources: tuple[int, int] | None
    processes: tuple[int, int] | None


def _range_text(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _ranks_text(what: str, first: int, last: int) -> str:
    """``resource rank 3`` or ``resource ranks 0-3``."""
    return f"{what} rank {first}" if first == last else f"{what} ranks {first}-{last}"


class RankStringPlacementStrategy(PlacementStrategy):
    """The strategy a placement string describes (``cluster.component_placement``).

    Grammar: comma-joined segments ``resource_ranks[:process_ranks]``; each part is
    ``a-b`` (inclusive) or ``a``; ``resource_ranks`` may be ``all`` (then it is the only
    segment). Omitted process ranks continue from the previous segment, one process
    per resource. In each segment one count must be an integer multiple of the other:
    ``k`` consecutive processes share a resource, or a process takes ``k`` consecutive
    resources. Across segments, process ranks run ``0..N-1`` in order and resource
    ranks are unique and ascending. A process never spans nodes.

    Args:
        placement: the placement string (an ``int`` means that single resource).
        node_group: label, ``"a,b"`` or list of labels; default ``cluster``.
        context: who the string belongs to, appended to error messages
            (e.g. ``"component 'actor'"``).

    Raises:
        PlacementError: syntax and every rule that needs no cluster at construction;
            range and node rules in `get_placement`. Messages quote the segment.
    """

    def __init__(
        self,
        placement: str | int,
        node_group: str | Sequence[str] | None = None,
        *,
        context: str | None = None,
    ) -> None:
        if isinstance(placement, bool) or not isinstance(placement, (str, int)):
            raise PlacementError(
                f"placement {placement!r}{self._suffix(context, None)}: expected a string "
                "such as '0-7' or '0-3:0-7'"
            )
        self.placement = str(placement).strip()
        self.context = context
        try:
            self.node_group_labels = _group_labels(node_group)
        except PlacementError as exc:
            raise PlacementError(f"{exc}{self._suffix(context, self.placement)}") from None
        self.segments = self._parse()
        self._layout(None)  # every check that does not need the cluster, now

    @staticmethod
    def _suffix(context: str | None, placement: str | None) -> str:
        bits = []
        if placement is not None:
            bits.append(f"placement {placement!r}")
        if context:
            bits.append(context)
        return f" (in {', '.join(bits)})" if bits else ""

    def _fail(self, segment: str, rule: str) -> PlacementError:
        return PlacementError(f"{segment!r}: {rule}{self._suffix(self.context, self.placement)}")

    def __repr__(self) -> str:
        return (
            f"RankStringPlacementStrategy({self.placement!r}, "
            f"node_group={','.join(self.node_group_labels)!r})"
        )

    # -- syntax ------------------------------------------------------------------------

    def _parse(self) -> list[_Segment]:
        if not self.placement:
            raise self._fail(
                self.placement,
                "empty placement; write segments resource_ranks[:process_ranks] such as "
                "'0-7' or '0-3:0-7'",
            )
        texts = [t.strip() for t in self.placement.split(",")]
        segments: list[_Segment] = []
        for text in texts:
            if not text:
                raise self._fail(
                    self.placement, "empty segment; remove the stray ',' between segments"
                )
            parts = text.split(":")
            if len(parts) > 2:
                raise self._fail(text, "too many ':'; a segment is resource_ranks[:process_ranks]")
            res_text = parts[0].strip()
            resources: tuple[int, int] | None
            if res_text.lower() == "all":
                resources = None
            else:
                resources = self._range(text, res_text, "resource")
            processes: tuple[int, int] | None = None
            if len(parts) == 2:
                proc_text = parts[1].strip()
                if not proc_text:
                    raise self._fail(text, "empty process ranks after ':'")
                if proc_text.lower() == "all":
                    raise self._fail(
                        text,
                        "'all' is not allowed in process ranks; give an explicit range "
                        "such as '0-7'",
                    )
                processes = self._range(text, proc_text, "process")
            segments.append(_Segment(text, resources, processes))
        if len(segments) > 1:
            for seg in segments:
                if seg.resources is None:
                    raise self._fail(
                        seg.text,
                        "'all' covers every resource of the node group, so it must be the "
                        "only segment",
                    )
        return segments

    def _range(self, segment: str, token: str, what: str) -> tuple[int, int]:
        if not token:
            raise self._fail(segment, f"empty {what} ranks")
        try:
            return parse_range(token, what=f"{what} rank")
        except PlacementError as exc:
            message = str(exc)
            # "'3-1': '3-1' is a reversed ..." says the same thing twice; drop the echo.
            echo = f"{token!r} is "
            if token == segment and message.startswith(echo):
                message = message[len(echo) :]
            raise self._fail(segment, message) from None

    # -- semantics ---------------------------------------------------------------------

    def _layout(self, num_resources: int | None, describe: str = "") -> list[list[int]]:
        """Resource ranks per process rank.

        ``num_resources`` is the size of the resource table, or ``None`` to run only
        the checks that do not depend on it (an ``all`` segment is then skipped).
        """
        assignments: list[list[int]] = []
        next_proc = 0
        done: list[tuple[int, int, str]] = []  # resource ranges of earlier segments
        for seg in self.segments:
            if seg.resources is None:
                if num_resources is None:
                    if seg.processes is not None and seg.processes[0] != 0:
                        raise self._fail(
                            seg.text,
                            f"process ranks must start at 0, but this segment starts at "
                            f"{seg.processes[0]}",
                        )
                    return []
                if num_resources == 0:
                    raise self._fail(seg.text, f"'all' selects nothing: {describe}")
                first, last = 0, num_resources - 1
            else:
                first, last = seg.resources
            if num_resources is not None and last >= num_resources:
                raise self._fail(seg.text, f"resource rank {last} is out of range; {describe}")
            if done and first <= done[-1][1]:
                clash = next(((a, b, t) for a, b, t in done if first <= b and a <= last), None)
                if clash is not None:
                    raise self._fail(
                        seg.text,
                        f"Duplicate resource ranks found in placement string: "
                        f"{self.placement}. Resource ranks must be unique. "
                        f"{_ranks_text('Resource', first, last)} "
                        f"{'overlaps' if first == last else 'overlap'} "
                        f"{_ranks_text('resource', clash[0], clash[1])} of segment "
                        f"{clash[2]!r}; each resource may appear in one segment only",
                    )
                raise self._fail(
                    seg.text,
                    f"resource ranks must be ascending across segments, but "
                    f"{_range_text(first, last)} comes after {_range_text(*done[-1][:2])} "
                    f"(segment {done[-1][2]!r})",
                )
            n_res = last - first + 1
            if seg.processes is None:
                p_first, p_last = next_proc, next_proc + n_res - 1
            else:
                p_first, p_last = seg.processes
                if p_first != next_proc:
                    raise self._fail(seg.text, self._continuity_rule(p_first, p_last, next_proc))
            n_proc = p_last - p_first + 1
            if n_proc >= n_res:
                if n_proc % n_res:
                    raise self._fail(
                        seg.text,
                        f"{n_proc} processes cannot be spread over {n_res} resource"
                        f"{'s' if n_res != 1 else ''}; one count must be an integer "
                        "multiple of the other",
                    )
                share = n_proc // n_res
                # Consecutive process ranks share a resource: 0-1:0-3 puts 0,1 on
                # resource 0 and 2,3 on resource 1.
                assignments.extend([first + j // share] for j in range(n_proc))
            else:
                if n_res % n_proc:
                    raise self._fail(
                        seg.text,
                        f"{n_res} resources cannot be divided among {n_proc} process"
                        f"{'es' if n_proc != 1 else ''}; one count must be an integer "
                        "multiple of the other",
                    )
                span = n_res // n_proc
                assignments.extend(
                    list(range(first + j * span, first + (j + 1) * span)) for j in range(n_proc)
                )
            next_proc = p_last + 1
            done.append((first, last, seg.text))
        return assignments

    def _continuity_rule(self, p_first: int, p_last: int, expected: int) -> str:
        if expected == 0:
            return f"process ranks must start at 0, but this segment starts at {p_first}"
        if p_first < expected:
            return (
                f"Duplicate process ranks found in placement string: {self.placement}. "
                f"Process ranks must be unique. Process ranks {_range_text(p_first, p_last)} "
                f"repeat ranks already placed by earlier segments (0-{expected - 1})"
            )
        return (
            f"Process ranks must be in ascending order and continuous in placement string: "
            f"{self.placement}. This segment must start at process rank {expected}, not "
            f"{p_first}"
        )

    def _segment_of(self, assignments_per_segment: list[int]) -> Callable[[int], str]:
        """Map a process rank to the text of the segment that placed it."""

        def where(rank: int) -> str:
            for seg, end in zip(self.segments, assignments_per_segment, strict=True):
                if rank < end:
                    return repr(seg.text)
            return repr(self.placement)

        return where

    def get_placement(
        self, cluster_or_spec: Any, isolate_accelerator: bool = True
    ) -> list[Placement]:
        spec = resolve_spec(cluster_or_spec)
        suffix = self._suffix(self.context, self.placement)
        try:
            table = _resource_table(spec, self.node_group_labels)
        except PlacementError as exc:
            raise PlacementError(f"{exc}{suffix}") from None
        describe = _describe_table(spec, self.node_group_labels, table)
        assignments = self._layout(len(table), describe)
        # Process-rank boundaries of the segments, for error messages that quote them.
        ends: list[int] = []
        count = 0
        for seg in self.segments:
            if seg.processes is not None:
                count = seg.processes[1] + 1
            elif seg.resources is not None:
                count += seg.resources[1] - seg.resources[0] + 1
            else:
                count = len(assignments)
            ends.append(count)
        seg_of = self._segment_of(ends)
        try:
            return _build(spec, table, assignments, seg_of, isolate_accelerator)
        except PlacementError as exc:
            raise PlacementError(f"{exc}{suffix}") from None


def default_placement_strategy(cluster_or_spec: Any) -> PlacementStrategy:
    """The placement used when none is given: one process per accelerator across the
    cluster, or one process on node 0 when the cluster declares no accelerators."""
    spec = resolve_spec(cluster_or_spec)
    if spec.num_accelerators > 0:
        return PackedPlacementStrategy(0, spec.num_accelerators - 1)
    return NodePlacementStrategy([0])
