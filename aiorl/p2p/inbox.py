# HOT PATH: the small-object branch of Inbox.handle runs per small message.
"""The receiving side of one (source -> this worker) pair: an `Inbox`.

Control messages from one source arrive in the order it sent them (one connection,
one dispatching loop). The Inbox keeps two FIFOs, messages that *arrived* and receives
that were *posted*, and matches their heads: the k-th receive posted gets the k-th
message sent (``docs/ordering.md``). A cancelled receive that has not matched yet is
skipped. Each message's payload is taken over at arrival by the receiving half of the
path its descriptor names (CUDA transfers must start in arrival order); a receive's
result is ready once its own payload has landed.

Loss: `Inbox.lost` fails the posted receives and the CUDA payloads still in
flight, then lets each path drop what maps the source's memory. The engine then forgets
the Inbox (with what arrived and was not received yet), so that a later receive resolves
the name again: at once a failure for a dead worker, the new process for a restarted one.
"""

from __future__ import annotations

import asyncio
import pickle
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiorl.errors import PeerLostError, ProtocolError
from aiorl.p2p.message import InMessage, PostedRecv, nbytes_of
from aiorl.p2p.paths import CPU_PATHS, CUDA_PATHS
from aiorl.p2p.paths.base import PathHost, PathSpec, PathStatistics, RecvPath, fail, lost_error
from aiorl.protocol.p2p import (
    K_CPU,
    K_CUDA,
    K_OBJ,
    NOTHING,
    EmptyCudaDesc,
    Head,
    Hello,
    HelloReply,
    PathControl,
)
from aiorl.runtime.promise import is_settled
from aiorl.runtime.promise import reject as reject_work
from aiorl.runtime.promise import resolve as resolve_work
from aiorl.transport.serialization import byte_view

__all__ = ["Inbox", "InboxStatistics"]

_CPU_BY_TAG: dict[int, PathSpec] = {spec.tag: spec for spec in CPU_PATHS}
_CUDA_BY_TAG: dict[int, PathSpec] = {spec.tag: spec for spec in CUDA_PATHS}
_loads = pickle.loads


@dataclass(frozen=True)
class InboxStatistics:
    """One source as its Inbox sees it."""

    arrived: int  # messages waiting for a receive
    posted: int  # receives waiting for a message
    in_flight: int  # messages whose CUDA payload is still landing
    lost: bool
    paths: Mapping[str, PathStatistics]  # by path name; only the paths used so far


class Inbox:
    """Everything about receiving from one source (loop thread only)."""

    __slots__ = (
        "engine",
        "name",
        "address",
        "sender",
        "arrived",
        "posted",
        "lost_exc",
        "cpu_paths",
        "cuda_paths",
        "inflight",
        "taken",
        "route_back",
        "_on_taken",
    )

    def __init__(self, engine: PathHost, name: str,
                 on_taken: Callable[[Inbox], None] | None = None) -> None:
        self.engine = engine
        self.name = name
        self.address: str | None = None  # from the registry watch (for loss detection)
        #: The routing identity of the process whose messages this Inbox got (None: none
        #: yet): tells a restarted rank's messages from its predecessor's death.
        self.sender: bytes | None = None
        self.arrived: deque[InMessage] = deque()
        self.posted: deque[PostedRecv] = deque()
        self.lost_exc: BaseException | None = None
        self.cpu_paths: dict[int, RecvPath] = {}  # by tag, created on first use
        self.cuda_paths: dict[int, RecvPath] = {}
        self.inflight: set[InMessage] = set()  # messages whose CUDA payload is still landing
        #: Messages receives took since the sender was last told (its window's grant,
        #: ``p2p.taken``): ``on_taken(self)`` runs when this leaves 0 (the engine sends it).
        self.taken = 0
        self._on_taken = on_taken
        #: Where the source's ``p2p.taken`` goes when its messages come through the node
        #: agents: its (node, address); None for a direct source (back over its connection).
        self.route_back: tuple[str, str] | None = None

    def _path(self, cuda: bool, tag: int) -> RecvPath:
        paths = self.cuda_paths if cuda else self.cpu_paths
        path = paths.get(tag)
        if path is None:
            spec = (_CUDA_BY_TAG if cuda else _CPU_BY_TAG).get(tag)
            if spec is None:
                raise ProtocolError(f"p2p message from {self.name} names unknown path {tag}")
            path = paths[tag] = spec.recv(self.engine, self.name)
        return path

    # ------------------------------------------------------------------ receives
    def post(self, r: PostedRecv) -> None:
        """A receive was posted (loop thread): match it, or wait for a message."""
        if r.work.done():
            return  # cancelled before it was posted
        if self.arrived:
            self._deliver(r, self.arrived.popleft())
        elif self.lost_exc is not None:
            reject_work(r.work, lost_error(self.lost_exc, f"cannot receive from {self.name}"))
        else:
            self.posted.append(r)

    def handle(
        self,
        kind: int,
        head: Head | None,
        bufdesc: Sequence[Any] | None,
        cudadesc: Sequence[Any] | None,
        frames: list[Any],
    ) -> None:
        """One arrived message (`aiorl.protocol.p2p.data_from_wire` read its fields): hand
        it to the oldest waiting receive, or keep it."""
        posted = self.posted
        r = None
        while posted:
            r = posted[0]
            # done(), not only settled on the loop: a receive cancelled from another thread
            # (its wait() timed out) is withdrawn the moment cancel() returns, though the
            # loop has not run the cancellation yet; a message that causally follows it (the
            # canceller's caller then had it sent) must not be consumed by it (docs/ordering.md).
            if not r.work.done():
                break
            posted.popleft()  # cancelled: it no longer takes a message
            r = None
        if (
            r is not None
            and r.buf is None
            and kind == K_OBJ
            and bufdesc is None
            and (cudadesc is None)
        ):
            # Fast path: a small object for a waiting recv().
            posted.popleft()
            self._took()
            try:
                value = _loads(frames[0])
            except Exception as exc:  # noqa: BLE001 - e.g. a class missing here
                reject_work(r.work, exc)
                return
            resolve_work(r.work, value)
            return
        inc = InMessage(kind, head)
        try:
            self._parse(inc, bufdesc, cudadesc, frames, r)
        except Exception as exc:  # noqa: BLE001 - a broken message fails its receive, not the loop
            if not isinstance(exc, (ProtocolError, PeerLostError)):
                exc = ProtocolError(
                    f"malformed or undeliverable p2p message from {self.name}: {exc!r}"
                )
            inc.error = exc
        if r is not None:
            posted.popleft()
            self._deliver(r, inc)
        else:
            self.arrived.append(inc)

    def handle_batch(self, metas: Sequence[Sequence[Any]], frames: list[Any]) -> None:
        """Several small messages in one ZMQ message, in the order they were sent (one frame
        each: `aiorl.protocol.p2p.batch_from_wire` checked them)."""
        handle = self.handle
        posted = self.posted
        for (kind, head, bufdesc), frame in zip(metas, frames, strict=True):
            if kind == K_OBJ and bufdesc is None and posted:
                # Fast path, as in handle(): a small object for a waiting recv().
                r = posted[0]
                if r.buf is None and not r.work.done():  # done(): see handle()
                    posted.popleft()
                    self._took()
                    try:
                        value = _loads(frame)
                    except Exception as exc:  # noqa: BLE001 - e.g. a class missing here
                        reject_work(r.work, exc)
                        continue
                    resolve_work(r.work, value)
                    continue
            handle(kind, head, bufdesc, None, [frame])

    def _parse(
        self,
        inc: InMessage,
        bufdesc: Sequence[Any] | None,
        cudadesc: Sequence[Any] | None,
        frames: list[Any],
        r: PostedRecv | None,
    ) -> None:
        start = 0
        if inc.kind == K_OBJ:
            inc.pickle = frames[0]
            start = 1
        if bufdesc is not None:
            self._path(False, bufdesc[0]).accept(inc, bufdesc, frames, start, r)
        if cudadesc is not None:
            if cudadesc[0] == NOTHING:
                from aiorl.p2p.paths.cuda_common import empty_targets

                empty_targets(inc, EmptyCudaDesc.from_wire(cudadesc).specs)
                return
            self._path(True, cudadesc[0]).accept(inc, cudadesc, frames, start, r)
            fut = inc.cuda_fut
            if fut is not None:  # remembered so that the sender's loss fails it
                self.inflight.add(inc)
                fut.add_done_callback(lambda _f: self.inflight.discard(inc))

    # ------------------------------------------------------------------ delivery
    def _took(self) -> None:
        """A receive took one of the source's messages (or a receive was waiting for it)."""
        self.taken += 1
        if self.taken == 1 and self._on_taken is not None:
            self._on_taken(self)

    def _deliver(self, r: PostedRecv, inc: InMessage) -> None:
        self._took()
        if inc.error is not None:
            inc.release()
            reject_work(r.work, inc.error)
            return
        try:
            if r.buf is None:
                if inc.cuda_fut is None:
                    value = inc.decode()
                    _complete_after_cuda(r.work, inc, lambda: value)
                else:  # its CUDA tensors are allocated where they land, off the loop
                    _complete_after_cuda(r.work, inc, inc.decode)
            else:
                self._deliver_into(r, inc)
        except BaseException as exc:  # noqa: BLE001 - the receive fails, the loop goes on
            inc.release()
            reject_work(r.work, exc)

    def _deliver_into(self, r: PostedRecv, inc: InMessage) -> None:
        buf = r.buf
        if inc.direct is buf:
            resolve_work(r.work, buf)
            return
        if inc.kind == K_CPU:
            n = inc.sources[0][0]
            if n != nbytes_of(buf):
                raise ValueError(
                    f"recv_tensor buffer holds {nbytes_of(buf)} bytes but the message carries {n}"
                )
            if buf.device.type == "cpu":
                inc.copy_into(0, byte_view(buf))
                inc.release()
                resolve_work(r.work, buf)
            else:
                import torch

                src = torch.from_numpy(inc.view(0))
                self._copy_then_complete(r, buf, src, inc.release)
            return
        if inc.kind == K_CUDA:

            def landed() -> Any:
                src = inc.cuda[0]
                if src is buf:
                    return buf
                if nbytes_of(src) != nbytes_of(buf):
                    raise ValueError(
                        f"recv_tensor buffer holds {nbytes_of(buf)} bytes but the message "
                        f"carries {nbytes_of(src)}"
                    )
                self._copy_then_complete(r, buf, src, None)
                return _PENDING

            _complete_after_cuda(r.work, inc, landed)
            return
        # A message sent with send(): fine when it holds exactly one tensor of the right size.
        import torch

        decoded = inc.decode() if inc.cuda_fut is None else _PENDING

        def finish() -> Any:
            value = inc.decode() if decoded is _PENDING else decoded
            if not isinstance(value, torch.Tensor) or nbytes_of(value) != nbytes_of(buf):
                raise TypeError(
                    f"recv_tensor got a message holding {type(value).__qualname__}, "
                    f"not a tensor of {nbytes_of(buf)} bytes"
                )
            src = value.detach().contiguous()
            if buf.device.type == "cpu" and src.device.type == "cpu":
                byte_view(buf)[:] = byte_view(src)
                return buf
            self._copy_then_complete(r, buf, src, None)
            return _PENDING

        _complete_after_cuda(r.work, inc, finish)

    def _copy_then_complete(
        self, r: PostedRecv, buf: Any, src: Any, then: Callable[[], None] | None
    ) -> None:
        """Copy into a buffer when a GPU is involved: off the loop, on a side stream
        (`aiorl.p2p.paths.cuda_common.copy_async`); the receive completes after."""
        from aiorl.p2p.paths.cuda_common import copy_async

        fut = copy_async(self.engine, buf, src, r.event)

        def copied(f: asyncio.Future[None]) -> None:
            if then is not None:
                then()
            if f.cancelled() or f.exception() is not None:
                reject_work(r.work, f.exception() or PeerLostError("the copy was abandoned"))
            else:
                resolve_work(r.work, buf)

        fut.add_done_callback(copied)

    # ------------------------------------------------------------------ set-up, control, loss
    def answer(self, ask: Hello) -> HelloReply:
        """The reply to a ``p2p.hello`` from this source: every path adds its answers."""
        reply: dict[str, Any] = {}
        for spec in CPU_PATHS:
            self._path(False, spec.tag).answer(ask, reply)
        for spec in CUDA_PATHS:
            self._path(True, spec.tag).answer(ask, reply)
        return HelloReply(**reply)

    def on_control(self, op: str, message: PathControl) -> None:
        """A one-way message from the sender to one of our paths (e.g. ``p2p.drop``)."""
        for path in (*self.cpu_paths.values(), *self.cuda_paths.values()):
            if path.control == op:
                path.on_control(message)

    def lost(self, exc: PeerLostError | LookupError) -> None:
        """Fail what waits on a dead sender (the engine then forgets this Inbox, and the
        messages it still holds with it: docs/ordering.md, "Failure")."""
        if self.lost_exc is None:
            self.lost_exc = exc
        while self.posted:
            reject_work(
                self.posted.popleft().work, lost_error(exc, f"cannot receive from {self.name}")
            )
        for inc in [*self.arrived, *self.inflight]:
            if inc.cuda_fut is not None and not inc.cuda_fut.done():
                fail(inc.cuda_fut, lost_error(exc, f"CUDA payload from {self.name} lost"))
        for path in (*self.cpu_paths.values(), *self.cuda_paths.values()):
            path.lost(exc)

    def close(self) -> None:
        for path in (*self.cpu_paths.values(), *self.cuda_paths.values()):
            path.close()

    def statistics(self) -> InboxStatistics:
        paths: dict[str, PathStatistics] = {}
        for specs, made in ((CPU_PATHS, self.cpu_paths), (CUDA_PATHS, self.cuda_paths)):
            for spec in specs:
                path = made.get(spec.tag)
                if path is not None:
                    paths[spec.name] = path.statistics()
        return InboxStatistics(
            arrived=len(self.arrived),
            posted=len(self.posted),
            in_flight=len(self.inflight),
            lost=self.lost_exc is not None,
            paths=paths,
        )


#: What a delivery step returns when it completes the receive itself, later.
_PENDING = object()


def _complete_after_cuda(work: Any, inc: InMessage, value: Callable[[], Any]) -> None:
    """Complete ``work`` with ``value()`` once the message's CUDA payload (if any) landed."""
    fut = inc.cuda_fut

    def finish(f: asyncio.Future[None] | None) -> None:
        if is_settled(work):  # cancelled meanwhile: its buffer is not written, nor copied into
            inc.release()
            return
        if f is not None and (f.cancelled() or f.exception() is not None):
            exc = None if f.cancelled() else f.exception()
            reject_work(work, exc or PeerLostError("the CUDA transfer was abandoned"))
            return
        try:
            result = value()
        except BaseException as exc:  # noqa: BLE001
            reject_work(work, exc)
            return
        if result is not _PENDING:
            resolve_work(work, result)

    if fut is None:
        finish(None)
    elif fut.done():
        finish(fut)
    else:
        fut.add_done_callback(finish)
