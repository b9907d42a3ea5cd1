"""The front end's end of the router pipe (``engine.client.RouterClient``), against a pipe end the test drives."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import time

from engine.client import RouterClient
from engine.protocol.codec import decode, encode
from engine.protocol.messages import Events, GenerationRequest, RouterStatus, TokenEvent


def request(rid: int, prompt_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_ids=[7] * prompt_tokens, max_new_tokens=2)


async def first_event(client: RouterClient, req: GenerationRequest) -> TokenEvent:
    events = client.generate(req)
    try:
        return await events.__anext__()
    finally:
        await events.aclose()


def test_a_router_busy_with_a_step_does_not_block_the_event_loop():
    """The router reads its pipe only between steps: long prompts that fill the pipe must not
    stop the event loop (every stream would stall for the step's length)."""
    router_end, frontend_end = multiprocessing.Pipe()
    client = RouterClient(frontend_end)

    async def submit_many() -> float:
        streams = [client.generate(request(rid, prompt_tokens=50_000)) for rid in range(40)]
        tasks = [asyncio.ensure_future(s.__anext__()) for s in streams]
        start = time.perf_counter()
        for _ in range(20):                       # the loop keeps turning while 8 MB wait for the reader
            await asyncio.sleep(0.001)
        turned = time.perf_counter() - start
        def router_reads():          # the router reads at last (off the loop: the loop writes what waits)
            return [decode(router_end.recv_bytes()).request_id for _ in streams]
        received = await asyncio.to_thread(router_reads)
        router_end.send_bytes(encode(Events([TokenEvent(rid, 5, -1.0, finish_reason="length") for rid in received])))
        events = await asyncio.gather(*tasks)
        assert received == list(range(40)) and [e.request_id for e in events] == received
        assert os.get_blocking(frontend_end.fileno())     # the reader thread's reads stay blocking
        return turned

    assert asyncio.run(submit_many()) < 2.0


def test_a_steps_events_reach_their_requests_in_order():
    router_end, frontend_end = multiprocessing.Pipe()
    client = RouterClient(frontend_end)

    async def run() -> dict[int, list[int]]:
        async def collect(rid):
            return [e.token_id async for e in client.generate(request(rid))]
        tasks = [asyncio.ensure_future(collect(rid)) for rid in (1, 2, 3)]
        for _ in range(3):                        # read off the loop: the requests are sent once it turns
            decode(await asyncio.to_thread(router_end.recv_bytes))
        router_end.send_bytes(encode(Events([TokenEvent(1, 10), TokenEvent(2, 20), TokenEvent(1, 11),
                                             TokenEvent(3, 30, finish_reason="length"), TokenEvent(99, 0)])))
        router_end.send_bytes(encode(Events([TokenEvent(2, 21, finish_reason="eos_token"),
                                             TokenEvent(1, 12, finish_reason="length")])))
        return dict(zip((1, 2, 3), await asyncio.gather(*tasks)))

    assert asyncio.run(run()) == {1: [10, 11, 12], 2: [20, 21], 3: [30]}


def test_when_the_router_is_gone_pending_and_new_requests_fail_at_once():
    router_end, frontend_end = multiprocessing.Pipe()
    client = RouterClient(frontend_end)
    router_end.send_bytes(encode(RouterStatus(healthy=True)))
    client.wait_ready(5)

    async def run() -> tuple[TokenEvent, TokenEvent]:
        pending = asyncio.ensure_future(first_event(client, request(1)))
        decode(await asyncio.to_thread(router_end.recv_bytes))
        router_end.close()
        failed = await asyncio.wait_for(pending, 5)
        late = await asyncio.wait_for(first_event(client, request(2)), 5)
        return failed, late

    failed, late = asyncio.run(run())
    assert "router process is gone" in failed.error and "router process is gone" in late.error
    assert not client.healthy()


def test_stats_carry_every_number_of_the_routers_status():
    """/metrics reads the router's counters through ``stats()``: a status field left out there never
    reaches it (the speculation counters once stayed 0 behind a launched server)."""
    router_end, frontend_end = multiprocessing.Pipe()
    client = RouterClient(frontend_end)
    status = RouterStatus(healthy=True, queue_size=1, batch_size=2, kv_used=3, kv_capacity=4, prefix_cache_tokens=5,
                          prefix_cache_lookup_tokens=6, prefix_cache_hit_tokens=7, prefix_cache_evicted_tokens=8,
                          speculation_drafted_tokens=9, speculation_accepted_tokens=10,
                          speculation_skipped_tokens=[11, 12])
    router_end.send_bytes(encode(status))
    assert client.wait_ready(timeout=5) == status
    numbers = {name: value for name, value in vars(status).items() if name not in ("healthy", "error")}
    assert client.stats() == numbers
    assert numbers.pop("speculation_skipped_tokens") == [11, 12] and set(numbers.values()) == set(range(1, 11))


def test_a_request_is_in_the_pipe_when_its_stream_has_started():
    """The event loop's own thread writes each request (no writer thread that must first win the GIL from
    a busy event loop: that held a burst's requests back 76-153 ms on an H100 host)."""
    router_end, frontend_end = multiprocessing.Pipe()
    client = RouterClient(frontend_end)

    async def run() -> tuple[bool, TokenEvent]:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(first_event(client, request(1)))
        checked = loop.create_future()
        loop.call_soon(lambda: checked.set_result(router_end.poll(0)))    # right after the stream's first step
        in_pipe = await checked
        assert decode(await asyncio.to_thread(router_end.recv_bytes)).request_id == 1
        router_end.send_bytes(encode(Events([TokenEvent(1, 5, finish_reason="length")])))
        return in_pipe, await task

    in_pipe, event = asyncio.run(run())
    assert in_pipe and event.token_id == 5


def test_a_pipe_that_fails_is_logged_with_its_cause_and_fails_the_requests(caplog):
    """Not EOF (the router exited) but an error reading the pipe: an ERROR line says why every request fails
    (a descriptor made non-blocking under the reader once did this in silence)."""
    import logging

    router_end, frontend_end = multiprocessing.Pipe()
    os.set_blocking(frontend_end.fileno(), False)          # the reader's first read fails: nothing to read yet
    with caplog.at_level(logging.ERROR, logger="engine.client"):
        client = RouterClient(frontend_end)
        assert client.wait_ready(5).error == "the router process is gone"
    assert any("reading the router's pipe failed (BlockingIOError" in r.getMessage() for r in caplog.records)
