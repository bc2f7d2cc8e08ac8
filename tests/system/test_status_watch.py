"""Live status: ``aiorl status --watch`` (plain lines off a terminal) and the registry's
Prometheus metrics, against real workers and a real channel."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest

import aiorl
from aiorl.registry.metrics import render, scrape, serve_metrics

pytestmark = pytest.mark.timeout(90)


class Busy(aiorl.Worker):
    def fill(self, n: int) -> int:
        channel = self.connect_channel("depth")
        for i in range(n):
            channel.put(i, async_op=False)
        channel.flush().wait(30)
        return n


@pytest.fixture(scope="module")
def cluster():
    with aiorl.Cluster(num_nodes=1, trace=True) as c:
        aiorl.Channel.create(c, "depth")
        group = Busy.create_group().launch(c, num_workers=2, name="busy")
        group.execute_on(0).fill(5).wait(60)
        yield c
        group.close()


def _cli(cluster: aiorl.Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    key_file = cluster._embedded.key_file if cluster._embedded and cluster.keys else None
    extra = ["--key-file", key_file] if key_file else []
    return subprocess.run(
        [sys.executable, "-m", "aiorl.cli.main", *args, "--registry", cluster.registry_address,
         *extra], capture_output=True, text=True, timeout=60)


def test_status_watch_prints_plain_lines_off_a_terminal(cluster):
    out = _cli(cluster, "status", "--watch", "--count", "2", "--interval", "0.3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    headers = [line for line in lines if line.split()[:1] == ["process"]]
    assert len(headers) == 2, out.stdout  # two refreshes
    assert "calls/s" in headers[0] and "pending" in headers[0]
    rows = {line.split()[0]: line for line in lines if line and line.split()[0].endswith(":0")}
    assert "busy:0" in rows and "ready" in rows["busy:0"]
    assert "depth=5" in rows["channel.depth:0"]  # the channel's depth, from its host
    assert "\x1b[" not in out.stdout  # no escape codes when not a terminal


def test_prometheus_metrics(cluster):
    rt = cluster.runtime

    async def fetch_records():
        return [w for w in (await rt.registry.status()).workers if w.state == "ready"]

    records = rt.run_sync(fetch_records())
    text = render(rt.run_sync(scrape(rt.endpoint, records), timeout=30))
    assert '# TYPE aiorl_worker_up gauge' in text
    assert 'aiorl_worker_up{worker="busy:1",group="busy",node="0"} 1' in text
    assert ('aiorl_channel_depth{worker="channel.depth:0",group="channel.depth",node="0",'
            'channel="depth",queue="default"} 5') in text
    assert 'aiorl_worker_operations_per_second{worker="busy:0"' in text  # tracing is on
    for line in text.splitlines():  # the exposition format: "# ..." or "name{labels} value"
        assert line.startswith("# ") or (line.count("{") == 1 and float(line.rsplit(" ", 1)[1])
                                          >= 0), line

    # The HTTP endpoint the registry serves with --metrics-port, on this loop for the test.
    server = rt.run_sync(serve_metrics(rt.endpoint, lambda: records, "127.0.0.1", 0))
    try:
        port = server.sockets[0].getsockname()[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            assert r.status == 200 and "text/plain" in r.headers["Content-Type"]
            assert 'aiorl_worker_up{worker="busy:0"' in r.read().decode()
    finally:
        rt.submit(server.close)
