"""Log lines about rejected input, rate-limited: whoever sends garbage must not be able to fill the disk or
drown the one line that matters."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any


class RateLimitedLog:
    """At most `burst` lines per `interval` seconds for each kind of message; the next line that gets through
    says how many were held back.

        warn = RateLimitedLog(log)
        warn.warning("bad-frame", "actor %d: bad data-plane message from %s: %s", me, src, e)
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0, burst: int = 5) -> None:
        self.logger = logger
        self.interval = interval
        self.burst = burst
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[float, int, int]] = {}  # kind -> (window start, lines logged, lines held back)

    def log(self, level: int, kind: str, msg: str, *args: Any) -> bool:
        """Log unless `kind` already used its share of this window; returns whether it was logged."""
        if not self.logger.isEnabledFor(level):
            return False
        now = time.monotonic()
        with self._lock:
            start, logged, held = self._windows.get(kind, (now, 0, 0))
            if now - start >= self.interval:
                start, logged = now, 0
            if logged >= self.burst:
                self._windows[kind] = (start, logged, held + 1)
                return False
            self._windows[kind] = (start, logged + 1, 0)
            if len(self._windows) > 1024:  # kinds are few; never let them grow without bound either
                self._windows = {kind: self._windows[kind]}
        if held:
            msg = f"{msg} ({held} similar messages were not logged)"
        self.logger.log(level, msg, *args)
        return True

    def warning(self, kind: str, msg: str, *args: Any) -> bool:
        return self.log(logging.WARNING, kind, msg, *args)

    def info(self, kind: str, msg: str, *args: Any) -> bool:
        return self.log(logging.INFO, kind, msg, *args)
