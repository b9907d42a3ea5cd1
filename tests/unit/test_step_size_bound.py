"""No planned step outgrows the step the worker's warm-up measured, and a prompt beside a decode batch that
fills the budget still moves every step (engine.router.scheduler's module docstring: the step budget).

The warm-up runs a step of ``largest_step_tokens`` (``engine.assembly.plan_engine``'s ``warmup_tokens``); the
KV cache gets the memory left after it, so a larger step could run out of GPU memory mid-serving. Before the fix the first prompt in order always took
``min_chunk`` tokens, also beside decode rows (and their drafts) that had used the whole budget."""
import random

import pytest

from engine.protocol.messages import FED_BACK, RowResult, SamplingParams, StepResult
from engine.router.allocator import SlotAllocator
from engine.router.scheduler import Request, Scheduler, SchedulerConfig, largest_step_tokens

LONG = 10_000       # the long prompt's request id


def warmup_tokens(config: SchedulerConfig, max_requests: int) -> int:
    """The warm-up step's tokens (engine.assembly: ``WorkerConfig.warmup_tokens``)."""
    return largest_step_tokens(config.max_prefill_tokens, max_requests, config.speculate)


def periodic(rid: int, prompt_len: int, max_new: int) -> Request:
    """A prompt of 1 2 3 1 2 3 ..., which ``answer`` goes on repeating: every n-gram draft is right."""
    return Request(request_id=rid, prompt_ids=[t % 3 + 1 for t in range(prompt_len)], max_new_tokens=max_new,
                   params=SamplingParams(), seed=0, stop_token_ids=frozenset({0}))


def answer(sched: Scheduler, step) -> StepResult:
    """A stand-in shard: each sampled row's next tokens go on with the period of 3 after its newest known
    token; a verify row keeps its drafts while they match and adds the token after them (greedy)."""
    by_id = {r.request_id: r for r in sched.running}
    rows = []
    for row in step.rows:
        request = by_id.get(row.request_id)
        if not row.sample or request is None:
            rows.append(RowResult(row.request_id))
            continue
        last = (request.prompt_ids + request.generated)[-1]
        drafts = row.input_ids[1:] if row.input_ids[0] == FED_BACK else []
        chosen = [(last + j) % 3 + 1 for j in range(len(drafts) + 1)]
        kept = 1
        while kept <= len(drafts) and drafts[kept - 1] == chosen[kept - 1]:
            kept += 1
        results = [RowResult(row.request_id, token_id=t, logprob=-1.0) for t in chosen[:kept]]
        results[0].following = results[1:]
        rows.append(results[0])
    return StepResult(rows)


def step_tokens(step) -> int:
    return sum(len(r.input_ids) for r in step.rows)


def prompt_tokens(step) -> int:
    return sum(len(r.input_ids) for r in step.rows if r.input_ids[0] != FED_BACK)


# (max_prefill_tokens, max_requests, speculate, attention_tile): the batch that decodes beside the prompt is
# max_requests - 1 requests (the prompt holds the last row)
CASES = {
    "plain-rows-leave-9": (64, 56, 0, 1),         # 55 rows: before, 55 + 16 = 71 tokens a step (warm-up: 64)
    "plain-rows-fill-the-budget": (64, 80, 0, 1),  # 79 rows: before, 79 + 16 = 95 (warm-up: 80)
    "drafts-fill-the-budget": (64, 16, 3, 1),      # 15 rows + 45 drafts: before, 60 + 16 = 76 (warm-up: 64)
    "a-whole-tile-does-not-fit": (64, 40, 0, 32),  # 39 rows, min_chunk 32: before, 39 + 32 = 71 (warm-up: 64)
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_long_prompt_beside_a_batch_that_fills_the_budget(case):
    """The batch decodes 150 tokens beside a 400-token prompt: no step passes the budget unless its plain decode
    rows alone fill it (then by one prompt token), none passes the warm-up's step, the prompt moves in every
    step until its first token, within the admission's delay bound (``Scheduler.prefill_delay``), and with
    --speculate the rows still draft beside the prompt's chunks."""
    budget, max_requests, speculate, tile = CASES[case]
    config = SchedulerConfig(max_prefill_tokens=budget, max_seq_len=4000, speculate=speculate, verify_step_cost=0.0,
                             attention_tile=tile, prefix_caching=False)
    sched = Scheduler(SlotAllocator(num_slots=100_000, max_requests=max_requests), config)
    for rid in range(max_requests - 1):
        sched.add(periodic(rid, 3, 150))
    for _ in range(100):                             # admitted, prefilled, decoding (the last ones slowly)
        if sum(1 for r in sched.running if r.can_decode) == max_requests - 1:
            break
        step = sched.schedule()
        sched.process(step, answer(sched, step))
    assert sum(1 for r in sched.running if r.can_decode) == max_requests - 1
    sched.add(periodic(LONG, 400, 2))
    limit = warmup_tokens(config, max_requests)
    first_token, drafts_beside_chunks = None, 0
    for i in range(sched.prefill_delay):              # the admission's bound of the prompt's wait
        decode_rows = sum(1 for r in sched.running if r.can_decode)
        step = sched.schedule()
        size, chunk = step_tokens(step), prompt_tokens(step)
        assert size <= max(budget, decode_rows + 1) and size <= limit, f"step {i}: {size} tokens"
        assert chunk > 0, f"step {i}: the prompt did not move"
        drafts_beside_chunks += size - chunk - len([r for r in step.rows if r.input_ids[0] == FED_BACK])
        sched.process(step, answer(sched, step))
        sched.check_integrity()
        if any(r.request_id == LONG and r.sample for r in step.rows):
            first_token = i
            break
    assert first_token is not None
    assert (drafts_beside_chunks > 0) == (speculate > 0)


def test_min_chunk_never_passes_the_budget():
    for budget, tile in ((8, 1), (64, 128), (4096, 64)):
        sched = Scheduler(SlotAllocator(num_slots=10_000, max_requests=4),
                          SchedulerConfig(max_prefill_tokens=budget, attention_tile=tile))
        assert sched.min_chunk == min(max(16, tile), budget) <= budget


@pytest.mark.parametrize("speculate", [0, 2])
def test_random_arrivals_beside_a_batch_larger_than_the_budget(speculate):
    """Random arrivals at a tight KV capacity, more request rows than a step's budget: every step within the
    warm-up's, within the budget whenever it carries a prompt chunk and its plain decode rows leave room, no
    slot runs out (the admission's delay bound holds with prompts that move by fewer tokens), every request
    ends."""
    rng = random.Random(11)
    max_requests, budget = 40, 32
    config = SchedulerConfig(max_prefill_tokens=budget, max_seq_len=600, speculate=speculate, verify_step_cost=0.0)
    alloc = SlotAllocator(num_slots=3000, max_requests=max_requests)
    sched = Scheduler(alloc, config)
    limit = warmup_tokens(config, max_requests)
    added = finished = over_budget = 0
    for i in range(3000):
        for _ in range(2 if rng.random() < 0.5 and added < 400 else 0):
            prompt = rng.choice([rng.randint(1, 12), rng.randint(100, 400)])
            sched.add(periodic(added, prompt, rng.randint(1, min(80, 600 - prompt))))
            added += 1
        if not sched.has_work():
            continue
        decode_rows = sum(1 for r in sched.running if r.can_decode)
        step = sched.schedule()
        size = step_tokens(step)
        assert size <= limit, f"step {i}: {size} tokens"
        if prompt_tokens(step):
            assert size <= max(budget, decode_rows + 1), f"step {i}: {size} tokens beside {decode_rows} rows"
            over_budget += size > budget
        for _, _, reason in sched.process(step, answer(sched, step)):
            finished += reason is not None
        sched.check_integrity()
    for _ in range(20_000):
        if not sched.has_work():
            break
        step = sched.schedule()
        for _, _, reason in sched.process(step, answer(sched, step)):
            finished += reason is not None
    assert added == 400 and finished == added and alloc.used_slots == 0
    assert over_budget > 0       # the batch did fill the budget beside prompts
