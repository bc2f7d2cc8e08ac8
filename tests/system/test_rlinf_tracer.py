"""RLinf's timers and tracer on aiorl: ``@Worker.timer(tag, trace=True)``,
``worker_timer``, ``pop_execution_time(s)``, and the ``cluster.tracer`` keys
(``enable``, ``output_file``) mapped onto aiorl's Perfetto/Chrome trace."""

from __future__ import annotations

import asyncio
import json

import pytest

import aiorl
from aiorl.trace import recorder

pytestmark = pytest.mark.timeout(120)


class Timed(aiorl.Worker):
    @aiorl.Worker.timer("generate", trace=True)
    def generate(self, n: int) -> int:
        return sum(range(n))

    @aiorl.Worker.timer()
    async def train_step(self) -> str:
        await asyncio.sleep(0.01)
        return "ok"

    def by_hand(self) -> None:
        with self.worker_timer():  # the tag is the calling method's name
            pass
        with self.worker_timer("block", trace=True):
            pass

    def missing(self) -> float:
        return self.pop_execution_time("never")


def test_timers_add_up_per_tag_until_popped(cluster):
    group = Timed.create_group().launch(cluster, num_workers=1, name="timed")
    try:
        group.generate(1000).wait(60)
        group.generate(1000).wait(60)
        assert group.train_step().wait(60) == ["ok"]
        group.by_hand().wait(60)
        [times] = group.pop_execution_times().wait(60)
        assert sorted(times) == ["block", "by_hand", "generate", "train_step"]
        assert times["train_step"] >= 0.01 and all(t >= 0 for t in times.values())
        assert group.pop_execution_times().wait(60) == [{}]  # popping resets
        with pytest.raises(ValueError, match="Timer 'never' has not been recorded"):
            group.missing().wait(60)
    finally:
        group.close()


def test_timer_wants_a_tag_call():
    with pytest.raises(TypeError, match=r"write @Worker.timer\(\) or @Worker.timer\('name'\)"):

        class Wrong(aiorl.Worker):
            @aiorl.Worker.timer  # type: ignore[arg-type]
            def step(self) -> None:
                pass


def test_cluster_tracer_keys_trace_the_workers_and_write_the_file_on_close(tmp_path):
    out = tmp_path / "trace.json"
    cfg = {"cluster": {"num_nodes": 1, "tracer": {"enable": True, "output_file": str(out)}}}
    assert not recorder.ON
    with aiorl.Cluster(cfg) as cluster:
        assert recorder.ON
        group = Timed.create_group().launch(cluster, num_workers=1, name="traced")
        group.generate(10).wait(60)
        group.by_hand().wait(60)
        assert not out.exists()  # written by close, while the workers still answer
    assert not recorder.ON  # the cluster turned tracing on, so its close turned it off
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    worker = next(pid for pid, name in names.items() if "traced:0" in name)
    spans = {e["name"] for e in events if e["pid"] == worker and e["ph"] in "Xb"}
    assert {"generate", "block"} <= spans  # trace=True timers; by_hand's plain one is not
    assert "by_hand" not in {e["name"] for e in events if e.get("cat") == "user"}


@pytest.mark.parametrize("section, message", [
    ({"enable": True, "server_port": 8888}, r"unknown key\(s\) server_port"),
    ({"enable": "yes"}, "cluster.tracer.enable must be true or false"),
    ({"enable": True, "output_file": 3}, "cluster.tracer.output_file must be a file path"),
    (["enable"], "cluster.tracer must be a mapping"),
])
def test_bad_tracer_sections_are_refused_before_anything_starts(section, message):
    with pytest.raises(ValueError, match=message):
        aiorl.Cluster({"cluster": {"num_nodes": 1, "tracer": section}})
