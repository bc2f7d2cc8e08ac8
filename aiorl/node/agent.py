"""The node agent (``aiorl-node``): joins the registry, spawns and supervises workers.

One agent runs per machine. It reports the machine's resources to the registry,
keeps it informed with heartbeats, and serves three operations:

* ``spawn``: start worker processes (forked from the warm zygote, see
  `aiorl.node.zygote`) with the environment and placement the driver chose;
* ``kill_group``: stop every worker of a group (SIGTERM, then SIGKILL);
* ``kill_workers``: stop some ranks of a group (an elastic group shrinking);
* ``free_port``: a free TCP port on this machine (for ``MASTER_PORT``).
* ``relay_p2p``: forward a worker's point-to-point message toward a worker of any node
  (`aiorl.node.p2p_relay`: all-to-all p2p without a connection per pair).

When a worker exits, the agent tells the registry its exit code, the signal
that killed it and the last lines of its output, which reach the owner as the
reason in [`PeerLostError`][aiorl.PeerLostError] or [`WorkerInitError`][aiorl.WorkerInitError].

No orphans: workers die with the zygote, the zygote with the agent
(``PR_SET_PDEATHSIG``), and on a clean stop the agent kills each worker's
process group. Started by an embedded ``Cluster``, the agent also exits when
its standard input closes (the driver died).

No split brain: an agent whose heartbeats have gone unanswered for two of its
lease's expiries, and whose connection to the registry is down (a registry that
is slow but alive keeps it up: `aiorl.transport.link`), kills its workers itself.
The registry declares the node dead after one expiry, and owners restart its
workers elsewhere only after the second, so no worker of a node the registry
declared dead acts beside its replacement; workers the registry declared dead
while the agent waited for it are stopped when it answers again.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import glob
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

from aiorl.errors import AddressError, AiorlError, ProtocolError, RegistryUnavailable
from aiorl.node.call_relay import CallRelay
from aiorl.node.logdirs import (  # noqa: F401 - KEPT_ENDED_AGENT_LOGS: read here too
    KEPT_ENDED_AGENT_LOGS,
    LANES,
    agent_logs_parent,
    remove_ended_agent_files,
)
from aiorl.node.node_workers import NodeWorker, NodeWorkers
from aiorl.node.p2p_relay import P2PRelay
from aiorl.node.visible_devices import physical_visible_devices
from aiorl.node.working_dirs import WorkingDirCache
from aiorl.node.zygote import encode_message, read_message, write_message
from aiorl.protocol.fields import Fields
from aiorl.protocol.ops import AgentOp, DriverOp, WorkerOp, WorkerState
from aiorl.protocol.registry import (
    FENCE_FACTOR,
    GroupRef,
    GroupSpec,
    NodeInfo,
    NodeRegistration,
    WorkerExit,
    parse_worker_info,
)
from aiorl.protocol.spawn import HostNode, SpawnReply, SpawnRequest, WorkerLaunch, WorkerSpawn
from aiorl.registry.client import INCARNATION_VARIABLE, RegistryClient
from aiorl.runtime.descriptors import check_descriptors_for
from aiorl.transport import security
from aiorl.transport.address import normalize_address
from aiorl.transport.endpoint import Endpoint, Incoming
from aiorl.transport.lane_setup import LANE_DIR_VAR
from aiorl.transport.link import LinkWatch
from aiorl.transport.sockets import local_ip
from aiorl.util.limits import raise_open_file_limit
from aiorl.util.memory import trim_memory
from aiorl.util.pidfile import PidFileError, pid_file
from aiorl.util.processes import python_module_command
from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["NodeAgent", "detect_accelerators", "main"]

log = logging.getLogger("aiorl.node")
#: What members can repeat (a malformed message) is logged once a second at most, with a count.
_warn = RateLimitedLog(log)

STDERR_TAIL_LINES = 20
OUTPUT_INTERVAL_S = 0.2
OUTPUT_CHUNK_BYTES = 1 << 20
#: Once the agent has forwarded nothing for others (relayed p2p, relayed calls) for this long,
#: it hands its allocator's free pages back (`aiorl.util.memory`), once. Not while traffic
#: flows: the pages of one relayed 64 MB message serve the next, and trimming between them
#: made each fault its pages in again (relayed 64 MB one way measured 1.3-1.8x slower).
TRIM_QUIET_S = 0.5
KILL_GRACE_S = 1.0
FENCE_CHECK_S = 0.1
#: A registry that answers no heartbeat but whose connection stays up (stopped, swapping, a
#: long loop turn) is waited for up to this many expiries (60 s by default) before the
#: workers are fenced anyway: how long a node may run with a registry that hangs.
STALLED_REGISTRY_FACTOR = 20


def detect_accelerators() -> tuple[int, str]:
    """Count NVIDIA GPUs without importing torch (the agent must start fast)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)]
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        return (len(ids), "cuda") if ids and devices else (0, "cpu")
    return (len(devices), "cuda") if devices else (0, "cpu")


def tail_lines(path: str, n: int = STDERR_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-n:])


class NodeAgent:
    def __init__(
        self,
        registry: str,
        *,
        host: str,
        node_rank: int | None,
        accelerators: int | None,
        hardware: dict[str, int],
        labels: dict[str, str],
        log_dir: str,
        keys: security.ClusterKeys | None,
        listen: str | None = None,
        owns_log_dir: bool = False,
    ) -> None:
        self.registry_address = registry
        self.host = host
        #: The cluster's keys: given to our endpoint and, over the zygote's private
        #: channel, to every worker (never through an environment variable).
        self.keys = keys
        #: Where this agent and its workers bind: ``ipc://DIR`` (embedded) or the node's IP.
        self.listen = listen or host
        #: A log directory this agent made for itself is removed on a clean stop.
        self.owns_log_dir = owns_log_dir
        self.node_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.requested_rank = node_rank
        detected, acc_type = detect_accelerators()
        self.num_accelerators = detected if accelerators is None else accelerators
        self.accelerator_type = acc_type if accelerators is None or detected else "declared"
        self.hardware = hardware
        self.labels = labels
        self.log_dir = log_dir
        #: Every worker of this node, spawning to ready (`aiorl.node.node_workers`).
        self.workers = NodeWorkers()
        #: The groups of our workers, with their owners: a restarted registry learns them
        #: from our registration, so it can expire a group whose driver died meanwhile.
        self.groups: dict[str, GroupSpec] = {}
        self.node_rank = -1
        self._spawn_waiters: dict[int, asyncio.Future[int]] = {}
        self._spawn_ids = iter(range(1, 1 << 62))
        self._zygote_ready: asyncio.Future[None] | None = None
        #: One spawn message at a time on the zygote channel: a large one is written in
        #: pieces as the zygote reads, and two must not interleave.
        self._zygote_write = asyncio.Lock()
        self._stopped = asyncio.Event()
        #: Seconds without an answered heartbeat after which the registry declares us dead.
        self._expiry = 3.0

    # ------------------------------------------------------------------ startup
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.endpoint = Endpoint(f"node-{self.node_id}", host=self.listen, keys=self.keys)
        self.registry = RegistryClient(self.endpoint, self.registry_address)
        self.endpoint.handle(AgentOp.SPAWN, self._on_spawn)
        self.endpoint.handle(AgentOp.KILL_GROUP, self._on_kill_group)
        self.endpoint.handle(AgentOp.KILL_WORKERS, self._on_kill_workers)
        self.endpoint.handle(AgentOp.FREE_PORT, lambda m: m.reply({"port": _free_port(self.host)}))
        self.endpoint.handle(AgentOp.PING, lambda m: m.reply(self.status()))
        self.endpoint.handle(AgentOp.WORKER_READY, self._on_worker_ready)
        # Relayed messages and calls go only to the endpoints of this node's ready workers
        # (an address nobody serves would open a connection that is never closed).
        self.call_relay = CallRelay(self.endpoint, self.workers.serves)
        self.endpoint.handle(AgentOp.RELAY_CALL, self.call_relay.on_relay_call)
        self.p2p_relay = P2PRelay(self.endpoint, self.node_id, self.registry.nodes,
                                  self.workers.is_local, starting=self.workers.pending,
                                  exited=self.workers.exited_at)
        self.workers.on_ready(lambda info: self.p2p_relay.worker_ready(info.endpoint))
        self.workers.on_ready(lambda info: self.call_relay.worker_ready(info.name))
        self.endpoint.handle(AgentOp.RELAY_P2P, self.p2p_relay.on_relay_p2p)
        self.working_dirs = WorkingDirCache(os.path.join(self.log_dir, "working_dirs"),
                                            self.workers.groups)
        self.endpoint.handle(AgentOp.WORKING_DIR, self.working_dirs.on_offer)
        self._zygote_ready = loop.create_future()
        self._start_zygote()
        #: Whether the registry's connection is up: tells a slow registry from a dead one.
        self._link = LinkWatch(f"node-{self.node_id}", self.registry_address, self.keys)
        self._link.start()
        await self._register()
        # Relayed p2p forwards to the listed nodes' agents, and closes the connection to
        # a node declared dead (what was queued toward it is freed at once).
        await self.registry.watch_nodes(self.p2p_relay.on_nodes)
        self.registry.start_heartbeats(self.node_id, self._heartbeat_interval, self._rejoin,
                                       expiry=self._expiry)
        self._output_task = loop.create_task(self._forward_output_forever())
        self._fence_task = loop.create_task(self._fence_forever())
        self._trim_task = loop.create_task(self._trim_forever())

    def status(self) -> dict[str, Any]:
        """What a ``ping`` answers: this node, its workers by state (`NodeWorkers.status`),
        and what its p2p relay could not deliver (messages whose senders were told, credits
        or counts for senders gone): the doctor's and the tests' view of the agent."""
        return {"node_id": self.node_id, "workers": self.workers.status(),
                "relay_undelivered": self.p2p_relay.undelivered,
                "relay_stray_back": self.p2p_relay.stray_back}

    async def _trim_forever(self) -> None:
        """Give the system back the memory of frames forwarded and freed, once the relays
        have been quiet for ``TRIM_QUIET_S`` (a trim costs about 2 µs)."""
        last, trimmed = -1, True
        while True:
            await asyncio.sleep(TRIM_QUIET_S / 2)
            moved = self.p2p_relay.moved + self.call_relay.moved
            if moved != last:
                last, trimmed, quiet_since = moved, False, time.monotonic()
            elif not trimmed and time.monotonic() - quiet_since >= TRIM_QUIET_S:
                trim_memory()
                trimmed = True

    # ------------------------------------------------------------------ fencing
    async def _fence_forever(self) -> None:
        """Kill our workers once the registry has not answered for ``FENCE_FACTOR`` expiries
        and its connection is down.

        After one expiry the registry has declared this node dead (if it is alive and we
        are cut off from it); owners restart its workers elsewhere only after the rest of
        the fence time, so ours never act beside their replacements. A registry that is
        merely restarting answers again sooner, and then nothing is lost
        (docs/failures.md). A registry whose connection stays up is slow, not dead (a
        dead process's connection is reset at once, a partition's within about 3 s of TCP
        keep-alive): it is waited for up to ``STALLED_REGISTRY_FACTOR`` expiries; it
        declares nobody dead while it answers nothing, and whom it declared dead once it
        answers again is stopped then (`_rejoin`): fencing after two expiries of a registry
        merely held up for seconds would have every agent SIGKILL every worker."""
        fenced = False
        waiting = False
        while True:
            await asyncio.sleep(FENCE_CHECK_S)
            silent = time.monotonic() - self.registry.last_answered
            if silent <= FENCE_FACTOR * self._expiry:
                fenced = waiting = False
                continue
            if self._link.up and silent <= STALLED_REGISTRY_FACTOR * self._expiry:
                if not waiting and len(self.workers):
                    log.warning("no answer from the registry for %.1f s (its expiry is %.1f s), "
                                "but its connection is up: it is slow, not gone; this node's "
                                "workers keep running (for up to %.0f s)", silent, self._expiry,
                                STALLED_REGISTRY_FACTOR * self._expiry)
                waiting = True
                continue
            victims = self.workers.running()
            if victims and not fenced:
                log.warning("no answer from the registry for %.1f s (its expiry is %.1f s): "
                            "stopping this node's %d worker(s), which it has declared dead "
                            "if it is alive",
                            silent, self._expiry, len(victims))
            fenced = True
            for c in victims:
                _signal_group(c.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ worker output
    async def _forward_output_forever(self) -> None:
        """Stream new lines of workers' output to the drivers that asked (like Ray's
        log_to_driver), a few times a second."""
        while True:
            await asyncio.sleep(OUTPUT_INTERVAL_S)
            for child in self.workers.running():
                self._forward_output(child)

    def _forward_output(self, child: NodeWorker) -> None:
        if child.output_to is None:
            return
        try:
            with open(child.log_path, "rb") as f:
                f.seek(child.output_offset)
                data = f.read(OUTPUT_CHUNK_BYTES)
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # whole lines only; the rest waits for its newline
        if end == 0:
            return
        child.output_offset += end
        lines = data[:end].decode("utf-8", "replace").splitlines()
        try:
            self.endpoint.send_oneway(child.output_to, DriverOp.WORKER_OUTPUT,
                                      {"name": child.name, "pid": child.pid, "lines": lines})
        except Exception:
            child.output_to = None  # the driver is gone; keep the output in the file only

    async def _rejoin(self) -> None:
        """The registry did not know us (it restarted, or it declared this node dead, e.g.
        after a stall of its own or of ours): register again, then stop the workers it holds
        dead. Their owners were told they died and restart them elsewhere; left running they
        would act beside their replacements."""
        rejoining = self.node_rank >= 0
        await self._register()
        if not rejoining:
            return
        # One request per group, not per worker: every agent asks this right after a
        # registry restart.
        for group in {c.group for c in self.workers if c.info is not None}:
            try:
                records = (await self.registry.lookup_group(group)).workers
            except AiorlError:
                continue  # not known (it closed) or no answer: nothing says it is dead
            for child in [c for c in self.workers.running() if c.group == group]:
                record = records.get(child.name)
                if record is None or child.info is None:
                    continue
                if record.incarnation > child.incarnation or (
                        record.incarnation == child.incarnation
                        and record.state == WorkerState.DEAD):
                    log.warning("the registry holds %s (pid %d) dead: stopping it",
                                child.name, child.pid)
                    _signal_group(child.pid, signal.SIGKILL)

    async def _register(self) -> None:
        wanted = self.requested_rank if self.node_rank < 0 else self.node_rank
        node = NodeInfo(
            node_id=self.node_id,
            endpoint=self.endpoint.address,
            node_rank=-1 if wanted is None else wanted,
            ip=self.host,
            hostname=socket.gethostname(),
            cpus=os.cpu_count() or 1,
            num_accelerators=self.num_accelerators,
            accelerator_type=self.accelerator_type,
            hardware=self.hardware,
            labels=self.labels,
            pid=os.getpid(),
        )
        live_groups = self.workers.groups()
        owned = tuple(spec for name, spec in self.groups.items() if name in live_groups)
        reply = await self.registry.register_node(NodeRegistration(node, owned))
        rejoined = self.node_rank >= 0
        self.node_rank = reply.node_rank
        self._heartbeat_interval = reply.lease.heartbeat_interval
        self._expiry = reply.lease.expiry
        self.registry.last_answered = time.monotonic()
        log.info("joined %s as node rank %d", self.registry_address, self.node_rank)
        if rejoined:
            await self._replay_workers()

    async def _replay_workers(self) -> None:
        """After a registry restart: report our live workers again and tell them to re-watch.
        (Exits it missed while down are retried by _report_exit.)"""
        for child in self.workers:
            if child.info is None:
                continue
            await self.registry.report_state(child.info, WorkerState.READY,
                                             incarnation=child.incarnation)
            try:
                self.endpoint.send_oneway(child.info.endpoint, WorkerOp.REGISTRY_RESTARTED)
            except Exception:
                log.debug("could not notify %s of the registry restart", child.name)

    def _on_worker_ready(self, msg: Incoming) -> None:
        try:
            info = parse_worker_info(Fields(msg.meta, "worker_ready").nested("info"))
        except ProtocolError as exc:
            _warn.warning("worker_ready", "ignored a malformed worker_ready: %s", exc)
            return
        if self.workers.ready(info) is None:
            _warn.warning("worker_ready_stale", "ignored the ready message of %s (pid %d): no "
                          "worker of that name is starting on this node (it exited already)",
                          info.name, info.pid)

    def _start_zygote(self) -> None:
        ours, theirs = socket.socketpair()
        self._zygote_channel = ours
        self.zygote = subprocess.Popen(
            python_module_command("aiorl.node.zygote", str(theirs.fileno()), str(os.getpid())),
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        # What every worker shares and must not inherit through its environment.
        write_message(ours, ("session", self.keys, self.listen))
        ours.setblocking(False)
        asyncio.get_running_loop().add_reader(ours.fileno(), self._on_zygote_readable)

    def _on_zygote_readable(self) -> None:
        # Messages are small and written whole; switch to blocking just to read one.
        self._zygote_channel.setblocking(True)
        try:
            msg = read_message(self._zygote_channel)
        finally:
            self._zygote_channel.setblocking(False)
        if msg is None:
            asyncio.get_running_loop().remove_reader(self._zygote_channel.fileno())
            if not self._stopped.is_set():
                code = self.zygote.wait()
                reason = f"the node's zygote process exited with code {code}"
                assert self._zygote_ready is not None
                if not self._zygote_ready.done():
                    reason += (" before it was ready: it could not preload the worker runtime "
                               "(its traceback is on this node agent's stderr)")
                log.error("%s", reason)
                if not self._zygote_ready.done():
                    self._zygote_ready.set_exception(OSError(reason))
                    self._zygote_ready.exception()  # retrieved: spawns re-raise it
                self._fail_spawns(reason)
                self._stopped.set()
            return
        kind = msg[0]
        if kind == "ready":
            assert self._zygote_ready is not None
            if not self._zygote_ready.done():
                self._zygote_ready.set_result(None)
        elif kind == "spawned":
            # Recorded here, in the zygote's order: its report of this child's exit, and
            # the child's own ready message, may come before the spawn request resumes.
            self.workers.forked(msg[1], msg[2])
            fut = self._spawn_waiters.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_result(msg[2])
        elif kind == "spawn_failed":
            self.workers.fork_failed(msg[1])
            fut = self._spawn_waiters.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_exception(OSError(f"fork failed: {msg[2]}"))
        elif kind == "exited":
            self._on_child_exit(msg[1], msg[2])

    def _fail_spawns(self, reason: str) -> None:
        for spawn_id, fut in self._spawn_waiters.items():
            self.workers.fork_failed(spawn_id)
            if not fut.done():
                fut.set_exception(OSError(reason))
        self._spawn_waiters.clear()

    # ------------------------------------------------------------------ spawning
    def _on_spawn(self, msg: Incoming) -> None:
        request = SpawnRequest.from_wire(msg.meta)  # ProtocolError: answered by the endpoint
        payload = bytes(msg.frames[0]) if msg.frames else b""
        task = asyncio.get_running_loop().create_task(self._spawn(request, payload))

        def answer(t: asyncio.Task[list[int]]) -> None:
            if t.cancelled():
                return  # the agent is shutting down; the caller learns it from the registry
            error = t.exception()
            if error is not None:
                msg.reply_error(error)
            else:
                msg.reply(SpawnReply(tuple(t.result())).to_wire())

        task.add_done_callback(answer)

    async def _spawn(self, request: SpawnRequest, payload: bytes) -> list[int]:
        assert self._zygote_ready is not None
        await self._zygote_ready
        request = self.working_dirs.prepare(request)  # a shipped working directory, if any
        os.makedirs(self.log_dir, mode=0o700, exist_ok=True)  # worker output is private
        self.groups[request.group] = request.group_spec()
        node = HostNode(self.node_id, self.node_rank, self.host, socket.gethostname(),
                        self.accelerator_type, self.endpoint.address)
        check_descriptors_for(len(self.workers) + len(request.workers))
        loop = asyncio.get_running_loop()
        specs: list[tuple[WorkerSpawn, asyncio.Future[int]]] = []
        spawn_ids: list[int] = []
        messages = []
        for launch in request.workers:
            launch = self._with_physical_devices(launch)
            # The group name's grammar (aiorl.names) keeps this path inside log_dir.
            log_path = os.path.join(self.log_dir, f"{request.group}_{launch.rank}.log")
            spec = WorkerSpawn(launch, request.group, request.world_size, payload,
                               self.registry_address, node, log_path)
            # A restart replaces an earlier process of this name that may still run here
            # (its death was declared while it lived on): never two of one name.
            self._kill([c for c in self.workers.running() if c.name == spec.name
                        and c.incarnation < _incarnation_of(launch.env)])
            spawn_id = next(self._spawn_ids)
            spawn_ids.append(spawn_id)
            self.workers.expect(spawn_id, spec.name, request.group, log_path,
                                incarnation=_incarnation_of(launch.env),
                                output_to=request.output_to)
            fut: asyncio.Future[int] = loop.create_future()
            self._spawn_waiters[spawn_id] = fut
            specs.append((spec, fut))
            messages.append(encode_message(("spawn", spawn_id, spec)))
        # Every fork of the request is asked for at once (one write), not one round trip
        # per worker: the zygote forks them back to back while the first children start
        # (256 workers: ~0.5 s less to the first answer). The channel is non-blocking
        # (its reads run on the loop): sendall would raise after a partial write when the
        # zygote is busy and the message is larger than the socket buffer (a few hundred
        # KiB of constructor arguments), leaving the zygote a torn message and this node
        # unable to start any worker again.
        try:
            async with self._zygote_write:
                await loop.sock_sendall(self._zygote_channel, b"".join(messages))
        except BaseException:
            # The zygote never got the request: nothing of it will start.
            for spawn_id in spawn_ids:
                self._spawn_waiters.pop(spawn_id, None)
                self.workers.fork_failed(spawn_id)
            raise
        outcomes = await asyncio.gather(*(fut for _, fut in specs), return_exceptions=True)
        # Every forked child is in the table (recorded as the zygote reported it), and
        # ours to supervise even when a sibling's fork failed.
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            raise failures[0]
        return [o for o in outcomes if not isinstance(o, BaseException)]

    def _with_physical_devices(self, launch: WorkerLaunch) -> WorkerLaunch:
        """``launch`` with its local GPU indices mapped through this agent's own
        ``CUDA_VISIBLE_DEVICES`` (aiorl.node.visible_devices)."""
        requested = launch.env.get("CUDA_VISIBLE_DEVICES")
        if requested is None:
            return launch
        physical = physical_visible_devices(
            requested, os.environ.get("CUDA_VISIBLE_DEVICES"), self.num_accelerators)
        if physical == requested:
            return launch
        return dataclasses.replace(launch, env={**launch.env, "CUDA_VISIBLE_DEVICES": physical})

    def _on_child_exit(self, pid: int, status: int) -> None:
        child = self.workers.exited(pid)
        if child is None or self._stopped.is_set():
            return  # shutting down: the registry learns from unregister_node instead
        if child.group not in self.workers.groups():
            self.groups.pop(child.group, None)  # none of its workers left here
        self._forward_output(child)  # its last words reach the driver before the news
        exit_code = os.waitstatus_to_exitcode(status)
        sig = -exit_code if exit_code < 0 else 0
        tail = tail_lines(child.log_path)
        how = f"killed by {signal.Signals(sig).name}" if sig else f"exited with code {exit_code}"
        log.info("worker %s (pid %d) %s", child.name, pid, how)
        self.call_relay.worker_exited(child.name, child.info.endpoint if child.info else None,
                                 f"worker {child.name} (pid {pid}) {how}")
        if child.info is not None:
            self.p2p_relay.worker_exited(child.info.endpoint)
        report = WorkerExit(child.name, pid, exit_code, sig, tail,
                            f"worker {child.name} (pid {pid}) {how}", child.incarnation)
        asyncio.get_running_loop().create_task(self._report_exit(report))

    async def _report_exit(self, report: WorkerExit) -> None:
        """Tell the registry; while it is unreachable (restarting), retry every second."""
        while not self._stopped.is_set():
            try:
                await self.registry.report_exit(report, timeout=5)
                return
            except RegistryUnavailable as exc:
                log.warning("could not report %s's exit yet (%s); retrying", report.address, exc)
                await asyncio.sleep(1.0)
            except AiorlError as exc:  # refused: retrying would be refused again
                log.error("the registry refused the exit report of %s: %s", report.address, exc)
                return

    def _on_kill_group(self, msg: Incoming) -> None:
        group = GroupRef.from_wire(msg.meta).group
        victims = [c for c in self.workers.running() if c.group == group]
        self._kill(victims)
        msg.reply({"killed": len(victims)})

    def _on_kill_workers(self, msg: Incoming) -> None:
        f = Fields(msg.meta, "kill_workers")
        names = {f"{f.group_name('group')}:{r}" for r in f.int_list("ranks", hi=1 << 20)}
        victims = [c for c in self.workers.running() if c.name in names]
        self._kill(victims)
        msg.reply({"killed": len(victims)})

    def _kill(self, victims: list[NodeWorker]) -> None:
        pids = [c.pid for c in victims if c.pid is not None]
        for pid in pids:
            _signal_group(pid, signal.SIGTERM)
        if pids:
            asyncio.get_running_loop().call_later(KILL_GRACE_S, self._kill_survivors, pids)

    def _kill_survivors(self, pids: list[int]) -> None:
        for pid in pids:
            if self.workers.by_pid(pid) is not None:
                _signal_group(pid, signal.SIGKILL)

    # ------------------------------------------------------------------ shutdown
    async def run_until_stopped(self, watch_stdin: bool) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopped.set)
        if watch_stdin:
            loop.add_reader(sys.stdin.fileno(), self._on_stdin)
        await self._stopped.wait()
        await self.shutdown()

    def _on_stdin(self) -> None:
        if not os.read(sys.stdin.fileno(), 4096):  # EOF: the driver that started us is gone
            asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
            self._stopped.set()

    async def shutdown(self) -> None:
        self._stopped.set()
        for c in self.workers.running():
            _signal_group(c.pid, signal.SIGKILL)
        try:
            await self.registry.unregister_node(self.node_id, timeout=1.0)
        except Exception:
            pass
        self.p2p_relay.close()
        self.call_relay.close()
        self.registry.close()
        self._link.stop()
        if self.zygote.poll() is None:
            self.zygote.kill()
        try:  # bounded: a zygote stuck in the kernel must not keep its agent from exiting
            self.zygote.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.warning("the zygote (pid %d) did not exit 5 s after SIGKILL; leaving it",
                        self.zygote.pid)
        self.endpoint.close()
        self.working_dirs.close()
        if self.owns_log_dir and os.environ.get("AIORL_KEEP_LOGS") != "1":
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _signal_group(pid: int | None, sig: int) -> None:
    if pid is None:
        return  # not forked yet: no process to signal
    try:
        os.killpg(pid, sig)  # workers lead their own process group (setsid in the zygote)
    except ProcessLookupError:
        pass
    except PermissionError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _incarnation_of(env: Any) -> int:
    """The incarnation a launch environment gives its worker (0 for a first start)."""
    value = str(env.get(INCARNATION_VARIABLE, "0"))
    return int(value) if value.isdigit() else 0


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host != "0.0.0.0" else "", 0))
        return int(s.getsockname()[1])


def _parse_kv(items: list[str], what: str, cast: Any = str) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"aiorl-node: {what} must look like NAME=VALUE, got {item!r}")
        out[key] = cast(value)
    return out


def default_log_dir() -> str:
    """This agent's worker-log directory when ``--log-dir`` is not given: a fresh private
    ``<pid>-<random>`` directory under the one per-user ``<runtime dir>/aiorl-node-logs-<uid>``
    (docs/deploy.md). What ended agents left there is cleaned first
    (`aiorl.node.logdirs.remove_ended_agent_files`: their lanes, and their logs beyond the
    newest `KEPT_ENDED_AGENT_LOGS`), so the total stays bounded."""
    parent = agent_logs_parent()
    try:
        os.makedirs(parent, mode=0o700, exist_ok=True)
        security.check_private_directory(parent)
    except (OSError, AiorlError) as exc:  # someone else's directory: do not use it
        log.warning("not keeping worker logs under %s: %s", parent, exc)
        return security.make_private_directory("aiorl-node-logs-")
    remove_ended_agent_files(parent)
    return tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=parent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiorl-node", description="Run an aiorl node agent.")
    parser.add_argument("--registry", default=os.environ.get("AIORL_REGISTRY"),
                        help="registry address, tcp://HOST:PORT or HOST:PORT (default: "
                             "$AIORL_REGISTRY)")
    parser.add_argument("--ipc-dir", default=None,
                        help="bind this agent's and its workers' sockets as Unix sockets in DIR, "
                             "a 0700 directory of this user (how an embedded Cluster runs)"),
    parser.add_argument("--host", default=None, help="this node's IP as others reach it")
    parser.add_argument("--node-rank", type=int, default=None, help="fixed node rank (stable order)")
    parser.add_argument("--accelerators", type=int, default=None,
                        help="declare N accelerators (default: detect NVIDIA GPUs)")
    parser.add_argument("--hardware", action="append", default=[], metavar="TYPE=COUNT",
                        help="custom hardware on this node, e.g. robot=2 (repeatable)")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--log-dir", default=None,
                        help="where worker logs go (default: a private directory under the "
                             "user's runtime directory, removed when the agent stops)")
    parser.add_argument("--exit-on-stdin-close", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--key-file", default=None,
                        help="the cluster key file written by aiorl-registry (default: "
                             "$AIORL_KEY_FILE or ~/.aiorl/cluster.key)")
    parser.add_argument("--insecure", action="store_true", help="no authentication")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--pid-file", default=None, metavar="PATH",
                        help="write this process's pid to PATH while it runs (stop it with "
                             "kill -TERM \"$(cat PATH)\")")
    args = parser.parse_args(argv)
    keys: security.ClusterKeys | None = None
    if args.insecure or os.environ.get(security.ENV_INSECURE) == "1":
        os.environ[security.ENV_INSECURE] = "1"
    elif args.key_file:
        keys = security.ClusterKeys.load(args.key_file)
    else:
        keys = security.keys_from_environment()
        if keys is None:
            parser.error("no cluster key: pass --key-file (the file aiorl-registry wrote), set "
                         "$AIORL_KEY_FILE, or run everything with --insecure")
    if keys is not None and keys.mechanism == "plain" and args.ipc_dir is None:
        parser.error("the key file says mechanism=plain, which aiorl uses only inside one "
                     "machine (it would send the secret over TCP): use mechanism=curve")
    # The zygote and the workers must not inherit the secret: they get it on a private channel.
    security.scrub_key_variables()
    security.set_process_keys(keys)
    if not args.registry:
        parser.error("--registry (or $AIORL_REGISTRY) is required")
    try:
        args.registry = normalize_address(args.registry, "--registry")  # HOST:PORT is tcp://
    except AddressError as exc:
        parser.error(str(exc))
    host = args.host or (
        "127.0.0.1" if args.registry.startswith(("tcp://127.", "tcp://localhost", "ipc://"))
        else local_ip()
    )
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s [node {host}] %(levelname)s %(message)s")
    soft, hard = raise_open_file_limit()
    log.info("open file limit: %d (hard limit %d)", soft, hard)
    log_dir = args.log_dir or default_log_dir()
    log.info("worker logs go to %s", log_dir)
    lane_dir = None
    if not args.ipc_dir:
        # Workers bound on the node's IP keep their lanes here (transport/lane.py), so the
        # agent relaying a call and the workers' own messages to each other skip ZMQ; the
        # zygote and the workers inherit the variable. Inside the private log directory:
        # whoever removes that (this agent, the Slurm launcher, a later agent's pruning)
        # removes the lanes of an agent that was killed too.
        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        lane_dir = os.path.join(log_dir, LANES)
        os.makedirs(lane_dir, mode=0o700, exist_ok=True)
        os.environ[LANE_DIR_VAR] = lane_dir
    agent = NodeAgent(
        args.registry, host=host, node_rank=args.node_rank, accelerators=args.accelerators,
        hardware=_parse_kv(args.hardware, "--hardware", int), labels=_parse_kv(args.label, "--label"),
        log_dir=log_dir, keys=keys, owns_log_dir=args.log_dir is None,
        listen=f"ipc://{args.ipc_dir}" if args.ipc_dir else None,
    )

    async def run() -> None:
        await agent.start()
        print(f"AIORL_NODE_READY={agent.node_rank}", flush=True)
        await agent.run_until_stopped(args.exit_on_stdin_close)

    import uvloop

    try:
        with pid_file(args.pid_file):
            uvloop.run(run())
    except PidFileError as exc:
        parser.error(str(exc))
    finally:
        if lane_dir is not None:
            shutil.rmtree(lane_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
