"""Registry addresses: the forms aiorl accepts, normalised in one place.

``Cluster(registry=...)`` (and Ray's spelling ``address=``), ``$AIORL_REGISTRY``,
``aiorl status --registry`` (and every ``aiorl`` command that reaches a cluster) and
``aiorl-node --registry`` all pass what they were given through `normalize_address`,
so each accepts the same forms and refuses the same mistakes with the same message:

* ``tcp://HOST:PORT`` (``HOST`` a name, an IPv4 address or a bracketed IPv6 one);
* ``HOST:PORT``, meaning ``tcp://HOST:PORT``;
* ``ipc://PATH``, a Unix socket (what an embedded cluster's registry listens on).

Anything else raises [`AddressError`][aiorl.AddressError] (a ``ValueError``) naming the value, where
it came from and the forms above, instead of a raw ZMQ error from deep in a connect.
"""

from __future__ import annotations

import re

from aiorl.errors import AddressError

__all__ = ["EXPECTED_FORMS", "normalize_address"]

#: What the error message shows as the accepted forms.
EXPECTED_FORMS = ("tcp://HOST:PORT (e.g. tcp://head:6380), HOST:PORT (the same: tcp:// is "
                  "implied) or ipc://PATH")

_HOST = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")
_IPV6 = re.compile(r"\[[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?\]")


def normalize_address(value: object, source: str = "registry address") -> str:
    """``value`` as the address aiorl connects to: ``tcp://HOST:PORT`` or ``ipc://PATH``.

    ``source`` says where the value came from (``"Cluster(registry=...)"``,
    ``"$AIORL_REGISTRY"``, ``"--registry"``); the error message starts with it.

    Example:
        ```python
        normalize_address("head:6380")          # 'tcp://head:6380'
        normalize_address("tcp://10.0.0.2:6380")  # unchanged
        normalize_address("head")               # AddressError: ... no port ...
        ```

    Raises:
        AddressError: ``value`` cannot be an address (a ``ValueError``).
    """
    if not isinstance(value, str):
        raise _error(source, value, f"not a string (got {type(value).__name__})")
    text = value.strip()
    if not text:
        raise _error(source, value, "it is empty (omit it for an embedded cluster)")
    if text in ("auto", "local"):
        raise _error(source, value, f"Ray's {text!r} has no equivalent here (omit the address "
                                    "for an embedded cluster)")
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "tcp", text
    elif scheme == "ipc":
        if not rest:
            raise _error(source, value, "ipc:// needs the path of the socket")
        return text
    elif scheme != "tcp":
        raise _error(source, value, f"aiorl speaks tcp:// and ipc://, not {scheme}://")
    host, colon, port = rest.rpartition(":")
    if not colon:
        raise _error(source, value, "it has no port")
    if not (_HOST.fullmatch(host) or _IPV6.fullmatch(host)):
        why = ("an IPv6 address needs brackets, [ADDRESS]:PORT" if ":" in host
               else "'*' is what a server binds, not an address to connect to" if host == "*"
               else f"{host!r} is not a host name or IP address" if host else "it has no host")
        raise _error(source, value, why)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise _error(source, value, f"the port {port!r} is not a number from 1 to 65535")
    return f"tcp://{host}:{int(port)}"


def _error(source: str, value: object, why: str) -> AddressError:
    return AddressError(f"{source}: {value!r} is not a registry address: {why}. Expected "
                        f"{EXPECTED_FORMS}.")
