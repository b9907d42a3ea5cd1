"""The step budget (stall-free batching): decode rows first, prompt chunks in the rest, their
attention-weighted cost capped while requests decode; short prompts pass long ones; admission
stays within the KV slots."""
import random

import pytest

from engine.protocol.messages import FED_BACK, SamplingParams
from engine.router.allocator import SlotAllocator
from engine.router.scheduler import (MIN_PROMPT_CHUNK, Request, Scheduler, SchedulerConfig, StepBudget, chunk_cost,
                                    largest_step_tokens)
from tests.unit.test_scheduler import fake_result, make_request


def drive(sched, steps, on_step=None):
    """Run ``steps`` steps (fewer if the work ends); ``on_step(i, step, decoding)`` sees each step
    with the ids of the requests that were decoding when it was planned."""
    for i in range(steps):
        if not sched.has_work():
            return i
        decoding = {r.request_id for r in sched.running if not r.in_prefill and r.remaining > 0}
        step = sched.schedule()
        if on_step is not None:
            on_step(i, step, decoding)
        sched.process(step, fake_result(step))
        sched.check_integrity()
    return steps


def prompt_rows(step):
    return [r for r in step.rows if r.input_ids[0] != FED_BACK]


def first_token_steps(sched, steps) -> dict[int, int]:
    """Drive ``steps`` steps; {request id: the step that sampled its first token}."""
    first_token = {}

    def check(i, step, decoding):
        for row in prompt_rows(step):
            if row.sample:
                first_token.setdefault(row.request_id, i)

    drive(sched, steps, check)
    return first_token


@pytest.mark.parametrize("stall_free", [None, 24])
def test_a_long_prompt_beside_decoding_requests_never_exceeds_the_budget(stall_free):
    alloc = SlotAllocator(num_slots=4000, max_requests=8)
    config = SchedulerConfig(max_prefill_tokens=64, max_seq_len=4000, stall_free_tokens=stall_free,
                             attention_span=300, kv_weight_tokens=500, prefix_caching=False)
    sched = Scheduler(alloc, config)
    for rid in range(4):
        sched.add(make_request(rid, 10, 200))
    drive(sched, 3)
    sched.add(make_request(9, 1500, 4))                   # arrives while 0..3 decode
    sizes, chunk_starts = [], []

    def check(i, step, decoding):
        sizes.append(sum(len(r.input_ids) for r in step.rows))
        rows = {r.request_id for r in step.rows if r.input_ids[0] == FED_BACK}
        assert decoding <= rows, f"step {i}: decoding requests {decoding - rows} have no row"
        chunk_starts.extend((r.start_pos, len(r.input_ids)) for r in prompt_rows(step))

    drive(sched, 400, check)
    assert max(sizes) <= 64
    assert sum(n for _, n in chunk_starts) == 1500 and not sched.has_work()
    if stall_free:       # the cost cap: 24 * (1 + context / 500) beside 4 decoding requests
        late = [n for start, n in chunk_starts if start > 1000]
        assert max(late) < min(n for start, n in chunk_starts if start < 100)


def test_a_chunks_cost_stays_within_the_stall_free_budget():
    config = SchedulerConfig(max_prefill_tokens=10_000, stall_free_tokens=100, attention_span=1000,
                             kv_weight_tokens=2000)
    decoding = [make_request(i, 500, 10) for i in range(3)]
    budget = StepBudget.for_step(config, decoding)
    assert budget.tokens == 10_000 - 3 and budget.cost == pytest.approx(100 * (1 + 1500 / 2000))
    for start in (0, 5000, 50_000):
        tokens = budget.fit(start, 100_000, config.attention_span)
        assert 0 < tokens and chunk_cost(start, tokens, 1000) <= budget.cost < chunk_cost(start, tokens + 1, 1000)
    assert StepBudget.for_step(config, []).cost is None         # nothing decodes: the token budget only


def test_each_decoding_request_adds_its_share_to_the_cap():
    config = SchedulerConfig(max_prefill_tokens=10_000, stall_free_tokens=100, stall_free_row_tokens=30,
                             attention_span=1000, kv_weight_tokens=2000)
    for batch in (1, 3, 40):
        decoding = [make_request(i, 500, 10) for i in range(batch)]
        expected = 100 * (1 + 500 * batch / 2000) + 30 * batch
        assert StepBudget.for_step(config, decoding).cost == pytest.approx(expected)
    with pytest.raises(ValueError, match="stall_free_row_tokens must be >= 0"):
        SchedulerConfig(stall_free_tokens=100, stall_free_row_tokens=-1)


def test_a_larger_decode_batch_lets_a_long_prompt_take_larger_chunks():
    """The same prompt beside one decoding request and beside eight: with the per-request share its chunks
    grow with the batch (without it they would shrink a little: the batch's context only); every step keeps
    its decode rows and stays within the cap. The batch decodes 200 tokens: past the prompt's last chunk
    (step 66 beside one), and every chunk is checked to have been planned beside it."""
    def chunks_beside(batch: int) -> list[int]:
        config = SchedulerConfig(max_prefill_tokens=4096, max_seq_len=4000, stall_free_tokens=24,
                                 stall_free_row_tokens=16, attention_span=300, kv_weight_tokens=500,
                                 prefix_caching=False)
        sched = Scheduler(SlotAllocator(num_slots=20_000, max_requests=16), config)
        for rid in range(batch):
            sched.add(make_request(rid, 10, 200))
        drive(sched, 2)
        sched.add(make_request(99, 1200, 2))
        sizes = []

        def check(i, step, decoding):
            rows = {r.request_id for r in step.rows if r.input_ids[0] == FED_BACK}
            assert decoding <= rows and (len(decoding) == batch or not prompt_rows(step))
            context = sum(r.held_tokens for r in sched.running if r.request_id in decoding)
            cap = 24 * (1 + context / 500) + 16 * len(decoding)
            cost = sum(chunk_cost(r.start_pos, len(r.input_ids), 300) for r in prompt_rows(step))
            assert cost <= cap + 1e-9 or sum(len(r.input_ids) for r in prompt_rows(step)) <= MIN_PROMPT_CHUNK
            sizes.extend(len(r.input_ids) for r in prompt_rows(step))

        drive(sched, 2000, check)
        assert not sched.has_work()
        return sizes
    one, eight = chunks_beside(1), chunks_beside(8)
    assert sum(one) == sum(eight) == 1200
    assert len(eight) < len(one) / 2 and max(eight) > 2 * max(one)


def test_a_burst_of_prompts_beside_one_decoding_request_is_capped_too():
    """Many prompts waiting for their first token do not lift the cap off the one decoding request's steps
    (they did while they outnumbered it: whole steps of prompt, the ITL tail of a mixed load)."""
    alloc = SlotAllocator(num_slots=20_000, max_requests=16)
    config = SchedulerConfig(max_prefill_tokens=512, max_seq_len=4000, stall_free_tokens=24, attention_span=300,
                             kv_weight_tokens=500, prefix_caching=False)
    sched = Scheduler(alloc, config)
    sched.add(make_request(0, 10, 300))
    drive(sched, 2)
    for rid in range(1, 9):
        sched.add(make_request(rid, 400, 2))
    costs = []

    def check(i, step, decoding):
        if decoding:
            cap = 24 * (1 + sum(r.held_tokens for r in sched.running if r.request_id in decoding) / 500)
            cost = sum(chunk_cost(r.start_pos, len(r.input_ids), 300) for r in prompt_rows(step))
            costs.append(cost)
            assert len(prompt_rows(step)) <= 1 or cost <= cap, f"step {i}: prompt cost {cost} over the cap {cap}"

    drive(sched, 3000, check)
    assert not sched.has_work() and len(costs) > 100 and max(costs) > 0


def test_a_short_prompt_passes_a_long_one():
    alloc = SlotAllocator(num_slots=20_000, max_requests=4)
    sched = Scheduler(alloc, SchedulerConfig(max_prefill_tokens=64, max_seq_len=20_000))
    sched.add(make_request(1, 10_000, 2))
    drive(sched, 3)
    sched.add(make_request(2, 20, 2))
    assert first_token_steps(sched, 5) == {2: 0}            # planned in full in the step after it arrived
    assert sched.running[0].in_prefill      # while the long prompt is still being planned


def test_a_short_prompt_passes_a_long_one_that_has_been_in_prefill_for_many_small_steps():
    """Beside a decoding stream the cost cap keeps steps small, so a long prompt spends many steps in prefill.
    A newcomer still goes first: the long one aged by what the others were given (nothing), not by its
    steps (it had aged past every newcomer, and the short prompt waited for all of it)."""
    alloc = SlotAllocator(num_slots=10_000, max_requests=8)
    config = SchedulerConfig(max_prefill_tokens=64, max_seq_len=10_000, stall_free_tokens=16, attention_span=300,
                             kv_weight_tokens=500, prefix_caching=False)
    sched = Scheduler(alloc, config)
    sched.add(make_request(0, 10, 2000))                  # the stream
    drive(sched, 3)
    sched.add(make_request(1, 3000, 1))
    drive(sched, 60)
    assert 0 < sched.running[1].prefilled < 1000          # capped chunks: 60 steps planned a fraction of it
    sched.add(make_request(2, 20, 1))
    first_token = first_token_steps(sched, 400)
    assert first_token[2] <= 1 and first_token[1] > first_token[2]


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones():
    alloc = SlotAllocator(num_slots=5000, max_requests=16)
    sched = Scheduler(alloc, SchedulerConfig(max_prefill_tokens=64, max_seq_len=5000))
    sched.add(make_request(0, 640, 1))
    planned = {}
    next_id = iter(range(1, 10_000))

    def check(i, step, decoding):
        for row in prompt_rows(step):
            planned[row.request_id] = planned.get(row.request_id, 0) + len(row.input_ids)
        for _ in range(3):                  # 90 new prompt tokens a step: more than the budget
            sched.add(make_request(next(next_id), 30, 1))

    steps = 0
    while planned.get(0, 0) < 640:
        drive(sched, 1, check)
        steps += 1
        assert steps <= 2 * 640 // 64 + 2, f"the long prompt got {planned.get(0, 0)} of 640 tokens"


def test_random_arrivals_never_run_out_of_slots():
    """Thousands of steps of random arrivals (long and short prompts, short and long outputs,
    aborts) at a tight KV capacity: no step lacks a slot, no step is larger than the warm-up's
    (``largest_step_tokens``: the budget here), and every request ends."""
    rng = random.Random(7)
    alloc = SlotAllocator(num_slots=1200, max_requests=12)
    config = SchedulerConfig(max_prefill_tokens=48, max_seq_len=1200, stall_free_tokens=16, attention_span=200,
                             kv_weight_tokens=400)
    sched = Scheduler(alloc, config)
    added, finished = 0, 0
    for i in range(3000):
        if rng.random() < 0.3 and added < 600:
            prompt = rng.choice([rng.randint(1, 40), rng.randint(200, 900)])
            sched.add(make_request(added, prompt, rng.randint(1, min(60, 1200 - prompt))))
            added += 1
        if sched.running and rng.random() < 0.01:
            finished += sched.abort(rng.choice(sched.running).request_id)
        if not sched.has_work():
            continue
        step = sched.schedule()
        assert sum(len(r.input_ids) for r in step.rows) <= largest_step_tokens(48, 12, speculate=0) == 48
        for _, _, reason in sched.process(step, fake_result(step)):
            finished += reason is not None
        sched.check_integrity()
    assert drive(sched, 20_000) < 20_000
    assert added > 500 and finished == added and alloc.used_slots == 0


def test_a_partial_attention_tile_costs_a_whole_one():
    """A program of the prefill attention takes ``attention_tile`` new tokens and walks the whole context for
    them: 33 tokens late in a long prompt cost two walks, so the budget takes one whole tile instead."""
    span, tile = 16_000, 32
    assert chunk_cost(90_000, 33, span, tile) - chunk_cost(90_000, 32, span, tile) > 32 * 90_000 / span
    assert chunk_cost(90_000, 32, span, tile) == pytest.approx(chunk_cost(90_000, 32, span))
    budget = StepBudget(tokens=4095, cost=256)
    assert budget.fit(90_000, 10_000, span) > 32                  # without tiles: a second, almost empty one
    assert budget.fit(90_000, 10_000, span, tile) == 32
    assert 0 <= budget.fit(0, 10_000, span) - budget.fit(0, 10_000, span, tile) <= 1   # early: about no difference


def a_prompt_beside_a_stream(prompt: int, stream_new: int, **config) -> Scheduler:
    """A stream (10-token prompt) decoding, then a ``prompt``-token request added beside it; 32-token tiles."""
    config = SchedulerConfig(max_prefill_tokens=4096, max_seq_len=8000, attention_tile=32, prefix_caching=False,
                             **config)
    sched = Scheduler(SlotAllocator(num_slots=20_000, max_requests=4), config)
    sched.add(make_request(0, 10, stream_new))
    drive(sched, 2)
    sched.add(make_request(1, prompt, 2))
    return sched


def test_the_first_prompt_moves_by_a_whole_tile_at_least():
    sched = a_prompt_beside_a_stream(3000, 300, stall_free_tokens=8, attention_span=300, kv_weight_tokens=500)
    sizes = []
    drive(sched, 400, lambda i, step, decoding: sizes.extend(len(r.input_ids) for r in prompt_rows(step)))
    assert sum(sizes) == 3000 and min(sizes[:-1]) >= 32
    with pytest.raises(ValueError, match="attention_tile must be >= 1"):
        SchedulerConfig(attention_tile=0)


def test_every_chunk_beside_a_stream_costs_its_whole_tiles_within_the_cap():
    """The stream decodes 300 tokens: past the prompt's last chunk (step 109), each chunk planned beside it."""
    sched = a_prompt_beside_a_stream(5000, 300, stall_free_tokens=200, attention_span=1000, kv_weight_tokens=50_000)
    chunks = []

    def check(i, step, decoding):
        assert decoding == {0} or not prompt_rows(step), f"step {i}: a chunk without the stream"
        cap = 200 * (1 + sum(r.held_tokens for r in sched.running if r.request_id in decoding) / 50_000)
        for r in prompt_rows(step):
            chunks.append(len(r.input_ids))
            n, tiles = len(r.input_ids), -(-len(r.input_ids) // 32) * 32
            cost = n + tiles * (r.start_pos + (n - 1) / 2) / 1000              # its attention's whole tiles
            assert cost <= cap + 1e-9 or len(r.input_ids) <= 32, f"step {i}: {len(r.input_ids)} tokens cost {cost}"

    drive(sched, 2000, check)
    assert sum(chunks) == 5000 and len(chunks) > 50


def test_chunks_behind_a_shared_prefix_pay_no_tile_of_their_own_for_it():
    """The shared-prefix kernel walks the prefix once for the new tokens of all its rows, tiled together: a
    chunk of 32 tokens after 3,000 shared positions costs their attention there, not a whole 64-token tile's."""
    span, tile = 15_000, 64
    shared = chunk_cost(3000, 32, span, tile, shared=3000)
    assert shared == pytest.approx(32 + (32 * 3000 + 64 * 15.5) / span)
    assert shared < chunk_cost(3000, 32, span, tile) - 32 * 3000 / span * 0.9     # about half the old charge
    assert chunk_cost(3000, 32, span, shared=3000) == pytest.approx(chunk_cost(3000, 32, span))   # untiled: equal
    assert chunk_cost(100, 32, span, tile, shared=3000) == chunk_cost(100, 32, span, tile)   # inside the prefix


def _burst_behind_a_cached_prefix(prefix: int = 600, requests: int = 40) -> tuple[list[int], set[int]]:
    """Request 0 (``prefix`` tokens) prefilled and decoding, then ``requests`` prompts of that prefix and 8
    tokens of their own: the burst's prompt rows in each step that had some, and the requests prefilled."""
    config = SchedulerConfig(max_prefill_tokens=4096, max_seq_len=2000, stall_free_tokens=24, attention_span=300,
                             kv_weight_tokens=500, attention_tile=64)
    sched = Scheduler(SlotAllocator(num_slots=20_000, max_requests=64), config)
    sched.add(make_request(0, prefix, 200))
    drive(sched, 3)
    base = list(range(1, prefix + 1))
    for rid in range(1, requests + 1):
        sched.add(Request(request_id=rid, prompt_ids=base + [5000 + rid * 8 + k for k in range(8)], max_new_tokens=4,
                          params=SamplingParams(), seed=0, stop_token_ids=frozenset({0})))
    sizes, prefilled = [], set()

    def count(i, step, decoding):
        burst = [r.request_id for r in prompt_rows(step) if r.request_id > 0]
        sizes.append(len(burst))
        prefilled.update(burst)

    drive(sched, 12, count)
    return [s for s in sizes if s], prefilled


def test_a_burst_behind_a_shared_prefix_fills_more_of_a_capped_step(monkeypatch):
    shared_sizes, prefilled = _burst_behind_a_cached_prefix()
    assert prefilled == set(range(1, 41))
    from engine.router.shared_prefix import SharedPrefixes

    monkeypatch.setattr(SharedPrefixes, "shared_length", lambda self, request_id: 0)    # charged per row's tiles
    tiled_sizes, _ = _burst_behind_a_cached_prefix()
    assert tiled_sizes[:5] == [1] * 5                  # a whole tile's walk of the prefix each: one a step
    assert shared_sizes[0] > 1 and shared_sizes[3] > 10 and len(shared_sizes) <= 6
