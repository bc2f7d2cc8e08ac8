"""CUDA payloads of point-to-point messages: NCCL pair groups and CUDA IPC.

Used by :mod:`aiorl.actors.p2p`; importable without CUDA (torch is imported
inside functions, and nothing here runs unless a CUDA tensor is sent).

NCCL
    One process group per *ordered* pair (sender -> receiver), so the two
    directions never share a communicator and cannot deadlock each other. The
    sender is rank 0 and opens a ``TCPStore`` on a free port; the store address
    travels in the first ZMQ control message, and the receiver connects as rank 1.
    Each side issues its NCCL operations for that pair on one dedicated thread,
    in control-message order: NCCL matches point-to-point operations of a pair
    in issue order, so this is what keeps the payloads matched to their messages.
    Group creation blocks (store rendezvous, communicator set-up), which is a
    second reason it happens on that thread and never on the event loop.

CUDA IPC
    NCCL refuses two ranks on one GPU, so two workers sharing a physical device
    (same node, same device UUID) exchange CUDA IPC handles instead
    (``torch.multiprocessing.reductions``). The receiver opens the handle, copies
    into its own tensor on its pair thread, waits for the copy and acknowledges;
    the sender's send completes on that acknowledgement.

Streams
    The caller's current stream may still be writing a tensor when it is sent
    (or reading a buffer when a receive is posted). The caller records a CUDA
    event at call time (the receiver also records one after allocating fresh
    tensors on its current stream); the pair thread issues everything on the
    pair's own side stream after waiting for that event, so transfers neither
    queue behind nor block the default stream. Completion is a CUDA event
    recorded on the side stream after the transfer, synchronised on a helper
    thread by :class:`~aiorl.runtime.work.AsyncCollWork`.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import pickle
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CudaPair",
    "device_uuid",
    "ipc_reduce",
    "local_cuda_info",
    "record_event",
    "reinterpret",
]

log = logging.getLogger("aiorl.p2p")

#: How long NCCL set-up waits for the other side before failing.
RENDEZVOUS_TIMEOUT_S = 120.0


def record_event() -> Any:
    """A CUDA event recorded on the calling thread's current stream."""
    import torch

    ev = torch.cuda.Event()
    ev.record()
    return ev


def device_uuid(index: int) -> str:
    """A node-unique identifier of local CUDA device ``index`` (its UUID, else its PCI address)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return "pci:{}:{}:{}".format(
        getattr(props, "pci_domain_id", "?"),
        getattr(props, "pci_bus_id", "?"),
        getattr(props, "pci_device_id", "?"),
    )


def local_cuda_info() -> dict[str, Any]:
    """What a receiver tells a sender about its GPUs: current device and every device's UUID."""
    import torch

    if not torch.cuda.is_available():
        return {"current": -1, "uuids": []}
    return {
        "current": torch.cuda.current_device(),
        "uuids": [device_uuid(i) for i in range(torch.cuda.device_count())],
    }


class CudaPair:
    """One side of the NCCL link of an ordered pair, with its issuing thread.

    Args:
        gid: the pair's group id (also the store prefix), chosen by the sender.
        rank: 0 on the sender, 1 on the receiver.
        device: the local CUDA device index this side uses.
    """

    def __init__(self, gid: str, rank: int, device: int) -> None:
        self.gid = gid
        self.rank = rank
        self.device = device
        self.store: Any = None
        self.store_address: tuple[str, int] | None = None
        self.pg: Any = None
        self.stream: Any = None
        self.closed = False
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aiorl-p2p-cuda")

    # ------------------------------------------------------------------ set-up
    def open_master_store(self, host: str) -> tuple[str, int]:
        """Sender: open the rendezvous store on a free port; returns its address."""
        import torch.distributed as dist

        self.store = dist.TCPStore(
            host,
            0,
            2,
            True,
            timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
            wait_for_workers=False,
        )
        self.store_address = (host, int(self.store.port))
        return self.store_address

    def set_store_address(self, host: str, port: int) -> None:
        """Receiver: where the sender's store listens (connected lazily on the pair thread)."""
        self.store_address = (host, port)

    def _ensure_group(self) -> Any:
        # Pair thread only. Blocks until the other side joins (store rendezvous).
        if self.pg is not None:
            return self.pg
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        if self.store is None:
            if self.store_address is None:
                raise RuntimeError(f"no rendezvous address for NCCL pair {self.gid!r}")
            host, port = self.store_address
            self.store = dist.TCPStore(host, port, 2, False, timeout=timeout)
        prefix = dist.PrefixStore(self.gid, self.store)
        opts = dist.ProcessGroupNCCL.Options()
        try:
            opts._timeout = timeout
        except AttributeError:
            pass  # older torch: the default timeout applies
        self.pg = dist.ProcessGroupNCCL(prefix, self.rank, 2, opts)
        return self.pg

    def _side_stream(self) -> Any:
        """This pair's own stream (pair thread only), so transfers never sit in the default
        stream's queue or make it wait."""
        import torch

        if self.stream is None:
            torch.cuda.set_device(self.device)
            self.stream = torch.cuda.Stream(self.device)
        return self.stream

    # ------------------------------------------------------------------ transfers
    def submit(
        self, tensors: Sequence[Any], wait_event: Any, send: bool
    ) -> concurrent.futures.Future:
        """Issue one NCCL send (rank 0) or receive (rank 1) per tensor, after ``wait_event``.

        Returns a future of ``(works, done_event)``; ``done_event`` completes when
        every transfer of the call has. Tensors must stay referenced until then.
        """
        return self._thread.submit(self._issue, list(tensors), wait_event, send)

    def _issue(self, tensors: list[Any], wait_event: Any, send: bool) -> tuple[list[Any], Any]:
        import torch

        if self.closed:
            raise RuntimeError(f"NCCL pair {self.gid} is closed")
        pg = self._ensure_group()
        stream = self._side_stream()
        with torch.cuda.stream(stream):
            if wait_event is not None:
                stream.wait_event(wait_event)
            # ProcessGroupNCCL orders its NCCL stream after the current (= our side) stream.
            works = [pg.send([t], 1, 0) if send else pg.recv([t], 0, 0) for t in tensors]
            for w in works:
                w.wait()  # our side stream waits for the NCCL stream (no CPU block)
            done = torch.cuda.Event()
            done.record(stream)
        return works, done

    def ipc_copy(
        self, handles: bytes, targets: Sequence[Any], wait_event: Any, device: int
    ) -> concurrent.futures.Future:
        """Receiver: on the pair thread, open CUDA IPC ``handles`` and copy into ``targets``.

        The future completes when the copies are done on the GPU (so the sender may
        reuse its tensors as soon as it hears back).
        """
        return self._thread.submit(self._ipc_copy, handles, list(targets), wait_event, device)

    def _ipc_copy(self, handles: bytes, targets: list[Any], wait_event: Any, device: int) -> None:
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        stream = self._side_stream()
        with torch.cuda.stream(stream):
            if wait_event is not None:
                stream.wait_event(wait_event)
            sources = []
            for args, target in zip(pickle.loads(handles), targets, strict=True):
                args = list(args)
                args[6] = device  # the sender's index of this GPU may differ from ours
                # Opening waits (on the current stream) for the sender's producing stream.
                src = rebuild_cuda_tensor(*args)
                target.copy_(reinterpret(src, target), non_blocking=True)
                sources.append(src)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        del sources  # releases the sender's blocks (torch's IPC reference counters)

    def run(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the pair thread, after everything submitted before it."""
        return self._thread.submit(fn, *args)

    def close(self) -> None:
        """Abort the communicator (a peer that died leaves NCCL operations hanging)."""
        self.closed = True
        pg = self.pg
        if pg is not None:
            for attr in ("abort", "_abort", "shutdown"):
                fn = getattr(pg, attr, None)
                if fn is not None:
                    try:
                        fn()
                        break
                    except Exception:
                        log.debug("NCCL %s of %s failed", attr, self.gid, exc_info=True)
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.store = None


def reinterpret(src: Any, like: Any) -> Any:
    """``src``'s bytes seen with ``like``'s dtype and shape (same byte count, both contiguous)."""
    import torch

    if src.dtype == like.dtype:
        return src.reshape(like.shape)
    return src.reshape(-1).view(torch.uint8).view(like.dtype).reshape(like.shape)


def ipc_reduce(tensors: Sequence[Any]) -> bytes:
    """The CUDA IPC handles of ``tensors`` as one pickle (the sender keeps the tensors alive)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return pickle.dumps([reduce_tensor(t.detach())[1] for t in tensors], protocol=5)
