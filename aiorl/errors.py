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
"""

from __future__ import annotations

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
]


class AiorlError(Exception):
    """Base class of every error aiorl raises on purpose."""


class RemoteError(AiorlError):
    """A worker method raised an exception.

    Attributes:
        worker_name: the address of the worker that raised, e.g. ``"rollout:3"``.
        rank: the worker's rank in its group.
        exc_type: the qualified name of the original exception type.
        remote_traceback: the formatted traceback from the worker process.
        cause: the original exception, when it could be unpickled on this side.
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

    def __reduce__(self):  # keep every field when the error itself crosses a process boundary
        return (
            type(self),
            (
                self.worker_name,
                self.rank,
                self.exc_type,
                self.message,
                self.remote_traceback,
                None,
            ),
        )


class WorkerInitError(RemoteError):
    """A worker's ``__init__`` raised, or its process could not start."""


class RegistryError(RemoteError):
    """The registry refused a request; the message says why.

    It is a :class:`RemoteError` raised by the worker named ``"registry"`` at
    rank -1, so code that caught ``RemoteError`` around registry calls keeps
    working. Build one with :meth:`from_message`.
    """

    @classmethod
    def from_message(cls, message: str, remote_traceback: str = "") -> RegistryError:
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


class QueueFull(AiorlError):
    """``put_nowait`` found the channel queue full."""


class QueueEmpty(AiorlError):
    """``get_nowait`` found the channel queue empty."""


class RegistryUnavailable(AiorlError):
    """The registry did not answer within the timeout."""


class AuthenticationError(AiorlError):
    """A peer failed authentication (e.g. wrong CURVE keys)."""


class ProtocolError(AiorlError):
    """A message was malformed, truncated, or of an unknown protocol version."""
