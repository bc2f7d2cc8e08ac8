"""The typed control plane: operation names, messages and the spawn spec.

Layer: above ``errors`` and ``names``; below ``registry``. It imports nothing
else from aiorl (and only the standard library besides), so every process,
the registry included, can parse messages without pulling in the runtime.

* `ops`: every op and worker state, as ``str`` enums;
* `registry`: the registry's requests, replies and events;
* `spawn`: what a driver asks an agent to start, and what
  the agent hands each new worker process;
* `call_relay`, `p2p_relay`: group calls and point-to-point messages relayed by node agents;
* `p2p`: what the two ends of a point-to-point pair send each other;
* `broadcast`: what the members of a broadcast send each other;
* `channels`: what channel handles and channel workers send each other;
* `fields`: the checked reading every ``from_wire`` uses.
"""

from aiorl.protocol.ops import AgentOp, DriverOp, RegistryEvent, RegistryOp, WorkerOp, WorkerState

__all__ = ["AgentOp", "DriverOp", "RegistryEvent", "RegistryOp", "WorkerOp", "WorkerState"]
