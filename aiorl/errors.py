"""The one exception tree of aiorl.

Every error that aiorl raises on purpose derives from :class:`AiorlError`, so a
caller can catch the whole family with one ``except`` clause, and each subclass
names one kind of problem::

    AiorlError
    ├── RemoteError          a worker method raised; carries rank, type, traceback
    │   ├── WorkerInitError  a worker's ``__init__`` raised
    │   └── RegistryError    the registry refused a request (worker "registry", rank -1)
    │       ├── NotFoundError (also LookupError)
    │       │   ├── GroupNotFoundError
    │       │   └── WorkerNotFoundError
    │       └── ConflictError (also ValueError)
    │           ├── GroupExistsError
    │           └── NodeRankTakenError
    ├── WaitTimeout          a wait ran out of time (also TimeoutError)
    ├── PeerLostError        the peer died or became unreachable
    ├── PlacementError       an invalid placement string or strategy (also ValueError)
    ├── QueueFull            ``put_nowait`` on a full channel queue
    ├── QueueEmpty           ``get_nowait`` on an empty channel queue
    ├── RegistryUnavailable  the registry did not answer in time
    ├── AuthenticationError  a peer failed authentication
    └── ProtocolError        a malformed or incompatible message

Errors cross process boundaries as data, never as pickles: :func:`to_wire`
describes an exception as a msgpack-able dict (class name, module, message,
traceback text, and a :class:`RemoteError`'s worker and rank), and
:func:`from_wire` rebuilds it. Unpickling an error reply would run whatever
code the sender chose, and an error can come from a peer that has not proven
who it is (an ``--insecure`` cluster, or whoever answers a socket address).
"""

from __future__ import annotations

import asyncio
import builtins
import traceback
from typing import Any, TypeVar

__all__ = [
    "AiorlError",
    "AuthenticationError",
    "ConflictError",
    "GroupExistsError",
    "GroupNotFoundError",
    "NodeRankTakenError",
    "NotFoundError",
    "PeerLostError",
    "PlacementError",
    "ProtocolError",
    "QueueEmpty",
    "QueueFull",
    "RegistryError",
    "RegistryUnavailable",
    "RemoteError",
    "WaitTimeout",
    "WorkerInitError",
    "WorkerNotFoundError",
    "from_wire",
    "to_wire",
]


class AiorlError(Exception):
    """Base class of every error aiorl raises on purpose."""


class RemoteError(AiorlError):
    """A worker method raised an exception.

    Where the original type is a built-in exception (``KeyError``, ``ValueError``,
    ``TimeoutError``, ...), the error raised here is also an instance of it, as Ray's task
    errors are, so code written for the local case keeps working; the remote traceback is
    kept either way::

        try:
            group.lookup("missing").wait()
        except KeyError as exc:          # a RemoteError too
            print(exc.rank, exc.remote_traceback)

    Attributes:
        worker_name: the address of the worker that raised, e.g. ``"rollout:3"``.
        rank: the worker's rank in its group.
        exc_type: the qualified name of the original exception type.
        remote_traceback: the formatted traceback from the worker process.
        cause: the original exception, only where it was raised in this process;
            errors from other processes arrive as text (see :func:`to_wire`).
    """

    def __init__(
        self,
        worker_name: str,
        rank: int,
        exc_type: str,
        message: str,
        remote_traceback: str,
        cause: BaseException | None = None,
    ) -> None:
        self.worker_name = worker_name
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.cause = cause
        super().__init__(worker_name, rank, exc_type, message, remote_traceback)

    def __str__(self) -> str:
        return (
            f"{self.exc_type} in worker {self.worker_name} (rank {self.rank}): {self.message}\n"
            f"--- remote traceback ---\n{self.remote_traceback.rstrip()}"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # keep every field when the error itself crosses a process boundary
        fields = (self.worker_name, self.rank, self.exc_type, self.message, self.remote_traceback)
        if type(self).__qualname__.startswith("RemoteError("):  # derived: rebuilt from the type name
            return (remote_error, fields)
        return (type(self), (*fields, None))


class WorkerInitError(RemoteError):
    """A worker's ``__init__`` raised, or its process could not start."""


_R = TypeVar("_R", bound="RegistryError")


class RegistryError(RemoteError):
    """The registry refused a request; the message says why.

    It is a :class:`RemoteError` raised by the worker named ``"registry"`` at
    rank -1, so code that caught ``RemoteError`` around registry calls keeps
    working. Build one with :meth:`from_message`.
    """

    @classmethod
    def from_message(cls: type[_R], message: str, remote_traceback: str = "") -> _R:
        return cls("registry", -1, cls.__name__, message, remote_traceback)

    def __str__(self) -> str:
        return self.message


class NotFoundError(RegistryError, LookupError):
    """The registry has no such group, worker or node."""


class GroupNotFoundError(NotFoundError):
    """No live worker group has this name."""


class WorkerNotFoundError(NotFoundError):
    """The group exists, but has no worker of this name or rank."""


class ConflictError(RegistryError, ValueError):
    """The request conflicts with the registry's state (a name or rank already taken)."""


class GroupExistsError(ConflictError):
    """A live worker group already has this name."""


class NodeRankTakenError(ConflictError):
    """Another live node agent already holds this node rank."""


class WaitTimeout(AiorlError, TimeoutError):
    """A wait (``AsyncWork.wait``, a blocking call, resolving a worker) ran out of time."""


class PeerLostError(AiorlError):
    """The peer of a pending or new operation died or became unreachable."""


class PlacementError(AiorlError, ValueError):
    """An invalid placement string, node group or strategy."""


class QueueFull(AiorlError, asyncio.QueueFull):
    """``put_nowait`` found the channel queue full (also an :class:`asyncio.QueueFull`)."""


class QueueEmpty(AiorlError, asyncio.QueueEmpty):
    """``get_nowait`` found the channel queue empty (also an :class:`asyncio.QueueEmpty`)."""


class RegistryUnavailable(AiorlError):
    """The registry did not answer within the timeout."""


class AuthenticationError(AiorlError):
    """A peer failed authentication (e.g. wrong CURVE keys)."""


class ProtocolError(AiorlError):
    """A message was malformed, truncated, or of an unknown protocol version."""


# ---------------------------------------------------------------------------- wire codec
#: The classes :func:`from_wire` rebuilds by name: aiorl's own. Any other type (a
#: builtin ``ValueError`` included) arrives as a :class:`RemoteError` naming it, so a
#: failure in another process is always recognisable as remote and nothing the sender
#: names is ever imported or instantiated here.
_WIRE_CLASSES: dict[str, type[AiorlError]] = {
    cls.__name__: cls
    for cls in (globals().get(name) for name in __all__)
    if isinstance(cls, type) and issubclass(cls, AiorlError)
}


def to_wire(exc: BaseException, **extra: Any) -> dict[str, Any]:
    """Describe ``exc`` as plain data for an ERROR reply.

    A :class:`RemoteError` keeps its own worker, rank, original type and remote
    traceback (forwarded unchanged); ``extra`` (e.g. ``error="RemoteError"``,
    ``worker=``, ``rank=`` from a worker wrapping whatever its method raised)
    overrides any field.
    """
    cls = type(exc)
    meta: dict[str, Any] = {
        "error": cls.__name__ if _WIRE_CLASSES.get(cls.__name__) is cls else "RemoteError",
        "module": cls.__module__,
        "type": f"{cls.__module__}.{cls.__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(cls, exc, exc.__traceback__)),
    }
    if isinstance(exc, RemoteError) and "worker" not in extra:
        meta.update(worker=exc.worker_name, rank=exc.rank, type=exc.exc_type,
                    message=exc.message, traceback=exc.remote_traceback)
    meta.update(extra)
    return meta


def from_wire(meta: Any) -> BaseException:
    """Rebuild the exception that :func:`to_wire` described, without running any code
    the sender chose: only aiorl's classes are rebuilt as themselves."""
    if not isinstance(meta, dict):
        return ProtocolError(f"malformed error reply: {meta!r:.200}")
    name = meta.get("error")
    cls = _WIRE_CLASSES.get(name) if isinstance(name, str) else None
    message = _text(meta.get("message"))
    if cls is None or issubclass(cls, RemoteError):
        rank = meta.get("rank")
        fields = (_text(meta.get("worker", "?")), rank if isinstance(rank, int) else -1,
                  _text(meta.get("type", name)), message, _text(meta.get("traceback")))
        return remote_error(*fields) if cls in (None, RemoteError) else cls(*fields)
    return cls(message)


#: "builtins.KeyError" -> the RemoteError subclass that also derives from KeyError.
_BUILTIN_REMOTE_CLASSES: dict[str, type[RemoteError]] = {}


def remote_error(worker_name: str, rank: int, exc_type: str, message: str,
                 remote_traceback: str) -> RemoteError:
    """A :class:`RemoteError` for a remote exception of type ``exc_type`` (a qualified name).

    For a built-in exception type (``"builtins.KeyError"``) the error is an instance of a
    subclass of both ``RemoteError`` and that type, made once per type and cached, so that
    ``except KeyError`` catches it. Only built-ins are looked up (by name, in the
    ``builtins`` module): nothing the sender names is imported. A type whose instance
    layout or constructor cannot be combined with ``RemoteError`` (``UnicodeDecodeError``,
    which checks its arguments) gives a plain ``RemoteError``; so do ``StopIteration`` and
    ``StopAsyncIteration``, which would change control flow where they are raised.

    Example::

        err = remote_error("rollout:3", 3, "builtins.KeyError", "'x'", "Traceback ...")
        assert isinstance(err, KeyError) and isinstance(err, RemoteError)
    """
    fields = (worker_name, rank, exc_type, message, remote_traceback)
    cls = _BUILTIN_REMOTE_CLASSES.get(exc_type)
    if cls is None:
        cls = RemoteError
        module, _, name = exc_type.rpartition(".")
        base = getattr(builtins, name, None) if module == "builtins" else None
        if isinstance(base, type) and issubclass(base, Exception) and not issubclass(
                base, (AiorlError, StopIteration, StopAsyncIteration)):  # those change control flow
            try:
                derived = type(f"RemoteError({name})", (RemoteError, base),
                               {"__module__": __name__, "__qualname__": f"RemoteError({name})"})
                derived(*fields)  # some built-ins check their arguments (UnicodeDecodeError)
                cls = derived
            except TypeError:  # an instance layout or constructor that cannot be combined
                pass
        if len(_BUILTIN_REMOTE_CLASSES) < 256:  # built-ins are finite; bound it anyway
            _BUILTIN_REMOTE_CLASSES[exc_type] = cls
    return cls(*fields)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ("" if value is None else repr(value))
