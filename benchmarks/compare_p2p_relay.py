"""Medians of several ``bench_p2p.py --relay`` runs of two trees, side by side.

Run: ``python benchmarks/compare_p2p_relay.py --before A1.json A2.json ... --after B1.json ...``
where each file is a ``benchmarks/results/p2p_relay.json`` written by one run (copy it away
between runs; alternate the trees' runs so that both see the same load). Prints, for the
direct and the relayed pair, the median of each measurement over the runs of each tree, the
range, and after / before.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

ROWS = [
    ("small object round trip, us", ("small_rtt_us",)),
    ("small one-way, msg/s", ("small_oneway_msgs_per_s",)),
    ("send_tensor 1KB one-way, ms", ("tensor_ms", "1KB")),
    ("send_tensor 1MB one-way, ms", ("tensor_ms", "1MB")),
    ("send_tensor 64MB one-way, ms", ("tensor_ms", "64MB")),
]


def _value(result: dict[str, Any], route: str, keys: tuple[str, ...]) -> float | None:
    value: Any = result.get(route)
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value)


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):,.3g} ({min(values):,.3g}-{max(values):,.3g})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", nargs="+", required=True, help="result files of one tree")
    parser.add_argument("--after", nargs="+", required=True, help="result files of the other")
    args = parser.parse_args(argv)
    runs = {}
    for side in ("before", "after"):
        runs[side] = []
        for path in getattr(args, side):
            with open(path) as f:
                runs[side].append(json.load(f))
    print(f"medians of {len(runs['before'])} runs before and {len(runs['after'])} after "
          "(range in parentheses)")
    print(f"{'':>30} {'before':>26} {'after':>26} {'after/before':>13}")
    for route in ("direct", "relayed"):
        print(f"{route} pair")
        for label, keys in ROWS:
            cols = {side: [v for r in runs[side] if (v := _value(r, route, keys)) is not None]
                    for side in runs}
            ratio = (f"{statistics.median(cols['after']) / statistics.median(cols['before']):.2f}x"
                     if cols["before"] and cols["after"] else "-")
            print(f"{label:>30} {_cell(cols['before']):>26} {_cell(cols['after']):>26} "
                  f"{ratio:>13}")


if __name__ == "__main__":
    main()
