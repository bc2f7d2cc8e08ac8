"""Which GPUs a process sees and on which machine: what a receiver tells a sender, so the
sender can choose CUDA IPC (same physical GPU, same host) or NCCL.

Importable without CUDA: torch is imported inside the functions that need it.
"""

from __future__ import annotations

import functools
import socket
import sys
from typing import Any

from aiorl.util.cuda_device import selected_device

__all__ = ["cuda_needs_init", "device_uuid", "host_identity", "local_cuda_info"]


@functools.cache
def device_uuid(index: int) -> str:
    """A node-unique identifier of local CUDA device ``index`` (its UUID, else PCI address)."""
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


@functools.cache
def host_identity() -> str:
    """This machine (hostname and boot id): two node agents on one host share it, so their
    workers may still exchange CUDA IPC handles."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def cuda_needs_init() -> bool:
    """Whether describing this process's GPUs would initialise CUDA here (its first use),
    which must then happen off the event loop."""
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    return bool(torch.cuda.is_available()) and not torch.cuda.is_initialized()


def local_cuda_info() -> dict[str, Any]:
    """What a receiver tells a sender: its machine, selected device and every device's UUID."""
    import torch

    if not torch.cuda.is_available():
        return {"host": host_identity(), "current": -1, "uuids": []}
    return {
        "host": host_identity(),
        "current": selected_device(),
        "uuids": [device_uuid(i) for i in range(torch.cuda.device_count())],
    }
