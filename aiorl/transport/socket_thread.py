"""`SocketThread`: a daemon thread that owns one socket of its own, apart from the loop.

The heartbeat thread (`aiorl.transport.pulse`) and the link watch
(`aiorl.transport.link`) each keep a DEALER away from the event loop, so that a loop busy
with user work never silences a live process nor makes a slow peer look dead. Both are
started once and stopped within about 0.1 s (their loops poll ``_stopping``).
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod

from aiorl.transport.security import ClusterKeys
from aiorl.util.threads import RuntimeThread

__all__ = ["SocketThread"]


class SocketThread(ABC):
    """One daemon thread and its socket's identity; subclasses write `_run`."""

    def __init__(self, kind: str, name: str, address: str, keys: ClusterKeys | None) -> None:
        self.address = address
        self._keys = keys
        self._identity = f"{name}-{kind}-{os.getpid()}-{id(self):x}".encode()
        self._stopping = threading.Event()
        self._thread = RuntimeThread(target=self._run, name=f"aiorl-{kind}-{name}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread (within about 0.1 s) and close its socket."""
        self._stopping.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(2)

    @abstractmethod
    def _run(self) -> None:
        """The thread's body: return once ``_stopping`` is set, its socket closed."""
