"""Tracing: the recorder's rules, the Chrome merge, and a traced pipeline of real workers.

The pipeline: the driver calls two producer ranks, each sends items to one consumer that
receives them and puts a summary into a channel the driver reads. Its trace must have
spans in every worker, a flow from each send to its receive and from each call to its
execution, and load as Chrome trace JSON (checked event by event, not by eye).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import pytest

import aiorl
from aiorl.actors.inspection import traced_execution
from aiorl.group import calls as group_calls
from aiorl.names import WorkerAddress, WorkerInfo
from aiorl.trace import chrome, recorder
from aiorl.transport.endpoint import Incoming
from tests._paths import REPO_ROOT

pytestmark = pytest.mark.timeout(90)


# ----------------------------------------------------------------------------- recorder
@pytest.fixture
def tracing():
    was = recorder.ON
    recorder.enable()
    recorder.drain()
    yield
    if not was:
        recorder.disable()
    recorder.drain()


def test_off_records_nothing():
    assert not recorder.ON, "tracing must be off by default (a traced Cluster's close turns it off)"
    recorder.drain()  # what an earlier traced test left behind
    with aiorl.span("quiet", step=1) as s:
        assert s is None
    aiorl.mark("nothing")
    assert recorder.drain()["spans"] == []


def test_span_mark_and_pending(tracing):
    with aiorl.span("rollout.generate", step=3) as s:
        assert s in recorder.open_spans  # pending while open: what the doctor dates
    aiorl.mark("weights.published", version=7)
    with pytest.raises(KeyError), aiorl.span("fails"):
        raise KeyError("x")
    dump = recorder.drain()
    by_name = {w[1]: w for w in dump["spans"]}
    generate = by_name["rollout.generate"]
    assert generate[12] == {"step": 3} and generate[8] is True and generate[3] >= generate[2]
    assert by_name["weights.published"][0] == "mark"
    assert by_name["fails"][8] is False and "KeyError" in by_name["fails"][9]
    assert not recorder.open_spans


def test_aiorl_trace_environment_variable(monkeypatch):
    was = recorder.ON
    try:
        monkeypatch.setenv("AIORL_TRACE", "0")
        recorder.disable()
        assert recorder.enable_from_environment() is False
        monkeypatch.setenv("AIORL_TRACE", "1")
        assert recorder.enable_from_environment() is True
    finally:
        (recorder.enable if was else recorder.disable)()


def test_flow_ids_are_counted_per_pair(tracing):
    assert recorder.flow_seq("a>b/p2p") == ("a>b/p2p", 1)
    assert recorder.flow_seq("a>b/p2p") == ("a>b/p2p", 2)
    assert recorder.flow_seq("b>a/p2p") == ("b>a/p2p", 1)


def test_clock_offset_estimate_and_correction():
    # The remote clock is 5 ms ahead; the pull took 2 ms round trip.
    offset, error = chrome.estimate_offset(1_000_000, 3_000_000, 7_000_000)
    assert offset == 5_000_000 and error == 1_000_000
    remote = chrome.PulledBuffer(
        {"pid": 2, "process": "w:0", "clock_ns": 7_000_000, "threads": {},
         "spans": [["user", "x", 6_000_000, 6_500_000, 1, 1, None, 0, True, None, None, None,
                    None, False]], "open": []},
        node="1", group="w", rank=0, sent_ns=1_000_000, received_ns=3_000_000, local=False)
    trace = chrome.merge([remote])
    (x,) = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert x["ts"] == pytest.approx(1000.0) and x["dur"] == pytest.approx(500.0)


def test_recording_cost_is_bounded(tracing):
    """Opening and closing a span (the hooks' work) costs a few Python calls, whatever the
    buffer holds: a regression guard with room for a loaded 2-core box; the budget itself
    (≤ 2 µs per span) is measured by benchmarks/bench_trace.py. Timed by this thread's CPU
    time, best of five rounds: a loaded machine delays the thread, it does not make the
    recording cost more."""
    n, rounds = 4_000, []
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(n):
            recorder.begin("call", "step", "g:0").end()
        rounds.append((time.thread_time() - t0) / n)
        recorder.drain()
    per_span = min(rounds)
    assert per_span < 10e-6, f"{per_span * 1e6:.2f} µs per span"


_HOOK_LOOPS = """
import bench_trace
from aiorl.names import WorkerAddress, WorkerInfo
from aiorl.trace import recorder
me = WorkerInfo(WorkerAddress("bench", 0), 0, 1, 0, "127.0.0.1", "ipc://unused")
print(type(bench_trace.call_hook_ns(n=500)).__name__,
      type(bench_trace.execution_hook_ns(me, n=500)).__name__, recorder.ON)
"""


@pytest.mark.timeout(90)
def test_the_two_per_call_hooks_record_what_they_pack(tracing):
    """The compact records of a group call's answer (driver) and an ``async def`` execution's
    start (worker) expand to full records naming the method, the peer and the flow; and
    benchmarks/bench_trace.py's loops that time those hooks alone still fit them."""
    me = WorkerInfo(WorkerAddress("bench", 0), 0, 1, 0, "127.0.0.1", "ipc://unused")
    out = subprocess.run(  # its own process: the benchmark module is a script, not a package
        [sys.executable, "-c", _HOOK_LOOPS], cwd=REPO_ROOT / "benchmarks",
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["float", "float", "False"]

    loop = asyncio.new_event_loop()
    try:
        shape = group_calls.CallTrace("driver", "g", (0, 1), "step")
        call = group_calls.TracedGroupCall(aiorl.AsyncWork(loop), 2)
        call.shape, call.nbytes, call.t0 = shape, 10, recorder.now()
        call.results[0], call.results[1] = 41, 42
        call.settle(0, None, (None, [b"abcd"]))
        call.settle(1, ValueError("no"), None)
    finally:
        loop.close()
    traced_execution(lambda: None, True, Incoming(None, b"driver/1/x", 0, 7, "call", "step",  # type: ignore[arg-type]
                                                   []), me)
    spans = recorder.drain()["spans"]
    answered, failed, started = spans
    assert answered[:2] == ("call", "step") and answered[6] == "g:0" and answered[7] == 14
    assert answered[8] is True and answered[10] == ("driver>g:0/call", 41)
    assert failed[6] == "g:1" and failed[8] is False and failed[9] == "ValueError: no"
    assert failed[10] == ("driver>g:1/call", 42)
    assert started[:2] == ("exec", "step") and started[6] == "driver"
    assert started[11] == ("driver>bench:0/call", 7)


# ----------------------------------------------------------------------------- a pipeline
ITEMS = 3


class Producer(aiorl.Worker):
    async def produce(self, n: int) -> int:
        for i in range(n):
            with aiorl.span("produce.item", i=i):
                await self.send({"rank": self.worker_info.rank, "i": i}, "consumer", 0)
        return n


class Consumer(aiorl.Worker):
    def consume(self, producers: int, n: int) -> int:
        channel = self.connect_channel("summaries")
        total = 0
        for src in range(producers):
            for _ in range(n):
                total += self.recv("producer", src).wait(30)["i"]
        channel.put(total, async_op=False)
        return total


@pytest.fixture(scope="module")
def traced_cluster():
    with aiorl.Cluster(num_nodes=1, trace=True) as c:
        yield c
    recorder.disable()
    recorder.drain()


def _check_chrome_json(trace: dict[str, Any]) -> None:
    """What Chrome/Perfetto require of each event kind (a parser, not an eye)."""
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    required = {"X": {"ts", "dur", "pid", "tid", "name"}, "b": {"ts", "id", "pid", "cat"},
                "e": {"ts", "id", "pid", "cat"}, "s": {"ts", "id", "pid", "tid"},
                "f": {"ts", "id", "pid", "tid", "bp"}, "M": {"pid", "name", "args"},
                "i": {"ts", "pid", "tid", "s"}, "C": {"ts", "pid", "args"}}
    for e in trace["traceEvents"]:
        assert e["ph"] in required, e
        missing = required[e["ph"]] - e.keys()
        assert not missing, (e, missing)
        if "ts" in e:
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
    opened = Counter((e["pid"], e["id"]) for e in trace["traceEvents"] if e["ph"] == "b")
    closed = Counter((e["pid"], e["id"]) for e in trace["traceEvents"] if e["ph"] == "e")
    assert opened == closed


def test_trace_of_a_pipeline(traced_cluster, tmp_path):
    cluster = traced_cluster
    channel = aiorl.Channel.create(cluster, "summaries")
    producers = Producer.create_group().launch(cluster, num_workers=2, name="producer")
    consumer = Consumer.create_group().launch(cluster, num_workers=1, name="consumer")
    try:
        consumed = consumer.consume(2, ITEMS)
        assert producers.produce(ITEMS).wait(60) == [ITEMS, ITEMS]
        assert consumed.wait(60) == [2 * sum(range(ITEMS))]
        assert channel.get(async_op=False) == 2 * sum(range(ITEMS))

        path = tmp_path / "trace.json"
        cluster.trace_dump(str(path))
        trace = json.loads(path.read_text())  # what ui.perfetto.dev reads
    finally:
        producers.close()
        consumer.close()

    _check_chrome_json(trace)
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    pid_of = {name.split()[-1].split("@")[0]: pid for pid, name in names.items()}
    for worker in ("producer:0", "producer:1", "consumer:0", "driver"):
        assert worker in pid_of, names
        assert any(e["pid"] == pid_of[worker] and e["ph"] in "Xb" for e in events), worker

    def flows(ph: str) -> dict[int, int]:
        return {e["id"]: e["pid"] for e in events if e["ph"] == ph}

    starts, ends = flows("s"), flows("f")
    linked = [(starts[i], ends[i]) for i in starts.keys() & ends.keys()]
    consumer_pid = pid_of["consumer:0"]
    for rank in (0, 1):
        sends = [1 for src, dst in linked if src == pid_of[f"producer:{rank}"]
                 and dst == consumer_pid]
        assert len(sends) == ITEMS, f"producer:{rank} -> consumer: {len(sends)} send->recv flows"
    # Each call of the driver ends in its execution in the worker.
    for worker in ("producer:0", "producer:1", "consumer:0"):
        assert (pid_of["driver"], pid_of[worker]) in linked, worker
    user = [e for e in events if e.get("name") == "produce.item" and e["ph"] in "bX"]
    assert len(user) == 2 * ITEMS
    assert any(e.get("cat") == "channel" for e in events)


class AsyncEcho(aiorl.Worker):
    async def echo(self, x: int) -> int:
        return x

    async def fail(self) -> None:
        raise ValueError("boom")


def test_async_calls_link_to_their_executions(traced_cluster, tmp_path):
    """The two hottest hooks keep compact records (a call's answer at the driver, an
    ``async def`` execution's start at the worker): pulled, each call is a span with its
    error, and each links to its execution's start by a flow."""
    group = AsyncEcho.create_group().launch(traced_cluster, num_workers=1, name="aecho")
    try:
        assert [group.echo(i).wait(30) for i in range(5)] == [[i] for i in range(5)]
        with pytest.raises(ValueError, match="boom"):
            group.fail().wait(30)
        recent = recorder.recent(60.0)  # what live status reads, compact records included
        assert recent["call"][0] * 60.0 >= 6, recent
        path = tmp_path / "async.json"
        traced_cluster.trace_dump(str(path))
        trace = json.loads(path.read_text())
    finally:
        group.close()
    _check_chrome_json(trace)
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    pid_of = {name.split()[-1].split("@")[0]: pid for pid, name in names.items()}
    driver, worker = pid_of["driver"], pid_of["aecho:0"]
    calls = [e for e in events if e["pid"] == driver and e.get("cat") == "call"
             and e["ph"] == "b" and e["args"].get("peer") == "aecho:0"]
    assert sorted(e["name"] for e in calls) == ["echo"] * 5 + ["fail"]
    (failed,) = [e for e in calls if e["name"] == "fail"]
    assert "boom" in failed["args"]["error"]
    starts = {e["id"] for e in events if e["ph"] == "s" and e["pid"] == driver}
    ends = {e["id"] for e in events if e["ph"] == "f" and e["pid"] == worker}
    assert len(starts & ends) >= 6
    execs = [e["name"] for e in events if e["pid"] == worker and e.get("cat") == "exec"]
    assert sorted(execs) == ["echo"] * 5 + ["fail"], execs


class Marker(aiorl.Worker):
    def mark_many(self, n: int) -> int:
        for i in range(n):
            aiorl.mark("bulk", i=i, note="x" * 20)
        return n


def test_a_trace_larger_than_a_message_header_is_pulled(traced_cluster, tmp_path):
    """A worker's buffer of tens of thousands of spans is far beyond the 1 MiB a header may
    hold: the pull carries it as a payload frame (it was once dropped as malformed)."""
    marks = 40_000
    marker = Marker.create_group().launch(traced_cluster, num_workers=1, name="marker")
    try:
        assert marker.mark_many(marks).wait(60) == [marks]
        path = tmp_path / "big.json"
        traced_cluster.trace_dump(str(path))
        trace = json.loads(path.read_text())
    finally:
        marker.close()
    assert sum(1 for e in trace["traceEvents"] if e.get("name") == "bulk") == marks
