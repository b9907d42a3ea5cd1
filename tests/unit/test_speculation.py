"""Speculative decoding on the router side (drafts, verify rows, stop criteria, slot truncation),
driven through the real Router with a stand-in model that reads its context through the KV slots."""
from __future__ import annotations

import random
from collections import deque

import pytest

from engine.protocol.messages import FED_BACK, NO_PREFIX, GenerationRequest, RowResult, SamplingParams, Step, StepResult
from engine.router.allocator import AllocatorError, SlotAllocator
from engine.router.drafter import NgramDrafter, propose_ngram
from engine.router.router import Router
from engine.router.scheduler import VERIFY_STEP_COST, Scheduler, SchedulerConfig


# ---- the drafter -------------------------------------------------------------------

def test_ngram_drafter_matches_a_backward_search():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randint(0, 5) for _ in range(rng.randint(1, 40))]
        drafter = NgramDrafter()
        cut = rng.randint(0, len(tokens))
        drafter.extend(tokens[:cut])
        drafter.extend(tokens[cut:])          # incremental = at once
        for n in (1, 3, 5):
            assert drafter.propose(n) == propose_ngram(tokens, n)


def test_the_index_built_in_chunks_and_on_reads_equals_the_per_token_one():
    """``NgramDrafter.index`` in bulk (a prompt chunk at a time, or everything at the first read) holds, for every
    n-gram, the position after its latest occurrence whose next token is known: the per-token rule's index."""
    rng = random.Random(2)
    for _ in range(200):
        max_ngram = rng.choice([1, 2, 3, 5])
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(0, 60))]
        drafter, indexed = NgramDrafter(max_ngram), 0
        drafter.extend(tokens[: rng.randint(0, len(tokens))])
        while indexed < len(drafter.tokens) and rng.random() < 0.8:       # the scheduler's prompt chunks
            indexed += rng.randint(0, 9)
            drafter.index(indexed)
        drafter.extend(tokens[len(drafter.tokens) :], score=rng.random() < 0.5)
        expected = [{} for _ in range(max_ngram + 1)]
        for end in range(len(tokens)):
            for n in range(1, min(max_ngram, end) + 1):
                expected[n][tuple(tokens[end - n : end])] = end
        assert drafter.follow == expected and drafter.indexed == len(tokens)


def test_adding_a_long_prompt_leaves_its_index_to_the_prompt_chunks():
    """``Scheduler.add`` copies the prompt only; each planned chunk indexes its tokens (engine.router.drafter)."""
    sched = Scheduler(SlotAllocator(num_slots=400, max_requests=4),
                      SchedulerConfig(max_seq_len=400, max_prefill_tokens=100, speculate=4, prefix_caching=False))
    sched.add(_request(1, [t % 50 + 1 for t in range(300)], 10))
    (request,) = sched.waiting
    assert request.drafter.indexed == 0 and len(request.drafter.tokens) == 300
    sched.schedule()
    assert request.drafter.indexed == 100


def propose_copying(tokens: list[int], proposals: list[tuple[int, int, int]], max_drafts: int, ahead: int,
                    max_ngram: int) -> list[int]:
    """The reference of ``NgramDrafter.propose`` with its copy pointer: ``proposals`` holds (length of
    ``tokens`` then, source, ahead) of every earlier proposal that drafted; the latest one's source
    goes on while the tokens since equal its continuation, else the longest and latest match."""
    if proposals:
        length, source, _ = proposals[-1]
        since = len(tokens) - length
        if source + since < len(tokens) and tokens[length:] == tokens[source : source + since]:
            return tokens[source + since + ahead : source + since + ahead + max_drafts]
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == tokens[-n:]:
                return tokens[end + ahead : end + ahead + max_drafts]
    return []


def test_ngram_drafter_with_its_copy_pointer_matches_the_reference():
    rng = random.Random(1)
    for _ in range(200):
        max_ngram = rng.choice([1, 2, 3, 8])
        drafter, proposals = NgramDrafter(max_ngram), []
        source = [rng.randint(0, 6) for _ in range(rng.randint(1, 30))]
        drafter.extend(source)
        for _ in range(30):               # mostly copies of the source, sometimes a token of its own
            start = rng.randrange(len(source))
            new = source[start : start + rng.randint(1, 6)] if rng.random() < 0.7 else [rng.randint(0, 6)]
            drafter.extend(new)
            max_drafts, ahead = rng.randint(1, 5), rng.choice([0, 0, 1])
            expected = propose_copying(drafter.tokens, proposals, max_drafts, ahead, max_ngram)
            got = drafter.propose(max_drafts, ahead)
            assert got == expected
            if got:
                proposals.append((len(drafter.tokens), drafter.source, ahead))
            else:
                proposals.clear()


def test_the_copy_pointer_follows_the_quoted_text_where_the_latest_match_jumps_elsewhere():
    drafter = NgramDrafter(max_ngram=2)
    drafter.extend([10, 1, 2, 3, 4, 5, 6, 0, 3, 4, 99, 0, 10, 1])     # (3 4) occurs last before 99
    assert drafter.propose(3) == [2, 3, 4]
    drafter.extend([2, 3, 4])                 # the drafts were accepted: the copy goes on at 5
    assert drafter.propose(2) == [5, 6]
    assert NgramDrafter(max_ngram=2).propose(1) == []
    plain = NgramDrafter(max_ngram=2)
    plain.extend(drafter.tokens)
    assert plain.propose(2) == [99, 0]        # no pointer: the latest occurrence of (3 4)
    drafter.extend([7])                       # the output left the quote: back to the latest match
    assert drafter.propose(2) == []


def test_proposals_ahead_of_unknown_tokens_skip_the_guesses_and_the_streak_counts_foreseen_tokens():
    drafter = NgramDrafter()
    drafter.extend([4, 5, 6, 7, 8, 4, 5])
    assert drafter.propose(2, ahead=1) == [7, 8] and drafter.propose(2, ahead=0) == [6, 7]
    assert drafter.propose(3, ahead=3) == [4, 5] and drafter.propose(1, ahead=5) == []
    drafter.extend([6, 7], score=True)        # both foreseen
    assert drafter.streak == 2
    drafter.extend([1], score=True)           # 8 was foreseen
    assert drafter.streak == 0
    drafter.extend([2, 3])                    # not scored: the streak stays
    assert drafter.streak == 0 and drafter.tokens[-3:] == [1, 2, 3]


def test_ngram_drafter_prefers_the_longest_and_latest_match():
    drafter = NgramDrafter()
    drafter.extend([1, 2, 3, 9, 9, 2, 3, 7, 7, 5, 1, 2, 3])
    assert drafter.propose(2) == [9, 9]      # (1 2 3) before (2 3), whose latest occurrence 7 7 follows
    drafter.extend([4])
    assert drafter.propose(2) == [] and drafter.propose(0) == []
    latest = NgramDrafter()
    latest.extend([1, 2, 7, 1, 2, 8, 1, 2])
    assert latest.propose(5) == [8, 1, 2] and NgramDrafter().propose(3) == []


# ---- the allocator's truncate ------------------------------------------------------------

def test_truncate_frees_the_dropped_slots_once_and_keeps_shared_ones():
    alloc = SlotAllocator(num_slots=10, max_requests=2)
    alloc.open_request("a")
    slots = alloc.allocate("a", 6)
    alloc.truncate("a", 4)
    assert alloc.slots("a") == slots[:4] and alloc.free_slots == 6 and alloc.used_slots == 4
    alloc.check_integrity()
    alloc.cache_slots(slots[:2])                       # the tree holds the first two
    alloc.truncate("a", 1)
    assert alloc.free_slots == 8 and alloc.is_cached(slots[1])     # cached: not freed
    alloc.check_integrity()
    assert alloc.allocate("a", 3)[0] == slots[2]       # freed slots are reused
    with pytest.raises(AllocatorError, match="cannot keep 5"):
        alloc.truncate("a", 5)
    alloc.release("a")
    alloc.check_integrity()


# ---- the router with a stand-in model -------------------------------------------------

class SlotReadingShards:
    """A deterministic 'model' whose next token depends on the last three tokens of the context, read
    back through its own copy of ``req_to_token`` and the KV slots (as the real worker reads keys): a
    slot mapped wrongly (a rejected draft kept, a cached prefix with a stale token) changes the tokens.
    Verify rows are checked greedily, exactly as the worker does. Results come back in order, one step
    behind (the router's pipelining)."""

    def __init__(self, vocab: int = 13, period: int | None = None, twist: int | None = None):
        self.vocab, self.period = vocab, period      # period: repeat the token that many positions back
        self.twist = twist                           # ... but at positions that are multiples of it, the next one
        self.kv: dict[int, int] = {}               # slot -> token whose KV it holds
        self.table: dict[int, dict[int, int]] = {} # request row -> position -> slot
        self.last: dict[int, int] = {}             # request row -> newest sampled token (FED_BACK)
        self.results: deque = deque()
        self.verified = 0

    def next_token(self, row: int, length: int) -> int:
        context = [self.kv[self.table[row][p]] for p in range(length)]
        if self.period is not None and length >= self.period:
            twisted = self.twist is not None and length % self.twist == 0
            return context[-self.period] % self.vocab + 1 if twisted else context[-self.period]
        a, b, c = ([0, 0] + context)[-3:]
        return (a * 5 + b * 3 + c) % self.vocab + 1

    def submit(self, step) -> None:
        self.results.append(StepResult([self._run(r, step) for r in step.rows]))

    def _run(self, r, step) -> RowResult:
        table = self.table.setdefault(r.row, {})
        if r.prefix != NO_PREFIX:
            table.update(enumerate(step.prefix_slots(r.prefix, r.start_pos)))
        ids = [self.last[r.row] if t == FED_BACK else t for t in r.input_ids]
        for i, (token, slot) in enumerate(zip(ids, r.slots)):
            self.kv[slot], table[r.start_pos + i] = token, slot
        if not r.sample:
            return RowResult(r.request_id)
        drafts = r.input_ids[1:] if r.input_ids[0] == FED_BACK else []
        end = r.start_pos + len(ids) - len(drafts)
        chosen = [self.next_token(r.row, end + j) for j in range(len(drafts) + 1)]
        kept = 1
        while kept <= len(drafts) and drafts[kept - 1] == chosen[kept - 1]:
            kept += 1
        self.verified += len(drafts)
        self.last[r.row] = chosen[kept - 1]
        results = [RowResult(r.request_id, token_id=t, logprob=-1.0) for t in chosen[:kept]]
        results[0].following = results[1:]
        return results[0]

    def collect(self, timeout=None) -> StepResult:
        return self.results.popleft()


def run_router(speculate: int, arrivals: dict[int, list[GenerationRequest]], num_slots: int = 400,
               prefix_caching: bool = True, period: int | None = None):
    """Run requests arriving at given steps; the allocator and scheduler are checked after every step."""
    alloc = SlotAllocator(num_slots=num_slots, max_requests=6)
    scheduler = Scheduler(alloc, SchedulerConfig(max_prefill_tokens=24, max_seq_len=num_slots,  # every draft found
                                                 prefix_caching=prefix_caching, speculate=speculate,
                                                 verify_step_cost=0.0))
    shards = SlotReadingShards(period=period)
    router = Router(scheduler, shards, eos_token_ids=(0,))
    out: dict[int, list] = {}
    for step in range(10_000):
        for request in arrivals.get(step, []):
            router.submit(request)
            out[request.request_id] = []
        if step > max(arrivals) and not router.has_work():
            return out, scheduler, shards
        for event in router.step():
            out[event.request_id].append((event.token_id, event.finish_reason))
        scheduler.check_integrity()
    raise AssertionError("the router did not finish")


def workload(seed: int) -> dict[int, list[GenerationRequest]]:
    rng = random.Random(seed)
    arrivals: dict[int, list[GenerationRequest]] = {}
    shared = [rng.randint(1, 13) for _ in range(20)]
    for rid in range(14):
        prefix = shared[: rng.randint(0, 20)] if rid % 2 else []
        prompt = prefix + [rng.randint(1, 13) for _ in range(rng.randint(1, 30))]
        stops = [rng.randint(1, 13)] if rid % 3 == 0 else []
        request = GenerationRequest(rid, prompt, rng.randint(1, 40), SamplingParams(), stop_token_ids=stops)
        arrivals.setdefault(rng.choice([0, 0, 1, 3, 8, 20, 35]), []).append(request)
    return arrivals


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_speculation_gives_the_tokens_of_plain_decoding(seed, prefix_caching):
    """Ragged prompts, late joiners, shared prefixes, stop tokens and max_new_tokens inside accepted
    drafts: every speculate value ends each request with the same tokens and finish reason."""
    plain, _, _ = run_router(0, workload(seed), prefix_caching=prefix_caching)
    for speculate in (1, 2, 4):
        out, scheduler, shards = run_router(speculate, workload(seed), prefix_caching=prefix_caching)
        assert out == plain
        stats = scheduler.speculation    # drafts of rows whose request ended while they were in flight not counted
        assert shards.verified >= stats.drafted_tokens and 0 < stats.accepted_tokens < stats.drafted_tokens
        events = sum(len(tokens) for tokens in out.values())
        assert sum(stats.skipped_tokens) == events - stats.accepted_tokens      # one count per result
        assert sum(k * n for k, n in enumerate(stats.skipped_tokens)) == stats.accepted_tokens
        assert scheduler.allocator.used_slots == 0 and not scheduler.running


def test_no_token_past_max_new_tokens_when_the_limit_falls_inside_the_drafts():
    arrivals = {0: [GenerationRequest(rid, [3, 1, 4, 1, 5] * 3, n, SamplingParams(), stop_token_ids=[])
                    for rid, n in enumerate([1, 2, 3, 5, 6, 9])]}
    plain, _, _ = run_router(0, arrivals, period=5)       # the prompt's period goes on: every draft is right
    out, scheduler, _ = run_router(4, arrivals, period=5)
    assert out == plain and scheduler.speculation.accepted_tokens == scheduler.speculation.drafted_tokens > 0
    for rid, n in enumerate([1, 2, 3, 5, 6, 9]):
        assert len(out[rid]) == n and out[rid][-1][1] == "length"


def test_drafts_only_take_spare_slots():
    """A cache just big enough for the requests' own tokens: drafts shrink, nothing runs out."""
    arrivals = {0: [GenerationRequest(rid, [1, 2, 3, 4] * 5, 30, SamplingParams(), stop_token_ids=[])
                    for rid in range(2)]}
    plain, _, _ = run_router(0, arrivals, num_slots=100, prefix_caching=False)
    out, scheduler, _ = run_router(4, arrivals, num_slots=100, prefix_caching=False)
    assert out == plain and scheduler.speculation.drafted_tokens > 0


def test_verify_rows_behind_a_plain_row_guess_its_token_and_the_next_waits_for_their_result():
    alloc = SlotAllocator(num_slots=200, max_requests=4)
    sched = Scheduler(alloc, SchedulerConfig(max_seq_len=200, speculate=4, prefix_caching=False))
    sched.add(_request(1, [5, 6, 7, 5, 6], 4))
    prefill = sched.schedule()
    verify = sched.schedule()                    # behind the prompt's token in flight: guessed to be 7
    (row,) = verify.rows
    assert row.input_ids == [FED_BACK, 5, 6] and row.start_pos == 5 and len(row.slots) == 3   # remaining 3
    assert sched.schedule().rows == []           # a verify row in flight decides the next position
    assert alloc.held(1) == 8
    sched.process(prefill, StepResult([RowResult(1, token_id=7)]))
    assert sched.schedule().rows == []
    result = RowResult(1, token_id=5, following=[RowResult(1, token_id=9)])    # 5 accepted, 6 rejected: 9
    events = sched.process(verify, StepResult([result]))
    assert [(e[1].token_id, e[2]) for e in events] == [(5, None), (9, None)]
    assert alloc.held(1) == 7 and alloc.slots(1)[5:] == row.slots[:2]      # the rejected draft's slot is free
    alloc.check_integrity()
    assert sched.speculation.drafted_tokens == 2 and sched.speculation.accepted_tokens == 1
    (last,) = sched.schedule().rows
    assert last.input_ids == [FED_BACK] and last.start_pos == 7      # one token left: no drafts


class LoggingShards(SlotReadingShards):
    """SlotReadingShards that log each submit (with the step's verify rows) and collect in order."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.log: list[str] = []

    def submit(self, step) -> None:
        self.log.append("verify" if any(len(r.input_ids) > 1 for r in step.rows) else "submit")
        super().submit(step)

    def collect(self, timeout=None) -> StepResult:
        self.log.append("collect")
        return super().collect(timeout)


def test_after_a_verify_rows_result_the_next_step_goes_out_before_the_events_return():
    """A lone speculating request cannot be planned while its verify row is in flight: the step that
    collects that row's result submits the request's next row before it returns (the device does not
    idle while the caller handles the events), and the tokens are plain decoding's."""
    alloc = SlotAllocator(num_slots=200, max_requests=4)
    scheduler = Scheduler(alloc, SchedulerConfig(max_seq_len=200, speculate=4, prefix_caching=False,
                                                 verify_step_cost=0.0))
    shards = LoggingShards(period=5)                        # the prompt's period goes on: every draft is right
    router = Router(scheduler, shards, eos_token_ids=(0,))
    router.submit(GenerationRequest(1, [3, 1, 4, 1, 5] * 3, 40, SamplingParams()))
    tokens, calls = [], []
    while router.has_work():
        before = len(shards.log)
        tokens.extend(e.token_id for e in router.step())
        calls.append(shards.log[before:])
        alloc.check_integrity()
    assert tokens == ([3, 1, 4, 1, 5] * 8)[:40]
    waits = [c for c in calls if c and c[0] == "collect"]    # calls that planned nothing beside the verify row
    assert len(waits) >= 5 and all(c[1:] in (["verify"], ["submit"]) for c in waits[:-1]), calls


def test_verify_rows_that_reject_drafts_map_and_free_the_right_slots():
    """A 'model' that reads every token back through the slots copies the prompt's period but twists every 13th
    position, so verify rows keep some drafts and reject the rest: the tokens, the slots checked after every
    step and a second identical request served from the prefix cache are those of plain decoding."""
    def serve(speculate: int):
        alloc = SlotAllocator(num_slots=400, max_requests=4)
        scheduler = Scheduler(alloc, SchedulerConfig(max_seq_len=200, speculate=speculate, verify_step_cost=0.0))
        router = Router(scheduler, LoggingShards(period=5, twist=13), eos_token_ids=(0,))
        tokens = {}
        for rid in (1, 2):                  # the second after the first: its prompt and tokens come from the cache
            router.submit(GenerationRequest(rid, [3, 1, 4, 1, 5] * 3, 60, SamplingParams()))
            tokens[rid] = []
            for _ in range(200):
                if not router.has_work():
                    break
                tokens[rid].extend(e.token_id for e in router.step())
                scheduler.check_integrity()
            assert not router.has_work(), f"request {rid} still runs after 200 steps"
        return tokens, scheduler.speculation

    plain, _ = serve(0)
    tokens, stats = serve(4)
    assert tokens == plain and tokens[1] == tokens[2] and len(tokens[1]) == 60
    assert stats.drafted_tokens > stats.accepted_tokens > 20, stats


def test_a_verify_row_that_meets_the_stop_token_ends_its_request_as_plain_decoding_does():
    """The copied period's only twist, at position 39 (after several verify rows kept every draft), makes the
    token 6, the stop token, inside a verify row's drafts: the request ends on it exactly as without drafts,
    and no slot stays taken."""
    ended = {}
    for speculate in (0, 4):
        alloc = SlotAllocator(num_slots=400, max_requests=4)
        scheduler = Scheduler(alloc, SchedulerConfig(max_seq_len=200, speculate=speculate, verify_step_cost=0.0,
                                                     prefix_caching=False))
        router = Router(scheduler, LoggingShards(period=5, twist=39), eos_token_ids=(6,))
        router.submit(GenerationRequest(1, [3, 1, 4, 1, 5] * 3, 60, SamplingParams()))
        events = []
        for _ in range(100):
            if not router.has_work():
                break
            events.extend(router.step())
            scheduler.check_integrity()
        ended[speculate] = [(e.token_id, e.finish_reason) for e in events]
        assert alloc.used_slots == 0 and alloc.free_slots == 400
    assert ended[4] == ended[0] and ended[4][-1] == (6, "eos_token") and len(ended[4]) == 25
    assert scheduler.speculation.accepted_tokens > 10


def _pipelined(sched, alloc, steps: int, next_token) -> list[int]:
    """The router's loop for one request (plan N + 1, then see N); the rows of each planned step."""
    in_flight, rows = deque([sched.schedule()]), []
    for _ in range(steps):
        step = sched.schedule()
        rows.append(len(step.rows))
        in_flight.append(step)
        done = in_flight.popleft()
        sched.process(done, StepResult([RowResult(1, token_id=next_token()) for _ in done.rows]))
        alloc.check_integrity()
    return rows


def test_a_request_with_nothing_to_draft_decodes_pipelined_without_losing_a_step():
    alloc = SlotAllocator(num_slots=300, max_requests=4)
    sched = Scheduler(alloc, SchedulerConfig(max_seq_len=300, speculate=4, prefix_caching=False))
    sched.add(_request(1, list(range(1, 21)), 200))
    fresh = iter(range(1000, 2000))                          # every token new: no draft is ever found
    rows = _pipelined(sched, alloc, 80, lambda: next(fresh))
    assert rows == [1] * 80 and sched.speculation.drafted_tokens == 0


def test_rejected_drafts_pause_drafting_for_doubling_stretches_until_the_drafter_foresees_tokens_again():
    """Drafts found but always rejected (tokens 1..5 that the drafter never foresees): few steps lose
    the request's row. Then the output repeats
    the prompt: the drafter foresees two tokens in a row and drafting resumes within the pause."""
    alloc = SlotAllocator(num_slots=300, max_requests=4)
    sched = Scheduler(alloc, SchedulerConfig(max_seq_len=300, speculate=4, prefix_caching=False))
    sched.add(_request(1, [1, 2, 3] * 4 + list(range(7, 20)), 200))
    contrary = lambda: (sched.running[0].drafter.foresee() or 0) % 5 + 1     # never the token foreseen
    rows = _pipelined(sched, alloc, 80, contrary)
    (request,) = sched.running
    assert request.drafter.streak == 0
    skipped = [i for i, n in enumerate(rows) if n == 0]
    # attempts after pauses of 0, 2, 4 and 8 rows, each losing one step; then its expected gain (1.5 halved
    # by each miss: 0.094) is below a verify step's extra cost, and the last 60 steps carry no drafts
    assert skipped == [2, 4, 8, 15] and request.draft_misses == 4, skipped
    assert request.draft_gain < VERIFY_STEP_COST and not sched.drafters([request])
    quoted = iter(range(7, 20))                             # the output quotes the prompt now
    drafted = sched.speculation.drafted_tokens
    _pipelined(sched, alloc, 6, lambda: next(quoted))       # fewer rows than the pause left
    assert sched.speculation.drafted_tokens > drafted


def test_a_step_drafts_only_where_the_expected_accepted_drafts_beat_its_extra_cost():
    """Scheduler.drafters: a verify step costs VERIFY_STEP_COST more per row, a verifying row skips the next
    step (1 - 1/rows of a token): a few hopeful rows among many plain ones leave the step plain; rows with
    nothing to draft do not count."""
    sched = Scheduler(SlotAllocator(num_slots=64, max_requests=64), SchedulerConfig(max_seq_len=64, speculate=4))
    requests = []
    for rid in range(64):
        request = _request(rid, [1, 2, 3], 10)
        request.drafter = NgramDrafter()
        request.drafter.extend([1, 2, rid + 100, 1, 2] if rid < 32 else [rid + 100])  # 32 foresee a token, 32 none
        requests.append(request)
    assert sched.drafters(requests) == set(range(32))         # no results yet: each expects PRIOR_DRAFT_GAIN
    for r in requests[32:]:
        r.drafter.extend([r.request_id + 100])                # now they repeat a token: something to draft
    ids = {r.request_id for r in requests}
    assert sched.drafters(requests) == ids
    for r in requests[2:]:
        r.draft_gain = 0.1                                    # drafts that nearly never hit
    assert sched.drafters(requests) == set()                  # 2 x (1.5 - 63/64) = 1.0 < 0.15 x 64
    for r in requests[:30]:
        r.draft_gain = 2.5                                    # copied text
    assert sched.drafters(requests) == set(range(30))         # 30 x 1.52 = 45.5 > 9.6: only they draft
    requests[0].draft_gain = 0.2
    assert sched.drafters(requests[:1]) == {0}                # alone: no step to skip, 0.2 > 0.15
    requests[0].draft_pause = 3
    assert sched.drafters(requests[:1]) == set()              # pausing after misses
    ungated = Scheduler(SlotAllocator(num_slots=64, max_requests=64),
                        SchedulerConfig(max_seq_len=64, speculate=4, verify_step_cost=0.0))
    assert ungated.drafters(requests) == ids - {0}
    with pytest.raises(ValueError, match="verify_step_cost must be >= 0, got -1"):
        SchedulerConfig(speculate=4, verify_step_cost=-1)


def _request(rid, prompt, new, **params):
    from engine.router.scheduler import Request

    return Request(request_id=rid, prompt_ids=prompt, max_new_tokens=new, params=SamplingParams(**params), seed=0,
                   stop_token_ids=frozenset({0}))


def _verifying() -> tuple[SlotAllocator, Scheduler, Step]:
    """A scheduler whose request 1 (prompt 5 6 7 5 6, its first token 7) has a verify row of drafts 5 6 7 planned."""
    alloc = SlotAllocator(num_slots=200, max_requests=4)
    sched = Scheduler(alloc, SchedulerConfig(max_seq_len=200, speculate=4))
    sched.add(_request(1, [5, 6, 7, 5, 6], 20))
    prefill = sched.schedule()
    sched.process(prefill, StepResult([RowResult(1, token_id=7)]))
    return alloc, sched, sched.schedule()


def test_an_abort_with_a_verify_row_in_flight_frees_every_slot_and_drops_its_tokens():
    alloc, sched, verify = _verifying()
    assert verify.rows[0].input_ids == [FED_BACK, 5, 6, 7]
    assert sched.abort(1)
    alloc.check_integrity()
    assert alloc.used_slots == 0
    result = RowResult(1, token_id=5, following=[RowResult(1, token_id=6), RowResult(1, token_id=7)])
    assert sched.process(verify, StepResult([result])) == []
    sched.check_integrity()
    assert not sched.has_work() and sched.schedule().released == [1]
    cached = sched.cache.match([5, 6, 7, 5, 6, 7, 5, 6, 7])
    assert cached.length <= 6        # prompt + its first token at most: no draft's slot entered the tree


def test_the_draft_counters_count_what_results_applied_not_drafts_planned_or_tokens_past_a_stop():
    """Drafted tokens count when a verify row's result is applied (not for a row whose request was aborted
    meanwhile); accepted ones are those appended, none after a stop token the row met; TGI's skipped tokens
    count each result by the accepted drafts it appended."""
    from engine.router.scheduler import Request

    sched = Scheduler(SlotAllocator(num_slots=200, max_requests=4), SchedulerConfig(max_seq_len=200, speculate=4))
    for rid in (1, 2):
        sched.add(Request(rid, [5, 6, 7, 5, 6], 20, SamplingParams(), 0, stop_token_ids=frozenset({6})))
    prefill = sched.schedule()
    sched.process(prefill, StepResult([RowResult(rid, token_id=7) for rid in (1, 2)]))
    verify = sched.schedule()
    assert [r.input_ids for r in verify.rows] == [[FED_BACK, 5, 6, 7]] * 2
    assert sched.abort(2)
    following = [RowResult(1, token_id=t) for t in (6, 7, 8)]          # every draft kept, then 8
    events = sched.process(verify, StepResult([RowResult(1, token_id=5, following=following), RowResult(2, 5)]))
    assert [(e[1].token_id, e[2]) for e in events] == [(5, None), (6, "eos_token")]     # 7 and 8 after the stop
    stats = sched.speculation
    assert (stats.drafted_tokens, stats.accepted_tokens) == (3, 1)
    assert stats.skipped_tokens == [2, 1, 0, 0, 0]                   # two prompts' first tokens, then 5 6
    assert sched.speculation_status() == {"speculation_drafted_tokens": 3, "speculation_accepted_tokens": 1,
                                          "speculation_skipped_tokens": [2, 1, 0, 0, 0]}


def test_a_kept_draft_that_failed_ends_its_request_after_the_tokens_before_it():
    """The worker's verify row result whose second kept token failed (NaN scores, the grammar) carries that
    token's error: the first token is given, then the error ends the request (plain decoding's order)."""
    alloc, sched, verify = _verifying()
    failed = RowResult(1, token_id=6, error="Request failed during generation: the token scores were NaN")
    events = sched.process(verify, StepResult([RowResult(1, token_id=5, following=[failed])]))
    assert [(e[1].token_id, e[1].error, e[2]) for e in events] == [(5, None, None), (6, failed.error, None)]
    assert not sched.has_work() and alloc.used_slots == 0 and sched.running == []
    assert (sched.speculation.drafted_tokens, sched.speculation.accepted_tokens) == (3, 0)


# ---- the tokens-per-step replay (bench/spec_bench.py steps) ---------------------------

def test_the_step_replay_counts_rows_waits_and_drafts_of_the_real_scheduler():
    from bench.spec_bench import noise, replay

    quoting = ([7, 1, 2, 3, 4, 5, 6, 8], [1, 2, 3, 4, 5, 6, 8, 9, 10])     # copies its prompt, then 9 10
    plain = replay([quoting], 0)
    assert plain == {"tokens": 8, "rows": 8, "verify_rows": 0, "waits": 0, "drafted": 0, "accepted": 0}
    spec = replay([quoting], 4)
    assert spec["tokens"] == 8 and spec["rows"] < 8 and spec["accepted"] >= 4 and spec["verify_rows"] >= 1
    assert 1 <= spec["waits"] <= spec["verify_rows"]    # a verify row's successor waits for its result
    assert replay(noise(2, 16), 4)["accepted"] == 0


def test_the_batch_replay_shows_the_step_gate_keeping_hopeless_drafts_out_of_a_large_batch():
    """bench.spec_bench batch: 24 noise requests at once draft by chance and never hit; without the gate many
    steps become verify steps, with it none do, and copying requests beside them still draft and gain."""
    from bench.spec_bench import noise, replay_batch

    load = noise(24, 24)
    ungated, gated = replay_batch(load, 2, gate=False), replay_batch(load, 2, gate=True)
    assert ungated["verify_steps"] > 0 and ungated["accepted"] == 0
    assert gated["verify_steps"] == 0 and gated["cost_in_decode_steps"] < ungated["cost_in_decode_steps"]
    quoting = ([7, 1, 2, 3, 4, 5, 6, 8] * 4, [1, 2, 3, 4, 5, 6, 8, 7] * 4)
    copying = replay_batch([quoting] * 4, 4, gate=True)
    assert copying["accepted"] >= 16 and copying["decode_steps"] < 32
