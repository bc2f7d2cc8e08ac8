"""``aiorl doctor`` and ``aiorl trace``: ask every live process, then explain what waits on what.

Collection: the registry lists every live worker and driver with its endpoint; each is
asked the ``inspect`` operation (aiorl/actors/inspection.py) concurrently, with a timeout,
from any endpoint (the driver's own for ``cluster.doctor()``, a private one for the
command line). Nothing here runs inside the job's processes except that one handler.

Analysis (`diagnose`): the waits of all processes, each a typed record its service reports
(calls, p2p, channel operations, weights waits, broadcasts), form one wait-for graph whose
nodes are processes, channels and weight names:

* ``A -> B`` when A waits a receive from B, a call it made to B, a send to B, or an answer
  to a broadcast from B (the source waits for the members, a member for the source);
* ``A -> channel 'c'`` when A waits a get (or a put) on channel ``c``, and ``channel 'c' ->
  P`` for each live producer P of an empty channel with getters waiting (those that put
  into it; while nobody has, the workers that hold it and do not get from it);
* ``A -> weights 'w'`` when A waits for a version of ``w`` no publisher completed yet, and
  ``weights 'w' -> P`` for each live publisher P of ``w`` (from the publishers' own answers).

Every wait is an "any of" wait, so the nodes that cannot go on are found first (`_stuck`);
a cycle among them is a deadlock, unless one of its waits is younger than `STUCK_AFTER_S`.
An edge to a dead process, to an empty channel none of whose producers is alive, to a full
channel none of whose consumers is alive, or to a weight name nobody publishes, is a wait
that can never end; a group call that some ranks answered and others not, and a broadcast
some members never called, name their stragglers. Findings come first in plain words, then
the oldest waits (ages need tracing on for calls, p2p and channels: spans carry their
start), then every process's summary.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from aiorl.protocol.inspect import decode_answer
from aiorl.protocol.ops import WorkerOp, WorkerState
from aiorl.protocol.registry import StatusReport
from aiorl.registry.client import RegistryClient
from aiorl.trace import chrome
from aiorl.trace import recorder as _trace
from aiorl.transport.endpoint import Endpoint

__all__ = [
    "DoctorReport", "Probe", "collect", "diagnose", "format_report", "format_stacks",
    "dump_trace", "switch_tracing",
]

#: Seconds each process has to answer one inspect request.
DEFAULT_TIMEOUT = 5.0
#: Seconds a wait must have lasted (where its age is known) before the doctor names it in
#: a deadlock or as a wait nothing can end: a younger one may be the ordinary hand-over of
#: a busy pipeline (a rollout that waits for the version the trainer is publishing).
STUCK_AFTER_S = 2.0
#: Spans per page of a trace pull (a few MB in the puller, whatever the buffers hold).
TRACE_PAGE_SPANS = 10_000


@dataclass
class Probe:
    """One live process the registry knows, and what it answered (or why it did not)."""

    name: str
    endpoint: str
    kind: str  # "worker" or "driver"
    node: str = "?"
    local: bool = True  # on this machine: its clock needs no correction
    reply: dict[str, Any] | None = None
    error: str | None = None
    sent_ns: int = 0
    received_ns: int = 0


def _probes(status: StatusReport) -> tuple[list[Probe], dict[str, str]]:
    """The processes to ask (live workers and drivers) and every worker's registry state."""
    here = socket.gethostname()
    hosts = {n.node_rank: n.hostname for n in status.nodes}
    states: dict[str, str] = {}
    probes: list[Probe] = []
    for w in status.workers:
        states[w.name] = str(w.state)
        if w.state == WorkerState.READY and w.info.endpoint:
            probes.append(Probe(w.name, w.info.endpoint, "worker", str(w.info.node_rank),
                                hosts.get(w.info.node_rank, here) in (here, "")))
    for d in status.drivers:
        if d.endpoint:
            probes.append(Probe("driver", d.endpoint, "driver", d.hostname or "?",
                                d.hostname in (here, "")))
    return probes, states


async def collect(endpoint: Endpoint, registry: RegistryClient, action: str,
                  timeout: float = DEFAULT_TIMEOUT,
                  arguments: dict[str, Any] | None = None) -> tuple[list[Probe], StatusReport]:
    """Ask every live process ``inspect(action)`` at once; each probe holds its answer."""
    status = await registry.status(timeout=timeout)
    probes, _ = _probes(status)
    request = {**(arguments or {}), "action": action}

    async def ask(p: Probe) -> None:
        p.sent_ns = _trace._now()
        try:
            _, frames = await endpoint.request(p.endpoint, WorkerOp.INSPECT, request,
                                               timeout=timeout)
            p.reply = decode_answer(frames)
        except TimeoutError:
            p.error = (f"did not answer within {timeout:g} s (its event loop is blocked: see "
                       "`aiorl doctor stack` or py-spy)")
        except Exception as exc:  # noqa: BLE001 - one process's failure is part of the report
            p.error = f"{type(exc).__name__}: {exc}"
        p.received_ns = _trace._now()

    await asyncio.gather(*(ask(p) for p in probes))
    return probes, status


async def switch_tracing(endpoint: Endpoint, registry: RegistryClient, on: bool,
                         timeout: float = DEFAULT_TIMEOUT) -> list[Probe]:
    """Turn tracing on or off in every live process."""
    probes, _ = await collect(endpoint, registry, "trace_start" if on else "trace_stop", timeout)
    return probes


async def dump_trace(endpoint: Endpoint, registry: RegistryClient, path: str,
                     timeout: float = DEFAULT_TIMEOUT,
                     page_spans: int | None = None) -> tuple[dict[str, Any], list[Probe]]:
    """Drain every live process's trace buffer and write them, merged into one Chrome trace,
    to ``path``; returns ``{"path", "processes", "spans", "events"}`` and the probes.

    In bounded pieces: every process is first asked at once for its clock, open spans and
    thread names (the clock offsets come from these small answers' round trips), then each
    one's spans are fetched a page (``page_spans``, `TRACE_PAGE_SPANS`) at a time, and each
    page is written as events before the next is asked for. Whole buffers in one answer each,
    merged in memory, take a driver to about 1 GB for four full 200,000-span buffers; a page
    is a few MB. A process that stops answering midway keeps what
    was written of it, and its probe names the error."""
    page = TRACE_PAGE_SPANS if page_spans is None else page_spans
    probes, _ = await collect(endpoint, registry, "trace_page", timeout,
                              {"first": True, "max_spans": 0})
    answered: dict[int, Probe] = {}
    buffers = []
    for p in probes:
        if p.reply is None:
            continue
        group, _, rank = p.name.rpartition(":")
        buffers.append(chrome.PulledBuffer(
            p.reply, node=p.node, group=group if p.kind == "worker" else "",
            rank=int(rank) if rank.isdigit() else -1, sent_ns=p.sent_ns,
            received_ns=p.received_ns, local=p.local))
        answered[id(buffers[-1])] = p
    chrome.node_offsets(buffers)
    loop = asyncio.get_running_loop()
    tracks = chrome.ordered(buffers)
    with open(path, "w") as out:
        writer = chrome.TraceWriter(out)
        for index, b in enumerate(tracks):
            probe = answered[id(b)]
            pid = int(b.dump.get("pid", index))
            writer.write(chrome.process_events(index, b))
            written = 0
            more = bool(b.dump.get("more"))
            while more:
                try:
                    _, frames = await endpoint.request(
                        probe.endpoint, WorkerOp.INSPECT,
                        {"action": "trace_page", "first": False, "max_spans": page},
                        timeout=timeout)
                    answer = decode_answer(frames)
                    spans = answer["spans"]
                    more = bool(answer.get("more")) and bool(spans)
                except Exception as exc:  # noqa: BLE001 - the rest of the trace is still written
                    probe.error = (f"stopped answering the trace pull after {written} spans: "
                                   f"{type(exc).__name__}: {exc}")
                    break
                # Off the loop: a page's events take a while to write on a slow core.
                await loop.run_in_executor(None, writer.write,
                                           chrome.span_events(pid, spans, b.offset_ns, written))
                written += len(spans)
                del answer, spans, frames
            writer.write(chrome.span_events(pid, chrome.open_spans(b.dump), b.offset_ns,
                                            written))
        writer.close(len(buffers))
    summary = {"path": path, "processes": len(buffers), "spans": writer.spans,
               "events": writer.events}
    return summary, probes


# ---------------------------------------------------------------------- analysis
@dataclass
class Wait:
    """One edge of the wait-for graph: ``waiter`` waits ``what`` on ``target``."""

    waiter: str
    target: str
    what: str  # "recv from", "call to", "get on", ...
    age_s: float | None = None
    count: int = 1

    def words(self) -> str:
        age = f" for {self.age_s:.1f} s" if self.age_s is not None else ""
        many = f" ({self.count} operations)" if self.count > 1 else ""
        return f"{self.waiter} waits {self.what} {self.target}{many}{age}"


@dataclass
class DoctorReport:
    """What ``aiorl doctor`` found; ``exit_code`` is 1 on a deadlock or a dead-peer wait."""

    findings: list[str] = field(default_factory=list)
    deadlocks: list[list[str]] = field(default_factory=list)
    dead_peer_waits: list[str] = field(default_factory=list)
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    #: Waits on a channel whose producers all finished (seen with ``interval`` > 0 only);
    #: not counted in ``exit_code``: a new call may still feed it.
    idle_waits: list[str] = field(default_factory=list)
    growing_channels: list[dict[str, Any]] = field(default_factory=list)
    unresponsive: list[str] = field(default_factory=list)
    oldest_waits: list[dict[str, Any]] = field(default_factory=list)
    waits: list[dict[str, Any]] = field(default_factory=list)
    processes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.deadlocks or self.dead_peer_waits else 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "exit_code": self.exit_code}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


def _channel_node(name: str) -> str:
    return f"channel '{name}'"


def _weights_node(name: str) -> str:
    return f"weights '{name}'"


def _is_resource(node: str) -> bool:
    """A channel or a weight name, not a process."""
    return node.startswith(("channel '", "weights '"))


def _publishers(snapshots: dict[str, dict[str, Any]]
                ) -> tuple[dict[str, list[str]], dict[str, int | None]]:
    """Each weight name's live publishers (from their own answers: a dead one is absent),
    and the newest version of the name that every shard completed (None: not yet)."""
    who: dict[str, list[str]] = {}
    shards: dict[str, dict[int, int | None]] = {}
    counts: dict[str, int] = {}
    for process, snap in snapshots.items():
        for pub in snap.get("publishes_weights") or ():
            who.setdefault(pub["name"], []).append(process)
            shards.setdefault(pub["name"], {})[pub["shard"]] = pub["version"]
            counts[pub["name"]] = max(counts.get(pub["name"], 1), pub["num_shards"])
    newest: dict[str, int | None] = {}
    for name, by_shard in shards.items():
        versions = [by_shard.get(i) for i in range(counts[name])]
        newest[name] = None if None in versions else min(v for v in versions if v is not None)
    return {n: sorted(p) for n, p in who.items()}, newest


def _weights_edges(snapshots: dict[str, dict[str, Any]], edges: list[Wait],
                   publishers: dict[str, list[str]]
                   ) -> tuple[list[Wait], list[tuple[Wait, str]]]:
    """Edges from each waited-on weight name to its live publishers (only a publish ends a
    wait for a version), and the waits on a name no live process publishes."""
    out: list[Wait] = []
    orphans: list[tuple[Wait, str]] = []
    linked: set[str] = set()
    for e in edges:
        if not e.target.startswith("weights '"):
            continue
        name = e.target[len("weights '"):-1]
        alive = publishers.get(name, [])
        if not alive:
            orphans.append((e, f"and no live process publishes {name!r}"))
        elif e.target not in linked:
            linked.add(e.target)
            out += [Wait(e.target, p, "a publish from") for p in alive]
    return out, orphans


def _ages(pending: list[dict[str, Any]]) -> dict[tuple[str, str | None], float]:
    """Tracing on: the oldest open span per (category, peer), to date the waits."""
    ages: dict[tuple[str, str | None], float] = {}
    for e in pending:
        if e["kind"] == "span":
            key = (e["cat"], e["peer"])
            ages[key] = max(ages.get(key, 0.0), e["age_s"])
    return ages


def _edges(process: str, pending: list[dict[str, Any]], names: dict[str, str],
           published: dict[str, int | None]) -> list[Wait]:
    """``process``'s waits as edges; ``published``: each weight name's newest version any
    live publisher completed (a wait for a version already out is no edge)."""
    ages = _ages(pending)
    counted: dict[tuple[str, str], Wait] = {}

    def add(target: str | None, what: str, age: float | None) -> None:
        if not target or target == process:
            return
        w = counted.get((target, what))
        if w is None:
            counted[target, what] = Wait(process, target, what, age)
        else:
            w.count += 1

    for e in pending:
        kind = e["kind"]
        if kind == "recv":
            add(e["peer"], "recv from", ages.get(("recv", e["peer"])))
        elif kind == "send":
            add(e["peer"], "send to", ages.get(("send", e["peer"])))
        elif kind == "call":
            peer = e.get("peer") or names.get(e["address"])
            add(peer, "a call answered by", e.get("age_s"))
        elif kind.startswith("channel."):
            verb = kind.split(".", 1)[1]
            add(_channel_node(e["channel"]), f"{verb} on",
                ages.get(("channel", f"channel {e['channel']}")))
        elif kind == "broadcast":
            what = (f"broadcast #{e['seq']} to {len(e['members'])} members, the answer of"
                    if e["source"] == process else
                    f"broadcast #{e['seq']}, the payload and verdict of")
            for member in e["waiting_for"]:
                add(member, what, e.get("age_s"))
        elif kind == "weights":
            done = published.get(e["name"])
            if done is not None and e["wanted"] is not None and done >= e["wanted"]:
                continue  # published already: the news is on its way, nothing is stuck
            add(_weights_node(e["name"]), _weights_what(e), e.get("age_s"))
    return list(counted.values())


def _weights_what(e: dict[str, Any]) -> str:
    """``wait_for version >= 4 (latest 3) on``: a weights wait record in words."""
    latest = "none" if e["latest"] is None else e["latest"]
    wanted = "a first version" if e["wanted"] is None else f"version >= {e['wanted']}"
    return f"{e['op']} {wanted} (latest {latest}) on"


def _gone(names: list[str], states: dict[str, str]) -> str:
    # "ready" in the registry but no answer to the snapshot: killed a moment ago, its death
    # not reported yet.
    return ", ".join(f"{p} does not answer" if states.get(p, "gone") == "ready"
                     else f"{p} is {states.get(p, 'gone')}" for p in names)


def _channel_edges(snapshots: dict[str, dict[str, Any]], states: dict[str, str]
                   ) -> tuple[list[Wait], dict[tuple[str, str], str], dict[str, dict[str, Any]]]:
    """Edges from empty channels to their producers; why a channel never fills (no producer
    alive) or never drains (no consumer alive), by (channel node, "get" or "put"); every
    hosted queue."""
    edges: list[Wait] = []
    dead_ends: dict[tuple[str, str], str] = {}
    queues: dict[str, dict[str, Any]] = {}
    for host, snap in snapshots.items():
        for q in snap.get("channels") or ():
            node = _channel_node(q["channel"])
            queues[f"{node} queue {q['queue']!r}"] = q
            if q["size"] and q["waiting_putters"] and not q["waiting_getters"]:
                # Only a consumer can make room. One that never came may still come (the
                # pipeline is starting); consumers that came and all died never will.
                consumers = q.get("consumers") or []
                if consumers and not any(states.get(c, "ready") == "ready" and c in snapshots
                                         for c in consumers):
                    dead_ends[node, "put"] = ("which is full and has no consumer alive "
                                              f"({_gone(consumers, states)})")
                continue
            if q["size"] or not q["waiting_getters"]:
                continue
            alive = [p for p in q["producers"] if states.get(p, "ready") == "ready"
                     and p in snapshots]
            if not q["producers"]:
                # Nobody has put yet: a worker that holds the channel and does not wait to
                # get from it may still put (a rollout that connected and waits for weights
                # first). Not a driver: drivers create the channels their workers use, and
                # one that does put is a producer from its first put on.
                getters = set(q.get("parked_clients") or ())
                alive = [p for p, snap in sorted(snapshots.items())
                         if q["channel"] in (snap.get("holds_channels") or ())
                         and p not in getters and p != host and p != "driver"]
            for p in alive:
                edges.append(Wait(node, p, "a put from"))
            if not alive:
                gone = _gone(q["producers"], states)
                dead_ends[node, "get"] = (
                    "which is empty and has no producer alive"
                    + (f" ({gone})" if gone else
                       " (nobody has put into it, and nobody else holds it)"))
    return edges, dead_ends, queues


def _stuck(edges: list[Wait], states: dict[str, str]) -> set[str]:
    """The nodes of the graph that cannot go on, whatever the others do.

    Every wait is an "any of" wait: a channel get ends with a put from any of its producers,
    a weight name's wait with its publishers' publish, a process with several operations
    pending goes on when any of them ends. So a node is free when it waits on nothing, or
    when one of its targets is free (a target the graph does not know, not reported dead, is
    free); the rest, found by a fixpoint, is stuck. Only cycles among stuck nodes are
    deadlocks: a trainer that waits on a channel fed by four rollouts of which one waits for
    the trainer's next weights is not stuck while the three others produce."""
    out: dict[str, list[str]] = {}
    for e in edges:
        out.setdefault(e.waiter, []).append(e.target)
    dead = {str(WorkerState.DEAD), str(WorkerState.FAILED)}
    # A channel or weight name with no edge out has no live producer or publisher: stuck.
    free = {t for targets in out.values() for t in targets
            if t not in out and states.get(t) not in dead and not _is_resource(t)}
    changed = True
    while changed:
        changed = False
        for node, targets in out.items():
            if node not in free and any(t in free for t in targets):
                free.add(node)
                changed = True
    return set(out) - free


def _cycles(edges: Iterable[Wait]) -> list[list[Wait]]:
    """Simple cycles of the wait-for graph, each once (the graph is small)."""
    graph: dict[str, list[Wait]] = {}
    for e in edges:
        graph.setdefault(e.waiter, []).append(e)
    found: list[list[Wait]] = []
    seen: set[tuple[str, ...]] = set()

    def walk(start: str, node: str, path: list[Wait], on_path: set[str]) -> None:
        for e in graph.get(node, ()):
            if e.target == start:
                cycle = [*path, e]
                nodes = [w.waiter for w in cycle]
                # Told from its first process (alphabetically), not from a channel.
                i = nodes.index(min(nodes, key=lambda n: (_is_resource(n), n)))
                key = tuple(nodes[i:] + nodes[:i])
                if key not in seen:
                    seen.add(key)
                    found.append(cycle[i:] + cycle[:i])
            elif e.target not in on_path and e.target > start:
                walk(start, e.target, [*path, e], on_path | {e.target})

    for start in sorted(graph):
        walk(start, start, [], {start})
    return found


def _merged(cycles: list[list[Wait]]) -> list[list[Wait]]:
    """The cycles that pass through the same channels and weight names, with the same
    processes except those that end a resource's wait, told as one: four rollouts that each
    close the same trainer/channel/weights cycle are one deadlock, ``rollout:0 and rollout:1``
    in one line. Cycles without a channel or weight name are left as they are."""
    groups: dict[tuple[Any, ...], list[list[Wait]]] = {}
    for cycle in cycles:
        resources = [k for k, w in enumerate(cycle) if _is_resource(w.waiter)]
        if not resources:
            groups[("plain", id(cycle))] = [cycle]
            continue
        first = min(resources, key=lambda k: cycle[k].waiter)
        aligned = cycle[first:] + cycle[:first]
        key = tuple("*" if k and _is_resource(aligned[k - 1].waiter) else w.waiter
                    for k, w in enumerate(aligned))
        groups.setdefault(key, []).append(aligned)
    out = []
    for members in groups.values():
        if len(members) == 1 and not _is_resource(members[0][0].waiter):
            out.append(members[0])
            continue
        merged = []
        for k, w in enumerate(members[0]):
            waiters = sorted({m[k].waiter for m in members})
            targets = sorted({m[k].target for m in members})
            ages = [a for m in members if (a := m[k].age_s) is not None]
            merged.append(Wait(" and ".join(waiters), " and ".join(targets), w.what,
                               max(ages) if ages else None, max(m[k].count for m in members)))
        # Told from a single process that waits on a resource (the trainer), if any.
        starts = [k for k, w in enumerate(merged)
                  if " and " not in w.waiter and not _is_resource(w.waiter)]
        s = starts[0] if starts else 0
        out.append(merged[s:] + merged[:s])
    return out


def _sentence(chain: list[Wait]) -> str:
    """``a waits X b for 7.1 s, which waits Y c, ...``: a chain of waits in one line
    (each wait's age where it is known)."""
    def one(w: Wait) -> str:
        age = f" for {w.age_s:.1f} s" if w.age_s is not None else ""
        return f"{w.what} {w.target}{age}"

    text = f"{chain[0].waiter} waits {one(chain[0])}"
    for w in chain[1:]:
        text += f", which {'each wait' if ' and ' in w.waiter else 'waits'} {one(w)}"
    return text


def _stragglers(snapshots: dict[str, dict[str, Any]], names: dict[str, str]
                ) -> list[dict[str, Any]]:
    """Group calls some ranks answered and others not: the latter are named."""
    out = []
    for process, snap in snapshots.items():
        calls: dict[int, list[dict[str, Any]]] = {}
        for e in snap["pending"]:
            if e["kind"] == "call":
                calls.setdefault(e["call"], []).append(e)
        for entries in calls.values():
            size = entries[0]["call_size"]
            if len(entries) == size:
                continue  # nobody answered yet: slow everywhere, not a straggler
            late = sorted(e.get("peer") or names.get(e["address"], e["address"]) for e in entries)
            methods = sorted({x["method"] for n in late for x in
                              snapshots.get(n, {}).get("pending", ()) if x["kind"] == "executing"
                              and x["peer"] == process})
            age = max((e.get("age_s") or 0.0 for e in entries), default=0.0)
            out.append({"caller": process, "ranks": size, "answered": size - len(entries),
                        "waiting_for": late, "methods": methods, "age_s": age or None})
    return out


def _broadcast_stragglers(snapshots: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Broadcasts whose source has waited `STUCK_AFTER_S` or more for members that have not
    called ``broadcast`` at all (no record of that set and number in their answer): named as
    stragglers. A member that called and waits on the source is an edge of the graph
    instead; one that is dead, a wait on a dead peer."""
    called: set[tuple[str, str, int]] = set()
    for process, snap in snapshots.items():
        for e in snap["pending"]:
            if e["kind"] == "broadcast":
                called.add((process, e["set"], e["seq"]))
    out = []
    for process, snap in snapshots.items():
        for e in snap["pending"]:
            if e["kind"] != "broadcast" or e["source"] != process \
                    or (e.get("age_s") or 0.0) < STUCK_AFTER_S:
                continue
            absent = [m for m in e["waiting_for"]
                      if m in snapshots and (m, e["set"], e["seq"]) not in called]
            if absent:
                out.append({"caller": process, "ranks": len(e["members"]),
                            "answered": len(e["members"]) - len(absent),
                            "waiting_for": absent, "methods": ["broadcast"],
                            "age_s": e["age_s"], "seq": e["seq"]})
    return out


def _idle(snap: dict[str, Any]) -> bool:
    """Runs no call and waits on nothing: a worker whose work returned."""
    return not any(e["kind"] != "span" for e in snap["pending"])


def _idle_producers(edges: list[Wait], channel_edges: list[Wait],
                    snapshots: dict[str, dict[str, Any]],
                    later: dict[str, dict[str, Any]]) -> list[str]:
    """Gets on an empty channel all of whose live producers ran nothing in two snapshots
    an interval apart (their calls returned): nothing will put into it unless someone
    makes a new call. One snapshot is not enough: a producer between two calls of a
    driver's loop is idle for a moment."""
    enders: dict[str, list[str]] = {}
    for e in channel_edges:
        enders.setdefault(e.waiter, []).append(e.target)
    out = []
    for e in edges:
        producers = enders.get(e.target)
        if not e.what.startswith("get") or not producers:
            continue
        still = any(x["kind"].startswith("channel.get") and _channel_node(x["channel"]) == e.target
                    for x in later.get(e.waiter, {}).get("pending", ()))
        if still and all(p in later and _idle(snapshots[p]) and _idle(later[p])
                         for p in producers):
            out.append(f"{e.words()}, which is empty; its producers ({', '.join(producers)}) "
                       "are alive but run nothing (their calls returned): nothing will put "
                       "into it unless a new call is made")
    return out


def _graph(snapshots: dict[str, dict[str, Any]], states: dict[str, str], names: dict[str, str]
           ) -> tuple[list[Wait], list[Wait], dict[tuple[str, str], str],
                      dict[str, dict[str, Any]], list[tuple[Wait, str]], list[Wait],
                      list[list[Wait]]]:
    """The wait-for graph of one collection: the processes' own waits, the channels' and
    weight names' edges to who can end them, the dead ends, the hosted queues, the waits on
    unpublished names, all edges, and the cycles among stuck nodes old enough to report."""
    for snap in snapshots.values():  # name the peers a process knows only by address
        for e in snap["pending"]:
            if not e.get("peer") and e.get("address") in names:
                e["peer"] = names[e["address"]]
    publishers, published = _publishers(snapshots)
    edges: list[Wait] = []
    for name, snap in snapshots.items():
        edges.extend(_edges(name, snap["pending"], names, published))
    channel_edges, dead_ends, queues = _channel_edges(snapshots, states)
    weights_edges, orphans = _weights_edges(snapshots, edges, publishers)
    all_edges = edges + channel_edges + weights_edges
    stuck = _stuck(all_edges, states)
    cycles = [c for c in _cycles(e for e in all_edges if e.waiter in stuck and e.target in stuck)
              # a wait this young may be the ordinary hand-over of a busy pipeline
              if not any(w.age_s is not None and w.age_s < STUCK_AFTER_S for w in c)]
    return edges, channel_edges, dead_ends, queues, orphans, all_edges, cycles


def diagnose(probes: list[Probe], status: StatusReport,
             later: list[Probe] | None = None, interval: float = 0.0) -> DoctorReport:
    """The report of one collection of snapshots (``later``: a second one, for growth)."""
    _, states = _probes(status)
    report = DoctorReport()
    snapshots: dict[str, dict[str, Any]] = {}
    for p in probes:
        if p.reply is None:
            report.unresponsive.append(f"{p.name} ({p.endpoint}): {p.error}")
            continue
        snapshots[p.name] = p.reply
    names = {p.endpoint: p.name for p in probes}
    names.update({w.info.endpoint: w.name for w in status.workers if w.info.endpoint})
    later_snaps = {p.name: p.reply for p in later or () if p.reply is not None}
    edges, channel_edges, dead_ends, queues, orphans, all_edges, cycles = _graph(
        snapshots, states, names)
    report.waits = [asdict(e) for e in all_edges]
    if later is not None:
        # Each process answers at its own moment, so one collection is no consistent cut:
        # two trainers exchanging gradients can each be seen waiting a receive from the
        # other while both messages are on the wire. With a second collection, a cycle
        # is a deadlock only if it is there in both.
        again = {frozenset(w.waiter for w in c)
                 for c in _graph(later_snaps, states, names)[-1]}
        cycles = [c for c in cycles if frozenset(w.waiter for w in c) in again]
    for cycle in _merged(cycles):
        report.deadlocks.append([w.words() for w in cycle])
        report.findings.append(f"DEADLOCK: {_sentence(cycle)} (a cycle: none of them can go on)")
    for e, why in orphans:
        if e.age_s is not None and e.age_s < STUCK_AFTER_S:
            continue  # the publisher may not have made its publisher yet (the job starts)
        text = f"{e.words()}, {why}"
        report.dead_peer_waits.append(text)
        report.findings.append("NO PUBLISHER: " + text)
    for e in edges:
        target_state = states.get(e.target)
        if target_state in (WorkerState.DEAD, WorkerState.FAILED):
            text = f"{e.words()}, which is {target_state}"
            report.dead_peer_waits.append(text)
            report.findings.append("WAITING ON A DEAD PEER: " + text)
    for e in edges:
        dead_end = dead_ends.get((e.target, "put" if e.what.startswith("put") else "get"))
        if dead_end is not None:
            text = f"{e.words()}, {dead_end}"
            report.dead_peer_waits.append(text)
            report.findings.append("WAITING ON A DEAD PEER: " + text)
    for s in _stragglers(snapshots, names):
        report.stragglers.append(s)
        method = f" {'/'.join(s['methods'])}" if s["methods"] else ""
        age = f" after {s['age_s']:.1f} s" if s["age_s"] else ""
        report.findings.append(
            f"STRAGGLER: {s['caller']}'s group call{method}: {s['answered']} of {s['ranks']} "
            f"ranks answered; still waiting{age} for {', '.join(s['waiting_for'])}")
    for s in _broadcast_stragglers(snapshots):
        report.stragglers.append(s)
        report.findings.append(
            f"STRAGGLER: {s['caller']}'s broadcast #{s['seq']} to {s['ranks']} members: "
            f"{s['answered']} of {s['ranks']} called it; still waiting after {s['age_s']:.1f} s "
            f"for {', '.join(s['waiting_for'])}, which never called broadcast")
    if later is not None:
        before = {k: q["size"] for k, q in queues.items()}
        for text in _idle_producers(edges, channel_edges, snapshots, later_snaps):
            report.idle_waits.append(text)
            report.findings.append("NO PRODUCER AT WORK: " + text)
        _, _, after = _channel_edges(later_snaps, states)
        for key, q in after.items():
            if key in before and q["size"] > before[key] and not q["waiting_getters"]:
                grown = {"queue": key, "from": before[key], "to": q["size"],
                         "interval_s": interval}
                report.growing_channels.append(grown)
                report.findings.append(
                    f"GROWING: {key} grew from {before[key]} to {q['size']} items in "
                    f"{interval:.1f} s with nobody getting from it")
    for line in report.unresponsive:
        report.findings.append("UNRESPONSIVE: " + line)
    dated = [{"process": name, "what": _describe_pending(e), "age_s": e["age_s"]}
             for name, snap in snapshots.items() for e in snap["pending"]
             if e.get("age_s") is not None]
    report.oldest_waits = sorted(dated, key=lambda e: -e["age_s"])[:10]
    for p in probes:
        snap = p.reply or {}
        report.processes.append({
            "name": p.name, "kind": p.kind, "node": p.node, "pid": snap.get("pid"),
            "answered": p.reply is not None, "tracing": snap.get("tracing"),
            "pending": [e for e in snap.get("pending", ()) if e["kind"] != "span"],
            "threads": snap.get("threads", []), "tasks": snap.get("tasks", []),
            "channels": snap.get("channels", []), "resources": snap.get("resources", {}),
        })
    return report


# ---------------------------------------------------------------------- text
def _describe_pending(e: dict[str, Any]) -> str:
    kind = e["kind"]
    if kind == "executing":
        return f"executing {e['method']}() for {e['peer']}"
    if kind == "span":
        cat, peer = e["cat"], e.get("peer")
        if cat in ("recv", "send"):
            return f"{cat} {'from' if cat == 'recv' else 'to'} {peer}"
        tags = ", ".join(f"{k}={v}" for k, v in (e.get("tags") or {}).items())
        return f"{'span ' if cat == 'user' else ''}{e['name']}" + (
            f" ({tags})" if tags else "") + (f" with {peer}" if peer else "")
    if kind == "call":
        return f"call to {e.get('peer') or e['address']} (rank {e['index']} of a " \
               f"{e['call_size']}-rank group call)"
    if kind.startswith("channel."):
        return f"{kind.split('.', 1)[1]} on channel '{e['channel']}' (queue {e['queue']!r})"
    if kind == "weights":
        return f"{_weights_what(e)} weights '{e['name']}'"
    if kind == "broadcast":
        return (f"broadcast #{e['seq']} from {e['source']} to {len(e['members'])} members, "
                f"waiting for {', '.join(e['waiting_for']) or 'nobody'}")
    return f"{kind} {'from' if kind == 'recv' else 'to'} {e.get('peer')}"


def format_report(report: DoctorReport, verbose: bool = False) -> str:
    """The report in plain words: findings first, then oldest waits, then each process."""
    lines = []
    answered = sum(1 for p in report.processes if p["answered"])
    pending = sum(len(p["pending"]) for p in report.processes)
    lines.append(f"aiorl doctor: {answered}/{len(report.processes)} processes answered, "
                 f"{pending} pending operations")
    lines.append("")
    if report.findings:
        lines.extend(report.findings)
    else:
        lines.append("No deadlock, no wait on a dead peer, no straggler found.")
    lines.append("")
    if report.oldest_waits:
        lines.append("OLDEST WAITS (dated while tracing is on)")
        for e in report.oldest_waits:
            lines.append(f"  {e['age_s']:8.2f} s  {e['process']}: {e['what']}")
        lines.append("")
    lines.append("PROCESSES")
    for p in report.processes:
        if not p["answered"]:
            lines.append(f"  {p['name']} (node {p['node']}): did not answer")
            continue
        rss = p["resources"].get("rss_bytes", 0) / 2**20
        lines.append(f"  {p['name']} (node {p['node']}, pid {p['pid']}, {rss:.0f} MiB): "
                     f"{len(p['pending'])} pending")
        for e in p["pending"]:
            lines.append(f"      {_describe_pending(e)}")
        for q in p["channels"]:
            lines.append(f"      hosts channel '{q['channel']}' queue {q['queue']!r}: "
                         f"{q['size']} items, {q['waiting_getters']} getters and "
                         f"{q['waiting_putters']} putters waiting, producers: "
                         f"{', '.join(q['producers']) or 'none'}, consumers: "
                         f"{', '.join(q.get('consumers') or ()) or 'none'}")
        if verbose:
            for t in p["tasks"]:
                lines.append(f"      task {t['name']} ({t['coro']}) at {t['where']}")
    return "\n".join(lines)


def format_stacks(probes: list[Probe]) -> str:
    """Every process's thread stacks and asyncio tasks, like ``py-spy dump`` for each."""
    out = []
    for p in probes:
        out.append(f"=== {p.name} (node {p.node}, {p.endpoint})")
        if p.reply is None:
            out.append(f"    no answer: {p.error}")
            continue
        for t in p.reply["threads"]:
            mark = "  (answering this request)" if t["inspecting"] else ""
            out.append(f"--- thread {t['thread']}{mark}")
            out.append(t["stack"].rstrip())
        for task in p.reply["tasks"]:
            out.append(f"--- task {task['name']} {task['coro']}: awaits {task['awaits']}")
            if task["stack"]:
                out.append(task["stack"].rstrip())
        out.append("")
    return "\n".join(out)

