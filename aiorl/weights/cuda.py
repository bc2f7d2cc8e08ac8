"""GPU-resident versions: subscribers on the publisher's GPU copy device to device (CUDA IPC).

A publisher whose state dict lives on one CUDA device keeps, besides the host slots every
subscriber of the node can read, the same two slots on that device (`CudaSlots`),
written in the same seqlock bracket as the host slots (the sequence numbers stay in the
host header, so one check covers both copies). It exports each GPU slot once by CUDA IPC
(torch's ``reduce_tensor``: an IPC memory handle plus torch's reference counting, so the
memory lives while any importer holds it). A subscriber whose ``into`` tensors are on that
same device (`same_device`) opens the slots (`open_slots`) and copies out of
them on its current stream, then synchronises before it checks the sequence number: a
device-to-device copy instead of host -> device.

Importable without CUDA (torch is imported inside functions); the tests that need a GPU
(``tests/test_weights_cuda.py``) skip without one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiorl.p2p.gpu import device_uuid
from aiorl.weights._layout import Layout

__all__ = ["CudaExport", "CudaSlots", "cuda_device_of", "device_uuid_of", "open_slots",
           "read_tensors_cuda", "same_device"]


@dataclass(frozen=True)
class CudaExport:
    """What a subscriber needs to open a publisher's GPU slots: the device's UUID and, per
    slot, torch's IPC rebuild function and arguments."""

    device_uuid: str
    slots: tuple[tuple[Any, tuple[Any, ...]], ...]


def cuda_device_of(state_dict: Mapping[str, Any]) -> int | None:
    """The one CUDA device index holding every tensor, or None (CPU, mixed, or empty)."""
    devices = {(t.device.type, t.device.index) for t in state_dict.values()}
    if len(devices) != 1:
        return None
    kind, index = devices.pop()
    return int(index or 0) if kind == "cuda" else None


def _device_uuid(index: int) -> str:
    """The GPU's node-unique name, as the GPU machinery names it (so a weights export and a
    subscriber's device compare the same way the P2P and broadcast paths do)."""
    return device_uuid(index)


class CudaSlots:
    """The publisher's two GPU slots of one shard (flat uint8 tensors of the slot size)."""

    def __init__(self, layout: Layout, device: int, count: int) -> None:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        self.layout = layout
        self.device = device
        self.slots = [torch.empty(layout.nbytes, dtype=torch.uint8, device=f"cuda:{device}")
                      for _ in range(count)]
        self.export = CudaExport(_device_uuid(device),
                                 tuple(reduce_tensor(s) for s in self.slots))  # type: ignore[no-untyped-call]

    def write(self, slot: int, state_dict: Mapping[str, Any]) -> None:
        """Copy ``state_dict`` into GPU slot ``slot`` and wait for the copies to finish."""
        import torch

        dst = self.slots[slot]
        with torch.no_grad(), torch.cuda.device(self.device):
            for spec in self.layout.tensors:
                if spec.nbytes:
                    src = state_dict[spec.name]
                    dst[spec.offset : spec.offset + spec.nbytes].view(src.dtype).view(
                        src.shape).copy_(src)
            torch.cuda.current_stream().synchronize()


def device_uuid_of(into: Mapping[str, Any]) -> tuple[int, str] | None:
    """The one CUDA device of every tensor of ``into`` (index, UUID), or None."""
    index = cuda_device_of(into)
    return None if index is None else (index, _device_uuid(index))


def same_device(export: CudaExport | None, into: Mapping[str, Any]) -> bool:
    """Whether every tensor of ``into`` is on the GPU ``export`` lives on."""
    if export is None:
        return False
    index = cuda_device_of(into)
    return index is not None and _device_uuid(index) == export.device_uuid


def open_slots(export: CudaExport) -> list[Any]:
    """The publisher's GPU slots, opened in this process (keep them: opening is costly)."""
    return [rebuild(*args) for rebuild, args in export.slots]


def read_tensors_cuda(layout: Layout, slot: Any, into: Mapping[str, Any]) -> None:
    """Copy every tensor of ``layout`` from GPU slot ``slot`` into ``into`` (same device) and
    wait for the copies, so that the seqlock check after it covers them."""
    import torch

    with torch.no_grad(), torch.cuda.device(slot.device):
        for spec in layout.tensors:
            if spec.nbytes:
                dst = into[spec.name]
                dst.copy_(slot[spec.offset : spec.offset + spec.nbytes].view(dst.dtype).view(
                    dst.shape))
        torch.cuda.current_stream().synchronize()
