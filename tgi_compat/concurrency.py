"""TGI's concurrency limit: a semaphore that never waits (a full server answers 429 at once)."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from .errors import OverloadedError


class ConcurrencyLimiter:
    def __init__(self, limit: int):
        self.limit = limit
        self._in_use = 0
        self._lock = threading.Lock()

    @contextmanager
    def permits(self, count: int = 1) -> Iterator[None]:
        """Hold ``count`` permits (one per best_of sub-request) or raise ``OverloadedError``."""
        with self._lock:
            if self._in_use + count > self.limit:
                raise OverloadedError()
            self._in_use += count
        try:
            yield
        finally:
            with self._lock:
                self._in_use -= count
