"""TGI's concurrency limit: a semaphore that never waits (a full server answers 429 at once).

With several front-end processes the count of held permits lives in shared memory
(``tgi_compat.frontend_group``): the limit is the server's, whichever process takes a request.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from .errors import OverloadedError


class _LocalCount:
    def __init__(self):
        self.value = 0
        self._lock = threading.Lock()

    def get_lock(self):
        return self._lock


class ConcurrencyLimiter:
    def __init__(self, limit: int, shared_count=None):
        """``shared_count``: a multiprocess ``Value`` the other front ends count in too (None: this process alone)."""
        self.limit = limit
        self._held = shared_count if shared_count is not None else _LocalCount()

    @property
    def in_use(self) -> int:
        return self._held.value

    @contextmanager
    def permits(self, count: int = 1) -> Iterator[None]:
        """Hold ``count`` permits (one per best_of sub-request) or raise ``OverloadedError``."""
        with self._held.get_lock():
            if self._held.value + count > self.limit:
                raise OverloadedError()
            self._held.value += count
        try:
            yield
        finally:
            with self._held.get_lock():
                self._held.value -= count
