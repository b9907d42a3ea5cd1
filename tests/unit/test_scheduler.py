import random

import pytest

from engine.router.allocator import SlotAllocator
from engine.protocol.messages import SamplingParams
from engine.router.scheduler import Request, Scheduler, SchedulerConfig, peak_usage
from engine.protocol.messages import FED_BACK, RowResult, StepResult


def brute_force_peak(requests):
    """Simulate every request generating its remaining tokens, one per step."""
    peak, t = 0, 0
    while True:
        alive = [(rem, held) for rem, held in requests if rem >= t]
        if not alive:
            return peak
        peak = max(peak, sum(held + t for rem, held in alive))
        t += 1


def test_peak_usage_matches_a_simulation():
    rng = random.Random(1)
    for _ in range(200):
        reqs = [(rng.randint(1, 40), rng.randint(1, 60)) for _ in range(rng.randint(1, 8))]
        assert peak_usage(reqs) == brute_force_peak(reqs)


def make_request(rid, prompt_len, max_new, **params):
    return Request(request_id=rid, prompt_ids=list(range(1, prompt_len + 1)), max_new_tokens=max_new,
                   params=SamplingParams(**params), seed=0, stop_token_ids=frozenset({0}))


def fake_result(step, token=7):
    return StepResult([RowResult(r.request_id, token_id=token if r.sample else None, logprob=-1.0) for r in step.rows])


def run_to_end(sched, alloc, token=7, max_steps=10_000):
    """Drive the scheduler with a stand-in for the model that always answers `token`."""
    max_used, finished = 0, {}
    for _ in range(max_steps):
        if not sched.has_work():
            return max_used, finished
        step = sched.schedule()
        max_used = max(max_used, alloc.used_slots)
        for request, _, reason in sched.process(step, fake_result(step, token)):
            if reason:
                finished[request.request_id] = (reason, len(request.generated))
        alloc.check_integrity()
    raise AssertionError("scheduler did not finish")


def test_admission_never_exceeds_capacity_and_every_request_finishes():
    rng = random.Random(2)
    alloc = SlotAllocator(num_slots=300, max_requests=16)
    sched = Scheduler(alloc, SchedulerConfig(max_prefill_tokens=64, max_seq_len=300))
    lengths = {}
    for rid in range(60):
        prompt, new = rng.randint(1, 120), rng.randint(1, 100)
        lengths[rid] = new
        sched.add(make_request(rid, prompt, new))
    max_used, finished = run_to_end(sched, alloc)
    assert max_used <= 300
    assert finished == {rid: ("length", n) for rid, n in lengths.items()}
    assert alloc.used_slots == 0 and alloc.free_rows == 16


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    alloc = SlotAllocator(num_slots=1000, max_requests=4)
    sched = Scheduler(alloc, SchedulerConfig(max_prefill_tokens=32, max_seq_len=1000))
    sched.add(make_request(1, 100, 2, prompt_logprobs=True))
    chunks = []
    for _ in range(4):
        step = sched.schedule()
        (row,) = step.rows
        chunks.append((row.start_pos, len(row.input_ids), row.sample, len(row.logprob_targets)))
        sched.process(step, StepResult([RowResult(1, token_id=5 if row.sample else None,
                                                   prompt_logprobs=[-1.0] * len(row.logprob_targets))]))
    assert chunks == [(0, 32, False, 32), (32, 32, False, 32), (64, 32, False, 32), (96, 4, True, 3)]
    request = sched.running[0]
    assert len(request.prompt_logprobs) == 100 and request.prompt_logprobs[0] is None


def test_eos_finishes_and_length_is_checked_first():
    alloc = SlotAllocator(num_slots=100, max_requests=4)
    sched = Scheduler(alloc, SchedulerConfig(max_seq_len=100))
    sched.add(make_request(1, 5, 1))
    sched.add(make_request(2, 5, 3))
    _, finished = run_to_end(sched, alloc, token=0)
    assert finished == {1: ("length", 1), 2: ("eos_token", 1)}


def test_abort_frees_slots_in_every_state():
    alloc = SlotAllocator(num_slots=40, max_requests=4)
    sched = Scheduler(alloc, SchedulerConfig(max_prefill_tokens=8, max_seq_len=40))
    sched.add(make_request(1, 20, 10))
    sched.add(make_request(2, 20, 10))   # does not fit next to 1: waits
    step = sched.schedule()
    assert [r.request_id for r in step.rows] == [1] and alloc.used_slots == 8
    assert sched.abort(1) and sched.abort(2) and not sched.abort(3)
    assert alloc.used_slots == 0 and not sched.has_work()
    alloc.check_integrity()
    assert sched.schedule().released == [1]


def test_small_requests_overtake_a_huge_one_until_the_others_got_its_length_of_prompt():
    """Admission goes shortest prompt first, aged by the prompt tokens the others were given since a
    request arrived: a 60-token prompt that does not fit is passed by 5-token ones while 5 plus what the
    others got since it arrived is less than 60; then a newcomer queues behind it, and nobody overtakes
    it (it waited ``max_waiting_steps``)."""
    alloc = SlotAllocator(num_slots=100, max_requests=32)
    sched = Scheduler(alloc, SchedulerConfig(max_seq_len=100, max_waiting_steps=3, prefix_caching=False))
    def step():
        s = sched.schedule()
        sched.process(s, fake_result(s))

    sched.add(make_request(1, 10, 80))    # running: peak 90
    step()
    sched.add(make_request(2, 60, 30))    # does not fit while 1 runs
    since = sched.prompt_work
    rid = 3
    while 5 + sched.prompt_work - since < 60:
        sched.add(make_request(rid, 5, 1))    # fits beside 1: admitted although 2 arrived first
        step()
        assert [r.request_id for r in sched.waiting] == [2], f"request {rid} was not admitted"
        rid += 1
    assert rid == 3 + 11
    sched.add(make_request(rid, 5, 1))    # the others got 55 prompt tokens since 2 arrived: it queues behind 2
    step()
    assert [r.request_id for r in sched.waiting] == [2, rid]


def test_waiting_requests_are_admitted_shortest_first_and_in_arrival_order_between_equals():
    alloc = SlotAllocator(num_slots=1000, max_requests=8)
    sched = Scheduler(alloc, SchedulerConfig(max_prefill_tokens=64, max_seq_len=200))
    for rid, length in enumerate((50, 30, 40, 30, 10)):
        sched.add(make_request(rid, length, 4))
    assert [r.request_id for r in sched.waiting] == [4, 1, 3, 2, 0]
    step = sched.schedule()     # a step's budget (64 new prompt tokens) admits 10 + 30 + 30
    assert [r.request_id for r in sched.running] == [4, 1, 3] and [r.request_id for r in sched.waiting] == [2, 0]
    assert {r.request_id for r in step.rows} == {4, 1, 3}


def test_a_request_over_the_limits_is_refused():
    sched = Scheduler(SlotAllocator(num_slots=50, max_requests=2), SchedulerConfig(max_seq_len=64))
    with pytest.raises(ValueError, match="exceeds the limit of 50"):
        sched.add(make_request(1, 40, 20))
    with pytest.raises(ValueError, match="at least one prompt token"):
        sched.add(make_request(2, 0, 20))


def test_peak_admission_runs_more_requests_at_once_than_reservation():
    def max_running(admission):
        alloc = SlotAllocator(num_slots=400, max_requests=64)
        sched = Scheduler(alloc, SchedulerConfig(max_seq_len=400, admission=admission))
        for rid in range(40):
            sched.add(make_request(rid, 20, 10 + 5 * (rid % 8)))
        most = 0
        while sched.has_work():
            step = sched.schedule()
            most = max(most, len(sched.running))
            sched.process(step, fake_result(step))
            assert alloc.used_slots <= 400
        return most

    peak, reserve = max_running("peak"), max_running("reserve")
    assert reserve <= 400 // (20 + 10)   # each holds at least prompt 20 + 10 new tokens
    assert peak > reserve
    with pytest.raises(ValueError, match="admission 'fifo'"):
        SchedulerConfig(admission="fifo")


def test_rows_are_planned_ahead_of_their_tokens_but_never_past_max_new_tokens():
    alloc = SlotAllocator(num_slots=100, max_requests=4)
    sched = Scheduler(alloc, SchedulerConfig(max_seq_len=100))
    sched.add(make_request(1, 5, 2))
    prefill = sched.schedule()                  # samples token 1
    decode = sched.schedule()                   # planned before token 1 is known: feeds it back
    assert decode.rows[0].input_ids == [FED_BACK] and decode.rows[0].start_pos == 5
    assert sched.schedule().rows == []          # token 2 is the last one: nothing more to plan
    first = sched.process(prefill, fake_result(prefill, token=7))
    second = sched.process(decode, fake_result(decode, token=8))
    assert [(e[1].token_id, e[2]) for e in first + second] == [(7, None), (8, "length")]
    assert alloc.used_slots == 0 and not sched.has_work()


def test_a_request_that_ends_with_a_row_in_flight_frees_its_slots_and_its_late_token_is_dropped():
    alloc = SlotAllocator(num_slots=100, max_requests=4)
    sched = Scheduler(alloc, SchedulerConfig(max_seq_len=100))
    sched.add(make_request(1, 5, 10))
    prefill = sched.schedule()
    decode = sched.schedule()
    events = sched.process(prefill, fake_result(prefill, token=0))     # EOS
    assert [reason for _, _, reason in events] == ["eos_token"] and alloc.used_slots == 0
    assert sched.process(decode, fake_result(decode)) == []
    alloc.check_integrity()
    assert not sched.has_work() and sched.schedule().released == [1]


def test_peak_usage_with_prompt_delays_and_capped_growth_matches_a_simulation():
    """(L, R, delay, growth): holds R + clamp(t - delay, 0, growth) while t <= L (L may exceed
    delay + growth + 1: a prompt still being planned lives up to its wait bound longer)."""
    rng = random.Random(3)
    for _ in range(300):
        reqs = []
        for _ in range(rng.randint(1, 8)):
            delay, growth = rng.choice([0, 0, rng.randint(1, 5)]), rng.randint(0, 30)
            life = delay + growth + rng.choice([1, 1, 0, rng.randint(2, 40)] if delay == 0 else [1])
            reqs.append((max(life, 0), rng.randint(1, 60), delay, growth))
        brute = max(sum(r + min(max(t - d, 0), g) for life, r, d, g in reqs if t <= life)
                    for t in range(max(q[0] for q in reqs) + 1))
        assert peak_usage(reqs) == brute
