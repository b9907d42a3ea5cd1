"""Several front-end processes as one server (``--frontend-processes``): what they share and how the router
tells them apart (``tgi_compat.frontend_group``, ``engine.router.process.FrontendLinks``)."""
from __future__ import annotations

import multiprocessing
import os

import pytest

from engine.protocol.codec import decode, encode
from engine.protocol.messages import Events, GenerationRequest, RouterStatus, StepStats, TokenEvent, frontend_of
from tgi_compat.concurrency import ConcurrencyLimiter
from tgi_compat.errors import OverloadedError
from tgi_compat.frontend_group import FrontendGroup, auto_frontend_processes, is_frontend_name, listening_socket


@pytest.mark.parametrize("cores, expected", [(1, 1), (2, 1), (7, 1), (8, 2), (12, 3), (16, 4), (128, 4)])
def test_auto_gives_one_front_end_per_four_cores_at_most_four(cores, expected):
    assert auto_frontend_processes(cores) == expected


def test_each_front_end_numbers_requests_that_name_it(monkeypatch):
    import itertools

    from tgi_compat import request_ids

    monkeypatch.setattr(request_ids, "_counter", itertools.count(1))
    group = FrontendGroup(3, multiprocessing.get_context("spawn"))
    try:
        for index in range(3):
            request_ids.number_from(group.member(index).first_request_id(), group.count)
            ids = [request_ids.next_request_id() for _ in range(5)]
            assert len(set(ids)) == 5 and all(frontend_of(i, 3) == index for i in ids)
        assert [group.member(i).process_name for i in range(3)] == ["frontend-0", "frontend-1", "frontend-2"]
        assert all(is_frontend_name(group.member(i).process_name) for i in range(3))
        assert not any(is_frontend_name(name) for name in ("router", "shard-0", "frontends"))
    finally:
        group.close()
    assert not os.path.exists(group.metrics_dir)


def test_one_front_end_shares_nothing():
    group = FrontendGroup(1, multiprocessing.get_context("spawn"))
    member = group.member(0)
    assert (member.shared, member.permits, member.metrics_dir, member.process_name) == (False, None, None, "frontend")
    with pytest.raises(ValueError, match="between 1 and 64"):
        FrontendGroup(0, multiprocessing.get_context("spawn"))


def test_front_ends_share_the_port_only_with_reuse_port():
    first = listening_socket("127.0.0.1", 0, reuse_port=True)
    port = first.getsockname()[1]
    try:
        second = listening_socket("127.0.0.1", port, reuse_port=True)
        second.close()
        with pytest.raises(OSError):
            listening_socket("127.0.0.1", port, reuse_port=False)
    finally:
        first.close()


def test_the_concurrency_limit_counts_every_front_ends_requests():
    shared = multiprocessing.get_context("spawn").Value("q", 0)
    a, b = ConcurrencyLimiter(3, shared), ConcurrencyLimiter(3, shared)
    with a.permits(2), b.permits(1):
        assert shared.value == 3
        for limiter in (a, b):
            with pytest.raises(OverloadedError):
                with limiter.permits(1):
                    pass
    assert shared.value == 0 and a.in_use == b.in_use == 0


def _count_in_one_front_end(metrics_dir: str, index: int, requests: int) -> None:
    from tgi_compat.frontend_group import FrontendMember, use_shared_metrics
    from tgi_compat.metrics import ServerMetrics

    use_shared_metrics(FrontendMember(index, 2, None, metrics_dir))
    metrics = ServerMetrics(64, 128, 1, metrics_dir)
    for _ in range(requests):
        metrics.request_count.inc()
    metrics.update_from_stats({"prefix_cache_lookup_tokens": 50, "queue_size": index + 5}, None)
    metrics.piece_cache.looked_up(hits=index + 1, misses=2)       # each front end's own tokenizer piece cache
    metrics.piece_cache.holds(1000 * (index + 1))
    if index == 0:       # the router sends its steps' numbers to the first front end only
        metrics.observe_steps([StepStats("decode", 4, False, 0.001, 0.01, 0.001, 0.0, 0.012)])


def test_metrics_sum_what_every_front_end_counted_and_show_the_routers_totals_once():
    group = FrontendGroup(2, multiprocessing.get_context("spawn"))
    try:
        context = multiprocessing.get_context("spawn")
        for index, requests in ((0, 3), (1, 4)):
            child = context.Process(target=_count_in_one_front_end, args=(group.metrics_dir, index, requests))
            child.start()
            child.join(60)
            assert child.exitcode == 0
        from tgi_compat.metrics import ServerMetrics

        scraper = ServerMetrics(64, 128, 1, group.metrics_dir)     # the process a scrape reached
        scraper.update_from_stats({"prefix_cache_lookup_tokens": 50, "queue_size": 6}, None)
        text = scraper.render()
    finally:
        group.close()
    lines = set(text.splitlines())
    assert "tgi_request_count 7.0" in lines                      # 3 + 4: both front ends' requests
    assert "tgi_prefix_cache_lookup_tokens 50.0" in lines        # the router's total, not 50 per front end
    assert 'tgi_batch_inference_count{method="decode"} 1.0' in lines
    assert "tgi_queue_size 6.0" in lines                         # the latest status
    assert {"tgi_tokenizer_piece_cache_hits 3.0", "tgi_tokenizer_piece_cache_misses 4.0",
            "tgi_tokenizer_piece_cache_chars 3000.0"} <= lines    # both front ends' caches
    assert "# TYPE tgi_request_count counter" in lines


def _links_and_loop(count: int):
    from engine.router.allocator import SlotAllocator
    from engine.router.process import FrontendLinks, RouterLoop
    from engine.router.router import Router
    from engine.router.scheduler import Scheduler, SchedulerConfig

    pipes = [multiprocessing.Pipe() for _ in range(count)]
    links = FrontendLinks([router_end for _, router_end in pipes])
    scheduler = Scheduler(SlotAllocator(64, 8), SchedulerConfig(max_prefill_tokens=64, max_seq_len=32))
    loop = RouterLoop(Router(scheduler, shards=None, eos_token_ids=(0,)), links)
    return [front for front, _ in pipes], links, loop, scheduler


def _received(conn) -> list:
    out = []
    while conn.poll(0.2):
        out.append(decode(conn.recv_bytes()))
    return out


def test_the_router_sends_each_request_events_to_the_front_end_that_numbered_it():
    fronts, links, loop, scheduler = _links_and_loop(2)
    step = StepStats("decode", 3, False, 0.0, 0.0, 0.0, 0.0, 0.0)
    links.send_events([TokenEvent(1, 5, -0.5), TokenEvent(2, 6, -0.5), TokenEvent(3, 7, -0.5)], [step])
    links.send_status(RouterStatus(True, 1, 2, 3, 4))
    first, second = _received(fronts[0]), _received(fronts[1])
    assert first == [Events([TokenEvent(1, 5, -0.5), TokenEvent(3, 7, -0.5)], [step]), RouterStatus(True, 1, 2, 3, 4)]
    assert second == [Events([TokenEvent(2, 6, -0.5)], []), RouterStatus(True, 1, 2, 3, 4)]


def test_a_request_numbered_for_another_front_end_is_refused():
    fronts, links, loop, scheduler = _links_and_loop(2)
    fronts[0].send_bytes(encode(GenerationRequest(2, [5, 6, 7], 2)))     # id 2 belongs to front end 1
    fronts[1].send_bytes(encode(GenerationRequest(4, [5, 6, 7], 2)))
    assert loop.read_inbox(0.5)
    assert [r.request_id for r in scheduler.waiting] == [4]
    answer = _received(fronts[0])            # the sender hears why, so its client is not left waiting
    assert [(e.request_id, e.error) for m in answer for e in m.events] == [(2, "Request failed: misnumbered request id")]


def test_a_front_end_that_goes_loses_only_its_requests():
    fronts, links, loop, scheduler = _links_and_loop(2)
    for front, request_id in ((fronts[0], 1), (fronts[1], 2), (fronts[0], 3), (fronts[1], 4)):
        front.send_bytes(encode(GenerationRequest(request_id, [5, 6, 7], 2)))
    assert loop.read_inbox(0.5) and sorted(r.request_id for r in scheduler.waiting) == [1, 2, 3, 4]
    fronts[1].close()
    assert loop.read_inbox(0.5)                                     # front end 0 is still there
    assert sorted(r.request_id for r in scheduler.waiting) == [1, 3]
    links.send_events([TokenEvent(1, 5, -0.5), TokenEvent(2, 6, -0.5)], [])     # nothing is sent to the closed pipe
    assert _received(fronts[0]) == [Events([TokenEvent(1, 5, -0.5)], [])]
    fronts[0].close()
    assert not loop.read_inbox(0.5)                                 # every front end is gone: the router stops
    assert not scheduler.waiting


def test_the_routers_steps_go_to_the_first_front_end_still_there():
    fronts, links, loop, scheduler = _links_and_loop(2)
    fronts[0].close()
    loop.read_inbox(0.5)
    step = StepStats("prefill", 1, False, 0.0, 0.0, 0.0, 0.0, 0.0)
    links.send_events([], [step])
    assert _received(fronts[1]) == [Events([], [step])]

