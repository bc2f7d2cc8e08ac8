"""``aiorl doctor``, ``aiorl trace`` and ``aiorl status --watch``: look inside a running job.

Each command reaches the cluster the way ``aiorl status`` does (``--registry`` and
``--key-file``, ``$AIORL_REGISTRY``, else this user's newest embedded cluster), opens a
private endpoint, and asks every live process through the ``inspect`` operation
(aiorl/cluster/doctor.py). Nothing needs to be installed or started in the job.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["add_parsers", "watch"]

T = TypeVar("T")


def _add_target_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--registry", default=None,
                   help="registry address (default: $AIORL_REGISTRY, else this user's newest "
                        "running embedded Cluster())")
    p.add_argument("--pid", type=int, default=None,
                   help="the driver process whose embedded Cluster() to look at, when this "
                        "user runs several (default: the newest)")
    p.add_argument("--key-file", default=None,
                   help="the cluster's key file (default: $AIORL_KEY_FILE, else "
                        "~/.aiorl/cluster.key when it exists)")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds each process has to answer (default 5)")


def add_parsers(sub: Any) -> None:
    """Add ``doctor`` and ``trace`` to the ``aiorl`` command."""
    doc = sub.add_parser("doctor", help="find deadlocks, waits on dead peers and stragglers")
    doc.add_argument("what", nargs="?", choices=["report", "stack"], default="report",
                     help="'stack': print every process's thread stacks and asyncio tasks")
    _add_target_arguments(doc)
    doc.add_argument("--json", action="store_true", help="the structured report as JSON")
    doc.add_argument("--interval", type=float, default=1.0,
                     help="seconds between two channel samples, to find channels that only "
                          "grow (0: one sample; default 1)")
    doc.add_argument("-v", "--verbose", action="store_true", help="list asyncio tasks too")
    doc.set_defaults(func=_doctor)
    tr = sub.add_parser("trace", help="record spans in every process; dump a Perfetto trace")
    tr.add_argument("action", choices=["start", "stop", "dump"])
    tr.add_argument("-o", "--output", default="trace.json",
                    help="where 'dump' writes the Chrome/Perfetto trace (default trace.json)")
    _add_target_arguments(tr)
    tr.set_defaults(func=_trace)


def _run(args: argparse.Namespace, name: str,
         body: Callable[[Any, Any], Awaitable[T]]) -> T | None:
    """Run ``body(endpoint, registry client)`` against the cluster; None if none was found."""
    import uvloop

    from aiorl.cli.target import resolve_target
    from aiorl.registry.client import RegistryClient
    from aiorl.transport.endpoint import Endpoint

    target = resolve_target(args)
    if target is None:
        return None
    address, keys, host = target
    if host is None and address.startswith("ipc://"):  # the registry's private directory
        host = "ipc://" + os.path.dirname(address[len("ipc://"):])

    async def run() -> T:
        endpoint = Endpoint(name, keys=keys, host=host or "127.0.0.1")
        try:
            return await body(endpoint, RegistryClient(endpoint, address))
        finally:
            endpoint.close()

    return uvloop.run(run())


def _doctor(args: argparse.Namespace) -> int:
    from aiorl.cluster import doctor
    from aiorl.errors import AuthenticationError, RegistryUnavailable

    async def body(endpoint: Any, registry: Any) -> Any:
        probes, status = await doctor.collect(endpoint, registry, "snapshot", args.timeout)
        if args.what == "stack":
            return doctor.format_stacks(probes)
        later = None
        if args.interval > 0:
            await asyncio.sleep(args.interval)
            later, _ = await doctor.collect(endpoint, registry, "snapshot", args.timeout)
        return doctor.diagnose(probes, status, later, args.interval)

    try:
        result = _run(args, "aiorl-doctor", body)
    except (RegistryUnavailable, AuthenticationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result is None:
        return 2
    if isinstance(result, str):
        print(result)
        return 0
    print(result.to_json() if args.json else doctor.format_report(result, args.verbose))
    return int(result.exit_code)


def _trace(args: argparse.Namespace) -> int:
    from aiorl.cluster import doctor
    from aiorl.errors import AuthenticationError, RegistryUnavailable

    async def body(endpoint: Any, registry: Any) -> Any:
        if args.action == "dump":
            return await doctor.dump_trace(endpoint, registry, args.output, args.timeout)
        return await doctor.switch_tracing(endpoint, registry, args.action == "start",
                                           args.timeout)

    try:
        result = _run(args, "aiorl-trace", body)
    except (RegistryUnavailable, AuthenticationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result is None:
        return 2
    if args.action == "dump":
        summary, probes = result
        print(f"wrote {args.output}: {summary['spans']} spans from "
              f"{summary['processes']} processes "
              "(open it in https://ui.perfetto.dev); their buffers are empty now: the next "
              "dump holds what they record from here on")
    else:
        probes = result
        print(f"tracing {'on' if args.action == 'start' else 'off'} in "
              f"{sum(p.reply is not None for p in probes)} processes")
    failed = [p for p in probes if p.error is not None]
    for p in failed:
        print(f"  {p.name}: {p.error}", file=sys.stderr)
    return 1 if failed else 0


# ---------------------------------------------------------------------- status --watch
def watch(args: argparse.Namespace) -> int:
    """Refresh a table of every process (state, CPU, RSS, pending operations, channels;
    calls/s and bytes/s while tracing is on, from the processes' trace buffers)."""
    from aiorl.cluster import doctor

    interval = max(0.2, float(getattr(args, "interval", 2.0)))
    refreshes = int(getattr(args, "count", 0))  # 0: until interrupted
    previous: dict[str, tuple[float, float]] = {}

    async def body(endpoint: Any, registry: Any) -> None:
        live = _live_display() if sys.stdout.isatty() else None
        try:
            done = 0
            while True:
                probes, status = await doctor.collect(endpoint, registry, "metrics",
                                                      args.timeout)
                rows = _watch_rows(probes, status, previous)
                if live is not None:
                    live.update(rows)
                else:
                    _print_plain(rows)
                done += 1
                if done == refreshes:
                    return
                await asyncio.sleep(interval)
        finally:
            if live is not None:
                live.stop()

    try:
        _run(args, "aiorl-watch", body)
    except KeyboardInterrupt:
        pass
    return 0


HEADERS = ["process", "node", "state", "cpu %", "rss MiB", "calls/s", "bytes/s", "pending",
           "channels"]
_NUMERIC = {"cpu %", "rss MiB", "calls/s", "bytes/s", "pending"}


def _watch_rows(probes: list[Any], status: Any, previous: dict[str, tuple[float, float]]
                ) -> list[list[str]]:
    states = {w.name: str(w.state) for w in status.workers}
    rows = []
    now = time.monotonic()
    for p in probes:
        snap = p.reply or {}
        res = snap.get("resources") or {}
        cpu = "-"
        if "cpu_s" in res:
            before = previous.get(p.endpoint)
            if before is not None and now > before[0]:
                cpu = f"{100 * (res['cpu_s'] - before[1]) / (now - before[0]):.0f}"
            previous[p.endpoint] = (now, res["cpu_s"])
        pending = sum((snap.get("pending") or {}).values())
        channels = ", ".join(f"{q['channel']}={q['size']}" for q in snap.get("channels", ()))
        rates = snap.get("rates") or {}
        # Calls served (executions) for a worker, calls made for a driver; tracing on only.
        calls = (rates.get("exec") or rates.get("call") or [0.0])[0]
        traced = bool(snap.get("tracing"))
        rows.append([p.name, p.node, states.get(p.name, "driver") if p.reply else "no answer",
                     cpu, f"{res.get('rss_bytes', 0) / 2**20:.0f}" if res else "-",
                     f"{calls:.0f}" if traced else "-",
                     _human(sum(r[2] for r in rates.values())) if traced else "-",
                     str(pending), channels or "-"])
    return rows


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000:
            return f"{nbytes:.0f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.0f} TB"


class _RichDisplay:
    """The table redrawn in place by ``rich``, where it is installed."""

    def __init__(self) -> None:
        from rich.live import Live

        self._live = Live(auto_refresh=False)
        self._live.start()

    def update(self, rows: list[list[str]]) -> None:
        from rich.table import Table

        table = Table(title=f"aiorl  {time.strftime('%H:%M:%S')}")
        for h in HEADERS:
            table.add_column(h, justify="right" if h in _NUMERIC else "left")
        for row in rows:
            table.add_row(*row)
        self._live.update(table, refresh=True)

    def stop(self) -> None:
        self._live.stop()


class _PlainDisplay:
    """The same table in plain text, the screen cleared before each refresh: ``rich`` is
    not one of aiorl's dependencies, and a terminal without it must still watch."""

    def update(self, rows: list[list[str]]) -> None:
        sys.stdout.write("\x1b[H\x1b[2J")  # cursor home, clear the screen
        _print_plain(rows)
        sys.stdout.flush()

    def stop(self) -> None:
        pass


def _live_display() -> _RichDisplay | _PlainDisplay:
    try:
        return _RichDisplay()
    except ImportError:
        return _PlainDisplay()


def _print_plain(rows: list[list[str]]) -> None:
    from aiorl.util.text import format_table

    print(time.strftime("%H:%M:%S"))
    print(format_table(HEADERS, rows))
    print(flush=True)
