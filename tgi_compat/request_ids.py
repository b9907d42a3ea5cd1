"""Request ids: unique and increasing within the server, one per (sub-)request.

The counter is process-wide on purpose: several apps may share one backend, and the
router keys its requests by this id. ``itertools.count`` is atomic under the GIL. Front end
``k`` of ``N`` (``--frontend-processes``) numbers ``k + 1``, ``k + 1 + N``, ... (``number_from``), so that
ids are unique across the processes and tell the router whose events they are.
"""
from __future__ import annotations

import itertools

_counter = itertools.count(1)


def number_from(first: int, step: int) -> None:
    """Number this process's requests ``first``, ``first + step``, ... (once, before serving)."""
    global _counter
    _counter = itertools.count(first, step)


def next_request_id() -> int:
    return next(_counter)
