"""The payload-path protocol: how one kind of transfer plugs into a Sender and an Inbox.

A *payload path* moves the bytes of a message that do not travel inline. It has two
halves, each instantiated per peer and owning that peer's state (a segment pool, a
probe result, an NCCL pair, its completion tokens), its loss and its close:

* a `SendPath` per (path, destination), created by the `Sender`
  once the destination is resolved (``create`` returns None where the path cannot
  apply, e.g. shared memory toward another node);
* a `RecvPath` per (path, source), created by the `Inbox`
  when a message or a set-up question first names it.

A path is described by a `PathSpec` (its wire tag, its slot in the control
message, its two halves); `aiorl.p2p.paths.PATHS` lists them in order of
preference. The Sender tries, for a message's CPU bytes and then for its CUDA
tensors, the first path of the slot whose ``fits`` holds and whose ``place`` does not
decline. Adding a path is adding a module and one line to that list.

The two `Protocol` classes stay the typed contract: the Sender and the Inbox
are written against them alone, and anything with those members is a path (a test double
need not inherit anything). Most paths need only some of the members, though: no set-up
question, nothing acknowledged, nothing held per peer. `SendPathBase` and
`RecvPathBase` implement the protocols with those defaults, so a path subclasses them
and writes only what differs, at least ``place`` and ``accept``: those two are abstract in the
protocols, so a subclass that forgets one fails at its first ``create``. Base
classes with defaults rather than ABCs *instead of* the protocols, because the contract
should not require inheritance; rather than defaults *in* the protocols, because a protocol's
method bodies are not inherited by the classes that match it structurally.
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, TypeVar

from aiorl.errors import NotFoundError, PeerLostError, ProtocolError
from aiorl.runtime.waiter import BlockingWaiter, Job

if TYPE_CHECKING:
    from aiorl.p2p.message import InMessage, OutMessage, PostedRecv
    from aiorl.protocol.p2p import Hello, HelloReply, PathAck, PathControl, TransferDone
    from aiorl.transport.endpoint import Endpoint

__all__ = [
    "Destination",
    "PathHost",
    "PathSpec",
    "PathStatistics",
    "Placed",
    "RecvPath",
    "RecvPathBase",
    "SendPath",
    "SendPathBase",
    "fail",
    "lost_error",
    "resolve",
    "watch_completion",
]


class PathHost(Protocol):
    """What a payload path may use of its engine (the engine is one)."""

    loop: asyncio.AbstractEventLoop
    endpoint: Endpoint
    name: str  # this worker's name: the ``src`` of its control messages
    pid: int
    node_id: str | None
    waiter: BlockingWaiter

    @property
    def closed(self) -> bool: ...

    def on_loop(self) -> bool: ...

    def call_soon_threadsafe(self, fn: Callable[..., object], *args: Any) -> None: ...


class Destination(Protocol):
    """What a sending half knows of its destination (the Sender is one)."""

    name: str
    address: str | None  # set once resolved, before any path is created
    same_node: bool

    def next_token(self) -> int:
        """A completion token unique toward this destination (``p2p.done`` names it)."""
        ...


class Placed(NamedTuple):
    """Where a path put a message's bytes, and what the Sender must do about it."""

    desc: list[Any]  # the path's descriptor: goes into the control message
    #: Completes when the sender may reuse the bytes (None: already).
    done: asyncio.Future[None] | None = None
    #: Called when the control message could not leave (give back what ``place`` took).
    undo: Callable[[], object] | None = None
    #: Called once the control message left; returns the completion future (CUDA transfers
    #: are issued only then, so a message that never left never pairs up with a receive).
    after_send: Callable[[], asyncio.Future[None]] | None = None


@dataclass(frozen=True)
class PathStatistics:
    """One path's view of one peer, for tests and debugging."""

    usable: bool | None  # None: not probed yet
    in_use: int = 0  # payloads (or segments) the other side has not released yet
    resources: int = 0  # e.g. shared segments held toward this peer
    resource_bytes: int = 0


class SendPath(Protocol):
    """The sending half of a payload path, for one destination (loop thread only)."""

    #: True once the path needs no set-up question any more (or never did).
    settled: bool
    #: The one-way op whose messages this path consumes (``p2p.ack``/``p2p.done``), if any.
    acks: ClassVar[str | None]

    def wants(self, msg: OutMessage) -> bool:
        """Whether ``msg`` would need this path's one-time set-up first (no side effects)."""
        ...

    def ask(self, msg: OutMessage) -> dict[str, Any] | None:
        """This path's questions of the ``p2p.hello`` request, as keyword arguments of
        `aiorl.protocol.p2p.Hello` (None: it decided without asking)."""
        ...

    def on_hello(self, reply: HelloReply) -> None:
        """The receiver's answer (one with no answers when the set-up request failed)."""
        ...

    def fits(self, msg: OutMessage) -> bool:
        """Whether this path takes ``msg`` (O(1), no allocation)."""
        ...

    @abstractmethod
    def place(self, msg: OutMessage, frames: list[Any]) -> Placed | None:
        """Put the payload where the receiver will find it; None declines (next path)."""
        ...

    def on_ack(self, ack: PathAck) -> bool:
        """The receiver released a payload of ours (a message of the op ``acks`` names);
        False when it is not ours."""
        ...

    def lost(self, exc: PeerLostError | LookupError) -> None:
        """The destination is gone: fail exactly what this path still waits for."""
        ...

    def close(self) -> None:
        """Release this path's resources (the engine is closing)."""
        ...

    def statistics(self) -> PathStatistics: ...


class RecvPath(Protocol):
    """The receiving half of a payload path, for one source (loop thread only)."""

    #: The one-way op from the sender this path consumes (``p2p.drop``), if any.
    control: ClassVar[str | None]

    def answer(self, ask: Hello, reply: dict[str, Any]) -> None:
        """Add this path's answers to a ``p2p.hello`` request to ``reply`` (keyword arguments
        of `aiorl.protocol.p2p.HelloReply`)."""
        ...

    @abstractmethod
    def accept(
        self,
        msg: InMessage,
        desc: Sequence[Any],
        frames: Sequence[Any],
        start: int,
        posted: PostedRecv | None,
    ) -> None:
        """Take the payload of ``msg`` (``frames[start:]`` are the data frames after the
        pickle); sets its sources, lease, ``direct`` buffer or CUDA future. Raises
        ``ProtocolError``/``PeerLostError`` to fail that message's receive."""
        ...

    def on_control(self, message: PathControl) -> None:
        """A one-way message of the op ``control`` names, from the sender."""
        ...

    def lost(self, exc: PeerLostError | LookupError) -> None:
        """The source is gone: fail what still lands and drop what maps its memory."""
        ...

    def close(self) -> None: ...

    def statistics(self) -> PathStatistics: ...


_SendT = TypeVar("_SendT", bound="SendPathBase")
_RecvT = TypeVar("_RecvT", bound="RecvPathBase")


class SendPathBase(SendPath):
    """A sending half with the defaults of a path that needs no set-up, takes every message
    offered, has nothing acknowledged and holds nothing toward its destination.

    A subclass writes ``place`` and what differs: ``create`` to decline destinations the
    path cannot reach, ``wants``/``ask``/``on_hello`` (then ``settled = False``) for a
    set-up question, ``fits``, ``acks`` and ``on_ack``, ``lost``/``close``/``statistics``.
    """

    acks: ClassVar[str | None] = None
    settled = True

    def __init__(self, host: PathHost, dest: Destination) -> None:
        self.host = host
        self.dest = dest

    @classmethod
    def create(cls: type[_SendT], host: PathHost, dest: Destination) -> _SendT | None:
        """The half toward ``dest`` (the `PathSpec` factory); None where it cannot apply."""
        return cls(host, dest)

    def wants(self, msg: OutMessage) -> bool:
        return False

    def ask(self, msg: OutMessage) -> dict[str, Any] | None:
        return None

    def on_hello(self, reply: HelloReply) -> None:
        """Nothing asked, nothing to learn."""

    def fits(self, msg: OutMessage) -> bool:
        return True

    def on_ack(self, ack: PathAck) -> bool:
        return False

    def lost(self, exc: PeerLostError | LookupError) -> None:
        """Nothing of its own to fail: the Sender fails the sends it still waits for."""

    def close(self) -> None:
        """Nothing held."""

    def statistics(self) -> PathStatistics:
        return PathStatistics(usable=True)


class RecvPathBase(RecvPath):
    """A receiving half with the defaults of a path that answers no set-up question, gets no
    control message and keeps nothing from its source once a payload is accepted.

    A subclass writes ``accept`` and what differs: ``answer``, ``control`` and
    ``on_control``, ``lost``/``close``/``statistics``.
    """

    control: ClassVar[str | None] = None

    def __init__(self, host: PathHost, source: str) -> None:
        self.host = host
        self.source = source

    @classmethod
    def create(cls: type[_RecvT], host: PathHost, source: str) -> _RecvT:
        """The half for ``source`` (the `PathSpec` factory)."""
        return cls(host, source)

    def answer(self, ask: Hello, reply: dict[str, Any]) -> None:
        """No set-up question to answer."""

    def on_control(self, message: PathControl) -> None:
        """No control message of its own."""

    def lost(self, exc: PeerLostError | LookupError) -> None:
        """Nothing outlives an accepted payload."""

    def close(self) -> None:
        """Nothing held."""

    def statistics(self) -> PathStatistics:
        return PathStatistics(usable=True)


SendFactory = Callable[["PathHost", Destination], "SendPath | None"]
RecvFactory = Callable[["PathHost", str], "RecvPath"]


@dataclass(frozen=True)
class PathSpec:
    """A payload path: its wire tag, which slot of the control message it fills, its halves.

    ``send(host, destination)`` returns the sending half toward one resolved
    destination, or None where the path cannot apply;
    ``recv(host, source name)`` the receiving half for one source.
    """

    name: str
    tag: int
    cuda: bool  # False: fills ``bufdesc`` (CPU bytes); True: ``cudadesc`` (CUDA tensors)
    send: SendFactory
    recv: RecvFactory


# ----------------------------------------------------------------------------- helpers
class AckedSends:
    """Sends whose bytes the receiver reads itself (CMA, CUDA IPC): each completes when the
    receiver's ack (``p2p.done``) names its token, and keeps what is read alive until then.

    Tokens come from the destination's Sender, so the paths of one pair never reuse one.
    """

    __slots__ = ("_loop", "_waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: dict[int, tuple[asyncio.Future[None], Any]] = {}

    def park(self, token: int, keep_alive: Any) -> tuple[asyncio.Future[None], Callable[[], None]]:
        """The completion future of send ``token`` and its undo (the control message failed)."""
        fut: asyncio.Future[None] = self._loop.create_future()
        self._waiting[token] = (fut, keep_alive)

        def undo() -> None:
            self._waiting.pop(token, None)

        return fut, undo

    def on_ack(self, done: TransferDone) -> bool:
        """Complete the send an ack names; False if the token is not ours."""
        token, err = done.token, done.reply
        entry = self._waiting.pop(token, None)
        if entry is None:
            return False
        if err:
            fail(entry[0], ProtocolError(f"the receiver could not read the payload: {err}"))
        else:
            resolve(entry[0], None)
        return True

    def fail_all(self, exc: PeerLostError | LookupError, peer: str) -> None:
        waiting, self._waiting = self._waiting, {}
        for fut, _kept in waiting.values():
            fail(fut, lost_error(exc, f"send to {peer} did not complete"))

    def clear(self) -> None:
        self._waiting.clear()

    def __len__(self) -> int:
        return len(self._waiting)


def resolve(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def lost_error(exc: BaseException | None, what: str) -> PeerLostError | LookupError:
    """A fresh error for one operation failed by the loss ``exc`` of its peer.

    A peer that never existed stays a ``LookupError`` of the same class
    (``GroupNotFoundError``, ``WorkerNotFoundError``), so callers can tell.
    """
    if isinstance(exc, NotFoundError):
        return type(exc).from_message(f"{what}: {exc}")
    if isinstance(exc, LookupError):
        return LookupError(f"{what}: {exc}")
    return PeerLostError(f"{what}: {exc}" if exc is not None else what)


def watch_completion(host: PathHost, ready: Callable[[], bool]) -> asyncio.Future[None]:
    """A loop future done once ``ready()`` holds, polled by the runtime's waiter thread.

    For completions only polling can observe (ZMQ releasing zero-copy frames, a CUDA
    event); a ``ready`` that raises fails the future.
    """
    fut: asyncio.Future[None] = host.loop.create_future()

    def report(error: BaseException | None) -> None:  # waiter thread
        host.call_soon_threadsafe(_settle, fut, error)

    host.waiter.watch(Job(ready, report))
    return fut


def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if error is None:
        resolve(fut, None)
    else:
        fail(fut, error)
