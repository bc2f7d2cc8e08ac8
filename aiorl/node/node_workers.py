"""The node agent's one table of its workers, whatever order the news of them arrives in.

A worker's record goes **spawning → forked → ready → gone**. Three sources move it, on
three channels that keep no order among themselves:

* the agent itself, when it asks the zygote for a fork (`NodeWorkers.expect`): the record
  exists, by name, before anything else can speak of the worker;
* the zygote's reports on its private channel, in order for one child: ``spawned`` (the
  fork's pid, `NodeWorkers.forked`) always before ``exited`` (`NodeWorkers.exited`);
* the worker's own ``worker_ready`` (`NodeWorkers.ready`), on the agent's endpoint, which
  may arrive before the zygote's ``spawned`` (the fork's report waits behind the others of
  its request) or after the worker has exited.

So a ready message finds its record by pid, else by name among the records that have not
said where they listen yet (a worker started under a profiler is the profiler's child: its
pid is not the fork's); a ready message from a process that already exited (its pid among
the recently gone) changes nothing. Relaying, supervision and status all read this table:
`endpoints` (the addresses relayed messages and calls may be sent to), `serves`, `pending`.
Listeners added with `on_ready` hear of each worker that becomes ready (the p2p relay
delivers what it held for that address).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from aiorl.names import WorkerInfo

__all__ = ["HOLD_FOR_READY_S", "NodeWorker", "NodeWorkers"]

#: How long the relays hold messages and calls for an address, or a worker name, of this
#: node whose worker is starting: a worker tells its agent where it listens before it tells
#: the registry (where peers learn it), so its ready message is at most a hop behind theirs.
HOLD_FOR_READY_S = 5.0
#: Pids of exited workers remembered, so that a ready message arriving after its process's
#: exit is recognised and ignored (bounded: one entry per exit, oldest forgotten first).
GONE_PIDS_KEPT = 4096


@dataclass
class NodeWorker:
    """One worker process of this node (spawning, forked or ready)."""

    name: str
    group: str
    log_path: str
    spawn_id: int
    incarnation: int = 0  # which process of its name this is (restarts count up)
    output_to: str | None = None  # endpoint of the driver that wants this worker's output
    pid: int | None = None  # once the zygote reported the fork
    info: WorkerInfo | None = None  # once the worker reported ready
    started: float = 0.0
    output_offset: int = 0  # how much of the log file has been forwarded

    @property
    def state(self) -> str:
        """``spawning``, ``forked`` or ``ready`` (a gone record is not in the table)."""
        if self.info is not None:
            return "ready"
        return "spawning" if self.pid is None else "forked"


class NodeWorkers:
    """The workers of one node agent, keyed by spawn id, with look-ups by pid and endpoint."""

    def __init__(self) -> None:
        self._records: dict[int, NodeWorker] = {}
        self._by_pid: dict[int, NodeWorker] = {}
        #: Endpoint -> the ready record serving it: the addresses relays may send to.
        self._by_endpoint: dict[str, NodeWorker] = {}
        self._gone_pids: collections.OrderedDict[int, None] = collections.OrderedDict()
        #: Endpoints of workers that exited (as bounded as the pids): what arrives for them
        #: late is expected (a sender's last credits), not a stranger's address.
        self._gone_endpoints: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._ready_listeners: list[Callable[[WorkerInfo], None]] = []

    # ------------------------------------------------------------------ transitions
    def expect(self, spawn_id: int, name: str, group: str, log_path: str, *,
               incarnation: int = 0, output_to: str | None = None) -> NodeWorker:
        """A fork of worker ``name`` is about to be asked for: its record exists from now."""
        record = NodeWorker(name, group, log_path, spawn_id, incarnation, output_to,
                              started=time.time())
        self._records[spawn_id] = record
        return record

    def forked(self, spawn_id: int, pid: int) -> NodeWorker | None:
        """The zygote forked ``spawn_id`` as ``pid`` (None: a spawn this table never expected)."""
        record = self._records.get(spawn_id)
        if record is not None:
            record.pid = pid
            self._by_pid[pid] = record
        return record

    def fork_failed(self, spawn_id: int) -> None:
        """The zygote could not fork ``spawn_id``: nothing of it runs."""
        record = self._records.pop(spawn_id, None)
        if record is not None and record.info is not None:
            self._by_endpoint.pop(record.info.endpoint, None)

    def ready(self, info: WorkerInfo) -> NodeWorker | None:
        """Worker ``info.name`` said where it listens. Returns its record, or None when the
        message is stale (its process exited already) or names no worker of this node."""
        if info.pid in self._gone_pids:
            return None
        record = self._by_pid.get(info.pid)
        if record is None or record.name != info.name:
            # Under a profiler the pid is the profiler's child's; the name is unique among
            # the records still waiting for their ready (the newest incarnation first).
            waiting = [r for r in self._records.values()
                       if r.name == info.name and r.info is None]
            record = max(waiting, key=lambda r: (r.incarnation, r.spawn_id), default=None)
        if record is None:
            return None
        if record.info is not None:
            self._by_endpoint.pop(record.info.endpoint, None)
        record.info = info
        self._by_endpoint[info.endpoint] = record
        for listener in list(self._ready_listeners):
            listener(info)
        return record

    def exited(self, pid: int) -> NodeWorker | None:
        """Process ``pid`` exited: its record leaves the table (None: not one of ours)."""
        record = self._by_pid.pop(pid, None)
        self._gone_pids[pid] = None
        while len(self._gone_pids) > GONE_PIDS_KEPT:
            self._gone_pids.popitem(last=False)
        if record is None:
            return None
        self._records.pop(record.spawn_id, None)
        if record.info is not None:
            if self._by_endpoint.get(record.info.endpoint) is record:
                del self._by_endpoint[record.info.endpoint]
            self._gone_endpoints[record.info.endpoint] = None
            while len(self._gone_endpoints) > GONE_PIDS_KEPT:
                self._gone_endpoints.popitem(last=False)
        return record

    def on_ready(self, listener: Callable[[WorkerInfo], None]) -> None:
        """Call ``listener(info)`` each time a worker becomes ready."""
        self._ready_listeners.append(listener)

    # ------------------------------------------------------------------ reading
    def __iter__(self) -> Iterator[NodeWorker]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def running(self) -> list[NodeWorker]:
        """The records whose process exists (forked or ready): those that can be signalled."""
        return [r for r in self._records.values() if r.pid is not None]

    def by_pid(self, pid: int) -> NodeWorker | None:
        return self._by_pid.get(pid)

    def groups(self) -> set[str]:
        """The groups with a worker of this node (spawning ones included)."""
        return {r.group for r in self._records.values()}

    def is_local(self, endpoint: str) -> bool:
        """Whether a ready worker of this node serves ``endpoint`` now."""
        return endpoint in self._by_endpoint

    def exited_at(self, endpoint: str) -> bool:
        """Whether a worker of this node that served ``endpoint`` has exited (recently)."""
        return endpoint in self._gone_endpoints

    def pending(self) -> bool:
        """Whether a worker of this node has been asked for and has not said it is ready:
        an address nobody serves yet may be its."""
        return any(r.info is None for r in self._records.values())

    def serves(self, name: str, endpoint: str) -> bool | None:
        """Whether worker ``name`` of this node serves ``endpoint``: True, False (no process
        of that name here, or none at that endpoint), None (one is starting and has not
        said where yet: cannot tell). A restart may briefly leave two processes of one name."""
        answer: bool | None = False
        for record in self._records.values():
            if record.name == name:
                if record.info is None:
                    answer = None
                elif record.info.endpoint == endpoint:
                    return True
        return answer

    def status(self) -> dict[str, int]:
        """How many records are in each state (for the doctor and the agent's logs)."""
        counts = {"spawning": 0, "forked": 0, "ready": 0}
        for record in self._records.values():
            counts[record.state] += 1
        return counts
