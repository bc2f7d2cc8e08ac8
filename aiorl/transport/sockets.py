"""The one place where aiorl creates ZMQ sockets.

Every socket of the runtime (registry, node agents, workers, drivers) is made by
`make_socket`, so that socket options (and authentication, when it is
switched on for a cluster) apply everywhere at once.
"""

from __future__ import annotations

import itertools
import os
import socket as _socket
import threading
import uuid
from typing import Any

import zmq

from aiorl.transport import security
from aiorl.transport.security import ClusterKeys
from aiorl.util.threads import blocked

__all__ = [
    "HANDSHAKE_FAILED_EVENTS",
    "IPC_PREFIX",
    "ROUTER_HWM",
    "bind_endpoint",
    "get_context",
    "local_ip",
    "make_socket",
    "monitor_connection",
]

IPC_PREFIX = "ipc://"
HANDSHAKE_FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
HANDSHAKE_EVENTS = HANDSHAKE_FAILED_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED
_monitor_ids = itertools.count()

_ctx_lock = threading.Lock()
_ctx_pid: int | None = None
_ctx: zmq.Context[zmq.Socket[Any]] | None = None


def get_context() -> zmq.Context[zmq.Socket[Any]]:
    """The process's ZMQ context, created anew after a fork (contexts do not survive fork)."""
    global _ctx, _ctx_pid
    with _ctx_lock:
        if _ctx is None or _ctx_pid != os.getpid():
            _ctx = _new_context()
            _ctx_pid = os.getpid()
        return _ctx


def _new_context() -> zmq.Context[zmq.Socket[Any]]:
    ctx: zmq.Context[zmq.Socket[Any]] = zmq.Context(io_threads=1)
    ctx.setsockopt(zmq.LINGER, 200)
    # libzmq starts its I/O and reaper threads with the first socket; starting them here,
    # SIGINT and SIGTERM blocked, leaves them to the main thread from the threads' first
    # instruction (libzmq blocks every signal in them itself once they run).
    with blocked():
        ctx.socket(zmq.PAIR).close()
    return ctx


#: Messages queued per peer, each way, on a ROUTER (see :func:`make_socket`): far above what
#: a peer that reads has outstanding (1,000 calls in flight), far below what floods memory.
ROUTER_HWM = 100_000
#: libzmq's own keep-alive on DEALERs (ZMTP PING every IVL; the connection is dropped when
#: no whole frame arrived within TIMEOUT of a PING). Read when a socket is made (tests lower
#: them). A frame must take less than the timeout end to end: see wire.MAX_FRAME_BYTES.
ZMTP_HEARTBEAT_IVL_MS = 1000
ZMTP_HEARTBEAT_TIMEOUT_MS = 3000


def make_socket(
    kind: int, *, identity: bytes | None = None, keys: ClusterKeys | None = None
) -> zmq.Socket[Any]:
    """Create a socket of ZMQ type ``kind`` with the runtime's standard options.

    With ``keys``, a ROUTER becomes a server admitting only holders of the cluster
    key and a DEALER a client presenting it and, under CURVE, accepting only a
    server that proves it holds the cluster key too (see security.py).

    High-water marks: a DEALER's are unlimited (flow control is done by the protocols
    above: credits in channels, request/reply in calls; a dropped or blocked control
    message would be worse than memory held for a moment). A ROUTER serves peers it does
    not control, so each peer's queues are bounded at `ROUTER_HWM` messages: a peer
    that sends without reading its replies gets its further replies dropped (the send
    raises EAGAIN, which the endpoint counts and logs), and one that sends faster than
    the server reads is held back by TCP, instead of either growing the server's memory
    without bound (5.9 M pings in 10 s took a registry from 34 MB to 1 GB, and it stayed).
    """
    sock = get_context().socket(kind)
    hwm = ROUTER_HWM if kind == zmq.ROUTER else 0
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 200)
    if kind == zmq.ROUTER:
        # Raise EHOSTUNREACH instead of silently dropping a reply to a vanished peer,
        # and let a reconnecting peer with the same identity take its place.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if kind == zmq.DEALER:
        # Detect dead TCP peers even when no request is in flight.
        sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if keys is not None:
        if kind == zmq.ROUTER:
            security.enable_server(sock, keys)
        else:
            security.enable_client(sock, keys)
    return sock


def bind_endpoint(sock: zmq.Socket[Any], location: str, port: int = 0) -> str:
    """Bind ``sock`` and return the address peers connect to.

    ``location`` is either a host interface (``tcp://HOST:PORT``; port 0 = any free
    port) or ``ipc://DIR``: a Unix socket with a fresh name inside DIR, which must be
    a private directory (owner only, see `security.check_private_directory`),
    so that only this user can bind there or connect.
    """
    if location.startswith(IPC_PREFIX):
        directory = location[len(IPC_PREFIX):]
        security.check_private_directory(directory)
        address = f"{IPC_PREFIX}{directory}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
        sock.bind(address)
        return address
    if port:
        sock.bind(f"tcp://{location}:{port}")
        return f"tcp://{location}:{port}"
    chosen = sock.bind_to_random_port(f"tcp://{location}", min_port=20000, max_port=60000)
    return f"tcp://{location}:{chosen}"


def monitor_connection(sock: zmq.Socket[Any]) -> zmq.Socket[Any]:
    """A PAIR socket that receives ``sock``'s handshake events (succeeded / failed) and its
    disconnections.

    libzmq gives up on a connection for good after a failed handshake (a mechanism
    mismatch, refused credentials, a server without the expected key): that is how the
    endpoint learns it must rebuild the socket. A connection that drops is reconnected by
    libzmq, but what it had written may be lost: that is how the endpoint learns its pending
    requests may never be answered (aiorl.transport.peer). Read them with
    `zmq.utils.monitor.parse_monitor_message`.
    """
    address = f"inproc://aiorl-monitor-{next(_monitor_ids)}"
    sock.monitor(address, HANDSHAKE_EVENTS | zmq.EVENT_DISCONNECTED)
    pair = get_context().socket(zmq.PAIR)
    pair.setsockopt(zmq.LINGER, 0)
    pair.connect(address)
    return pair


def local_ip() -> str:
    """This host's address as other hosts see it: ``AIORL_NODE_IP``, else the hostname's."""
    override = os.environ.get("AIORL_NODE_IP")
    if override:
        return override
    try:
        return _socket.gethostbyname(_socket.gethostname())
    except OSError:
        return "127.0.0.1"
