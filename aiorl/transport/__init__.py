"""The wire layer: message envelopes, serialization, sockets and the asyncio endpoint.

Data flows one way: the actor layer (``aiorl.actors``) calls an `Endpoint`,
which frames messages with `aiorl.transport.wire` and moves them over ZMQ
sockets made by `aiorl.transport.sockets` (the one place sockets are created).
"""

from aiorl.transport.endpoint import Endpoint, Incoming
from aiorl.transport.serialization import dumps, loads
from aiorl.transport.wire import PROTOCOL_VERSION, Kind

__all__ = ["PROTOCOL_VERSION", "Endpoint", "Incoming", "Kind", "dumps", "loads"]
