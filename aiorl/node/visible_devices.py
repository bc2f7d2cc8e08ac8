"""Which physical GPUs a worker sees: the driver's local indices through the agent's own mask.

Placement numbers a node's accelerators ``0..n-1`` and gives each worker
``CUDA_VISIBLE_DEVICES`` in those *local* indices. A node agent may itself have been
started with a mask (``CUDA_VISIBLE_DEVICES=4,5,6,7``, or GPU UUIDs, e.g. the node's
half of a shared machine): its local device ``i`` is then the mask's ``i``-th entry, and
a worker must be given that entry, or it would run on physical GPUs 0-3, which belong to
someone else. The agent applies `physical_visible_devices` to every launch.

Entries that are not indices (``GPU-<uuid>``, ``MIG-...``) already name a device and pass
through. A mask shorter than the accelerators the agent reports (``--accelerators 8`` on
a node whose mask shows one GPU, as test machines do to try placement) is not a device
list to map through: the local indices pass unchanged.
"""

from __future__ import annotations

__all__ = ["physical_visible_devices"]


def _entries(value: str) -> list[str]:
    return [e.strip() for e in value.split(",") if e.strip()]


def physical_visible_devices(requested: str, agent_mask: str | None, node_devices: int) -> str:
    """``requested`` (a worker's local indices, comma-separated) as the devices the agent
    sees under ``agent_mask`` (its own ``CUDA_VISIBLE_DEVICES``; None: unmasked).

    Raises ``ValueError`` for a local index outside a mask that lists the node's devices.
    """
    if agent_mask is None:
        return requested
    mask = _entries(agent_mask)
    if len(mask) < node_devices or not mask:
        return requested
    out = []
    for entry in _entries(requested):
        if not entry.isdigit():
            out.append(entry)
            continue
        index = int(entry)
        if index >= len(mask):
            raise ValueError(
                f"local GPU {index} does not exist on this node: its agent runs with "
                f"CUDA_VISIBLE_DEVICES={agent_mask} ({len(mask)} devices)"
            )
        out.append(mask[index])
    return ",".join(out)
