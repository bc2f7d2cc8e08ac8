"""Setting lanes up: where a lane listens, how a client connects and proves the cluster key,
and the listener that admits clients (a lane itself: `aiorl.transport.lane`).

Authentication, both ways, before a message is read (docs/security.md, invariant 14): the
lane sits in the same private directory as the endpoint's ZMQ socket (only this user can
create or connect to it), each side checks the other's uid (``SO_PEERCRED``), and a client's
first bytes prove it holds the cluster's secret (an HMAC over the lane's path and the
client's routing id; the secret itself never crosses). The server answers one byte:
admitted; refused (no proof); or taken (another live lane holds that routing id: a second
client presenting someone's routing id must not receive their answers).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import hmac
import logging
import os
import re
import socket
import struct
from collections.abc import Callable
from typing import Any

from aiorl.transport import security
from aiorl.transport.lane import ADMITTED, HELLO_HEAD, REFUSED, TAKEN, LaneConnection
from aiorl.transport.security import ClusterKeys
from aiorl.util.ratelimit import RateLimitedLog

__all__ = ["HELLO_DEADLINE_S", "LANE_DIR_VAR", "LANE_SUFFIX", "MAX_UNGREETED", "LaneListener",
           "connect_lane", "lane_path"]

log = logging.getLogger("aiorl.transport")
_refused = RateLimitedLog(log)

LANE_SUFFIX = ".lane"
_IPC_PREFIX = "ipc://"
_PROOF_CONTEXT = b"aiorl-lane-1\0"
#: A client that has not said hello this long after it connected is closed: a client of
#: this machine sends its hello in the same turn as its connect.
HELLO_DEADLINE_S = 5.0
#: Connections still to say hello, at most; later ones are closed at once.
MAX_UNGREETED = 128


#: A private directory (0700, ours) where endpoints bound on TCP keep their lanes: set by a
#: node agent that binds its workers on the node's IP, for itself and its workers, so that
#: a machine's own processes reach its workers by lane there too.
LANE_DIR_VAR = "AIORL_LANE_DIR"


def lane_path(address: str) -> str | None:
    """Where the lane of the endpoint at ``address`` listens: beside an ``ipc://`` socket,
    or, for a ``tcp://`` one, in this process's lane directory (`LANE_DIR_VAR`); None when
    it has no place for one."""
    if address.startswith(_IPC_PREFIX):
        return address[len(_IPC_PREFIX):] + LANE_SUFFIX
    directory = os.environ.get(LANE_DIR_VAR)
    if not directory or not address.startswith("tcp://"):
        return None
    return os.path.join(directory, re.sub(r"[^0-9A-Za-z.]", "_", address[6:]) + LANE_SUFFIX)


def _proof(keys: ClusterKeys | None, path: str, identity: bytes) -> bytes:
    secret = keys.secret if keys is not None else b""
    return hmac.new(secret, _PROOF_CONTEXT + path.encode() + b"\0" + identity,
                    hashlib.sha256).digest()


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def connect_lane(address: str, identity: bytes, keys: ClusterKeys | None,
                 loop: asyncio.AbstractEventLoop,
                 on_message: Callable[[list[Any]], None]) -> LaneConnection | None:
    """A lane to the endpoint at ``address``, or None when it has none (not ``ipc://``,
    no lane there, or it cannot take a connection now): the caller then uses ZMQ."""
    path = lane_path(address)
    if path is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect(path)  # a Unix socket connects at once, or not at all
        if _peer_uid(sock) != os.getuid():  # not ours: speak ZMQ, which authenticates
            raise PermissionError(f"{path} is served by another user")
    except OSError:
        sock.close()
        return None
    conn = LaneConnection(sock, loop, on_message)
    # The first bytes fit in any socket buffer; not taken: the server is going away.
    if not conn.send_hello(_proof(keys, path, identity) + HELLO_HEAD.pack(len(identity))
                           + identity):
        conn.close()
        return None
    return conn


class LaneListener:
    """A server's lane: accepts this user's clients that prove the cluster key, and asks
    ``on_client(connection)`` whether to admit each once its hello passed (False: another
    live lane holds its routing id); the connection's messages then go to
    ``on_message(connection, frames)``, and ``on_gone(connection)`` runs once it ends.

    A client has `hello_deadline` seconds to say hello, and at most `MAX_UNGREETED` clients
    may be waiting to: a connection that says nothing costs a descriptor, and nothing else
    bounds how many a local process can open.
    """

    def __init__(self, address: str, keys: ClusterKeys | None,
                 loop: asyncio.AbstractEventLoop,
                 on_client: Callable[[LaneConnection], bool],
                 on_message: Callable[[LaneConnection, list[Any]], None],
                 on_gone: Callable[[LaneConnection], None], *,
                 hello_deadline: float = HELLO_DEADLINE_S) -> None:
        path = lane_path(address)
        if path is None:
            raise ValueError(f"no place for a lane for {address!r} (not ipc://, and no "
                             f"{LANE_DIR_VAR} for a tcp:// one)")
        if not address.startswith(_IPC_PREFIX):  # an ipc:// one's was checked at its bind
            security.check_private_directory(os.path.dirname(path))
        self.path = path
        self.keys = keys
        self.loop = loop
        self._on_client = on_client
        self._on_message = on_message
        self._on_gone = on_gone
        self._clients: set[LaneConnection] = set()
        #: Clients that have not said hello yet, with the timer that closes them.
        self._ungreeted: dict[LaneConnection, asyncio.TimerHandle] = {}
        self.hello_deadline = hello_deadline
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _bind_fresh(sock, path)  # in a private directory (checked above, or at the bind)
            sock.listen(1024)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                _refused.warning("lane accept", "lane %s: accept failed: %s", self.path, exc)
                return
            sock.setblocking(False)
            if _peer_uid(sock) != os.getuid():
                _refused.warning("lane uid", "refused a lane client of another user")
                sock.close()
                continue
            if len(self._ungreeted) >= MAX_UNGREETED:
                _refused.warning("lane ungreeted", "lane %s: %d connections have not said "
                                 "hello yet: closed a new one", self.path, MAX_UNGREETED)
                sock.close()
                continue
            conn = LaneConnection(sock, self.loop, _nothing, expect_hello=self._check)
            conn.on_message = functools.partial(self._on_message, conn)
            conn.on_broken = functools.partial(self._gone, conn)
            self._clients.add(conn)
            self._ungreeted[conn] = self.loop.call_later(self.hello_deadline, self._overdue,
                                                         conn)

    def _check(self, conn: LaneConnection, proof: bytes, identity: bytes) -> int:
        """A new client's hello: admitted when it proves the cluster key and its routing id
        has no other live lane here (whose answers it would otherwise take)."""
        timer = self._ungreeted.pop(conn, None)
        if timer is not None:
            timer.cancel()
        if not hmac.compare_digest(proof, _proof(self.keys, self.path, identity)):
            self._clients.discard(conn)  # it closes now, without telling `_gone`
            _refused.warning("lane refused", "refused a lane client that did not prove it "
                             "holds this cluster's key")
            return REFUSED
        if not self._on_client(conn):
            self._clients.discard(conn)
            _refused.warning("lane taken", "refused a lane client whose routing id %r already "
                             "has a live lane", identity[:80])
            return TAKEN
        return ADMITTED

    def _overdue(self, conn: LaneConnection) -> None:
        if self._ungreeted.pop(conn, None) is not None:
            _refused.warning("lane hello", "lane %s: closed a connection that said no hello "
                             "within %g s", self.path, self.hello_deadline)
            self._clients.discard(conn)
            conn.close()

    def _gone(self, conn: LaneConnection, reason: str, unsent: list[Any]) -> None:
        self._clients.discard(conn)
        timer = self._ungreeted.pop(conn, None)
        if timer is not None:
            timer.cancel()
        if conn.peer_identity:
            self._on_gone(conn)

    @property
    def clients(self) -> int:
        """Open connections, admitted or still to say hello."""
        return len(self._clients)

    def close(self) -> None:
        """Stop listening, close every client's lane and remove the socket file."""
        if self.sock.fileno() >= 0:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
        clients, self._clients = self._clients, set()
        for timer in self._ungreeted.values():
            timer.cancel()
        self._ungreeted.clear()
        for conn in clients:
            conn.close()


def _bind_fresh(sock: socket.socket, path: str) -> None:
    """Bind ``path``, first removing a lane file left by a process that died there (a TCP
    port, unlike an ipc:// name, is used again); a lane someone still serves is kept."""
    try:
        sock.bind(path)
        return
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # nobody listens: a dead process's lane
    else:
        raise OSError(errno.EADDRINUSE, f"a live lane is at {path}")
    finally:
        probe.close()
    sock.bind(path)


def _nothing(frames: list[Any]) -> None:
    """What a server's connection does with a message before it is set up (never runs)."""
