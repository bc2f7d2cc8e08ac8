"""Issue 28, "Hardening, round 2": items 2, 4 and 7, the last ones, with real processes.

* 2: a registry that is slow, not dead (stopped here for longer than the fence window)
  no longer has its agents SIGKILL every worker: its connection stays up, so the agents
  wait for it; whom it declares dead once it answers again is stopped then, so no worker
  the registry holds dead keeps running. A registry that is gone still has the workers
  fenced after two expiries: killed (tests/system/test_supervision.py) or behind a partition
  (here, where the machine lets the test make a network namespace).
* 7: ``cluster.trace_dump`` pulls each process's buffer in pages and writes them to the
  file as they come: the driver's peak memory is a page's, not the buffers' (four full
  200,000-span buffers took a driver to 1,053 MB).
* 4: a result larger than the ZMTP heartbeat lets one frame take (2 GiB under CURVE) was
  lost with the connection the receiver dropped, and the call waited for ever. Frames over
  `wire.MAX_FRAME_BYTES` now travel as pieces. The mechanism is shown at a tenth of the
  scale: the receiver's heartbeat timeout and the piece size lowered, a 768 MiB payload;
  the issue's own case (2,047 MiB, defaults) runs under ``AIORL_TEST_HUGE=1``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
import zlib
from typing import Any

import pytest
import uvloop

import aiorl
from aiorl.cluster import doctor
from aiorl.protocol.ops import WorkerState
from aiorl.transport import sockets, wire
from aiorl.transport.endpoint import Endpoint
from aiorl.transport.security import ClusterKeys
from tests._processes import alive, gone_within, wait_listening

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------------------- item 2
class Member(aiorl.Worker):
    def pid(self) -> int:
        return os.getpid()


@pytest.fixture
def processes(tmp_path):
    from tests.system.test_failures import stoppable_processes

    with stoppable_processes(tmp_path) as procs:  # the registry's expiry: 2 s
        yield procs


def test_a_stalled_registry_is_waited_for_and_holds_nobody_dead_for_its_own_stall(processes):
    """A registry stopped for 7 s, longer than the fence window (two expiries, 4 s here):
    before the fix the agent SIGKILLed its worker after 4 s. The registry's connection
    stays up, so now the agent waits: the worker runs and answers its caller for the whole
    stall. When the registry runs again it does not hold its own stall against the node and
    the driver (the heartbeats they sent meanwhile are unread in its sockets): the worker
    stays ready and running. Before, the resumed registry's first sweep declared them dead
    and tore the group down."""
    expiry = 2.0
    with aiorl.Cluster(registry=processes.address, num_nodes=1,
                       key_file=processes.key_file) as c:
        group = Member.create_group().launch(c, num_workers=1, name="patient")
        (pid,) = group.pid().wait(60)
        processes.registry.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        while time.monotonic() - stopped < 3.5 * expiry:
            assert alive([pid]), (f"the worker was stopped {time.monotonic() - stopped:.1f} s "
                                  "into a registry stall")
            assert group.pid().wait(10) == [pid]  # calls do not need the registry
            time.sleep(0.5)
        processes.registry.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        runtime = c.runtime
        while time.monotonic() - resumed < 3 * expiry:  # past any sweep of the stall
            record = runtime.run_sync(runtime.registry.lookup("patient:0", timeout=5), 10)
            assert record.state == WorkerState.READY, (
                f"the resumed registry holds the worker {record.state.value}")
            time.sleep(0.1)
        assert alive([pid]) and group.pid().wait(10) == [pid]


def _can_make_networks() -> bool:
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("unshare")
                                 and shutil.which("nsenter")):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


class _Partitionable:
    """A network namespace joined to this one by a veth pair (10.213.0.1 here, 10.213.0.2
    there), and a switch that cuts it off: blackhole routes both ways drop every packet
    silently, as a partition does (no reset, no ICMP error)."""

    HERE, THERE = "10.213.0.1", "10.213.0.2"

    def __init__(self) -> None:
        self.link = f"a3r{os.getpid() % 100000}"
        self.holder = subprocess.Popen(["unshare", "-n", "sleep", "3600"])
        try:
            deadline = time.monotonic() + 10
            while os.readlink(f"/proc/{self.holder.pid}/ns/net") == os.readlink(
                    "/proc/self/ns/net"):
                assert time.monotonic() < deadline, "unshare made no network namespace"
                time.sleep(0.01)
            self._ip("link", "add", self.link, "type", "veth", "peer", "name", "peer0",
                     "netns", str(self.holder.pid))
            self._ip("addr", "add", f"{self.HERE}/30", "dev", self.link)
            self._ip("link", "set", self.link, "up")
            self._ip("addr", "add", f"{self.THERE}/30", "dev", "peer0", there=True)
            self._ip("link", "set", "peer0", "up", there=True)
            self._ip("link", "set", "lo", "up", there=True)
        except BaseException:
            self.close()
            raise

    def _ip(self, *args: str, there: bool = False) -> None:
        enter = ["nsenter", "-t", str(self.holder.pid), "-n"] if there else []
        subprocess.run([*enter, "ip", *args], check=True, capture_output=True)

    def run_there(self, argv: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["nsenter", "-t", str(self.holder.pid), "-n", *argv])

    def cut(self, on: bool) -> None:
        verb = "add" if on else "del"
        self._ip("route", verb, "blackhole", f"{self.THERE}/32")
        self._ip("route", verb, "blackhole", f"{self.HERE}/32", there=True)

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.link], capture_output=True)
        self.holder.kill()
        self.holder.wait()


@pytest.mark.skipif(not _can_make_networks(),
                    reason="needs root, ip, unshare and nsenter (a network namespace)")
def test_a_registry_behind_a_partition_still_has_the_workers_fenced_in_two_expiries(
        tmp_path, monkeypatch):
    """The agent now waits for a registry whose connection is up; across a partition TCP
    keep-alive gives the connection up within about 3 s, so the fence comes, as documented,
    two expiries (4 s here) after the last answered heartbeat: the registry, alive on the
    other side, declared the node dead after one and restarts nothing before the second."""
    from tests.system.test_failures import stop_processes

    net = _Partitionable()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        key_file = str(tmp_path / "cluster.key")
        ClusterKeys.generate().save(key_file)
        address = f"tcp://{net.THERE}:6380"
        procs.append(net.run_there([
            sys.executable, "-m", "aiorl.registry.service", "--host", net.THERE, "--port",
            "6380", "--log-level", "WARNING", "--key-file", key_file, "--expiry", "2"]))
        wait_listening(address)  # imports take seconds under load; drivers wait 3 s
        monkeypatch.setenv("AIORL_NODE_IP", net.HERE)  # the agent, its workers, the driver
        procs.append(subprocess.Popen([
            sys.executable, "-m", "aiorl.node.agent", "--registry", address, "--node-rank",
            "0", "--log-level", "WARNING", "--key-file", key_file]))
        with aiorl.Cluster(registry=address, num_nodes=1, key_file=key_file) as c:
            group = Member.create_group().launch(c, num_workers=1, name="partitioned")
            (pid,) = group.pid().wait(60)
            net.cut(True)
            cut = time.monotonic()
            assert gone_within([pid], within=10), "a worker cut off from its registry runs on"
            assert 3.4 < time.monotonic() - cut < 6.5  # two expiries (4 s), less the last beat
            net.cut(False)
    finally:
        stop_processes(procs)
        net.close()


# ---------------------------------------------------------------------------- item 4
#: A frame this large takes ~0.5-1.5 s to encrypt under CURVE (more on a loaded machine),
#: longer than the lowered heartbeat timeout below: as one frame it is lost.
_BIG = 768 << 20
#: The piece size the test uses on both sides (a millisecond or two of encryption each:
#: the gaps between whole frames stay far below the timeout even on a loaded machine).
_PIECE = 1 << 20
#: The receiver's ZMTP heartbeat, lowered from 1 s / 3 s (sockets.py) by the same tenfold
#: as the payload is smaller than the issue's 2,047 MiB.
_PING_MS, _TIMEOUT_MS = 100, 400


def _payload(size: int) -> bytes:
    """Bytes that differ everywhere: pieces joined out of order would change the checksum."""
    return os.urandom(size)


def _big_server(q: Any, keys: ClusterKeys, piece: int, size: int) -> None:
    wire.MAX_FRAME_BYTES = piece  # what AIORL_MAX_FRAME_BYTES sets at import

    async def main() -> None:
        ep = Endpoint("big-server", keys=keys, host="127.0.0.1")
        payload = _payload(size)
        ep.handle("big", lambda m: m.reply({"crc": zlib.crc32(payload)}, [b"head", payload]))
        ep.handle("sink", lambda m: m.reply({"sizes": [len(memoryview(f)) for f in m.frames],
                                             "crc": zlib.crc32(m.frames[-1])}))
        q.put(ep.address)
        await asyncio.sleep(3600)

    uvloop.run(main())


def test_a_result_larger_than_a_heartbeat_allows_arrives_under_curve(monkeypatch):
    """Under CURVE libzmq encrypts a frame whole before its first byte leaves; a DEALER that
    sees no whole frame within its heartbeat timeout drops the connection, and the reply in
    it is gone. Before the fix the 768 MiB reply here never came (the request timed out);
    in pieces it arrives whole, both ways, and the connection keeps serving."""
    monkeypatch.setattr(sockets, "ZMTP_HEARTBEAT_IVL_MS", _PING_MS)
    monkeypatch.setattr(sockets, "ZMTP_HEARTBEAT_TIMEOUT_MS", _TIMEOUT_MS)
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", _PIECE)
    keys = ClusterKeys.generate("curve")
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    server = ctx.Process(target=_big_server, args=(q, keys, _PIECE, _BIG), daemon=True)
    server.start()
    try:
        address = q.get(timeout=60)

        async def client() -> None:
            ep = Endpoint("big-client", keys=keys, host="127.0.0.1")
            try:
                meta, frames = await ep.request(address, "big", timeout=30)
                assert [len(f) for f in frames] == [4, _BIG]
                assert zlib.crc32(frames[1]) == meta["crc"]
                del frames
                sent = _payload(_BIG // 4 + 12345)  # a ragged last piece, the other way
                meta, _ = await ep.request(address, "sink", frames=[b"x", sent], timeout=60)
                assert meta == {"sizes": [1, len(sent)], "crc": zlib.crc32(sent)}
                meta, _ = await ep.request(address, "sink", frames=[b"small"], timeout=10)
                assert meta["sizes"] == [5]
            finally:
                ep.close()

        uvloop.run(client())
    finally:
        server.kill()
        server.join(10)


class Producer(aiorl.Worker):
    def tensor(self, mib: int) -> Any:
        import torch

        return torch.ones(mib << 20, dtype=torch.uint8)


@pytest.mark.skipif(os.environ.get("AIORL_TEST_HUGE") != "1",
                    reason="moves a 2,047 MiB result (about 7 GB of memory at the peak): "
                           "AIORL_TEST_HUGE=1 runs it")
def test_a_2047_mib_tensor_result_reaches_the_driver_under_curve(tmp_path):
    """The issue's case at full size, defaults everywhere: a worker's 2,047 MiB tensor
    result over CURVE (attach mode) never reached the driver; it arrives now."""
    from tests.system.test_failures import ClusterProcesses

    procs = ClusterProcesses(tmp_path, nodes=1)
    try:
        with aiorl.Cluster(registry=procs.address, num_nodes=1, key_file=procs.key_file) as c:
            group = Producer.create_group().launch(c, num_workers=1, name="producer")
            try:
                (result,) = group.tensor(2047).wait(300)
                assert result.numel() == 2047 << 20 and bool(result[-1] == 1)
                del result
            finally:
                group.close()
    finally:
        procs.close()


def test_split_frames_are_views_and_join_refuses_counts_that_do_not_match(monkeypatch):
    """The sending side copies nothing (pieces are views of the frame); a SPLIT whose counts
    do not describe its frames is a ProtocolError, as for BATCH and PACKED."""
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 10)
    big = bytearray(os.urandom(25))
    frames = wire.split_frames([b"head", big, b"tail"])
    header = wire.decode_header(frames[0])
    assert header.kind == wire.Kind.SPLIT and header.meta == [1, 3, 1]
    big[0] ^= 0xFF  # a view sees the change; a copy would not
    assert bytes(frames[2])[0] == big[0]
    assert wire.join_frames(header.meta, frames[1:]) == [b"head", big, b"tail"]
    assert not wire.oversized([b"x" * 10]) and wire.oversized([b"x" * 11])
    for counts in ([1, 3], [1, 3, 2], [1, 0, 4], "5", [], [1, 3.0, 1]):
        with pytest.raises(wire.ProtocolError):
            wire.join_frames(counts, frames[1:])


# ---------------------------------------------------------------------------- item 7
class Tracer(aiorl.Worker):
    def fill(self, n: int) -> int:
        """Fill this process's trace buffer with ``n`` finished spans."""
        from aiorl.trace import recorder

        recorder.enable()
        t0 = recorder.now()
        for i in range(n):
            recorder.record("user", "filler", t0 + i, None, i, True, None, None, None, False)
        return n


def test_a_trace_dump_holds_a_page_at_a_time_not_the_buffers(tmp_path, monkeypatch):
    """Two workers with 100,000 spans each: the old pull decoded both buffers whole and built
    every event in memory before writing (a peak of hundreds of MB in the driver); pulled in
    pages of 2,000 spans and streamed to the file, the driver's Python allocations peak at a
    few MB, and the file holds every span, as valid Chrome JSON."""
    spans = 100_000
    monkeypatch.setattr(doctor, "TRACE_PAGE_SPANS", 2_000)
    with aiorl.Cluster(num_nodes=1) as c:
        group = Tracer.create_group().launch(c, num_workers=2, name="tracers")
        try:
            assert group.fill(spans).wait(120) == [spans, spans]
            path = tmp_path / "trace.json"
            tracemalloc.start()
            try:
                summary = c.trace_dump(str(path), timeout=30)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            # The command line pulls the same way (a second pull: refilled, then dumped).
            assert group.fill(1_000).wait(120) == [1_000, 1_000]
            key_file = c._embedded.key_file if c._embedded and c.keys else None
            cli = subprocess.run(
                [sys.executable, "-m", "aiorl.cli.main", "trace", "dump", "-o",
                 str(tmp_path / "cli.json"), "--registry", c.registry_address,
                 *(["--key-file", key_file] if key_file else [])],
                capture_output=True, text=True, timeout=120)
            assert cli.returncode == 0, cli.stderr
            with open(tmp_path / "cli.json") as f:
                dumped = json.load(f)["traceEvents"]
            assert sum(e.get("name") == "filler" for e in dumped) == 2_000
        finally:
            group.close()
    assert summary["processes"] >= 3 and summary["spans"] >= 2 * spans  # and the driver
    assert peak < 24 << 20, f"the driver's peak while dumping: {peak / 2**20:.0f} MiB"
    with open(path) as f:
        trace = json.load(f)
    fillers = [e for e in trace["traceEvents"] if e.get("name") == "filler"]
    assert len(fillers) == 2 * spans
    assert trace["otherData"]["processes"] == summary["processes"]
    named = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {"node0 tracers:0", "node0 tracers:1"} <= named
    # Pages continue one another: every span of a process has its own place, in order.
    for rank_pid in {e["pid"] for e in fillers}:
        sizes = [e["args"]["bytes"] for e in fillers if e["pid"] == rank_pid and "bytes" in e["args"]]
        assert sizes == list(range(1, spans))


def test_a_pull_in_pages_takes_the_buffer_once_and_an_abandoned_one_is_not_lost():
    """``first`` takes what the buffer holds (spans recorded later wait for the next pull);
    pages come oldest first and say whether more remain; what a pull that stopped midway
    left is the start of the next pull, not lost."""
    from aiorl.trace import recorder

    was = recorder.ON
    recorder.enable()
    recorder.drain()
    recorder.drain_page(True, 1 << 30)  # a pull another test may have left midway
    try:
        t0 = recorder.now()
        for i in range(5):
            recorder.record("user", "early", t0, None, i, True, None, None, None, False)
        first = recorder.drain_page(True, 2)
        assert [s[7] for s in first["spans"]] == [0, 1] and first["more"]
        assert "clock_ns" in first and "threads" in first
        recorder.record("user", "late", t0, None, 9, True, None, None, None, False)
        page = recorder.drain_page(False, 2)
        assert [s[7] for s in page["spans"]] == [2, 3] and page["more"]
        # The puller goes away here; the next pull starts with what it left.
        again = recorder.drain_page(True, 10)
        assert [(s[1], s[7]) for s in again["spans"]] == [("early", 4), ("late", 9)]
        assert not again["more"] and recorder.drain_page(False, 10) == {"spans": [],
                                                                          "more": False}
    finally:
        recorder.drain()
        if not was:
            recorder.disable()
