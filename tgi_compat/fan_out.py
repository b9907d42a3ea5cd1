"""One HTTP request, several generations: `n` choices, a list of prompts.

Each generation is an ordinary ``GenerateService`` request (its own id, permit, log
lines and metrics). ``gather_all`` waits for all of them and cancels the rest on the
first failure; ``merge_streams`` interleaves their streams in arrival order, ending
each one that fails with its ``TGIError`` as an item.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from typing import AsyncIterator, Awaitable, TypeVar

from .errors import GenerationError, TGIError
from .schema import U64_MAX, GenerateRequest

T = TypeVar("T")
log = logging.getLogger("tgi_compat")
_FINISHED = object()


def choice_request(request: GenerateRequest, choice: int) -> GenerateRequest:
    """Choice ``k`` samples with ``seed + k``: reproducible, yet not ``n`` copies of one text."""
    seed = request.parameters.seed
    if choice == 0 or seed is None:
        return request
    return replace(request, parameters=replace(request.parameters, seed=(seed + choice) % (U64_MAX + 1)))


async def gather_all(work: list[Awaitable[T]]) -> list[T]:
    """Results in order; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _pump(index: int, stream: AsyncIterator, queue: asyncio.Queue) -> None:
    try:
        async with contextlib.aclosing(stream):
            async for item in stream:
                queue.put_nowait((index, item))
    except TGIError as error:
        queue.put_nowait((index, error))
    except Exception as error:   # a bug in a formatter: still end the stream cleanly
        log.exception("stream %d of a fanned-out request failed", index)
        queue.put_nowait((index, GenerationError(f"{type(error).__name__}: {error}")))
    finally:
        queue.put_nowait((index, _FINISHED))


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """``(stream index, item)`` as items arrive; a failed stream's last item is its ``TGIError``.
    Closing the merged stream cancels the others (their requests are aborted)."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(i, s, queue)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _FINISHED:
                running -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
