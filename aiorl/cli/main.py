"""The ``aiorl`` command: ``status``, ``plan`` and ``demo``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from aiorl.cli.target import resolve_target
from aiorl.util.text import format_table

__all__ = ["format_table", "main"]


def _status(args: argparse.Namespace) -> int:
    import uvloop

    from aiorl.errors import AuthenticationError, RegistryUnavailable
    from aiorl.registry.client import RegistryClient
    from aiorl.transport.endpoint import Endpoint

    _remove_leftovers()
    if args.watch:
        from aiorl.cli import observe

        return observe.watch(args)
    target = resolve_target(args)
    if target is None:
        return 2
    address, keys, host = target

    async def fetch() -> dict[str, Any]:
        endpoint = Endpoint("aiorl-status", keys=keys, host=host or "127.0.0.1")
        try:
            report = await RegistryClient(endpoint, address).status(timeout=args.timeout)
            return report.to_wire()
        finally:
            endpoint.close()

    try:
        status = uvloop.run(fetch())
    except (RegistryUnavailable, AuthenticationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"registry {address}  up {status['uptime']:.0f} s")
    print()
    print("NODES")
    print(format_table(
        ["rank", "ip", "hostname", "cpus", "accelerators", "hardware", "node id"],
        [[n["node_rank"], n["ip"], n["hostname"], n["cpus"],
          f"{n['num_accelerators']} ({n['accelerator_type']})",
          ",".join(f"{k}={v}" for k, v in (n.get("hardware") or {}).items()) or "-", n["node_id"]]
         for n in status["nodes"]]))
    print()
    print("GROUPS")
    print(format_table(
        ["group", "class", "ready", "owner"],
        [[g["name"], g["worker_class"], f"{g['ready']}/{g['world_size']}", g["owner"]]
         for g in status["groups"]]))
    print()
    print("WORKERS")
    print(format_table(
        ["worker", "state", "node", "pid", "endpoint"],
        [[w["name"], w["state"], w["info"].get("node_rank", "-"), w["info"].get("pid", "-"),
          w["info"].get("endpoint", "-")] for w in status["workers"]]))
    return 0


def _remove_leftovers() -> None:
    """Clean what killed aiorl processes of this user left on this machine: the directories
    of embedded clusters whose driver is gone, and ended node agents' lanes and old logs. A
    killed process cannot clean up after itself; ``aiorl status`` is what a user runs to
    look at the machine, so it tidies it too. A failure here never stops the status."""
    from aiorl.cluster.embedded import remove_abandoned_sessions
    from aiorl.node.logdirs import remove_ended_agent_files

    for clean in (remove_abandoned_sessions, remove_ended_agent_files):
        try:
            clean()
        except Exception as exc:  # noqa: BLE001 - tidying is best effort
            print(f"aiorl status: could not remove leftovers ({clean.__name__}): {exc}",
                  file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from aiorl.cli import observe, plan, slurm

    parser = argparse.ArgumentParser(prog="aiorl", description="aiorl command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="show nodes, groups and workers of a running cluster")
    st.add_argument("--registry", default=None,
                    help="registry address (default: $AIORL_REGISTRY, else this user's newest "
                         "running embedded Cluster())")
    st.add_argument("--pid", type=int, default=None,
                    help="the driver process whose embedded Cluster() to show, when this user "
                         "runs several (default: the newest)")
    st.add_argument("--key-file", default=None,
                    help="the cluster's key file (default: $AIORL_KEY_FILE, else "
                         "~/.aiorl/cluster.key when it exists)")
    st.add_argument("--timeout", type=float, default=5.0,
                    help="seconds to wait for the registry's answer (default 5)")
    st.add_argument("--watch", action="store_true",
                    help="refresh a live table of every process (CPU, RSS, pending operations, "
                         "channel depths); plain lines when not a terminal")
    st.add_argument("--interval", type=float, default=2.0, help="--watch: seconds per refresh")
    st.add_argument("--count", type=int, default=0, help="--watch: stop after N refreshes")
    st.set_defaults(func=_status)
    plan.add_parser(sub)
    slurm.add_parser(sub)
    observe.add_parsers(sub)
    try:
        from aiorl.cli import demo
    except ImportError:
        pass  # a demo module that cannot load must not break `aiorl status` and `plan`
    else:
        demo.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
