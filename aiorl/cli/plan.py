"""``aiorl plan CONFIG.yaml``: show where every component's processes would run.

Reads the config's ``cluster:`` section, builds a [`ClusterSpec`][aiorl.placement.ClusterSpec]
(no cluster is started), and prints one grid per ``component_placement`` rule: a row
per node, a column per resource on the node, each cell the process ranks placed
there. An invalid config prints ``error: <reason>`` to stderr and exits with 2.

Usable as a subcommand of the ``aiorl`` entry point (`add_parser` and
`run`) or on its own: ``python -m aiorl.cli.plan CONFIG.yaml``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["add_parser", "main", "run"]

_DESCRIPTION = (
    "Check cluster.component_placement in a config and print, for every component, a "
    "grid of nodes x resources with the process ranks placed on each. Nothing is started."
)


def _accelerator_counts(text: str) -> int | list[int]:
    """``"8"`` -> 8 (every node); ``"8,8,0"`` -> one count per node."""
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a count: give N, or one count per node such as 8,8,4"
        ) from None
    if any(p < 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: accelerator counts must be >= 0")
    return parts[0] if len(parts) == 1 else parts


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG.yaml", help="config file with a cluster: section")
    parser.add_argument(
        "--num-nodes",
        metavar="M",
        type=_positive_int,
        default=None,
        help="number of nodes (default: cluster.num_nodes from the file, else 1)",
    )
    parser.add_argument(
        "--accelerators-per-node",
        metavar="N",
        type=_accelerator_counts,
        default=None,
        help=(
            "accelerators on each node, or a comma list with one count per node "
            "(default: cluster.accelerators_per_node from the file, else 0)"
        ),
    )


def add_parser(subparsers: Any) -> None:
    """Add the ``plan`` subcommand to an ``argparse`` subparsers object.

    The subparser's defaults carry ``func=run``, so a dispatcher can call
    ``args.func(args)``.
    """
    parser = subparsers.add_parser(
        "plan", help="show the placement a config describes", description=_DESCRIPTION
    )
    _add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the plan for ``args.config``; return 0, or 2 on an invalid config."""
    # Imported here, not at module level, so that `aiorl --help` stays fast.
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from aiorl.placement import ClusterSpec, ComponentPlacement, PlacementError, render_plan

    try:
        cfg = OmegaConf.load(args.config)
    except (OSError, OmegaConfBaseException) as exc:
        print(f"error: cannot read {args.config}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # YAML syntax errors come from PyYAML with many types
        print(f"error: cannot parse {args.config}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(cfg, DictConfig):  # a YAML list at the top level
        print(f"error: {args.config}: expected a mapping with a cluster: section",
              file=sys.stderr)
        return 2
    try:
        spec = ClusterSpec.from_config(
            cfg,
            accelerators_per_node=args.accelerators_per_node,
            num_nodes=args.num_nodes,
        )
        plan = ComponentPlacement(cfg, spec)
        text = render_plan(plan)
    except (PlacementError, OmegaConfBaseException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m aiorl.cli.plan CONFIG.yaml [options]``."""
    parser = argparse.ArgumentParser(prog="aiorl plan", description=_DESCRIPTION)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
