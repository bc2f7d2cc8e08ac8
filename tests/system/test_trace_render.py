"""docs/scripts/render_trace.py reads a real trace and draws it (the image in docs/debugging.md).

A small traced job (calls from the driver, sends from one worker to another) is dumped as
``aiorl trace dump`` writes it; the renderer must find its processes and tracks, bind each
send->recv flow to the send and the receive slices, and write a PNG. The drawing needs
matplotlib, which the ``test`` extra installs so that this test runs wherever the suite does.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import aiorl
from aiorl.trace import recorder
from tests._paths import REPO_ROOT

pytestmark = pytest.mark.timeout(90)

SCRIPT = REPO_ROOT / "docs" / "scripts" / "render_trace.py"
MESSAGES = 3


def _renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_trace", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class Sender(aiorl.Worker):
    def produce(self, n: int) -> None:
        for i in range(n):
            with aiorl.span("produce", i=i):
                self.send(i, "receiver", 0).wait(30)


class Receiver(aiorl.Worker):
    def consume(self, n: int) -> int:
        return sum(self.recv("sender", 0).wait(30) for _ in range(n))


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    with aiorl.Cluster(num_nodes=1, trace=True) as cluster:
        sender = Sender.create_group().launch(cluster, name="sender")
        receiver = Receiver.create_group().launch(cluster, name="receiver")
        try:
            consumed = receiver.consume(MESSAGES)
            sender.produce(MESSAGES).wait(60)
            assert consumed.wait(60) == [sum(range(MESSAGES))]
            cluster.trace_dump(str(path))
        finally:
            sender.close()
            receiver.close()
    recorder.disable()
    recorder.drain()
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def test_parses_processes_tracks_and_flows(trace: dict[str, Any]) -> None:
    timeline = _renderer().load(trace)
    names = [p.short_name for p in timeline.processes]
    assert names[0] == "driver" and {"sender:0", "receiver:0"} <= set(names), names
    by_name = {p.short_name: p for p in timeline.processes}
    kinds = {t.kind for p in timeline.processes for t in p.tracks}
    assert {"thread", "async", "counter"} <= kinds
    # Every send -> recv arrow goes from a send slice to a recv slice, peer to peer.
    p2p = [f for f in timeline.flows if f.source.name == "send"]
    assert len(p2p) == MESSAGES, [(f.source.name, f.target.name) for f in timeline.flows]
    for f in p2p:
        assert f.target.name == "recv" and f.target.peer == "sender:0"
        assert any(f.source in t.slices for t in by_name["sender:0"].tracks)
    # ... and each call of the driver to the execution it started.
    executions = {
        f.target.name for f in timeline.flows if f.source.peer in ("sender:0", "receiver:0")
    }
    assert {"produce", "consume"} <= executions
    # Anchors (zero-length thread slices carrying an async slice's flow) are not drawn.
    assert not any(s.name.endswith(" ->") for s in timeline.slices())


def test_renders_an_image(trace: dict[str, Any], tmp_path: Path) -> None:
    renderer = _renderer()
    out = tmp_path / "trace.png"
    renderer.render(renderer.load(trace), out, title="test", width_in=8)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and 5_000 < len(data) < 300_000
    svg = tmp_path / "trace.svg"
    renderer.main([str(_dump(trace, tmp_path)), "-o", str(svg), "--start", "0", "--end", "50"])
    assert svg.read_text().lstrip().startswith("<?xml")


def _dump(trace: dict[str, Any], folder: Path) -> Path:
    path = folder / "trace.json"
    path.write_text(json.dumps(trace))
    return path
