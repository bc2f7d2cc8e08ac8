"""The registry under many workers: registration rate, watch fan-out, status, memory, by N.

For each N a fresh ``aiorl-registry`` process starts (CURVE keys, TCP on 127.0.0.1, as a
deployed one). ``--nodes`` simulated node agents (default 100), spread over ``--clients``
processes, register as nodes; each then reports its N/nodes workers ``ready`` with the
registry's own typed requests (`RegistryClient.report_state`), all at once, as the
workers of a launch do. Workers are coroutines on their node's endpoint (one connection
per node, not per worker: 10,000 sockets would measure this VM's file limit instead).
Each node's workers form a group, watched by one of ``--watchers`` drivers. Measured:

* **registrations/s**: N over the time from "go" to the last acknowledged report;
  **registry CPU per registration** (its own user+system time, from /proc): what bounds
  the rate on a machine where the registry has a core to itself;
* **watch fan-out latency**: a state report to a probe group watched by every driver,
  until the last driver has the event (p50 of 50);
* **status latency**: ``status()`` (every node, group and worker record), p50 of 5;
* **registry memory per worker**: the registry's RSS growth over the registrations / N.

    python benchmarks/bench_registry_scale.py --sizes 1000,2500,5000,10000 \\
        [--json out.json] [--plot docs/img]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from aiorl.names import WorkerAddress, WorkerInfo
from aiorl.protocol.ops import WorkerState
from aiorl.protocol.registry import DriverInfo, GroupSpec, NodeInfo, NodeRegistration
from aiorl.registry.client import RegistryClient
from aiorl.transport.endpoint import Endpoint
from aiorl.transport.security import ClusterKeys

PROBE_GROUP = "probe"


def _node(i: int, endpoint: str) -> NodeInfo:
    return NodeInfo(node_id=f"sim-node-{i}", endpoint=endpoint, node_rank=i, ip="127.0.0.1",
                    hostname=f"sim{i}", cpus=64, num_accelerators=8, accelerator_type="cuda",
                    hardware={}, labels={}, pid=os.getpid())


def _worker(group: str, rank: int, size: int, node: int, endpoint: str) -> WorkerInfo:
    return WorkerInfo(WorkerAddress(group, rank), rank, size, node, "127.0.0.1",
                      f"{endpoint}#{rank}", pid=100_000 + rank, node_id=f"sim-node-{node}")


# ------------------------------------------------------------------ a client process
async def client(address: str, key_file: str, first: int, count: int, per_node: int) -> None:
    """Simulated nodes ``first..first+count-1``: register, wait for 'go', report workers."""
    keys = ClusterKeys.load(key_file)
    nodes = []
    for i in range(first, first + count):
        endpoint = Endpoint(f"sim-node-{i}", keys=keys)
        registry = RegistryClient(endpoint, address)
        await registry.register_node(NodeRegistration(_node(i, endpoint.address), ()))
        nodes.append((i, endpoint, registry))
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # "go"
    started = time.perf_counter()

    async def report_all(i: int, endpoint: Endpoint, registry: RegistryClient) -> None:
        await asyncio.gather(*(registry.report_state(
            _worker(f"g{i}", r, per_node, i, endpoint.address), WorkerState.READY, timeout=120,
            incarnation=0) for r in range(per_node)))

    await asyncio.gather(*(report_all(*n) for n in nodes))
    print(json.dumps({"elapsed": time.perf_counter() - started}), flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # "stop" (or EOF)
    for _, endpoint, registry in nodes:
        registry.close()
        endpoint.close()


# ------------------------------------------------------------------ one size
def _proc_stat(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return cpu, int(fields[21]) * os.sysconf("SC_PAGE_SIZE")


async def measure(n: int, nodes: int, clients: int, watchers: int, workdir: str) -> dict[str, float]:
    key_file = os.path.join(workdir, "cluster.key")
    ClusterKeys.generate().save(key_file)
    keys = ClusterKeys.load(key_file)
    registry_proc = subprocess.Popen(
        [sys.executable, "-m", "aiorl.registry.service", "--host", "127.0.0.1", "--port", "0",
         "--print-address", "--key-file", key_file, "--expiry", "300", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, text=True)
    procs: list[subprocess.Popen[str]] = []
    endpoints: list[Endpoint] = []
    try:
        assert registry_proc.stdout is not None
        address = registry_proc.stdout.readline().strip().split("=", 1)[1]
        per_node = n // nodes
        drivers = []
        for w in range(watchers):
            endpoint = Endpoint(f"bench-driver-{w}", keys=keys)
            endpoints.append(endpoint)
            registry = RegistryClient(endpoint, address)
            info = DriverInfo(f"driver-{w}", os.getpid(), platform.node(), endpoint.address)
            await registry.register_driver(info)
            drivers.append((info, registry))
        counts = [0] * watchers
        arrived: list[asyncio.Event] = [asyncio.Event() for _ in range(watchers)]

        def counter(w: int) -> Any:
            def on_event(name: str, state: str, info: Any, detail: Any) -> None:
                if name.startswith(PROBE_GROUP + ":"):
                    arrived[w].set()
                else:
                    counts[w] += 1
            return on_event

        for i in range(nodes):  # each node's workers are a group, watched by one driver
            info, registry = drivers[i % watchers]
            await registry.create_group(GroupSpec(f"g{i}", per_node, info.driver_id, "Sim"))
            await registry.watch(f"g{i}", counter(i % watchers))
        info, registry = drivers[0]
        await registry.create_group(GroupSpec(PROBE_GROUP, 1, info.driver_id, "Sim"))
        for w, (_, registry) in enumerate(drivers):
            await registry.watch(PROBE_GROUP, counter(w))
        share = [nodes // clients + (c < nodes % clients) for c in range(clients)]
        first = 0
        for c in range(clients):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--client", address, key_file, str(first),
                 str(share[c]), str(per_node)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True))
            first += share[c]
        loop = asyncio.get_running_loop()
        for p in procs:
            assert p.stdout is not None
            line = await loop.run_in_executor(None, p.stdout.readline)
            assert line.strip() == "ready", line
        cpu0, rss0 = _proc_stat(registry_proc.pid)
        started = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None
            json.loads(await loop.run_in_executor(None, p.stdout.readline))
        elapsed = time.perf_counter() - started
        cpu1, rss1 = _proc_stat(registry_proc.pid)
        while sum(counts) < per_node * nodes:  # every event reached its watcher
            await asyncio.sleep(0.01)
        # Watch fan-out: a report to the probe group, until every driver has the event.
        probe = Endpoint("bench-probe", keys=keys)
        endpoints.append(probe)
        probe_registry = RegistryClient(probe, address)
        latencies = []
        for k in range(50):
            for event in arrived:
                event.clear()
            t = time.perf_counter()
            await probe_registry.report_state(
                _worker(PROBE_GROUP, 0, 1, 0, probe.address), WorkerState.READY, incarnation=k)
            for event in arrived:
                await event.wait()
            latencies.append(time.perf_counter() - t)
        status_times = []
        for _ in range(5):
            t = time.perf_counter()
            report = await drivers[0][1].status(timeout=60)
            status_times.append(time.perf_counter() - t)
        assert len(report.workers) >= per_node * nodes
        for _, registry in drivers:
            registry.close()
        probe_registry.close()
        return {"workers": per_node * nodes, "registrations_per_s": per_node * nodes / elapsed,
                "registry_cpu_us_per_registration": (cpu1 - cpu0) / (per_node * nodes) * 1e6,
                "watch_fanout_p50_ms": statistics.median(latencies) * 1e3,
                "status_p50_ms": statistics.median(status_times) * 1e3,
                "registry_bytes_per_worker": (rss1 - rss0) / (per_node * nodes)}
    finally:
        for p in procs:
            try:
                if p.stdin is not None:
                    p.stdin.write("stop\n")
                    p.stdin.close()
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for endpoint in endpoints:
            endpoint.close()
        registry_proc.terminate()
        try:
            registry_proc.wait(10)
        except subprocess.TimeoutExpired:
            registry_proc.kill()
            registry_proc.wait()


def plot(results: list[dict[str, float]], directory: str) -> list[str]:
    """One figure with a panel per curve (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["workers"] for r in results]
    panels = [("registrations_per_s", "registrations / s"),
              ("registry_cpu_us_per_registration", "registry CPU per registration (µs)"),
              ("watch_fanout_p50_ms", "watch fan-out p50 (ms)"),
              ("status_p50_ms", "status() p50 (ms)"),
              ("registry_bytes_per_worker", "registry memory per worker (bytes)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.plot(xs, [r[key] for r in results], marker="o")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("workers")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    path = os.path.join(directory, "registry_scale.png")
    fig.savefig(path, dpi=90)
    return [path]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        address, key_file, first, count, per_node = sys.argv[2:7]
        import uvloop

        uvloop.run(client(address, key_file, int(first), int(count), int(per_node)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,2500,5000,10000")
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--clients", type=int, default=4, help="processes the nodes run in")
    parser.add_argument("--watchers", type=int, default=10, help="drivers watching groups")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--plot", help="write registry_scale.png into this directory")
    args = parser.parse_args()
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, load average {os.getloadavg()[0]:.2f}")
    results = []
    header = ("workers", "reg/s", "reg CPU µs", "watch p50 ms", "status p50 ms", "B/worker")
    print("".join(f"{h:>14}" for h in header))
    for n in (int(s) for s in args.sizes.split(",")):
        workdir = tempfile.mkdtemp(prefix="aiorl-bench-registry-")
        try:
            import uvloop

            r = uvloop.run(measure(n, args.nodes, args.clients, args.watchers, workdir))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        results.append(r)
        print(f"{r['workers']:>14.0f}{r['registrations_per_s']:>14.0f}"
              f"{r['registry_cpu_us_per_registration']:>14.1f}{r['watch_fanout_p50_ms']:>14.2f}"
              f"{r['status_p50_ms']:>14.1f}{r['registry_bytes_per_worker']:>14.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.node(), "cores": os.cpu_count(), "results": results},
                      f, indent=1)
    if args.plot:
        print("wrote", ", ".join(plot(results, args.plot)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
