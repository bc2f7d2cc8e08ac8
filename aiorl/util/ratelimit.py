"""``RateLimitedLog``: at most one warning per kind of trouble per interval, then a count.

What an outsider or a misbehaving member can repeat (a refused handshake, a malformed
message, an over-long HTTP request line) must not become one log line per try: 5,000
malformed heartbeats logged as 5,000 tracebacks make the log the denial of service. So
each kind of trouble is logged at most once per ``interval``; the ones in between are
counted, and the next warning of that kind says how many were left out ("and N more like
it since the last warning"). A run that ends inside an interval is counted but not logged
until the same kind happens again.

Kinds must come from a small fixed set chosen by the code (an operation name, "refused
curve"), never from what a peer sent: one entry is kept per kind. Thread-safe (the ZAP
handler runs on its own thread). Imports nothing from aiorl.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """See the module docstring."""

    def __init__(self, logger: logging.Logger, interval: float = 1.0) -> None:
        self.logger = logger
        self.interval = interval
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: Any,
                exc_info: BaseException | None = None) -> bool:
        """Log ``message % args`` at WARNING unless ``kind`` was logged less than ``interval``
        ago (then only count it); returns whether it was logged."""
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(kind, 0.0):
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return False
            more = self._suppressed.pop(kind, 0)
            self._next[kind] = now + self.interval
        if more:  # (a message without args is not %-formatted by logging: safe to extend)
            message += f" (and {more} more like it since the last warning)"
        self.logger.warning(message, *args, exc_info=exc_info)
        return True

    def suppressed(self, kind: str) -> int:
        """How many warnings of ``kind`` were counted and not yet reported."""
        with self._lock:
            return self._suppressed.get(kind, 0)
