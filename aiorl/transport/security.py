"""Cluster keys and CURVE authentication.

Every socket that can carry pickles is a ZMQ CURVE socket: traffic is encrypted
and a server (ROUTER) accepts a client (DEALER) only if the client proves it
holds the cluster's secret key. The check runs in libzmq's ZAP handshake,
before any message reaches aiorl, so an unauthenticated peer can never get a
byte unpickled. Refused handshakes are logged.

One key pair per cluster: all members (registry, node agents, workers,
drivers) hold the same pair. It comes from, in order:

1. an explicit :class:`ClusterKeys` (an embedded ``Cluster`` makes fresh ones);
2. ``$AIORL_CURVE_PUBLIC`` and ``$AIORL_CURVE_SECRET`` (how agents and
   workers of an embedded cluster receive them);
3. the key file named by ``$AIORL_KEY_FILE`` or ``--key-file``
   (``aiorl-registry`` writes one on first start; copy it to every node).

Two mechanisms, chosen per cluster (``mechanism`` in the key file, or
``$AIORL_AUTH_MECHANISM``):

* ``curve`` (the default for clusters started by hand): authentication and
  encryption of every message. It costs time: see ``benchmarks/bench_security.py``.
* ``plain``: the ZAP handshake checks the cluster secret, then messages travel
  unencrypted. An embedded ``Cluster`` uses it, since all of its traffic stays
  on loopback, which only the local root can read, and root owns the processes
  anyway. Use it across machines only on a network you trust against sniffing:
  the secret crosses the wire once per connection.

``AIORL_INSECURE=1`` turns authentication off (a private test network only).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from aiorl.errors import AuthenticationError

__all__ = [
    "ClusterKeys",
    "DEFAULT_KEY_FILE",
    "enable_server",
    "keys_from_environment",
    "load_or_create",
]

log = logging.getLogger("aiorl.security")

ENV_PUBLIC = "AIORL_CURVE_PUBLIC"
ENV_SECRET = "AIORL_CURVE_SECRET"
ENV_KEY_FILE = "AIORL_KEY_FILE"
ENV_INSECURE = "AIORL_INSECURE"
ENV_MECHANISM = "AIORL_AUTH_MECHANISM"
MECHANISMS = ("curve", "plain")
DEFAULT_KEY_FILE = Path.home() / ".aiorl" / "cluster.key"
ZAP_DOMAIN = b"aiorl"


@dataclass(frozen=True)
class ClusterKeys:
    """A CURVE key pair (Z85-encoded, 40 bytes each) shared by a cluster's members,
    and the mechanism that uses it (``curve``, or ``plain`` with the secret as password)."""

    public: bytes
    secret: bytes
    mechanism: str = "curve"

    def __post_init__(self) -> None:
        if self.mechanism not in MECHANISMS:
            raise AuthenticationError(
                f"unknown authentication mechanism {self.mechanism!r} (use one of {MECHANISMS})")

    @classmethod
    def generate(cls, mechanism: str = "curve") -> ClusterKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret, mechanism)

    def to_env(self) -> dict[str, str]:
        return {ENV_PUBLIC: self.public.decode(), ENV_SECRET: self.secret.decode(),
                ENV_MECHANISM: self.mechanism}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key file, readable by its owner only."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"public={self.public.decode()}\nsecret={self.secret.decode()}\n"
                    f"mechanism={self.mechanism}\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ClusterKeys:
        fields = {}
        try:
            for line in Path(path).read_text().splitlines():
                key, sep, value = line.partition("=")
                if sep:
                    fields[key.strip()] = value.strip().encode()
        except OSError as exc:
            raise AuthenticationError(f"cannot read the cluster key file {path}: {exc}") from None
        if len(fields.get("public", b"")) != 40 or len(fields.get("secret", b"")) != 40:
            raise AuthenticationError(f"{path} is not an aiorl key file (need public= and secret=)")
        mechanism = os.environ.get(ENV_MECHANISM) or fields.get("mechanism", b"curve").decode()
        return cls(fields["public"], fields["secret"], mechanism)

    def __repr__(self) -> str:  # never print the secret
        return f"ClusterKeys(public={self.public.decode()!r})"


def keys_from_environment() -> ClusterKeys | None:
    """Keys from ``$AIORL_CURVE_*`` or ``$AIORL_KEY_FILE``; None when ``AIORL_INSECURE=1``."""
    if os.environ.get(ENV_INSECURE) == "1":
        return None
    public, secret = os.environ.get(ENV_PUBLIC), os.environ.get(ENV_SECRET)
    if public and secret:
        return ClusterKeys(public.encode(), secret.encode(),
                           os.environ.get(ENV_MECHANISM) or "curve")
    key_file = os.environ.get(ENV_KEY_FILE)
    if key_file:
        return ClusterKeys.load(key_file)
    if DEFAULT_KEY_FILE.exists():
        return ClusterKeys.load(DEFAULT_KEY_FILE)
    return None


def load_or_create(path: str | os.PathLike[str]) -> ClusterKeys:
    """Load the key file at ``path``, creating it with fresh keys if it does not exist."""
    if Path(path).exists():
        return ClusterKeys.load(path)
    keys = ClusterKeys.generate()
    keys.save(path)
    log.warning("created cluster key file %s: copy it to every node (--key-file or $%s)",
                path, ENV_KEY_FILE)
    return keys


# ---------------------------------------------------------------------------- ZAP
_auth_lock = threading.Lock()
_authenticators: dict[int, Any] = {}  # id(context) -> authenticator (one per context)
_allowed: dict[bytes, bytes] = {}  # cluster public key -> secret, for every cluster served here


def _authenticator_class() -> type:
    from zmq.auth.thread import ThreadAuthenticator

    class ClusterAuthenticator(ThreadAuthenticator):  # type: ignore[misc, valid-type]
        """Admits clients that hold one of this process's cluster keys; logs refusals.

        Replaces pyzmq's PLAIN check, which logs passwords at debug level."""

        def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
            expected = _allowed.get(username.encode() if isinstance(username, str) else username)
            got = password.encode() if isinstance(password, str) else password
            if expected is not None and hmac.compare_digest(expected, got):
                return True, b"OK"
            log.warning("refused a connection that did not present this cluster's secret")
            return False, b"not a member of this cluster"

    return ClusterAuthenticator


class _ClusterKeyCheck:
    """ZAP credentials provider for CURVE: admit holders of an allowed cluster key."""

    def callback(self, domain: str, key: bytes) -> bool:
        if key in _allowed:
            return True
        log.warning("refused a connection that did not present this cluster's key")
        return False


def enable_server(sock: zmq.Socket, keys: ClusterKeys) -> None:
    """Make ``sock`` a server that admits only holders of ``keys`` (ZAP-checked)."""
    ctx = sock.context
    with _auth_lock:
        _allowed[keys.public] = keys.secret
        if id(ctx) not in _authenticators:
            auth = _authenticator_class()(ctx, log=logging.getLogger("aiorl.security.zap"))
            auth.start()
            auth.configure_curve_callback(domain=ZAP_DOMAIN.decode(),
                                          credentials_provider=_ClusterKeyCheck())
            # Passwords are checked by ClusterAuthenticator; this only enables PLAIN here.
            auth.configure_plain(domain=ZAP_DOMAIN.decode(), passwords={"-": "-"})
            _authenticators[id(ctx)] = auth
    sock.zap_domain = ZAP_DOMAIN
    if keys.mechanism == "plain":
        sock.plain_server = True
    else:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True


def enable_client(sock: zmq.Socket, keys: ClusterKeys) -> None:
    """Make ``sock`` a client presenting ``keys`` to servers of the same cluster."""
    if keys.mechanism == "plain":
        sock.plain_username = keys.public
        sock.plain_password = keys.secret
    else:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = keys.public
