"""Whether a connection to a peer is up: the kernel's view, not the peer's answers.

A node agent fences its workers when the registry stops answering (docs/failures.md,
invariant 28). Unanswered heartbeats alone cannot tell a dead registry from a slow one:
a registry held up for seconds (stopped, swapping, a long loop turn) answered nothing
for two expiries and both agents of a cluster SIGKILLed every worker.
A `LinkWatch` keeps one idle, authenticated connection to the peer from a thread of its
own and reports whether it is established:

* a peer process that ended (killed, crashed, its machine rebooted) closes its end: the
  kernel resets the connection, the link is down at once and reconnects fail;
* a peer that is merely slow or stopped keeps the connection: its kernel still
  acknowledges our TCP keep-alive probes (and a Unix socket stays connected);
* across a network partition nothing acknowledges the keep-alive probes: TCP gives the
  connection up after `KEEPALIVE_IDLE_S` + `KEEPALIVE_COUNT` x `KEEPALIVE_INTERVAL_S`
  (about 3 s) and the link is down.

libzmq's own ZMTP heartbeat is off on this socket: it is answered by the peer's process
(its I/O thread), which a stopped peer cannot do. What "down" means for the caller stays
with the caller (the agent's fence, aiorl/node/agent.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from aiorl.transport.security import ClusterKeys
from aiorl.transport.socket_thread import SocketThread
from aiorl.transport.sockets import get_context, make_socket

__all__ = ["KEEPALIVE_COUNT", "KEEPALIVE_IDLE_S", "KEEPALIVE_INTERVAL_S", "LinkWatch"]

log = logging.getLogger("aiorl.transport")

#: TCP keep-alive on the watched connection: the first probe after this many idle seconds,
#: then one every `KEEPALIVE_INTERVAL_S`; `KEEPALIVE_COUNT` unanswered probes end it.
#: Whole seconds: the kernel's resolution.
KEEPALIVE_IDLE_S = 1
KEEPALIVE_INTERVAL_S = 1
KEEPALIVE_COUNT = 2
#: How often the thread looks at its stop flag.
_STOP_CHECK_S = 0.1
#: After a failed handshake libzmq gives the connection up for good (a peer back with
#: another mechanism): the socket is made anew this long after.
_REBUILD_S = 1.0
_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_MONITOR_STOPPED)
_GIVEN_UP = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class LinkWatch(SocketThread):
    """Keep an idle connection to ``address`` and report whether it is established.

    `up` is true from a completed handshake until the connection is lost (a plain bool:
    any thread may read it). `stop` ends the thread and closes the socket.
    """

    def __init__(self, name: str, address: str, keys: ClusterKeys | None) -> None:
        super().__init__("link", name, address, keys)
        self.up = False

    def _connect(self) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
        sock = make_socket(zmq.DEALER, identity=self._identity, keys=self._keys)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 0)  # see the module's docstring
        if self.address.startswith("tcp://"):
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
            sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
            sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_COUNT)
        monitor_address = f"inproc://aiorl-link-{id(self):x}-{time.monotonic_ns()}"
        sock.monitor(monitor_address, _EVENTS)
        monitor = get_context().socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(monitor_address)
        sock.connect(self.address)
        return sock, monitor

    def _run(self) -> None:
        try:
            self._watch()
        except Exception:  # noqa: BLE001 - the link then reads as down: the caller's rule
            log.exception("watching the connection to %s stopped", self.address)
            self.up = False

    def _watch(self) -> None:
        sock, monitor = self._connect()
        rebuild_at: float | None = None
        try:
            while not self._stopping.is_set():
                if rebuild_at is not None and time.monotonic() >= rebuild_at:
                    sock.disable_monitor()
                    monitor.close()
                    sock.close()
                    sock, monitor = self._connect()
                    rebuild_at = None
                if not monitor.poll(int(_STOP_CHECK_S * 1000)):
                    continue
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.up = True
                elif event & (zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | _GIVEN_UP):
                    self.up = False
                    if event & _GIVEN_UP:
                        rebuild_at = time.monotonic() + _REBUILD_S
        finally:
            sock.disable_monitor()
            monitor.close()
            sock.close()
