"""The floor of a fan-out call: N forked Python processes that do only what a call needs.

``bench_scale.py --floor`` runs this beside aiorl's own fan-out group call, so that "what
does a call to every one of N Python processes cost on this machine, at the least?" is
measured on the same machine in the same run, rather than guessed.

The parent imports torch (as aiorl's zygote does before it forks workers, so that every
child's memory, page tables and fork cost look like a worker's), then forks ``N`` children,
each connected to it by its own ``socket.socketpair()`` (a Unix stream socket). A call is,
for every child: pack a request header ``(version, kind, request_id, op, meta)`` with
msgpack, prefix it with the 12-byte head ``struct.Struct("<IQ")`` (frame count 1, length),
send it; then wait until every child has answered. Each child runs a uvloop event loop
that reads its socket with ``add_reader``, unpacks the header, looks the method up by name
on an instance (a dict cache, as a worker does) and then, by ``--mode``:

* ``thread``: hands ``(fn, request_id)`` to its one method thread through a
  ``queue.SimpleQueue``; that thread calls the method and sends the reply itself. This is
  what aiorl does for a plain ``def`` method (it runs on the worker's method thread, so the
  loop keeps serving), at the price of a thread wake-up per call;
* ``loop``: calls the method on the loop and replies right there (what an ``async def``
  method that never awaits would cost, without even a task).

What it leaves out is everything a real runtime must do per call beyond that: no
authentication, no validation beyond the unpack, no ordering locks, no routing (one socket
per child, no broker, no identities), no error handling, no tracing, no arguments or
results to serialize. So its numbers are the least that any Python worker pays per call on
this machine; a runtime can approach them, not beat them.

Reported, as one JSON line: the median latency of a call to all ``N`` (ms), the children's
CPU per worker per call (µs; every thread of every child, from ``/proc/<pid>/task/*/
schedstat``) and the parent's own CPU per call (ms; ``time.process_time()``), both over the
measured calls only::

    python benchmarks/_fanout_floor.py --mode thread --workers 256 [--calls 100] [--warmup 10]

Children exit when their socket reaches end of file: when the parent closes it, and also
when the parent dies in any way (no other process holds the parent's end). The parent
waits for every child before it returns (and kills those that outlive a deadline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from struct import Struct
from typing import Any, NoReturn

import msgpack

HEAD = Struct("<IQ")  # frame count (always 1 here), length of the header frame
VERSION, REQUEST, REPLY = 1, 1, 2
MODES = ("thread", "loop")


class Target:
    """The instance whose method every call runs."""

    def noop(self) -> None:
        return None


def frame(header: tuple[Any, ...]) -> bytes:
    """One message: the 12-byte head, then the msgpack-encoded header."""
    body: bytes = msgpack.packb(header)
    return HEAD.pack(1, len(body)) + body


class Frames:
    """Splits a stream into unpacked headers. With one call in flight per socket a read
    holds one whole message (the fast path), but a stream socket does not promise it."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        if not self._buf and len(data) >= HEAD.size:
            _, length = HEAD.unpack_from(data, 0)
            if len(data) == HEAD.size + length:
                return [msgpack.unpackb(data[HEAD.size:])]
        self._buf += data
        out = []
        while len(self._buf) >= HEAD.size:
            _, length = HEAD.unpack_from(self._buf, 0)
            end = HEAD.size + length
            if len(self._buf) < end:
                break
            out.append(msgpack.unpackb(self._buf[HEAD.size:end]))
            del self._buf[:end]
        return out


# --- the child --------------------------------------------------------------------------


def child(sock: socket.socket, mode: str) -> NoReturn:
    """Serve calls on ``sock`` until it reaches end of file (never returns: ``os._exit``)."""
    status = 1
    try:
        serve(sock, mode)
        status = 0
    except Exception:
        traceback.print_exc()
    finally:
        os._exit(status)  # never fall back into the parent's code, nor run its atexit


def serve(sock: socket.socket, mode: str) -> None:
    import uvloop

    loop = uvloop.new_event_loop()
    sock.setblocking(False)
    target = Target()
    methods: dict[str, Callable[[], Any]] = {}
    frames = Frames()

    def reply(request_id: int) -> None:
        # A blocking send in spirit: the reply is ~30 bytes and at most one call is in
        # flight, so the (non-blocking, for the loop's sake) socket always has room.
        sock.send(frame((VERSION, REPLY, request_id, "call", None)))

    jobs: queue.SimpleQueue[tuple[Callable[[], Any], int]] = queue.SimpleQueue()

    def method_thread() -> None:
        while True:
            fn, request_id = jobs.get()
            fn()
            try:
                reply(request_id)
            except OSError:  # the parent is gone: the loop sees end of file and ends it all
                return

    if mode == "thread":
        threading.Thread(target=method_thread, name="method", daemon=True).start()

    def readable() -> None:
        try:
            data = sock.recv(65536)
        except OSError:  # ECONNRESET: the parent went with a reply still unread
            data = b""
        if not data:  # the parent closed its end, or died
            loop.stop()
            return
        for _version, _kind, request_id, _op, name in frames.feed(data):
            fn = methods.get(name) or methods.setdefault(name, getattr(target, name))
            if mode == "thread":
                jobs.put((fn, request_id))
            else:
                fn()
                reply(request_id)

    loop.add_reader(sock.fileno(), readable)
    loop.run_forever()


# --- the parent -------------------------------------------------------------------------


def fork_children(workers: int, mode: str) -> tuple[list[socket.socket], list[int]]:
    """Fork ``workers`` children, each with its own socket pair; the parent's ends first."""
    socks: list[socket.socket] = []
    pids: list[int] = []
    try:
        for _ in range(workers):
            mine, theirs = socket.socketpair()
            pid = os.fork()
            if pid == 0:
                # Only the parent may hold the parent's ends, or a child would not see end of
                # file when the parent dies.
                for s in socks:
                    s.close()
                mine.close()
                child(theirs, mode)
            theirs.close()
            socks.append(mine)
            pids.append(pid)
    except BaseException:
        reap(socks, pids, deadline=time.monotonic() + 10)
        raise
    return socks, pids


def reap(socks: list[socket.socket], pids: list[int], deadline: float) -> None:
    """Close the parent's ends (every child then sees end of file and exits) and wait for
    every child; one still alive at ``deadline`` is killed."""
    for s in socks:
        s.close()
    left = set(pids)
    while left:
        for pid in list(left):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                left.discard(pid)
        if left and time.monotonic() > deadline:
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            for pid in left:
                os.waitpid(pid, 0)
            return
        if left:
            time.sleep(0.01)


def children_cpu_ns(pids: list[int]) -> int:
    """The CPU time of every thread of every child so far (schedstat: ns on the CPU)."""
    total = 0
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    return total


async def drive(socks: list[socket.socket], pids: list[int], calls: int,
                warmup: int) -> dict[str, float]:
    """``warmup`` then ``calls`` fan-out calls to every child, one after the other."""
    loop = asyncio.get_running_loop()
    pending: dict[int, asyncio.Future[None]] = {}

    def readable(sock: socket.socket, frames: Frames) -> None:
        try:
            data = sock.recv(65536)
        except OSError:  # ECONNRESET: the child went with a request still unread
            data = b""
        if not data:  # a child died: fail the call rather than hang
            loop.remove_reader(sock.fileno())
            for future in pending.values():
                if not future.done():
                    future.set_exception(RuntimeError("a child closed its socket"))
            return
        for _version, _kind, request_id, _op, _meta in frames.feed(data):
            pending.pop(request_id).set_result(None)

    for sock in socks:
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), readable, sock, Frames())
    request_id = worker_cpu = 0
    driver_cpu = 0.0
    samples: list[float] = []
    try:
        for i in range(warmup + calls):
            if i == warmup:
                worker_cpu = children_cpu_ns(pids)
                driver_cpu = time.process_time()
            begin = time.perf_counter()
            futures = []
            for sock in socks:
                request_id += 1
                future = pending[request_id] = loop.create_future()
                futures.append(future)
                sock.send(frame((VERSION, REQUEST, request_id, "call", "noop")))
            await asyncio.gather(*futures)
            samples.append(time.perf_counter() - begin)
        driver_cpu = time.process_time() - driver_cpu  # before reading /proc: not the driver's
        worker_cpu = children_cpu_ns(pids) - worker_cpu
    finally:
        for sock in socks:
            loop.remove_reader(sock.fileno())
    return {"call_p50_ms": statistics.median(samples[warmup:]) * 1e3,
            "worker_cpu_us": worker_cpu / 1e3 / calls / len(pids),
            "driver_cpu_ms": driver_cpu / calls * 1e3}


def measure(mode: str, workers: int, calls: int = 100, warmup: int = 10,
            timeout: float = 300) -> dict[str, Any]:
    """Fork ``workers`` children, time ``calls`` fan-out calls, reap every child.

    Forks the calling process: call it from a process of its own (``main`` does), before
    anything that must not be forked (threads, an event loop, CUDA).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if workers < 1 or calls < 1 or warmup < 0:
        raise ValueError("workers and calls must be at least 1, warmup at least 0")
    import torch  # noqa: F401 - as aiorl's zygote: every child starts with torch loaded
    import uvloop

    deadline = time.monotonic() + timeout
    socks, pids = fork_children(workers, mode)  # before the parent's loop exists
    try:
        loop = uvloop.new_event_loop()
        try:
            result = loop.run_until_complete(asyncio.wait_for(
                drive(socks, pids, calls, warmup), max(1.0, deadline - time.monotonic())))
        finally:
            loop.close()
    finally:
        reap(socks, pids, deadline=max(deadline, time.monotonic() + 10))
    return {"mode": mode, "workers": workers, **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="thread",
                        help="where the child runs the method: its method thread, or its loop")
    parser.add_argument("--workers", type=int, default=256, help="children to fork")
    parser.add_argument("--calls", type=int, default=100, help="measured fan-out calls")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured calls first")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for it all")
    args = parser.parse_args()
    result = measure(args.mode, args.workers, args.calls, args.warmup, args.timeout)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
