"""GPU-resident versions: subscribers on the publisher's GPU copy device to device (CUDA IPC).

A publisher whose state dict lives on one CUDA device keeps its two slots on that device
(`CudaSlots`), written in the seqlock bracket of its host header (the sequence numbers
stay in host memory, so one check covers the GPU copy and the host bytes). The host
bytes of a slot are written only while some reader needs them (a CPU subscriber, one on
another GPU or node): then from the GPU slot, in one device-to-host copy into the shared
segment, which is page-locked once (`pin_host`) so that the copy runs at the link's
speed instead of being staged through pageable memory by the driver. It exports each GPU slot once by CUDA IPC
(torch's ``reduce_tensor``: an IPC memory handle plus torch's reference counting, so the
memory lives while any importer holds it). A subscriber whose ``into`` tensors are on that
same device (`same_device`) opens the slots (`open_slots`) and copies out of
them on its current stream, then synchronises before it checks the sequence number: a
device-to-device copy instead of host -> device.

Importable without CUDA (torch is imported inside functions); the tests that need a GPU
(``tests/gpu/test_weights_cuda.py``) skip without one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from aiorl.cuda.bulk_copy import copy_grouped
from aiorl.cuda.devices import device_uuid
from aiorl.protocol.weights import CudaExport, Layout
from aiorl.weights.layout import TensorPlan, plan_of

__all__ = ["CudaSlots", "cuda_device_of", "device_uuid_of", "open_slots",
           "pin_host", "GpuSlot", "same_device", "unpin_host"]

log = logging.getLogger("aiorl.weights")

#: ``cudaHostRegisterPortable``: pinned for every CUDA context of the process.
_REGISTER_PORTABLE = 1


def cuda_device_of(state_dict: Mapping[str, Any]) -> int | None:
    """The one CUDA device index holding every tensor, or None (CPU, mixed, or empty).

    Asked per pull: the cheap properties only (``t.device`` makes an object per tensor),
    and a CPU state dict is answered at its first tensor."""
    index = None
    for t in state_dict.values():
        if not t.is_cuda:
            return None
        here = t.get_device()
        if index is None:
            index = here
        elif here != index:
            return None
    return index


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
        # Each tensor's place in each slot, a typed view made once, and the places grouped
        # by dtype: per publish one fused copy per dtype (`aiorl.cuda.bulk_copy`), since the
        # slicings and launches of 1,000 tensors would cost more than the copies.
        self._plan = plan_of(layout)
        self._places = [self._plan.places(slot) for slot in self.slots]

    def write(self, slot: int, state_dict: Mapping[str, Any], host: Any = None) -> None:
        """Copy ``state_dict`` into GPU slot ``slot``, then, if ``host`` (the slot's host
        bytes, a uint8 array) is given, the whole GPU slot into it in one device-to-host
        copy; return once every copy finished (the seqlock bracket closes after this)."""
        import torch

        with torch.no_grad(), torch.cuda.device(self.device):
            plan = self._plan
            copy_grouped(self._places[slot], [state_dict[name] for name in plan.copied_names],
                         plan.groups)
            if host is not None:
                torch.from_numpy(host).copy_(self.slots[slot], non_blocking=True)
            # The current stream is the copier thread's default stream, which orders after
            # the work that produced ``state_dict`` on this process's other blocking streams;
            # the synchronize makes every copy complete before the version is published.
            torch.cuda.current_stream().synchronize()

    def to_host(self, slot: int, host: Any) -> None:
        """Copy GPU slot ``slot`` into its host bytes ``host`` (a version first written to the
        GPU only, now wanted by a host reader) and wait for the copy."""
        import torch

        with torch.cuda.device(self.device):
            torch.from_numpy(host).copy_(self.slots[slot], non_blocking=True)
            torch.cuda.current_stream().synchronize()


def pin_host(array: Any, device: int) -> bool:
    """Page-lock the host memory of ``array`` (a uint8 numpy array over a shared mapping)
    for CUDA, so device-to-host copies into it are direct; False (logged) if the driver
    refuses: the copies then go through the driver's pageable staging, slower but correct.
    `unpin_host` must undo it before the mapping goes."""
    import torch

    if array.size == 0:
        return False
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    with torch.cuda.device(device):
        status = cudart.cudaHostRegister(array.ctypes.data, array.size, _REGISTER_PORTABLE)
    if int(status) != 0:
        log.warning("cannot page-lock %d bytes of weight slots for CUDA (error %s): device to "
                    "host copies are staged by the driver", array.size, int(status))
        return False
    return True


def unpin_host(array: Any) -> None:
    """Undo `pin_host` (before the mapping is closed: the driver keeps the pages locked
    otherwise, and a later registration of a reused address would fail)."""
    import torch

    torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)  # type: ignore[no-untyped-call]


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


class GpuSlot:
    """A publisher's GPU slot opened in this process, and where each tensor of the layout
    last read from it lies in it (sliced once per layout, not per pull: slicing 1,000
    tensors costs more than copying them)."""

    def __init__(self, slot: Any) -> None:
        self.slot = slot
        self._plan: TensorPlan | None = None
        self._places: list[Any] = []

    def read(self, layout: Layout, into: Mapping[str, Any]) -> None:
        """Copy every tensor of ``layout`` from this slot into ``into`` (same device) and
        wait for the copies, so that the seqlock check after it covers them."""
        import torch

        plan = plan_of(layout)
        if plan is not self._plan:
            self._places = plan.places(self.slot)
            self._plan = plan
        with torch.no_grad(), torch.cuda.device(self.slot.device):
            copy_grouped([into[name] for name in plan.copied_names], self._places, plan.groups)
            torch.cuda.current_stream().synchronize()

