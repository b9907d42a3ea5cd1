"""Request ids: unique and increasing within the process, one per (sub-)request.

The counter is process-wide on purpose: several apps may share one backend, and the
router keys its requests by this id. ``itertools.count`` is atomic under the GIL.
"""
from __future__ import annotations

import itertools

_counter = itertools.count(1)


def next_request_id() -> int:
    return next(_counter)
