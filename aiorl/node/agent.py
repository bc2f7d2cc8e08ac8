"""The node agent (``aiorl-node``): joins the registry, spawns and supervises workers.

One agent runs per machine. It reports the machine's resources to the registry,
keeps it informed with heartbeats, and serves three operations:

* ``spawn``: start worker processes (forked from the warm zygote, see
  :mod:`aiorl.node.zygote`) with the environment and placement the driver chose;
* ``kill_group``: stop every worker of a group (SIGTERM, then SIGKILL);
* ``free_port``: a free TCP port on this machine (for ``MASTER_PORT``).

When a worker exits, the agent tells the registry its exit code, the signal
that killed it and the last lines of its output, which reach the owner as the
reason in :class:`~aiorl.errors.PeerLostError` or :class:`~aiorl.errors.WorkerInitError`.

No orphans: workers die with the zygote, the zygote with the agent
(``PR_SET_PDEATHSIG``), and on a clean stop the agent kills each worker's
process group. Started by an embedded ``Cluster``, the agent also exits when
its standard input closes (the driver died).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiorl.node.zygote import read_message, set_parent_death_signal, write_message
from aiorl.registry.client import RegistryClient
from aiorl.transport import security
from aiorl.transport.endpoint import Endpoint, Incoming
from aiorl.transport.sockets import local_ip

__all__ = ["NodeAgent", "detect_accelerators", "main"]

log = logging.getLogger("aiorl.node")

STDERR_TAIL_LINES = 20
OUTPUT_INTERVAL_S = 0.2
OUTPUT_CHUNK_BYTES = 1 << 20
KILL_GRACE_S = 1.0


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


@dataclass
class _Child:
    name: str
    group: str
    pid: int
    log_path: str
    started: float
    info: dict[str, Any] | None = None  # the worker's WorkerInfo once it reported ready
    output_to: str | None = None  # endpoint of the driver that wants this worker's output
    output_offset: int = 0  # how much of the log file has been forwarded


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
    ) -> None:
        self.registry_address = registry
        self.host = host
        self.node_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.requested_rank = node_rank
        detected, acc_type = detect_accelerators()
        self.num_accelerators = detected if accelerators is None else accelerators
        self.accelerator_type = acc_type if accelerators is None or detected else "declared"
        self.hardware = hardware
        self.labels = labels
        self.log_dir = log_dir
        self.children: dict[int, _Child] = {}
        self.node_rank = -1
        self._spawn_waiters: dict[int, asyncio.Future[int]] = {}
        self._spawn_ids = iter(range(1, 1 << 62))
        self._zygote_ready: asyncio.Future[None] | None = None
        self._stopped = asyncio.Event()

    # ------------------------------------------------------------------ startup
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.endpoint = Endpoint(f"node-{self.node_id}", host=self.host)
        self.registry = RegistryClient(self.endpoint, self.registry_address)
        self.endpoint.handle("spawn", self._on_spawn)
        self.endpoint.handle("kill_group", self._on_kill_group)
        self.endpoint.handle("free_port", lambda m: m.reply({"port": _free_port(self.host)}))
        self.endpoint.handle("ping", lambda m: m.reply({"node_id": self.node_id}))
        self.endpoint.handle("worker_ready", self._on_worker_ready)
        self._zygote_ready = loop.create_future()
        self._start_zygote()
        await self._register()
        self.registry.start_heartbeats(self.node_id, self._heartbeat_interval, self._register)
        self._output_task = loop.create_task(self._forward_output_forever())

    # ------------------------------------------------------------------ worker output
    async def _forward_output_forever(self) -> None:
        """Stream new lines of workers' output to the drivers that asked (like Ray's
        log_to_driver), a few times a second."""
        while True:
            await asyncio.sleep(OUTPUT_INTERVAL_S)
            for child in list(self.children.values()):
                self._forward_output(child)

    def _forward_output(self, child: _Child) -> None:
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
            self.endpoint.send_oneway(child.output_to, "worker_output",
                                      {"name": child.name, "pid": child.pid, "lines": lines})
        except Exception:
            child.output_to = None  # the driver is gone; keep the output in the file only

    async def _register(self) -> None:
        reply = await self.registry.request("register_node", {
            "node_id": self.node_id,
            "node_rank": self.requested_rank if self.node_rank < 0 else self.node_rank,
            "ip": self.host,
            "hostname": socket.gethostname(),
            "cpus": os.cpu_count() or 1,
            "num_accelerators": self.num_accelerators,
            "accelerator_type": self.accelerator_type,
            "hardware": self.hardware,
            "labels": self.labels,
            "endpoint": self.endpoint.address,
            "pid": os.getpid(),
        })
        rejoined = self.node_rank >= 0
        self.node_rank = reply["node_rank"]
        self._heartbeat_interval = reply["heartbeat_interval"]
        log.info("joined %s as node rank %d", self.registry_address, self.node_rank)
        if rejoined:
            await self._replay_workers()

    async def _replay_workers(self) -> None:
        """After a registry restart: report our live workers again and tell them to re-watch.
        (Exits it missed while down are retried by _report_exit.)"""
        for child in list(self.children.values()):
            if child.info is None:
                continue
            await self.registry.request("worker_state", {"info": child.info, "state": "ready"})
            try:
                self.endpoint.send_oneway(child.info["endpoint"], "registry_restarted")
            except Exception:
                log.debug("could not notify %s of the registry restart", child.name)

    def _on_worker_ready(self, msg: Incoming) -> None:
        info = msg.meta["info"]
        for child in self.children.values():
            if child.pid == info.get("pid"):
                child.info = info

    def _start_zygote(self) -> None:
        ours, theirs = socket.socketpair()
        self._zygote_channel = ours
        self.zygote = subprocess.Popen(
            [sys.executable, "-m", "aiorl.node.zygote", str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
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
            fut = self._spawn_waiters.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_result(msg[2])
        elif kind == "spawn_failed":
            fut = self._spawn_waiters.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_exception(OSError(f"fork failed: {msg[2]}"))
        elif kind == "exited":
            self._on_child_exit(msg[1], msg[2])

    def _fail_spawns(self, reason: str) -> None:
        for fut in self._spawn_waiters.values():
            if not fut.done():
                fut.set_exception(OSError(reason))
        self._spawn_waiters.clear()

    # ------------------------------------------------------------------ spawning
    def _on_spawn(self, msg: Incoming) -> None:
        task = asyncio.get_running_loop().create_task(self._spawn(msg.meta, msg.frames))

        def answer(t: asyncio.Task[list[int]]) -> None:
            if t.cancelled():
                return  # the agent is shutting down; the caller learns it from the registry
            if t.exception() is not None:
                msg.reply_error(t.exception())  # type: ignore[arg-type]
            else:
                msg.reply({"pids": t.result()})

        task.add_done_callback(answer)

    async def _spawn(self, meta: dict[str, Any], frames: list[Any]) -> list[int]:
        assert self._zygote_ready is not None
        await self._zygote_ready
        payload = bytes(frames[0]) if frames else b""
        os.makedirs(self.log_dir, exist_ok=True)
        pids = []
        for spec in meta["workers"]:
            name = f"{meta['group']}:{spec['rank']}"
            spec = dict(spec)
            spec.update(
                group=meta["group"],
                payload=payload,
                registry=self.registry_address,
                node={
                    "node_id": self.node_id,
                    "node_rank": self.node_rank,
                    "ip": self.host,
                    "hostname": socket.gethostname(),
                    "accelerator_type": self.accelerator_type,
                    "endpoint": self.endpoint.address,
                },
                log_path=os.path.join(self.log_dir, f"{name.replace(':', '_')}.log"),
            )
            spawn_id = next(self._spawn_ids)
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self._spawn_waiters[spawn_id] = fut
            write_message(self._zygote_channel, ("spawn", spawn_id, spec))
            pid = await fut
            self.children[pid] = _Child(name, meta["group"], pid, spec["log_path"], time.time(),
                                        output_to=meta.get("output_to"))
            pids.append(pid)
        return pids

    def _on_child_exit(self, pid: int, status: int) -> None:
        child = self.children.pop(pid, None)
        if child is None or self._stopped.is_set():
            return  # shutting down: the registry learns from unregister_node instead
        self._forward_output(child)  # its last words reach the driver before the news
        exit_code = os.waitstatus_to_exitcode(status)
        sig = -exit_code if exit_code < 0 else 0
        tail = tail_lines(child.log_path)
        how = f"killed by {signal.Signals(sig).name}" if sig else f"exited with code {exit_code}"
        log.info("worker %s (pid %d) %s", child.name, pid, how)
        report = {
            "address": child.name, "pid": pid, "exit_code": exit_code, "signal": sig,
            "stderr_tail": tail, "reason": f"worker {child.name} (pid {pid}) {how}",
        }
        asyncio.get_running_loop().create_task(self._report_exit(report))

    async def _report_exit(self, report: dict[str, Any]) -> None:
        """Tell the registry; while it is unreachable (restarting), retry every second."""
        while not self._stopped.is_set():
            try:
                await self.registry.request("worker_exited", report, timeout=5)
                return
            except Exception as exc:
                log.warning("could not report %s's exit yet (%s); retrying", report["address"], exc)
                await asyncio.sleep(1.0)

    def _on_kill_group(self, msg: Incoming) -> None:
        group = msg.meta["group"]
        victims = [c for c in self.children.values() if c.group == group]
        self._kill(victims)
        msg.reply({"killed": len(victims)})

    def _kill(self, victims: list[_Child]) -> None:
        for c in victims:
            _signal_group(c.pid, signal.SIGTERM)
        if victims:
            asyncio.get_running_loop().call_later(KILL_GRACE_S, self._kill_survivors, [c.pid for c in victims])

    def _kill_survivors(self, pids: list[int]) -> None:
        for pid in pids:
            if pid in self.children:
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
        for c in self.children.values():
            _signal_group(c.pid, signal.SIGKILL)
        try:
            await self.registry.request("unregister_node", {"node_id": self.node_id}, timeout=1.0)
        except Exception:
            pass
        self.registry.close()
        if self.zygote.poll() is None:
            self.zygote.kill()
        self.zygote.wait()
        self.endpoint.close()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # workers lead their own process group (setsid in the zygote)
    except ProcessLookupError:
        pass
    except PermissionError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiorl-node", description="Run an aiorl node agent.")
    parser.add_argument("--registry", default=os.environ.get("AIORL_REGISTRY"),
                        help="registry address, tcp://HOST:PORT (default: $AIORL_REGISTRY)")
    parser.add_argument("--host", default=None, help="this node's IP as others reach it")
    parser.add_argument("--node-rank", type=int, default=None, help="fixed node rank (stable order)")
    parser.add_argument("--accelerators", type=int, default=None,
                        help="declare N accelerators (default: detect NVIDIA GPUs)")
    parser.add_argument("--hardware", action="append", default=[], metavar="TYPE=COUNT",
                        help="custom hardware on this node, e.g. robot=2 (repeatable)")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--log-dir", default=None, help="where worker logs go")
    parser.add_argument("--exit-on-stdin-close", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--key-file", default=None,
                        help="the cluster key file written by aiorl-registry (default: "
                             "$AIORL_KEY_FILE or ~/.aiorl/cluster.key)")
    parser.add_argument("--insecure", action="store_true", help="no authentication")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.insecure or os.environ.get(security.ENV_INSECURE) == "1":
        os.environ[security.ENV_INSECURE] = "1"
    elif args.key_file:
        os.environ.update(security.ClusterKeys.load(args.key_file).to_env())
    else:
        keys = security.keys_from_environment()
        if keys is None:
            parser.error("no cluster key: pass --key-file (the file aiorl-registry wrote), set "
                         "$AIORL_KEY_FILE, or run everything with --insecure")
        # Into the environment, so the zygote and every worker it forks inherit them.
        os.environ.update(keys.to_env())
    if not args.registry:
        parser.error("--registry (or $AIORL_REGISTRY) is required")
    host = args.host or (
        "127.0.0.1" if args.registry.startswith(("tcp://127.", "tcp://localhost")) else local_ip()
    )
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s [node {host}] %(levelname)s %(message)s")
    log_dir = args.log_dir or os.path.join(tempfile.gettempdir(), f"aiorl-node-{os.getpid()}-logs")
    agent = NodeAgent(
        args.registry, host=host, node_rank=args.node_rank, accelerators=args.accelerators,
        hardware=_parse_kv(args.hardware, "--hardware", int), labels=_parse_kv(args.label, "--label"),
        log_dir=log_dir,
    )

    async def run() -> None:
        await agent.start()
        print(f"AIORL_NODE_READY={agent.node_rank}", flush=True)
        await agent.run_until_stopped(args.exit_on_stdin_close)

    import uvloop

    uvloop.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
