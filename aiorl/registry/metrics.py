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

The port asks for no key and shows worker, group and channel names, so ``aiorl-registry``
binds it to 127.0.0.1 unless ``--metrics-host`` says otherwise; it serves at most
`MAX_CONNECTIONS` clients at once and closes one that has not sent its request
within `REQUEST_DEADLINE` seconds (docs/security.md).
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
from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["render", "scrape", "serve_metrics"]

log = logging.getLogger("aiorl.registry.metrics")
_warn = RateLimitedLog(log)

#: Seconds a worker has to answer a scrape; one that does not is reported down.
SCRAPE_TIMEOUT = 2.0
#: The window of the per-second rates (tracing on).
RATE_WINDOW = 10.0
#: Clients served at once; more are answered ``503`` and closed (each holds a descriptor).
MAX_CONNECTIONS = 64
#: Seconds a client has, in all, to send its request line and headers.
REQUEST_DEADLINE = 5.0
#: Seconds a client has to take its answer.
SEND_DEADLINE = 10.0
#: Longest request or header line, and most header lines, a request may have.
MAX_LINE_BYTES = 8192
MAX_HEADER_LINES = 100

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


class _BadRequest(Exception):
    """A request the metrics port does not parse (answered 400 and closed)."""


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """The request line, once the headers that follow it are read (nothing in them
    changes the answer); b"" for a client that closed without asking anything."""
    request = await reader.readline()
    if not request:
        return b""
    for _ in range(MAX_HEADER_LINES):
        if not (await reader.readline()).strip():  # the blank line, or the client's EOF
            return request
    raise _BadRequest(f"more than {MAX_HEADER_LINES} header lines")


async def serve_metrics(endpoint: Endpoint, ready_workers: Callable[[], list[WorkerRecord]],
                        host: str, port: int, *, max_connections: int = MAX_CONNECTIONS,
                        request_deadline: float = REQUEST_DEADLINE) -> asyncio.Server:
    """Serve ``GET /metrics`` over plain HTTP on ``host:port`` (the registry's loop).

    It asks for no key, so the registry binds it to loopback unless told otherwise. At most
    ``max_connections`` clients are served at once (others get ``503`` and are closed at
    once); each has ``request_deadline`` seconds to send its request line and headers, and
    `SEND_DEADLINE` to take the answer, then it is closed. What goes wrong is logged
    at most once a second per kind of trouble, with a count of the rest."""
    active = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal active
        if active >= max_connections:
            _warn.warning("busy", "metrics port: %d connections are open (the limit): "
                          "refused another", max_connections)
            _answer(writer, "503 Service Unavailable", b"too many connections\n")
            writer.close()
            return
        active += 1
        # drain() returns once everything is with the kernel, so close() never waits on a
        # client that stopped reading: one that does not take its answer in time is aborted.
        writer.transport.set_write_buffer_limits(high=0)
        try:
            try:
                request = await asyncio.wait_for(_read_request(reader), request_deadline)
            except asyncio.TimeoutError:
                _warn.warning("slow", "metrics port: closed a connection that did not send "
                              "its request within %g s", request_deadline)
                return
            except (ValueError, asyncio.LimitOverrunError, _BadRequest) as exc:
                # A line longer than the stream's limit (ValueError from readline).
                _warn.warning("malformed", "metrics port: refused a malformed request: %s",
                              str(exc)[:200])
                _answer(writer, "400 Bad Request", b"malformed request\n")
                await asyncio.wait_for(writer.drain(), SEND_DEADLINE)
                return
            if not request:
                return
            parts = request.decode("latin-1").split()
            if len(parts) < 2 or parts[0] != "GET" or parts[1].split("?")[0] not in (
                    "/metrics", "/"):
                status, body = "404 Not Found", b"try /metrics\n"
            else:
                status = "200 OK"
                body = render(await scrape(endpoint, ready_workers())).encode()
            _answer(writer, status, body)
            await asyncio.wait_for(writer.drain(), SEND_DEADLINE)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            log.debug("metrics request dropped: %r", exc)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the port
            _warn.warning("failed", "metrics port: a request failed", exc_info=exc)
        finally:
            active -= 1
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()
            else:
                writer.close()

    return await asyncio.start_server(handle, host, port, limit=MAX_LINE_BYTES)


def _answer(writer: asyncio.StreamWriter, status: str, body: bytes) -> None:
    writer.write(f"HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4; "
                 f"charset=utf-8\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
