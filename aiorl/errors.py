"""The one exception tree of aiorl.

Every error that aiorl raises on purpose derives from [`AiorlError`][aiorl.AiorlError], so a
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
    ├── ClusterClosedError   the Cluster is closed, or its embedded registry died (also RuntimeError)
    ├── AddressError         not a registry address (also ValueError)
    ├── PlacementError       an invalid placement string or strategy (also ValueError)
    ├── QueueFull            ``put_nowait`` on a full channel queue
    ├── QueueEmpty           ``get_nowait`` on an empty channel queue
    ├── RegistryUnavailable  the registry did not answer in time
    ├── AuthenticationError  a peer failed authentication
    └── ProtocolError        a malformed or incompatible message

Errors cross process boundaries as data, never as pickles: `to_wire`
describes an exception as a msgpack-able dict (class name, module, message,
traceback text, and a [`RemoteError`][aiorl.RemoteError]'s worker and rank), and
`from_wire` rebuilds it. Unpickling an error reply would run whatever
code the sender chose, and an error can come from a peer that has not proven
who it is (an ``--insecure`` cluster, or whoever answers a socket address).
A remote error is also an instance of its original class where that is a built-in, or a
class of a module this process has already imported, found by name (`remote_error`):
the class is never imported and none of its code runs.
"""

from __future__ import annotations

import asyncio
import builtins
import sys
import traceback
import types
from typing import Any, TypeVar

__all__ = [
    "AddressError",
    "AiorlError",
    "AuthenticationError",
    "ClusterClosedError",
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
    "WorkingDirError",
    "from_wire",
    "to_wire",
]


class AiorlError(Exception):
    """Base class of every error aiorl raises on purpose.

    Example:
        ```python
        try:
            group.step().wait(60)
        except aiorl.AiorlError as exc:   # any aiorl failure: remote, lost peer, timeout, ...
            log.error("step failed: %s", exc)
        ```
    """


class RemoteError(AiorlError):
    """A worker method raised an exception.

    Where the original type is a built-in exception (``KeyError``, ``ValueError``,
    ``TimeoutError``, ...), the error raised here is also an instance of it, as Ray's task
    errors are, so code written for the local case keeps working; so it is where the
    original type is a class of a module this process has imported (the driver's own
    exception classes: its script, its test module, its packages), found by its module and
    qualified name, never imported or unpickled (see `remote_error`). The remote traceback
    is kept either way.

    Example:
        ```python
        try:
            group.lookup("missing").wait()
        except KeyError as exc:          # a RemoteError too
            print(exc.rank, exc.remote_traceback)

        class QuotaExceeded(Exception): ...   # in the driver's script, raised by a worker
        try:
            group.spend(100).wait()
        except QuotaExceeded as exc:     # a RemoteError too
            print(exc.worker_name, exc.rank, exc.remote_traceback)
        ```

    Attributes:
        worker_name: the address of the worker that raised, e.g. ``"rollout:3"``.
        rank: the worker's rank in its group.
        exc_type: the qualified name of the original exception type.
        remote_traceback: the formatted traceback from the worker process.
        cause: the original exception, only where it was raised in this process;
            errors from other processes arrive as text (see `to_wire`).
    """

    worker_name: str
    rank: int
    exc_type: str
    message: str
    remote_traceback: str
    cause: BaseException | None

    def __init__(
        self,
        worker_name: str,
        rank: int,
        exc_type: str,
        message: str,
        remote_traceback: str,
        cause: BaseException | None = None,
    ) -> None:
        _set_remote_fields(self, worker_name, rank, exc_type, message, remote_traceback, cause)
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
    """A worker's ``__init__`` raised, or its process could not start.

    Every call to that rank fails with it, carrying ``__init__``'s traceback.

    Example:
        ```python
        group = Trainer.create_group(bad_cfg).launch(cluster, num_workers=2)
        try:
            group.wait_ready(60)
        except aiorl.WorkerInitError as exc:
            print(exc.rank, exc.remote_traceback)
        ```
    """


_R = TypeVar("_R", bound="RegistryError")


class RegistryError(RemoteError):
    """The registry refused a request; the message says why.

    It is a [`RemoteError`][aiorl.RemoteError] raised by the worker named ``"registry"`` at
    rank -1, so code that caught ``RemoteError`` around registry calls keeps
    working. Build one with [`from_message`][aiorl.RegistryError.from_message].

    Example:
        ```python
        try:
            Reward.create_group().launch(cluster, name="reward")
        except aiorl.RegistryError as exc:   # GroupExistsError here
            print(exc)                       # the registry's reason, alone
        ```
    """

    @classmethod
    def from_message(cls: type[_R], message: str, remote_traceback: str = "") -> _R:
        """The error the registry raised with ``message`` (worker ``"registry"``, rank -1)."""
        return cls("registry", -1, cls.__name__, message, remote_traceback)

    def __str__(self) -> str:
        return self.message


class NotFoundError(RegistryError, LookupError):
    """The registry has no such group, worker or node (also a `LookupError`).

    Example:
        ```python
        try:
            reward = WorkerGroup.from_group_name(cluster, Reward, "reward")
        except LookupError:               # aiorl.NotFoundError and its subclasses
            reward = Reward.create_group().launch(cluster, name="reward")
        ```
    """


class GroupNotFoundError(NotFoundError):
    """No live worker group has this name.

    Example:
        ```python
        try:
            self.recv("nobody", 0).wait(5)
        except aiorl.GroupNotFoundError as exc:
            print(exc)                    # ... no worker group named 'nobody' exists ...
        ```
    """


class WorkerNotFoundError(NotFoundError):
    """The group exists, but has no worker of this name or rank.

    Example:
        ```python
        try:
            await self.send(batch, "trainer", 99)   # trainer has 2 ranks
        except aiorl.WorkerNotFoundError as exc:
            print(exc)
        ```
    """


class ConflictError(RegistryError, ValueError):
    """The request conflicts with the registry's state (a name or rank already taken); also a
    `ValueError`.

    Example:
        ```python
        try:
            Reward.create_group().launch(cluster, name="reward")
        except ValueError:                # aiorl.ConflictError: the name is taken
            ...
        ```
    """


class GroupExistsError(ConflictError):
    """A live worker group already has this name (a `ValueError`).

    Example:
        ```python
        Reward.create_group().launch(cluster, name="reward")
        try:
            Reward.create_group().launch(cluster, name="reward")
        except aiorl.GroupExistsError as exc:
            print(exc)                    # a worker group named 'reward' already exists
        ```
    """


class NodeRankTakenError(ConflictError):
    """Another live node agent already holds this node rank.

    The registry refuses an ``aiorl-node --node-rank R`` while another live agent holds
    rank ``R``; leave ``--node-rank`` out to get the lowest free rank.

    Example:
        ```console
        $ aiorl-node --registry tcp://head:6380 --node-rank 0 --key-file cluster.key
        ... NodeRankTakenError: node rank 0 is already taken by another live node
        ```
    """


class WaitTimeout(AiorlError, TimeoutError):
    """A wait (``AsyncWork.wait``, a blocking call, resolving a worker) ran out of time; also a
    `TimeoutError`. The work is cancelled locally; remote code already running goes on.

    Example:
        ```python
        try:
            group.slow_step().wait(timeout=5)
        except TimeoutError:              # aiorl.WaitTimeout
            ...
        ```
    """


class PeerLostError(AiorlError):
    """The peer of a pending or new operation died or became unreachable.

    The message names the worker, how it died and its last output lines (docs/failures.md).

    Example:
        ```python
        try:
            results = group.step().wait()
        except aiorl.PeerLostError as exc:
            print(exc)                    # worker rollout:3 (pid ...) was killed by SIGKILL ...
            group.close()
        ```
    """


class ConnectionLostError(PeerLostError):
    """The connection a request travelled on broke, and neither its answer nor a verdict on
    the peer came in time (a `PeerLostError`, so one ``except`` clause still covers both).

    The peer may still be alive and may still run the request: aiorl does not send a request
    twice when it cannot prove that the first one never arrived. Later requests to the same
    peer take a new connection (docs/reference/contract.md, "Connections").

    Example:
        ```python
        try:
            result = group.execute_on(0).step().wait()
        except aiorl.ConnectionLostError as exc:
            print(exc)   # ... the connection to ipc://... broke (the peer closed it) ...
            result = group.execute_on(0).step().wait()   # only if step() may run twice
        ```
    """


class ClusterClosedError(AiorlError, RuntimeError):
    """The [`Cluster`][aiorl.Cluster] this operation goes through is closed (also a
    `RuntimeError`): ``close()`` or the end of its ``with`` block stopped it, or its
    embedded registry died (then the Cluster closed itself and stopped its workers).

    Every call, wait for readiness, channel operation and launch on a closed Cluster raises it
    at once; work that was still pending when it closed failed with
    [`PeerLostError`][aiorl.PeerLostError] naming the same reason (docs/failures.md).

    Example:
        ```python
        cluster.close()
        try:
            group.step().wait()
        except aiorl.ClusterClosedError as exc:
            print(exc)                    # this Cluster is closed (...); create a new aiorl.Cluster()
        ```
    """


class AddressError(AiorlError, ValueError):
    """A registry address that cannot be one (also a `ValueError`); the message quotes
    it, says where it came from and shows the forms accepted: ``tcp://HOST:PORT``,
    ``HOST:PORT`` (meaning ``tcp://HOST:PORT``) and ``ipc://PATH``.

    Example:
        ```python
        try:
            aiorl.Cluster(registry="head")            # no port
        except aiorl.AddressError as exc:
            print(exc)                    # registry='head' is not a registry address: ...
        ```
    """


class PlacementError(AiorlError, ValueError):
    """An invalid placement string, node group or strategy (also a `ValueError`); the
    message quotes the offending segment and the rule it breaks.

    Example:
        ```python
        try:
            Trainer.create_group().launch(cluster, "0-9")   # the cluster has 8 GPUs
        except aiorl.PlacementError as exc:
            print(exc)                    # '0-9': resource rank 9 is out of range; ...
        ```
    """


class WorkingDirError(AiorlError, ValueError):
    """A working directory that cannot be shipped to the nodes (also a `ValueError`): over
    its size limit, holding a symbolic link that leaves it, or missing; or an archive a node
    refuses to unpack. The message names the entry and what to do.

    Example:
        ```python
        try:
            cluster = aiorl.Cluster(working_dir="~/project")
        except aiorl.WorkingDirError as exc:   # e.g. a checkpoint left in the directory
            print(exc)     # ... holds 812.0 MiB of files, more than its limit of 100.0 MiB ...
        ```
    """


class QueueFull(AiorlError, asyncio.QueueFull):
    """``put_nowait`` found the channel queue full (also an `asyncio.QueueFull`).

    Example:
        ```python
        try:
            channel.put_nowait(item)
        except aiorl.QueueFull:
            dropped += 1
        ```
    """


class QueueEmpty(AiorlError, asyncio.QueueEmpty):
    """``get_nowait`` found the channel queue empty (also an `asyncio.QueueEmpty`).

    Example:
        ```python
        try:
            item = channel.get_nowait()
        except aiorl.QueueEmpty:
            item = None
        ```
    """


class RegistryUnavailable(AiorlError):
    """The registry did not answer within the timeout, or refused this process's key.

    The message tells the two apart where the client can: "refused: wrong or missing key"
    when the registry rejected the handshake, "no answer from tcp://... (wrong address, or a
    key mismatch)" when it heard nothing (under CURVE, a wrong key is silence).

    Example:
        ```python
        try:
            cluster = aiorl.Cluster(registry="tcp://head:6380", key_file="cluster.key")
        except aiorl.RegistryUnavailable as exc:
            sys.exit(f"cannot reach the cluster: {exc}")
        ```
    """


class AuthenticationError(AiorlError):
    """A peer failed authentication (e.g. wrong CURVE keys), or a key cannot be used here
    (PLAIN over TCP, a socket directory others can enter); docs/security.md.

    Example:
        ```python
        try:
            cluster = aiorl.Cluster(registry="tcp://head:6380", key_file="cluster.key")
        except (aiorl.AuthenticationError, aiorl.RegistryUnavailable) as exc:
            sys.exit(f"check the key file: {exc}")
        ```
    """


class ProtocolError(AiorlError):
    """A message was malformed, truncated, or of an unknown protocol version.

    Seen when processes of different aiorl versions meet, or something that is not aiorl
    talks to an aiorl port; the message names the field.

    Example:
        ```python
        try:
            group.step().wait()
        except aiorl.ProtocolError as exc:   # e.g. a worker started from another aiorl version
            print(exc)
        ```
    """


# ---------------------------------------------------------------------------- wire codec
#: The classes :func:`from_wire` rebuilds by name: aiorl's own. Any other type (a
#: builtin ``ValueError`` included) arrives as a :class:`RemoteError` naming it, so a
#: failure in another process is always recognisable as remote, and nothing the sender
#: names is ever imported or instantiated here (`remote_error` may derive a RemoteError
#: subclass from a class already imported, and runs none of its code).
_WIRE_CLASSES: dict[str, type[AiorlError]] = {
    cls.__name__: cls
    for cls in (globals().get(name) for name in __all__)
    if isinstance(cls, type) and issubclass(cls, AiorlError)
}


def to_wire(exc: BaseException, **extra: Any) -> dict[str, Any]:
    """Describe ``exc`` as plain data for an ERROR reply.

    A [`RemoteError`][aiorl.RemoteError] keeps its own worker, rank, original type and remote
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
    """Rebuild the exception that `to_wire` described, without running any code
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


#: "builtins.KeyError" -> the RemoteError subclass that is also a KeyError (or RemoteError).
_DERIVED_REMOTE_CLASSES: dict[str, type[RemoteError]] = {}
#: A class of an imported module -> the RemoteError subclass that is also an instance of it.
#: Keyed by the class, not its name: a module run again (a notebook cell, a reload) defines
#: a new class under the same name, and ``except`` names the new one.
_MIRRORED_CLASSES: dict[type, type[RemoteError]] = {}
#: Exceptions that change control flow where they are raised: never mirrored.
_CONTROL_FLOW = (AiorlError, StopIteration, StopAsyncIteration, GeneratorExit, KeyboardInterrupt,
                 SystemExit, asyncio.CancelledError)
#: What would run a class's own code as it is subclassed, instantiated, filled or freed: a
#: class (outside ``builtins``) in whose MRO one is defined is not mirrored.
_CODE_HOOKS = ("__new__", "__init_subclass__", "__setattr__", "__getattribute__", "__del__")
#: The longest type name looked up (the name comes from another process).
_MAX_TYPE_NAME = 512
_class_dict = vars(type)["__dict__"].__get__  # a class's own namespace: no hook runs
_module_dict = vars(types.ModuleType)["__dict__"].__get__  # a module's: no __getattr__ runs


def remote_error(worker_name: str, rank: int, exc_type: str, message: str,
                 remote_traceback: str) -> RemoteError:
    """A [`RemoteError`][aiorl.RemoteError] for a remote exception of type ``exc_type`` (a qualified
    name).

    Where the type allows, the error is also an instance of the original type, as Ray's task
    errors are: ``except KeyError`` catches a worker's ``KeyError`` (``"builtins.KeyError"``),
    ``except ValueError`` a registry refusal a worker met (``"aiorl.errors.GroupExistsError"``:
    every registry error and ``PlacementError`` qualify), also when passed on by another
    worker (``"aiorl.errors.RemoteError(KeyError)"``). The class is derived once per type and
    cached. A type whose instance layout or constructor cannot be combined
    with ``RemoteError`` (``UnicodeDecodeError``, which checks its arguments) gives a plain
    ``RemoteError``; so do ``StopIteration`` and ``StopAsyncIteration``, which would change
    control flow where they are raised.

    Any other type (``"train.QuotaExceeded"``: a class of the driver's script, its test
    module, a package it imported) is looked up by its module and qualified name among the
    modules this process has *already imported* (``sys.modules``), through their namespaces
    (no module ``__getattr__`` runs); nothing is imported and nothing from the wire is
    unpickled, so the sender can pick among classes this process already has, never bring
    one. The error is also an instance of the class found when it is a ``BaseException``
    subclass whose module and qualified name are the ones named, with ``type`` as its
    metaclass, none of `_CODE_HOOKS` defined outside ``builtins`` (its ``__init__`` is not
    run either: the error has ``RemoteError``'s fields, not the attributes the class's own
    ``__init__`` sets) and none of the control-flow types `_CONTROL_FLOW` among its bases.
    A class defined inside a function (``f.<locals>.E``) is not found, nor one nested in a
    class of a module shipped by value (cloudpickle names it ``module.Inner``). Otherwise
    the error is a plain ``RemoteError``.

    Example:
        ```python
        err = remote_error("rollout:3", 3, "builtins.KeyError", "'x'", "Traceback ...")
        assert isinstance(err, KeyError) and isinstance(err, RemoteError)
        ```
    """
    fields = (worker_name, rank, exc_type, message, remote_traceback)
    cls = _DERIVED_REMOTE_CLASSES.get(exc_type)
    if cls is None:
        qualified = _imported_type_name(exc_type)
        if qualified is not None:  # resolved afresh every time: modules come and go
            return _mirror_imported_class(qualified, fields)(*fields)
        cls = _derive_remote_class(exc_type, fields)
        if len(_DERIVED_REMOTE_CLASSES) < 256:  # the types are finite; bound it anyway
            _DERIVED_REMOTE_CLASSES[exc_type] = cls
    return cls(*fields)


def _imported_type_name(exc_type: str) -> str | None:
    """The ``module.qualname`` to look up among imported modules, or None for a built-in
    or one of aiorl's classes (the fixed tables decide those; aiorl's other exceptions, such
    as ``UnawaitedWorkError``, carry state that does not travel):
    ``"aiorl.errors.RemoteError(m.E)"``, a mirrored error a worker passed on, names ``"m.E"``."""
    wrapped = f"{__name__}.RemoteError("
    name = exc_type[len(wrapped):-1] if exc_type.startswith(wrapped) and exc_type.endswith(
        ")") else exc_type
    module = name.rpartition(".")[0]
    return None if module in ("", "builtins") or f"{module}.".startswith("aiorl.") else name


def _mirror_imported_class(qualified: str, fields: tuple[Any, ...]) -> type[RemoteError]:
    """The RemoteError subclass that is also an instance of the class ``qualified`` names
    among imported modules, or RemoteError (`remote_error` says which classes qualify)."""
    base = _imported_exception_class(qualified)
    if base is None:
        return RemoteError
    cls = _MIRRORED_CLASSES.get(base)
    if cls is None:
        namespace = {"__module__": __name__, "__qualname__": f"RemoteError({qualified})",
                     "__str__": RemoteError.__str__, "__init__": _init_remote_fields_only}
        try:
            cls = type(f"RemoteError({qualified})", (RemoteError, base), namespace)
            cls(*fields)  # a layout that cannot be combined (slots, a C base) fails here
        except Exception:  # noqa: BLE001 - then the error is a plain RemoteError
            cls = RemoteError
        if len(_MIRRORED_CLASSES) < 256:
            _MIRRORED_CLASSES[base] = cls
    return cls


def _imported_exception_class(qualified: str) -> type[BaseException] | None:
    """The class named ``qualified`` (``module.qualname``) in a module already in
    ``sys.modules``, if it qualifies (`remote_error`); nothing is imported, no hook runs."""
    if len(qualified) > _MAX_TYPE_NAME:
        return None
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest module name first
        module = sys.modules.get(".".join(parts[:cut]))
        if not isinstance(module, types.ModuleType):
            continue
        obj: Any = _module_dict(module).get(parts[cut])
        for part in parts[cut + 1:]:  # a nested class: Outer.Inner
            obj = _class_dict(obj).get(part) if type(obj) is type else None
        if (type(obj) is type and issubclass(obj, BaseException)
                and f"{obj.__module__}.{obj.__qualname__}" == qualified
                and not issubclass(obj, _CONTROL_FLOW)
                and not any(hook in _class_dict(klass) for klass in obj.__mro__
                            if klass.__module__ != "builtins" for hook in _CODE_HOOKS)):
            return obj
    return None


def _init_remote_fields_only(self: RemoteError, worker_name: str, rank: int, exc_type: str,
                             message: str, remote_traceback: str,
                             cause: BaseException | None = None) -> None:
    """``RemoteError.__init__`` for a mirrored class of an imported module: that class's own
    ``__init__`` (which may take other arguments, or run code) is left out."""
    _set_remote_fields(self, worker_name, rank, exc_type, message, remote_traceback, cause)
    BaseException.__init__(self, worker_name, rank, exc_type, message, remote_traceback)


def _set_remote_fields(self: RemoteError, worker_name: str, rank: int, exc_type: str,
                       message: str, remote_traceback: str,
                       cause: BaseException | None) -> None:
    """The fields every RemoteError carries (one place for both ways of initialising one)."""
    self.worker_name = worker_name
    self.rank = rank
    self.exc_type = exc_type
    self.message = message
    self.remote_traceback = remote_traceback
    self.cause = cause


def _derive_remote_class(exc_type: str, fields: tuple[Any, ...]) -> type[RemoteError]:
    """The class `remote_error` caches for ``exc_type`` (``fields`` try it out)."""
    module, _, name = exc_type.rpartition(".")
    if module == __name__ and name.startswith("RemoteError(") and name.endswith(")"):
        name = name[len("RemoteError("):-1]  # a worker passed on a derived error
        module = __name__ if name in _WIRE_CLASSES else "builtins"
    base: Any = None
    if module == "builtins":
        base = getattr(builtins, name, None)
        if not (isinstance(base, type) and issubclass(base, Exception)) or issubclass(
                base, (AiorlError, StopIteration, StopAsyncIteration)):  # those change control flow
            return RemoteError
    elif module == __name__ and issubclass(_WIRE_CLASSES.get(name, AiorlError),
                                           (RegistryError, PlacementError)):
        base = _WIRE_CLASSES[name]  # "not found", "exists", a bad placement, met by a worker
    else:
        return RemoteError
    # A RemoteError subclass (a registry error a worker met) is derived from alone; its
    # str() names the worker that passed it on, as every RemoteError's does.
    bases = (base,) if issubclass(base, RemoteError) else (RemoteError, base)
    try:
        derived: type[RemoteError] = type(
            f"RemoteError({name})", bases, {"__module__": __name__, "__qualname__":
                                            f"RemoteError({name})", "__str__": RemoteError.__str__})
        derived(*fields)  # some built-ins check their arguments (UnicodeDecodeError)
    except TypeError:  # an instance layout or constructor that cannot be combined
        return RemoteError
    return derived


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ("" if value is None else repr(value))
