"""Requests sent on a schedule from a thread of their own: heartbeats that user work cannot stop.

A process's `Endpoint` lives on its event loop, and so did its
heartbeats. A driver decodes results on that loop: a result whose class takes seconds to import,
the first tensor (``import torch``), or a 2 GiB tensor held it for seconds, the registry heard no
heartbeat for its expiry and tore down every group of a driver that was alive. Liveness
must not depend on user code, so a `Pulse` sends its requests from a thread of its own,
over a DEALER socket of its own (same keys, its own routing id), and hands each answer to a
callback on that thread. The thread waits in `zmq.Socket.poll`, which releases the GIL, and
needs the GIL only for a moment per beat: a loop busy in Python code (an import) leaves it the
interpreter's switch interval (5 ms) every so often, which is plenty.

What a beat means stays with the caller (`RegistryClient`): this
module only sends ``op``/``meta`` as a request every ``interval`` seconds and reports replies and
error replies; answers to beats sent before a registry restarted count the same as fresh ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from aiorl.errors import ProtocolError
from aiorl.transport.security import ClusterKeys
from aiorl.transport.socket_thread import SocketThread
from aiorl.transport.sockets import make_socket
from aiorl.transport.wire import Kind, decode_header, encode_header, split_batch, unpack

__all__ = ["Pulse"]

log = logging.getLogger("aiorl.transport")

#: How often the thread looks at its stop flag while it waits for the next beat or an answer.
_STOP_CHECK_S = 0.1
#: A heartbeat socket unanswered this long (at least three beats) is made anew.
_REBUILD_AFTER_S = 2.0


def _messages(frames: list[Any]) -> list[list[Any]]:
    """The messages in what arrived: one, or those of a (possibly PACKED) BATCH of replies
    (a registry that was slow answers several beats in one loop turn)."""
    header = decode_header(frames[0])
    if header.kind == Kind.PACKED:
        frames = unpack(header.meta, frames[1:])
        header = decode_header(frames[0])
    if header.kind == Kind.BATCH:
        return split_batch(header.meta, frames[1:])
    return [frames]


class Pulse(SocketThread):
    """Send ``op`` with ``meta`` to ``address`` every ``interval`` seconds from a thread.

    ``on_reply(meta)`` runs on the pulse thread for each reply, ``on_error(meta)`` for each
    error reply, and ``on_beat()`` (when given) as each beat is due, answered or not (the
    caller may judge a silence there); all must be quick and thread-safe (hand work to a
    loop with ``call_soon_threadsafe``). `stop` ends the thread and closes its socket.
    """

    def __init__(self, name: str, address: str, keys: ClusterKeys | None, op: str, meta: Any,
                 interval: float, on_reply: Callable[[Any], None],
                 on_error: Callable[[Any], None],
                 on_beat: Callable[[], None] | None = None) -> None:
        super().__init__("pulse", name, address, keys)
        self._request = (op, meta)
        self._interval = interval
        self._on_reply = on_reply
        self._on_error = on_error
        self._on_beat = on_beat

    def _run(self) -> None:
        sock = self._connect()
        try:
            self._beat(sock)
        except Exception:  # noqa: BLE001 - logged; the owner's expiry logic takes over
            log.exception("heartbeats to %s stopped", self.address)

    def _connect(self) -> zmq.Socket[Any]:
        sock = make_socket(zmq.DEALER, identity=self._identity, keys=self._keys)
        sock.setsockopt(zmq.LINGER, 0)  # a beat nobody took is worth nothing once we stop
        sock.connect(self.address)
        return sock

    def _beat(self, sock: zmq.Socket[Any]) -> None:
        op, meta = self._request
        request_id = 0
        next_beat = time.monotonic() + self._interval
        # libzmq gives a connection up for good after a failed handshake (a registry that
        # came back with another mechanism, then the right one): a socket unanswered this
        # long is made anew, as the endpoint rebuilds its own (a down peer costs nothing).
        silence = max(3 * self._interval, _REBUILD_AFTER_S)
        answered = time.monotonic()
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    if now - answered > silence:
                        sock.close()
                        sock = self._connect()
                        answered = now
                    request_id += 1
                    try:
                        sock.send(encode_header(Kind.REQUEST, request_id, op, meta),
                                  zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # not connected yet: the next beat tries again
                    next_beat = now + self._interval
                    if self._on_beat is not None:
                        self._on_beat()
                if sock.poll(int(1000 * min(_STOP_CHECK_S, max(next_beat - now, 0.0))) + 1):
                    if self._answers(sock.recv_multipart(zmq.NOBLOCK)):
                        answered = time.monotonic()
        finally:
            sock.close()

    def _answers(self, frames: list[Any]) -> bool:
        """Hand each reply and error reply in ``frames`` on; whether there was any."""
        try:
            messages = _messages(frames)
            headers = [decode_header(m[0]) for m in messages]
        except ProtocolError as exc:
            log.debug("a malformed answer to a heartbeat from %s: %s", self.address, exc)
            return False
        answered = False
        for header in headers:
            if header.kind == Kind.REPLY:
                self._on_reply(header.meta)
                answered = True
            elif header.kind == Kind.ERROR:
                self._on_error(header.meta)
                answered = True
        return answered
