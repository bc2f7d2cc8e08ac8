"""The registry service (``aiorl-registry``): who is where, and who is alive.

The registry holds three tables:

* **nodes**: one per node agent (id, rank, ip, hostname, cpus, accelerators,
  custom hardware, labels, agent endpoint), kept alive by heartbeats;
* **drivers**: processes that own groups (a ``Cluster`` in a user's program),
  also kept alive by heartbeats;
* **workers**: address -> :class:`~aiorl.names.WorkerInfo`, state and endpoint,
  grouped by root group name.

Clients *watch* names (a worker, a group, or ``"*"``) and get each change
pushed as a ``worker`` event, so nobody polls. When a node's or driver's
heartbeats stop for ``expiry`` seconds it is declared dead: a dead node's
workers are reported ``dead``; a dead driver's groups are torn down.

Nothing here unpickles: every request and reply is msgpack.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from aiorl.errors import ProtocolError
from aiorl.transport.endpoint import Endpoint, Incoming

__all__ = ["RegistryService", "main"]

log = logging.getLogger("aiorl.registry")

#: Worker states, in the order a healthy worker passes through them.
STARTING, READY, FAILED, DEAD = "starting", "ready", "failed", "dead"


@dataclass
class _Node:
    info: dict[str, Any]
    identity: bytes
    last_seen: float
    alive: bool = True


@dataclass
class _Driver:
    driver_id: str
    info: dict[str, Any]
    last_seen: float


@dataclass
class _Worker:
    info: dict[str, Any]
    state: str
    detail: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"info": self.info, "state": self.state, "detail": self.detail}


@dataclass
class _Group:
    name: str
    world_size: int
    owner: str  # driver id
    worker_class: str
    created: float
    closed: bool = False


class RegistryService:
    """The registry's state and request handlers, served on one :class:`Endpoint`."""

    def __init__(self, endpoint: Endpoint, *, heartbeat_interval: float = 0.5, expiry: float = 3.0):
        self.endpoint = endpoint
        self.heartbeat_interval = heartbeat_interval
        self.expiry = expiry
        self.nodes: dict[str, _Node] = {}
        self.drivers: dict[str, _Driver] = {}
        self.workers: dict[str, _Worker] = {}
        self.groups: dict[str, _Group] = {}
        self.watchers: dict[str, set[bytes]] = {}  # pattern -> client identities
        self.started = time.time()
        for op, fn in {
            "register_node": self._register_node,
            "unregister_node": self._unregister_node,
            "register_driver": self._register_driver,
            "unregister_driver": self._unregister_driver,
            "heartbeat": self._heartbeat,
            "create_group": self._create_group,
            "close_group": self._close_group,
            "worker_state": self._worker_state,
            "worker_exited": self._worker_exited,
            "lookup": self._lookup,
            "lookup_group": self._lookup_group,
            "watch": self._watch,
            "unwatch": self._unwatch,
            "nodes": self._nodes,
            "status": self._status,
            "ping": lambda m: m.reply({"uptime": time.time() - self.started}),
        }.items():
            endpoint.handle(op, _checked(fn))
        self._reaper = endpoint.loop.create_task(self._expire_loop())

    # ------------------------------------------------------------------ nodes and drivers
    def _register_node(self, msg: Incoming) -> None:
        info = dict(_require(msg.meta, "node_id", "endpoint"))
        node_id = str(info["node_id"])
        wanted = info.get("node_rank")
        taken = {n.info["node_rank"] for nid, n in self.nodes.items() if n.alive and nid != node_id}
        if wanted is not None and wanted >= 0:
            if wanted in taken:
                raise ValueError(f"node rank {wanted} is already taken by another live node")
            rank = int(wanted)
        else:
            rank = next(r for r in range(len(taken) + 1) if r not in taken)
        info["node_rank"] = rank
        self.nodes[node_id] = _Node(info, msg.identity, time.monotonic())
        log.info("node %s joined as rank %d (%s, %s accelerators)", node_id, rank,
                 info.get("ip"), info.get("num_accelerators", 0))
        msg.reply({"node_rank": rank, "heartbeat_interval": self.heartbeat_interval,
                   "expiry": self.expiry})
        self._broadcast_nodes()

    def _unregister_node(self, msg: Incoming) -> None:
        node = self.nodes.pop(str(_require(msg.meta, "node_id")["node_id"]), None)
        msg.reply(None)
        if node is not None:
            self._node_gone(node, "its node agent shut down")

    def _register_driver(self, msg: Incoming) -> None:
        meta = _require(msg.meta, "driver_id")
        self.drivers[meta["driver_id"]] = _Driver(meta["driver_id"], dict(meta), time.monotonic())
        msg.reply({"heartbeat_interval": self.heartbeat_interval, "expiry": self.expiry})

    def _unregister_driver(self, msg: Incoming) -> None:
        driver_id = _require(msg.meta, "driver_id")["driver_id"]
        self.drivers.pop(driver_id, None)
        msg.reply(None)

    def _heartbeat(self, msg: Incoming) -> None:
        meta = _require(msg.meta, "id")
        now = time.monotonic()
        node = self.nodes.get(meta["id"])
        if node is not None and node.alive:
            node.last_seen = now
            msg.reply({"known": True})
            return
        driver = self.drivers.get(meta["id"])
        if driver is not None:
            driver.last_seen = now
            msg.reply({"known": True})
            return
        # Unknown (e.g. this registry restarted): the sender re-registers.
        msg.reply({"known": False})

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval / 2)
            now = time.monotonic()
            for node in list(self.nodes.values()):
                if node.alive and now - node.last_seen > self.expiry:
                    node.alive = False
                    log.warning("node %s missed heartbeats for %.1f s: declared dead",
                                node.info["node_id"], now - node.last_seen)
                    self._node_gone(node, f"node {node.info['node_rank']} stopped answering")
                    self._broadcast_nodes()
            for driver in list(self.drivers.values()):
                if now - driver.last_seen > self.expiry:
                    del self.drivers[driver.driver_id]
                    log.warning("driver %s missed heartbeats: tearing down its groups", driver.driver_id)
                    for group in list(self.groups.values()):
                        if group.owner == driver.driver_id:
                            self._teardown_group(group, "its driver disappeared")

    def _node_gone(self, node: _Node, reason: str) -> None:
        node_id = node.info["node_id"]
        for name, w in list(self.workers.items()):
            if w.info.get("node_id") == node_id and w.state in (STARTING, READY):
                self._set_state(name, DEAD, {"reason": reason})

    def _broadcast_nodes(self) -> None:
        self._notify("@nodes", "nodes", {"nodes": self._node_list()})

    def _node_list(self) -> list[dict[str, Any]]:
        return sorted(
            ({**n.info, "alive": n.alive} for n in self.nodes.values() if n.alive),
            key=lambda i: i["node_rank"],
        )

    def _nodes(self, msg: Incoming) -> None:
        msg.reply({"nodes": self._node_list()})

    # ------------------------------------------------------------------ groups and workers
    def _create_group(self, msg: Incoming) -> None:
        meta = _require(msg.meta, "group", "world_size", "owner")
        name = meta["group"]
        existing = self.groups.get(name)
        if existing is not None and not existing.closed and existing.owner != meta["owner"]:
            raise ValueError(f"a worker group named {name!r} already exists")
        if existing is not None and existing.owner == meta["owner"] and not meta.get("restore"):
            raise ValueError(f"a worker group named {name!r} already exists")
        self.groups[name] = _Group(name, int(meta["world_size"]), meta["owner"],
                                   str(meta.get("worker_class", "")), time.time())
        if not meta.get("restore"):
            # Leftovers of a closed group of the same name. (A restore after a registry
            # restart keeps them: a tombstone may be the news its owner has not heard yet.)
            for wname, w in list(self.workers.items()):
                if _root(wname) == name and w.state in (DEAD, FAILED):
                    del self.workers[wname]
        msg.reply(None)

    def _close_group(self, msg: Incoming) -> None:
        name = _require(msg.meta, "group")["group"]
        group = self.groups.get(name)
        if group is None:
            raise KeyError(f"no worker group named {name!r}")
        self._teardown_group(group, "its group was closed")
        msg.reply(None)

    def _teardown_group(self, group: _Group, reason: str) -> None:
        group.closed = True
        for node in self.nodes.values():
            if node.alive:
                try:
                    self.endpoint.send_oneway(node.info["endpoint"], "kill_group", {"group": group.name})
                except Exception:
                    log.warning("could not ask node %s to stop group %s", node.info["node_id"], group.name)
        for name, w in list(self.workers.items()):
            if _root(name) == group.name and w.state in (STARTING, READY):
                self._set_state(name, DEAD, {"reason": reason})
        del self.groups[group.name]

    def _worker_state(self, msg: Incoming) -> None:
        meta = _require(msg.meta, "info", "state")
        info = meta["info"]
        name = str(info["address"])
        if meta["state"] not in (STARTING, READY, FAILED):
            raise ValueError(f"unknown worker state {meta['state']!r}")
        current = self.workers.get(name)
        if current is not None and current.state == DEAD and current.info.get("pid") == info.get("pid"):
            msg.reply(None)  # already reported dead (e.g. its node expired); do not resurrect
            return
        self.workers[name] = _Worker(info, STARTING)
        self._set_state(name, meta["state"], meta.get("detail") or {})
        msg.reply(None)

    def _worker_exited(self, msg: Incoming) -> None:
        meta = _require(msg.meta, "address", "pid")
        name = meta["address"]
        w = self.workers.get(name)
        detail = {k: meta.get(k) for k in ("exit_code", "signal", "stderr_tail", "reason")}
        if w is None:
            # Died before it could register: keep a tombstone so the owner learns why.
            self.workers[name] = _Worker({"address": name, "pid": meta["pid"]}, STARTING)
        elif w.info.get("pid") not in (None, meta["pid"]) or w.state in (DEAD, FAILED):
            msg.reply(None)
            return
        self._set_state(name, DEAD, detail)
        msg.reply(None)

    def _set_state(self, name: str, state: str, detail: dict[str, Any]) -> None:
        w = self.workers[name]
        w.state = state
        w.detail = detail
        event = {"name": name, **w.to_wire()}
        self._notify(name, "worker", event)
        self._notify(_root(name), "worker", event)
        self._notify("*", "worker", event)

    def _lookup(self, msg: Incoming) -> None:
        name = _require(msg.meta, "name")["name"]
        w = self.workers.get(name)
        if w is None:
            raise KeyError(f"no worker named {name!r} is registered")
        msg.reply(w.to_wire())

    def _lookup_group(self, msg: Incoming) -> None:
        name = _require(msg.meta, "group")["group"]
        group = self.groups.get(name)
        if group is None:
            raise KeyError(f"no worker group named {name!r}")
        members = {n: w.to_wire() for n, w in self.workers.items() if _root(n) == name}
        msg.reply({"world_size": group.world_size, "worker_class": group.worker_class,
                   "owner": group.owner, "workers": members})

    def _watch(self, msg: Incoming) -> None:
        """Subscribe to a worker name, a group name, ``*`` or ``@nodes``; reply with a snapshot."""
        pattern = str(_require(msg.meta, "name")["name"])
        self.watchers.setdefault(pattern, set()).add(msg.identity)
        if pattern == "@nodes":
            msg.reply({"nodes": self._node_list()})
            return
        snapshot = {
            n: w.to_wire() for n, w in self.workers.items()
            if pattern == "*" or n == pattern or _root(n) == pattern
        }
        msg.reply({"workers": snapshot})

    def _unwatch(self, msg: Incoming) -> None:
        pattern = str(_require(msg.meta, "name")["name"])
        self.watchers.get(pattern, set()).discard(msg.identity)
        msg.reply(None)

    def _notify(self, pattern: str, op: str, meta: Any) -> None:
        subscribers = self.watchers.get(pattern)
        if not subscribers:
            return
        for identity in list(subscribers):
            if not self.endpoint.push_event(identity, op, meta):
                subscribers.discard(identity)  # the subscriber disconnected

    def _status(self, msg: Incoming) -> None:
        msg.reply({
            "uptime": time.time() - self.started,
            "nodes": self._node_list(),
            "groups": [
                {"name": g.name, "world_size": g.world_size, "worker_class": g.worker_class,
                 "owner": g.owner,
                 "ready": sum(1 for n, w in self.workers.items() if _root(n) == g.name and w.state == READY)}
                for g in self.groups.values()
            ],
            "workers": [{"name": n, **w.to_wire()} for n, w in sorted(self.workers.items())],
            "drivers": [d.info for d in self.drivers.values()],
        })

    def close(self) -> None:
        self._reaper.cancel()
        self.endpoint.close()


def _root(name: str) -> str:
    return name.split(":", 1)[0]


def _require(meta: Any, *keys: str) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise ProtocolError(f"request meta must be a map, got {type(meta).__name__}")
    missing = [k for k in keys if k not in meta]
    if missing:
        raise ProtocolError(f"request is missing field(s) {', '.join(missing)}")
    return meta


def _checked(fn: Any) -> Any:
    """Turn any exception in a handler into an error reply; the service keeps running."""

    def run(msg: Incoming) -> None:
        try:
            fn(msg)
        except Exception as exc:
            if not isinstance(exc, (ProtocolError, KeyError, ValueError)):
                log.exception("registry handler %s failed", msg.op)
            msg.reply_error(exc)

    return run


async def serve(host: str, port: int, *, expiry: float, ready_line: bool, keys: Any,
                exit_on_stdin_close: bool = False) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            endpoint = Endpoint("registry", host=host, port=port, keys=keys)
            break
        except zmq.ZMQError as exc:
            # A restarted registry may find its port still held by the old socket for a moment.
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            log.warning("port %d is busy; retrying", port)
            await asyncio.sleep(0.2)
    service = RegistryService(endpoint, expiry=expiry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if exit_on_stdin_close:
        # An embedded registry's stdin is a pipe from the driver process: EOF means the
        # driver is gone (even SIGKILLed), and nobody else will stop us.
        def on_stdin() -> None:
            if not os.read(sys.stdin.fileno(), 4096):
                loop.remove_reader(sys.stdin.fileno())
                stop.set()

        loop.add_reader(sys.stdin.fileno(), on_stdin)
    if ready_line:
        # The embedded Cluster reads this line to learn the address.
        print(f"AIORL_REGISTRY={endpoint.address}", flush=True)
    log.info("registry serving on %s", endpoint.address)
    await stop.wait()
    service.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiorl-registry", description="Run the aiorl registry service.")
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on (default: all)")
    parser.add_argument("--port", type=int, default=6380, help="TCP port (0 = any free port)")
    parser.add_argument("--expiry", type=float, default=3.0,
                        help="seconds without heartbeats before a node or driver is declared dead")
    parser.add_argument("--print-address", action="store_true",
                        help="print AIORL_REGISTRY=<address> once listening")
    parser.add_argument("--key-file", default=None,
                        help="cluster key file (created if missing; default: $AIORL_KEY_FILE "
                             "or ~/.aiorl/cluster.key)")
    parser.add_argument("--insecure", action="store_true",
                        help="no authentication (only on a private, trusted network)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--exit-on-stdin-close", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s [registry] %(levelname)s %(message)s", stream=sys.stderr)
    import uvloop

    from aiorl.transport import security

    if args.insecure or os.environ.get(security.ENV_INSECURE) == "1":
        os.environ[security.ENV_INSECURE] = "1"
        keys = None
    elif os.environ.get(security.ENV_PUBLIC) and not args.key_file:
        keys = security.keys_from_environment()
    else:
        keys = security.load_or_create(
            args.key_file or os.environ.get(security.ENV_KEY_FILE) or security.DEFAULT_KEY_FILE)
    uvloop.run(serve(args.host, args.port, expiry=args.expiry, ready_line=args.print_address,
                     keys=keys, exit_on_stdin_close=args.exit_on_stdin_close))
    return 0


if __name__ == "__main__":
    sys.exit(main())
