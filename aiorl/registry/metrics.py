"""Per-worker metrics in the Prometheus text format: ``aiorl-registry --metrics-port PORT``.

On each scrape of ``GET /metrics`` the registry asks every ready worker for its live numbers
(the ``inspect`` operation's ``metrics`` action, aiorl/actors/inspection.py) concurrently,
with a short timeout, and renders them in the Prometheus text exposition format (version
0.0.4), so an existing Prometheus/Grafana setup scrapes a cluster like any other target.
Nothing is collected between scrapes.

Series (labels ``worker``, ``group``, ``node``):

* ``aiorl_worker_up``: 1 if the worker answered this scrape;
* ``aiorl_worker_cpu_seconds_total``, ``aiorl_worker_resident_memory_bytes``;
* ``aiorl_worker_pending_operations{kind=...}``: receives, sends, calls, channel operations;
* ``aiorl_channel_depth{channel, queue}``: items in each queue a channel worker hosts;
* while tracing is on: ``aiorl_worker_operations_per_second{category}`` (calls, executions,
  sends, receives, channel operations), ``..._errors_per_second``, ``..._bytes_per_second``
  over the last 10 s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from aiorl.protocol.inspect import decode_answer
from aiorl.protocol.ops import WorkerOp
from aiorl.protocol.registry import WorkerRecord
from aiorl.transport.endpoint import Endpoint

__all__ = ["render", "scrape", "serve_metrics"]

log = logging.getLogger("aiorl.registry.metrics")

#: Seconds a worker has to answer a scrape; one that does not is reported down.
SCRAPE_TIMEOUT = 2.0
#: The window of the per-second rates (tracing on).
RATE_WINDOW = 10.0

_HELP = {
    "aiorl_worker_up": ("gauge", "1 if the worker answered this scrape"),
    "aiorl_worker_cpu_seconds_total": ("counter", "CPU time of the worker process"),
    "aiorl_worker_resident_memory_bytes": ("gauge", "resident memory of the worker process"),
    "aiorl_worker_pending_operations": ("gauge", "operations the worker waits for, by kind"),
    "aiorl_channel_depth": ("gauge", "items in a queue of a channel the worker hosts"),
    "aiorl_worker_operations_per_second": ("gauge", "finished operations per second, by "
                                           "category (tracing on)"),
    "aiorl_worker_errors_per_second": ("gauge", "failed operations per second (tracing on)"),
    "aiorl_worker_bytes_per_second": ("gauge", "payload bytes per second (tracing on)"),
}


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, object]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def render(answers: Iterable[tuple[WorkerRecord, dict[str, Any] | None]]) -> str:
    """The exposition text of the workers' answers (None: the worker did not answer)."""
    samples: dict[str, list[str]] = {name: [] for name in _HELP}

    def add(metric: str, labels: dict[str, object], value: float) -> None:
        samples[metric].append(f"{metric}{_labels(labels)} {float(value):g}")

    for record, reply in answers:
        base: dict[str, object] = {"worker": record.name, "group": record.info.address.root_group_name,
                                   "node": record.info.node_rank}
        add("aiorl_worker_up", base, 0 if reply is None else 1)
        if reply is None:
            continue
        res = reply.get("resources") or {}
        add("aiorl_worker_cpu_seconds_total", base, res.get("cpu_s", 0.0))
        add("aiorl_worker_resident_memory_bytes", base, res.get("rss_bytes", 0))
        for kind, n in sorted((reply.get("pending") or {}).items()):
            add("aiorl_worker_pending_operations", {**base, "kind": kind}, n)
        for q in reply.get("channels") or ():
            add("aiorl_channel_depth", {**base, "channel": q["channel"], "queue": q["queue"]},
                q["size"])
        for cat, (ops, errors, nbytes) in sorted((reply.get("rates") or {}).items()):
            labels = {**base, "category": cat}
            add("aiorl_worker_operations_per_second", labels, ops)
            add("aiorl_worker_errors_per_second", labels, errors)
            add("aiorl_worker_bytes_per_second", labels, nbytes)
    lines = []
    for metric, (kind, text) in _HELP.items():
        lines.append(f"# HELP {metric} {text}")
        lines.append(f"# TYPE {metric} {kind}")
        lines.extend(samples[metric])
    return "\n".join(lines) + "\n"


async def scrape(endpoint: Endpoint, workers: Iterable[WorkerRecord]
                 ) -> list[tuple[WorkerRecord, dict[str, Any] | None]]:
    """Ask each worker for its metrics at once; None for a worker that did not answer."""

    async def ask(record: WorkerRecord) -> tuple[WorkerRecord, dict[str, Any] | None]:
        try:
            _, frames = await endpoint.request(
                record.info.endpoint, WorkerOp.INSPECT,
                {"action": "metrics", "window": RATE_WINDOW}, timeout=SCRAPE_TIMEOUT)
            reply = decode_answer(frames)
        except Exception as exc:  # noqa: BLE001 - a worker that cannot answer is "down"
            log.debug("metrics of %s: %s", record.name, exc)
            return record, None
        return record, reply

    return list(await asyncio.gather(*(ask(r) for r in workers)))


async def serve_metrics(endpoint: Endpoint, ready_workers: Callable[[], list[WorkerRecord]],
                        host: str, port: int) -> asyncio.Server:
    """Serve ``GET /metrics`` over plain HTTP on ``host:port`` (the registry's loop)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)).strip():
                pass  # headers: nothing in them changes the answer
            parts = request.decode("latin-1").split()
            if len(parts) < 2 or parts[0] != "GET" or parts[1].split("?")[0] not in (
                    "/metrics", "/"):
                status, body = "404 Not Found", b"try /metrics\n"
            else:
                status = "200 OK"
                body = render(await scrape(endpoint, ready_workers())).encode()
            writer.write(f"HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4; "
                         f"charset=utf-8\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError) as exc:
            log.debug("metrics request dropped: %s", exc)
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)
