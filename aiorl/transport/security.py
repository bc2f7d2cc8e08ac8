"""Cluster keys, authentication, and the private directories of a session.

Pickle over a socket is code execution, in both directions: a server unpickles
requests, a client unpickles replies. So every socket authenticates its peer
*both ways* before a message is read (the threat model is in docs/security.md):

* Multi-machine clusters use ``curve``: one CURVE key pair per cluster, held by
  every member (registry, node agents, workers, drivers). A server admits only
  clients that hold the pair (checked by ZAP, in libzmq, before any message is
  delivered), and every client pins the cluster's public key as the server key,
  so a process that took over a peer's address without the secret key fails the
  handshake and receives nothing. Every message is encrypted.
* Embedded clusters (every process on this machine) use ``plain`` over
  ``ipc://`` sockets inside a private directory (mode 0700, created by the
  driver under the user's runtime directory). The directory is what
  authenticates the server: only this user (and root) can create a socket
  there, so nobody else can squat an address, and only they can connect. The
  PLAIN secret on top is a second check on the client. PLAIN is never used over
  TCP: it hands the secret to whoever answers the address.

Keys come from, in order: an explicit `ClusterKeys` (an embedded
``Cluster`` makes fresh ones and hands them to its processes in a 0600 key file;
a node agent hands them to its workers over its private channel to the zygote,
see `set_process_keys`); ``$AIORL_CURVE_PUBLIC`` / ``$AIORL_CURVE_SECRET``;
the key file named by ``$AIORL_KEY_FILE`` or ``--key-file`` (``aiorl-registry``
writes one on first start; copy it to every node). Processes that received keys
remove those variables from their environment, so workers never inherit them.

``AIORL_INSECURE=1`` / ``--insecure`` turns authentication off (a private test
network only); an embedded cluster's sockets then still live in the private
directory.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from aiorl.errors import AuthenticationError
from aiorl.util.ratelimit import RateLimitedLog
from aiorl.util.threads import blocked

__all__ = [
    "ClusterKeys",
    "DEFAULT_KEY_FILE",
    "check_private_directory",
    "enable_server",
    "keys_from_environment",
    "load_or_create",
    "make_private_directory",
    "scrub_key_variables",
    "set_process_keys",
]

log = logging.getLogger("aiorl.security")
#: Refused handshakes are logged at most once a second per mechanism, with a count of the
#: rest: anyone who can reach a port can make one per try (docs/security.md).
_refusals = RateLimitedLog(log)

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

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key file, readable by its owner only."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a link planted at this name is refused, never written through.
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
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


_UNSET = object()
_process_keys: ClusterKeys | None | object = _UNSET


def set_process_keys(keys: ClusterKeys | None) -> None:
    """Make ``keys`` (None: insecure) what every endpoint of this process uses by default.

    A worker receives its keys from its node agent in its start message, not in its
    environment; this is how its endpoints (and any a library opens in it) find them."""
    global _process_keys
    _process_keys = keys


def scrub_key_variables() -> None:
    """Remove the key variables from this process's environment, so that the processes
    it starts do not inherit the secret. (The kernel's copy of the environment this
    process was started with, /proc/PID/environ, is readable by this user only.)"""
    for name in (ENV_PUBLIC, ENV_SECRET):
        os.environ.pop(name, None)


def keys_from_environment() -> ClusterKeys | None:
    """This process's keys (`set_process_keys`), else ``$AIORL_CURVE_*`` or a key
    file (``$AIORL_KEY_FILE``, then the default); None when ``AIORL_INSECURE=1``."""
    if _process_keys is not _UNSET:
        return _process_keys  # type: ignore[return-value]
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


# ---------------------------------------------------------------------------- private dirs
#: Longest base directory for session directories: a Unix socket path inside one
#: (``BASE/aiorl-XXXXXXXX/PID-XXXXXXXX``) must fit in sun_path (107 bytes on Linux).
_MAX_BASE_LEN = 70


def runtime_base() -> str:
    """The user's runtime directory ($XDG_RUNTIME_DIR: private, on tmpfs, cleared at
    logout) when it is usable, else the temporary directory."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and len(runtime) <= _MAX_BASE_LEN:
        try:
            check_private_directory(runtime)
            return runtime
        except AuthenticationError:
            log.debug("$XDG_RUNTIME_DIR %s is not a private directory; using the temp dir", runtime)
    base = tempfile.gettempdir()
    return base if len(base) <= _MAX_BASE_LEN else "/tmp"


def make_private_directory(prefix: str) -> str:
    """Create a fresh directory only this user can enter (mode 0700, random name, created
    atomically so nobody can have prepared it) under the user's runtime directory."""
    return tempfile.mkdtemp(prefix=prefix, dir=runtime_base())


def check_private_directory(path: str) -> None:
    """Raise [`AuthenticationError`][aiorl.AuthenticationError] unless ``path`` is a directory owned
    by this user that nobody else can enter: then nobody else can create, replace or connect
    to a Unix socket inside it.

    ``path`` itself must not be a symbolic link (``lstat``): in a shared directory such as
    /tmp another user can plant ``aiorl-clusters-<uid>`` as a link to one of *our* private
    directories, which would pass a check that follows it and have us write, list and
    remove files there."""
    try:
        # A trailing slash would make lstat follow a link: look at the name itself.
        info = os.lstat(os.fspath(path).rstrip("/") or "/")
    except OSError as exc:
        raise AuthenticationError(f"cannot use {path} for private sockets: {exc}") from None
    if stat.S_ISLNK(info.st_mode):
        raise AuthenticationError(
            f"{path} is a symbolic link (owner uid {info.st_uid}), not a private directory: "
            "someone may have planted it; remove it if it is not yours")
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise AuthenticationError(
            f"{path} is not a private directory (a directory of uid {os.getuid()} with mode "
            f"0700; found uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o})")


# ---------------------------------------------------------------------------- ZAP
_auth_lock = threading.Lock()
#: id(context) -> (context, its authenticator). The context is kept and compared, so that a
#: new context that reuses a dead one's id (after a fork, say) gets its own authenticator.
_authenticators: dict[int, tuple[Any, Any]] = {}
_allowed: dict[bytes, bytes] = {}  # cluster public key -> secret, for every cluster served here
_zap_peer = ""  # the address of the peer whose ZAP request is being checked (for the log)


def _authenticator_class() -> type:
    from zmq.auth.thread import ThreadAuthenticator

    class ClusterAuthenticator(ThreadAuthenticator):
        """Admits clients that hold one of this process's cluster keys; logs refusals.

        Replaces pyzmq's PLAIN check, which logs passwords at debug level."""

        async def handle_zap_message(self, msg: list[bytes]) -> None:
            global _zap_peer  # one request at a time on this thread: the refusal log names it
            _zap_peer = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
            await super().handle_zap_message(msg)

        def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
            expected = _allowed.get(username.encode() if isinstance(username, str) else username)
            got = password.encode() if isinstance(password, str) else password
            if expected is not None and hmac.compare_digest(expected, got):
                return True, b"OK"
            _refusals.warning("plain", "refused a connection from %s that did not present "
                              "this cluster's secret", _zap_peer or "a local process")
            return False, b"not a member of this cluster"

    return ClusterAuthenticator


class _ClusterKeyCheck:
    """ZAP credentials provider for CURVE: admit holders of an allowed cluster key."""

    def callback(self, domain: str, key: bytes) -> bool:
        if key in _allowed:
            return True
        _refusals.warning("curve", "refused a connection from %s that did not present this "
                          "cluster's key", _zap_peer)
        return False


def enable_server(sock: zmq.Socket[Any], keys: ClusterKeys) -> None:
    """Make ``sock`` a server that admits only holders of ``keys`` (ZAP-checked)."""
    ctx = sock.context
    with _auth_lock:
        _allowed[keys.public] = keys.secret
        known = _authenticators.get(id(ctx))
        if known is None or known[0] is not ctx:
            auth = _authenticator_class()(ctx, log=logging.getLogger("aiorl.security.zap"))
            with blocked():  # pyzmq's ZAP thread: SIGINT and SIGTERM are the main thread's
                auth.start()
            auth.configure_curve_callback(domain=ZAP_DOMAIN.decode(),
                                          credentials_provider=_ClusterKeyCheck())
            # Passwords are checked by ClusterAuthenticator; this only enables PLAIN here.
            auth.configure_plain(domain=ZAP_DOMAIN.decode(), passwords={"-": "-"})
            _authenticators[id(ctx)] = (ctx, auth)
    sock.zap_domain = ZAP_DOMAIN
    if keys.mechanism == "plain":
        sock.plain_server = True
    else:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True


def enable_client(sock: zmq.Socket[Any], keys: ClusterKeys) -> None:
    """Make ``sock`` a client presenting ``keys`` to servers of the same cluster; under
    CURVE it also pins the cluster's public key as the only server key it accepts."""
    if keys.mechanism == "plain":
        sock.plain_username = keys.public
        sock.plain_password = keys.secret
    else:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = keys.public
