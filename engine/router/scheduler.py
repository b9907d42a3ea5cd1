"""The router's step planner: admission, chunked prefill, decode rows, stop criteria.

Admission is LightLLM's Efficient Router rule. For the admitted requests sorted by
remaining new tokens ``L`` (descending), each holding (or about to hold) ``R`` tokens,
the peak future KV usage is ``max_k (k * L_k + sum_{j<=k} R_j)``: when the request
with the k-th longest remaining output finishes, the k longest are still running and
each has grown by ``L_k``. A waiting request is admitted only if the peak with it
stays within the slot capacity, so a step can never run out of KV slots.

Steps are pipelined: the router plans step N+1 while step N runs, so a request may have
a token in flight (``pending``) whose value only the worker knows. Its next decode row
feeds ``FED_BACK`` (the worker substitutes the token it sampled last for the row), and
no row is planned past ``max_new_tokens``. A request that finishes or is aborted frees
its slots at once: a row of it still in flight writes only slots that a later step (run
after it on the device) may hand to another request, and its result is ignored.

Step budget (stall-free batching): a step carries at most ``max_prefill_tokens`` tokens,
decode rows first (every decoding request has a row in every step), prompt chunks in the
rest. While requests decode, ``stall_free_tokens`` also caps the prompt chunks' cost, so a
step stays close to a decode step's time: a chunk of n tokens from position p costs
``n + n' * (p + n/2) / attention_span`` (its matmuls, plus its attention over the context; n' is n
rounded up to whole ``attention_tile``s, which a program of the attention takes whatever their use),
against ``stall_free_tokens * (1 + decode context / kv_weight_tokens)`` (a decode step costs
reading the weights plus the running requests' KV) ``+ stall_free_row_tokens * decoding requests``
(a lone stream's steps stay near its decode step; a large batch lends the prompts more of each step,
whose time its streams already share). Prompt chunks go shortest-remaining
first, aged by the prompt tokens the others were given since admission
(``_prefill_priority``), so short prompts pass a long one and no prompt waits forever;
the first prompt in that order always gets at least ``MIN_PROMPT_CHUNK`` tokens, or a whole
``attention_tile`` if more (``Scheduler.min_chunk``, within the budget; drafts give way to them), or
where the plain decode rows leave less of the budget, what they leave, one token at least. So a step
with prompt chunks stays within the budget unless its decode rows alone fill it, and then carries one
prompt token beside them: ``max_requests`` tokens at most (a prompt in prefill holds a row). The
worker's warm-up measures a step of ``largest_step_tokens`` (a step of decode rows alone may pass the
budget, with verify rows up to ``max_requests * (1 + speculate)`` tokens),
so no step outgrows the activation memory it measured. Waiting requests are admitted in the same spirit, shortest
prompt first, aged by the prompt tokens the others were given since they arrived
(``_admission_key``). Admission counts a prompt not yet planned as if its request
grew from now on and lived ``prefill_delay_bound`` steps longer (an upper bound of its
wait whatever the order), so the peak stays an upper bound.

Prefix cache (``engine.router.prefix_cache``, on unless ``prefix_caching=False``):
  * at admission a request takes the longest cached prefix of its prompt but the last
    token (whose logits choose the first new token): its first row maps those slots into
    positions 0..k-1 of its ``req_to_token`` row and prefills only the rest. A request that
    asks for prompt logprobs takes no cached prefix (every prompt token's logprob needs its
    logits), though its prompt is cached for others;
  * a request's prompt enters the tree when its last chunk is planned (rows of later steps
    run after that chunk on the device, so a request admitted one step later reads complete
    KV) and stays locked while the request runs; at finish or abort the tokens whose KV a
    planned row writes (prompt + generated, not a token still in flight that the router has
    not seen) enter too, and the request unlocks. Evicting needs no care for rows in flight:
    a row writes only its own request's newest slots, and a slot freed now is written by a
    later step only after the device has run every earlier one;
  * admission counts each running request's exclusive tokens plus the locked tree tokens it
    pins longest (``PinnedTokens``): shared tokens count once, evictable ones as free.
  * with a rope that rotates a token by the length of the forward pass computing it (``dynamic``,
    ``longrope``: ``engine.models.rope.plain_rope_length``), a cached key is the same for every
    request only within ``rope_plain_len`` tokens: a prompt longer than that neither takes nor
    leaves a cached prefix, and a shorter one leaves at most its first ``rope_plain_len`` tokens
    (``_cacheable``), so the cache never changes a token's rotation.

Speculation (``speculate`` > 0, TGI's ``--speculate``): every request (``speculates``) decodes
through verify rows ``[FED_BACK, d1 .. dn]``, whose drafts ``d`` come
from ``engine.router.drafter`` (prompt lookup in the request's own tokens, or with ``draft_heads``
the tokens the shard's Medusa heads proposed with the request's newest result); the shard returns
the accepted drafts plus one corrected or bonus token, each through the stop criteria here in
order (never a token past ``max_new_tokens``: n <= remaining - 1). A verify row's result decides
the next row's position (1 to n + 1 tokens come back), so a request is not planned while a verify
row of it is in flight (``verifying``): it skips a step (the pipeline's depth). Where every running
request verifies (as at batch 1) the router waits for the result and plans the next step from it: the
device idles only for the host's turnaround. A row planned behind the verify row instead, as if every
draft were accepted, cost more than that wait: on one H200 the demo's batch-1 speed-up with such
rows (void where the verify row kept fewer) was 1.56/1.54x at 4 drafts and 1.76/1.59x at 8, against
1.70/1.65x and 1.93/1.87x waiting (``bench.spec_bench demo``, interleaved runs of one call): their
drafts follow text not yet verified, and a row moved back on the device after a miss is a verify
step's time for one token. Behind a plain row in flight (or its prompt's last chunk) a request
drafts without waiting: the drafter guesses the unknown
token from where it copies (``NgramDrafter.propose``'s ``ahead``) and a wrong guess only gets the
drafts rejected, so finding nothing to draft costs no step. A request whose drafts are all
rejected twice in a row decodes plain pipelined rows for a pause that doubles with each further
such miss (2, 4, .. up to ``max_draft_pause`` rows; an accepted draft ends the streak), so loads
whose drafts fail lose at most one step in ``max_draft_pause`` + 2 to speculation; two tokens in
a row that the drafter foresaw (``RESUME_STREAK``, scored for free on every token) end a pause.
A step drafts only where it pays (``drafters``): a verify step pads every row to 1 + n tokens and
cost 1.12-1.16x a decode step on one H100 (``VERIFY_STEP_COST``), and a verifying request skips the
next step (worth a token when other rows fill that step, ``1 - 1 / rows``); each request keeps the
accepted drafts per verify row it has been getting (``draft_gain``, halved towards each result, reset
to ``PRIOR_DRAFT_GAIN`` when the drafter foresees tokens again). The rows with something to draft whose
expected gain beats the skip draft when their summed gain beats the step's extra cost, else the step
stays plain: on an H100
64 random prompts lost 6.7% to drafts that nearly never hit, as a few rows turned whole steps into
verify steps.
The slots of rejected drafts are freed
when the result comes (``SlotAllocator.truncate``), before any of them could enter the prefix
cache. Drafts take only slots free beyond the step's own needs (beside prompt chunks, also only
tokens left in the step's budget), and admission reserves a
speculating request's whole remaining length at once (accepted drafts grow it faster than one
token a step), so KV still never runs out.
"""
from __future__ import annotations

import logging
import math
import time
from bisect import insort
from dataclasses import dataclass, field

from engine.protocol.messages import (FED_BACK, NO_PREFIX, PrefixSlots, RowResult, SamplingParams, Step, StepResult,
                                      StepRow)
from engine.router.allocator import AllocatorError, SlotAllocator
from engine.router.drafter import HeadDrafter, NgramDrafter
from engine.router.prefix_cache import Match, PrefixCache, TreeNode, common_prefix_length
from engine.router.shared_prefix import SharedPrefixes

log = logging.getLogger(__name__)

ADMISSION_RULES = ("peak", "reserve")
MAX_SKIPPED = 16     # waiting requests tried per step after one did not fit
DEFER_MIN_TOKENS = 128   # wait for a running prefill that will cache at least this many more prompt tokens
MIN_PROMPT_CHUNK = 16    # prompt tokens a step carries while prompts wait (progress beside any decode batch), or
                         # what the plain decode rows leave of the budget, at least one (module docstring)
MAX_DRAFT_PAUSE = 32     # plain (pipelined) decode rows, at most, between draft attempts after misses
RESUME_STREAK = 2        # tokens in a row the drafter foresaw that end a draft pause
VERIFY_STEP_COST = 0.15  # a verify step's cost over a decode step's, in decode rows per row (H100: 1.163x at
                         # batch 1, 1.119x at 32, Llama-2-7B, 4 drafts: bench.spec_bench verify)
PRIOR_DRAFT_GAIN = 1.5   # accepted drafts per verify row expected of a request with no results yet


@dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_tokens: int = 4096       # tokens of one step: decode rows first, prompt chunks fill the rest
    stall_free_tokens: int | None = None # while requests decode, the prompt chunks' cost cap (module docstring)
    stall_free_row_tokens: int = 0       # with it: each decoding request adds this to the cap (module docstring)
    attention_span: int = 32768          # context at which a prompt token's attention costs its matmuls
    kv_weight_tokens: int = 32768        # context tokens whose KV weighs as much as the weights
    attention_tile: int = 1              # new tokens one prefill-attention program takes: a partial tile
                                         # walks the context as a full one does (``chunk_cost``)
    waiting_served_ratio: float = 0.0    # TGI: admit only when waiting >= ratio * running
    max_waiting_steps: int = 20          # TGI's --max-waiting-tokens: then admit anyway
    max_seq_len: int = 4096              # prompt + new tokens of one request
    admission: str = "peak"              # "peak": LightLLM's rule; "reserve": TGI-style sum of maxima
    prefix_caching: bool = True          # reuse the KV of cached prompt prefixes (engine.router.prefix_cache)
    speculate: int = 0                   # drafted tokens per verify row (module docstring); 0: off
    max_draft_pause: int = MAX_DRAFT_PAUSE   # plain rows at most between draft attempts after misses; 0: none
    verify_step_cost: float = VERIFY_STEP_COST   # a verify step's extra cost per row (module docstring); 0: no gate
    draft_heads: bool = False            # drafts come from the shard's Medusa heads (``RowResult.drafts``), not n-grams
    rope_plain_len: int | None = None    # the prefix cache holds and gives only tokens within it (module docstring);
                                         # None: every token (the rope rotates by position alone)

    def __post_init__(self):
        if self.admission not in ADMISSION_RULES:
            raise ValueError(f"admission {self.admission!r} is not one of {', '.join(ADMISSION_RULES)}")
        for name in ("max_prefill_tokens", "attention_span", "kv_weight_tokens", "attention_tile"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.speculate < 0:
            raise ValueError(f"speculate must be >= 0, got {self.speculate}")
        if self.verify_step_cost < 0:
            raise ValueError(f"verify_step_cost must be >= 0, got {self.verify_step_cost}")
        if self.stall_free_tokens is not None and self.stall_free_tokens < 1:
            raise ValueError(f"stall_free_tokens must be >= 1 (or None: off), got {self.stall_free_tokens}")
        if self.stall_free_row_tokens < 0:
            raise ValueError(f"stall_free_row_tokens must be >= 0, got {self.stall_free_row_tokens}")


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int] = frozenset()
    generated: list[int] = field(default_factory=list)
    prefilled: int = 0
    waited_steps: int = 0
    arrived_at_work: int = 0           # the scheduler's ``prompt_work`` when it arrived (admission order)
    admitted_at_work: int = 0          # the scheduler's ``prompt_work`` when it was admitted (ageing)
    prompt_logprobs: list[float | None] | None = None
    pending: int = 0                   # tokens sampled by steps in flight, not yet seen
    decoding: bool = False             # a decode row was planned (it joined its shared-prefix group by then)
    cached_prefix: int = 0             # prompt tokens taken from the prefix cache at admission
    cached_len: int = 0                # leading tokens whose slots lie on the lock path (in the tree)
    lock_node: TreeNode | None = None  # the prefix cache node this request locks (with its ancestors)
    drafter: NgramDrafter | HeadDrafter | None = None  # set when the request speculates (its known tokens in)
    draft_misses: int = 0              # verify rows in a row that had nothing accepted
    draft_pause: int = 0               # plain decode rows to plan before drafting again
    draft_gain: float = PRIOR_DRAFT_GAIN  # accepted drafts per verify row it has been getting (module docstring)
    verifying: bool = False            # a verify row is in flight: its result decides the next position
    uncached_hint: int | None = None   # prompt tokens past its cached prefix when first asked (waiting_fills_a_step)

    @property
    def remaining(self) -> int:
        """New tokens not yet planned."""
        return self.max_new_tokens - len(self.generated) - self.pending

    @property
    def held_tokens(self) -> int:
        """Tokens this request holds once its whole prompt is in (planned ones included)."""
        return len(self.prompt_ids) + len(self.generated) + self.pending

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < len(self.prompt_ids)

    @property
    def speculates(self) -> bool:
        return self.drafter is not None

    @property
    def drafting(self) -> bool:
        """Whether its next decode row carries drafts (if the drafter finds any)."""
        return self.drafter is not None and self.draft_pause == 0

    @property
    def can_decode(self) -> bool:
        """Whether the next step may carry a decode (or verify) row of this request."""
        if self.in_prefill or self.remaining <= 0:
            return False
        return not self.verifying

    def draft_missed(self, max_pause: int) -> None:
        """A verify row had nothing accepted: the second such row in a row starts a pause of 2 plain
        rows, each further one doubles it (a lone miss inside copied text costs no pause)."""
        self.draft_misses += 1
        self.draft_pause = min(2 ** (self.draft_misses - 1), max_pause) if self.draft_misses > 1 else 0


@dataclass
class SpeculationStats:
    """Cumulative draft counts, for /metrics (``RouterStatus``), counted as results are applied (none of a row
    whose request finished or was aborted while it was in flight)."""
    drafted_tokens: int = 0      # draft tokens of the verify rows whose results were applied
    accepted_tokens: int = 0     # of those, accepted and appended (none past a stop)
    skipped_tokens: list[int] = field(default_factory=lambda: [0])  # [k], k = 0..speculate: results (of any row)
                                                                     # that appended k accepted drafts (TGI's
                                                                     # ``tgi_request_skipped_tokens``)

    def applied(self, drafted: int, accepted: int) -> None:
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.skipped_tokens[accepted] += 1


class Scheduler:
    def __init__(self, allocator: SlotAllocator, config: SchedulerConfig):
        self.allocator = allocator
        self.config = config
        self.cache = PrefixCache(allocator) if config.prefix_caching else None
        self.shared = SharedPrefixes() if self.cache is not None else None   # cascade attention's groups
        self.waiting: list[Request] = []    # in admission order (``_admission_key``)
        self.running: list[Request] = []
        self._released: list[int] = []
        self.prompt_work = 0            # prompt tokens planned so far, every request's (ageing)
        # a whole attention tile: fewer tokens would cost as much (``chunk_cost``)
        self.min_chunk = min(max(MIN_PROMPT_CHUNK, config.attention_tile), config.max_prefill_tokens)
        self.prefill_delay = prefill_delay_bound(config, allocator.num_slots, allocator.max_requests)
        if allocator.max_requests - 1 + self.min_chunk > config.max_prefill_tokens:
            log.warning("%d requests decoding leave fewer than %d of a step's %d tokens to a prompt beside them: "
                        "prompts move by fewer tokens a step while the batch is that full (raise "
                        "--max-batch-prefill-tokens or lower --max-batch-size)", allocator.max_requests - 1,
                        self.min_chunk, config.max_prefill_tokens)
        self.last_filter_s = 0.0        # the last ``process`` call's time freeing finished requests
        self.speculation = SpeculationStats(skipped_tokens=[0] * (config.speculate + 1))
        log.info("prefix caching %s",
                 "on" if self.cache is not None else "off (--prefix-caching false / PREFIX_CACHING=0)")

    def speculation_status(self) -> dict[str, int | list[int]]:
        """The draft counters and ``tgi_request_skipped_tokens``'s counts, as ``RouterStatus`` fields (none when
        speculation is off)."""
        if not self.config.speculate:
            return {}
        return {"speculation_drafted_tokens": self.speculation.drafted_tokens,
                "speculation_accepted_tokens": self.speculation.accepted_tokens,
                "speculation_skipped_tokens": list(self.speculation.skipped_tokens)}

    def prefix_cache_status(self) -> dict[str, int]:
        """The prefix cache's numbers, as ``RouterStatus`` fields (none when it is off)."""
        if self.cache is None:
            return {}
        stats = self.cache.stats
        return {"prefix_cache_tokens": self.cache.cached_slots, "prefix_cache_lookup_tokens": stats.lookup_tokens,
                "prefix_cache_hit_tokens": stats.hit_tokens, "prefix_cache_evicted_tokens": stats.evicted_tokens}

    # ---- requests in and out -------------------------------------------------------

    def add(self, request: Request) -> None:
        total = len(request.prompt_ids) + request.max_new_tokens
        if not request.prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if total > self.config.max_seq_len or total > self.allocator.num_slots:
            raise ValueError(f"prompt ({len(request.prompt_ids)}) + max_new_tokens ({request.max_new_tokens}) = "
                             f"{total} exceeds the limit of {min(self.config.max_seq_len, self.allocator.num_slots)}")
        if self.config.speculate:
            request.drafter = HeadDrafter() if self.config.draft_heads else NgramDrafter()
            request.drafter.extend(request.prompt_ids)
        request.arrived_at_work = self.prompt_work
        insort(self.waiting, request, key=_admission_key)

    def abort(self, request_id: int) -> bool:
        """Drop a request wherever it is; its slots are freed. False if unknown."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return True
        for request in self.running:
            if request.request_id == request_id:
                self._finish(request)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning ------------------------------------------------------------------

    def schedule(self) -> Step:
        """The next Step: one decode row per decoding request, prompt chunks in the rest of the budget."""
        self._admit()
        decoding = [r for r in self.running if r.can_decode]
        drafters = self.drafters(decoding)
        draft_room = self.config.speculate * len(drafters)
        chunks = self._plan_chunks(decoding, draft_room)
        need = len(decoding) + sum(chunks.values())
        self._make_room(need)
        if chunks:      # the first prompt's minimum may have taken the drafts' share of the budget
            draft_room = min(draft_room, self.config.max_prefill_tokens - need)
        spare = DraftRoom(min(draft_room, self.allocator.free_slots - need))
        rows, prefixes = [], PrefixTable()
        for request in self.running:
            if request.request_id in chunks:
                rows.append(self._prefill_row(request, chunks[request.request_id], prefixes))
            elif request.can_decode:
                rows.append(self._decode_row(request, spare, request.request_id in drafters))
        if self.shared is not None and rows:
            self.shared.mark(rows)
        released, self._released = self._released, []
        return Step(rows=rows, released=released, prefixes=prefixes.lists)

    def _plan_chunks(self, decoding: list[Request], draft_room: int = 0) -> dict[int, int]:
        """{request id: prompt tokens this step} (module docstring: the step budget); ``draft_room``:
        the most draft tokens the decode rows may carry, which the first prompt's minimum takes back
        (``schedule`` then cuts the drafts to what the chunks left)."""
        prefilling = [r for r in self.running if r.in_prefill]
        if not prefilling:
            return {}
        budget = StepBudget.for_step(self.config, decoding)
        # what the first in order gets at least: a min chunk, or what the plain decode rows leave of the
        # budget (never a step past the warm-up's: with one prompt in prefill at most max_requests - 1 rows)
        floor = min(self.min_chunk, max(budget.tokens, 1))
        budget.tokens -= draft_room
        span, tile, chunks = self.config.attention_span, self.config.attention_tile, {}
        for request in sorted(prefilling, key=self._prefill_priority):
            want = len(request.prompt_ids) - request.prefilled
            shared = self.shared.shared_length(request.request_id) if self.shared is not None else 0
            tokens = budget.fit(request.prefilled, want, span, tile, shared)
            if not chunks:
                tokens = max(tokens, min(want, floor))    # the first in order always moves
            if tokens > 0:
                budget.take(request.prefilled, tokens, span, tile, shared)
                chunks[request.request_id] = tokens
            if budget.tokens <= 0:
                break
        self.prompt_work += sum(chunks.values())
        return chunks

    def _prefill_priority(self, request: Request) -> int:
        """Shortest remaining prompt first, aged by the prompt tokens the others were given since its
        admission: once they got its remaining tokens, it goes before any newcomer. Ageing by work, not
        by steps (before: ``max_prefill_tokens`` a step), keeps the order when steps are small: beside a
        decoding stream the cost cap makes them so, and a 100k-token prompt in prefill for a few seconds
        had aged past every newcomer, which then waited for all of it (``bench.schedule_replay --load
        beside``, its model of one H100: a 100-token prompt's TTFT 8.5 s before, 0.35 s with this)."""
        own = request.prefilled - request.cached_prefix
        waited = self.prompt_work - request.admitted_at_work - own
        return len(request.prompt_ids) - request.prefilled - waited

    def _make_room(self, need: int) -> None:
        """Evict once for the whole step (not once per row) when the free slots run short."""
        if self.cache is None:
            return
        if need > self.allocator.free_slots:
            self.cache.evict(need - self.allocator.free_slots)

    def _admit(self) -> None:
        """Admit waiting requests, in their order (``_admission_key``: shortest prompt first, aged), while
        the peak KV usage fits and a step's budget of new prompt tokens lasts (a request admitted later
        may find its prefix cached by one prefilled now; a prompt still being planned does not hold
        newcomers back: shorter ones pass it)."""
        if not self.waiting:
            return
        ratio_ok = len(self.waiting) >= self.config.waiting_served_ratio * len(self.running)
        head = self.waiting[0]
        if self.running and not ratio_ok and head.waited_steps < self.config.max_waiting_steps:
            for request in self.waiting:
                request.waited_steps += 1
            return
        usage = peak_usage if self.config.admission == "peak" else reserved_usage
        budget = self.config.max_prefill_tokens     # new prompt tokens a step admits (about what it can plan)
        pinned = PinnedTokens(self.running, self.prefill_delay)
        misses = 0
        for request in list(self.waiting):
            if budget <= 0:
                break
            match = self._match(request)
            fits = not self._should_wait_for_a_prefill(request, match) and self.allocator.free_rows > 0
            capacity = self.allocator.num_slots
            if fits and (pinned.bound(request, match) <= capacity or usage(pinned.trial(request, match)) <= capacity):
                pinned.commit(request, match, self._start(request, match))
                budget -= len(request.prompt_ids) - match.length
                continue
            misses += 1
            if (request is head and head.waited_steps >= self.config.max_waiting_steps) or misses >= MAX_SKIPPED:
                break   # the head has waited long enough (nobody overtakes it), or enough was tried
        for request in self.waiting:
            request.waited_steps += 1

    def waiting_fills_a_step(self) -> bool:
        """Whether the waiting requests' prompt tokens past their cached prefixes fill a step's budget.
        Each request's count is matched once, when first asked (a hint for the router's choice: the tree
        may have grown since, and ``_admit`` matches again; matching every waiting request at every
        step while a burst arrives cost as much as planning it)."""
        left = self.config.max_prefill_tokens
        for request in self.waiting:
            if request.uncached_hint is None:
                request.uncached_hint = len(request.prompt_ids) - self._match(request).length
            left -= request.uncached_hint
            if left <= 0:
                return True
        return False

    def _match(self, request: Request) -> Match:
        """The cached prefix a request would take: never its last prompt token, nothing when it
        asks for prompt logprobs (they need every prompt token's logits)."""
        if self.cache is None or request.params.prompt_logprobs or not self._cacheable(request):
            return Match()
        return self.cache.match(request.prompt_ids[:-1])

    def _cacheable(self, request: Request) -> int:
        """How many of a request's first tokens the prefix cache may give it and hold of it: all of them, but
        with a rope that rotates by the forward pass's length (``SchedulerConfig.rope_plain_len``) only
        tokens that took the plain rotation: none of a prompt longer than that length, else the tokens
        within it (``engine.models.rope.plain_rope_length``)."""
        limit = self.config.rope_plain_len
        if limit is None:
            return self.config.max_seq_len
        return 0 if len(request.prompt_ids) > limit else limit

    def _should_wait_for_a_prefill(self, request: Request, match: Match) -> bool:
        """Whether a running request's unfinished prefill will cache much more of this prompt."""
        if self.cache is None or request.params.prompt_logprobs or not self._cacheable(request):
            return False
        want = len(request.prompt_ids) - 1 - match.length
        if want < DEFER_MIN_TOKENS:
            return False
        for other in self.running:
            if other.in_prefill and other.cached_len <= match.length + DEFER_MIN_TOKENS:
                shared = common_prefix_length(other.prompt_ids[: len(request.prompt_ids) - 1], request.prompt_ids)
                if shared - match.length >= DEFER_MIN_TOKENS:
                    return True
        return False

    def _start(self, request: Request, match: Match) -> TreeNode | None:
        """Run the request with its matched prefix; returns its lock node (None without the cache)."""
        self.waiting.remove(request)
        self.allocator.open_request(request.request_id)
        self.running.append(request)
        if self.cache is not None:
            slots = match.slots
            request.lock_node = self.cache.lock(match)
            self.allocator.share(request.request_id, slots)
            if match.length:
                self.shared.join(request.request_id, slots)     # its prompt chunks can take the prefix once
            self.cache.stats.lookup_tokens += len(request.prompt_ids)
            self.cache.stats.hit_tokens += match.length
        request.prefilled = request.cached_len = request.cached_prefix = match.length
        request.admitted_at_work = self.prompt_work
        log.info("request %s admitted: %d prompt tokens, %d from the prefix cache", request.request_id,
                 len(request.prompt_ids), match.length)
        return request.lock_node

    def _prefill_row(self, request: Request, tokens: int, prefixes: "PrefixTable") -> StepRow:
        start = request.prefilled
        end = min(len(request.prompt_ids), start + tokens)
        chunk = request.prompt_ids[start:end]
        last_chunk = end == len(request.prompt_ids)
        first = start == request.cached_prefix
        targets = None
        if request.params.prompt_logprobs:
            targets = request.prompt_ids[start + 1 : end + (0 if last_chunk else 1)]
        prefix, prefix_ids = NO_PREFIX, None
        if first and start > 0:
            prefix = prefixes.index(self.allocator.slots(request.request_id), start)
            prefix_ids = request.prompt_ids[:start] if request.params.has_penalties else None
        row = StepRow(
            request_id=request.request_id, row=self.allocator.row(request.request_id), start_pos=start,
            input_ids=chunk, slots=self.allocator.allocate(request.request_id, len(chunk)), sample=last_chunk,
            params=request.params if first else None, seed=request.seed, logprob_targets=targets,
            prefix=prefix, prefix_ids=prefix_ids, prompt_len=len(request.prompt_ids),
        )
        request.prefilled = end
        request.pending += last_chunk
        if request.speculates:
            request.drafter.index(end)         # a long prompt's n-gram index, a chunk a step (engine.router.drafter)
        if last_chunk and self.cache is not None:
            self._cache_prompt(request)
        return row

    def _cache_prompt(self, request: Request) -> None:
        """Put the prompt (its KV written by rows planned up to now) into the tree, locked.

        Skipped when the tree learned more of this prompt since admission (another request
        prefilled it too): this request's copy then stays its own.
        """
        if not self._cacheable(request):
            return
        prompt = request.prompt_ids
        slots = self.allocator.slots(request.request_id)[: len(prompt)]
        node = self.cache.extend(request.lock_node, request.cached_len, prompt, slots)
        if node is None:        # the tree goes on past the lock node along this prompt: maybe further
            if self.cache.match(prompt).length != request.cached_len:
                return
            node = self.cache.insert(prompt, slots)
        self.cache.lock_node(node)
        self.cache.unlock_node(request.lock_node)
        request.lock_node, request.cached_len = node, len(prompt)

    def drafters(self, decoding: list[Request]) -> set[int]:
        """The requests whose decode rows may carry drafts this step (module docstring): those not pausing, with
        something to draft, whose expected accepted drafts beat the skipped step, if together they beat the
        step's extra cost."""
        candidates = [r for r in decoding if r.drafting]
        if not candidates or self.config.verify_step_cost == 0:
            return {r.request_id for r in candidates}
        skip = 1 - 1 / len(decoding)
        worth = [r for r in candidates if r.draft_gain > skip and r.drafter.foresee() is not None]
        gain = sum(r.draft_gain - skip for r in worth)
        return {r.request_id for r in worth} if gain > self.config.verify_step_cost * len(decoding) else set()

    def _decode_row(self, request: Request, spare: "DraftRoom", draft: bool) -> StepRow:
        """Feeds the request's newest token (sampled by the worker, maybe still in flight); a request
        that speculates also feeds the drafts that follow it (a verify row)."""
        if self.shared is not None and not request.decoding:
            request.decoding = True                   # the first decode row: the prompt's slots are all known
            if not self.shared.is_member(request.request_id):
                prompt = len(request.prompt_ids) - 1
                self.shared.join(request.request_id, self.allocator.slots(request.request_id)[:prompt])
        drafts = []
        if draft:
            room = spare.take(min(self.config.speculate, request.remaining - 1))
            drafts = request.drafter.propose(room, ahead=request.pending)   # behind a row in flight: guessed
            spare.give_back(room - len(drafts))
            request.verifying = bool(drafts)
        elif request.speculates and request.draft_pause > 0:
            request.draft_pause -= 1
        row = StepRow(
            request_id=request.request_id, row=self.allocator.row(request.request_id),
            start_pos=request.held_tokens - 1, input_ids=[FED_BACK, *drafts],
            slots=self.allocator.allocate(request.request_id, 1 + len(drafts)), sample=True,
        )
        request.pending += 1 + len(drafts)
        return row

    # ---- results -------------------------------------------------------------------

    def process(self, step: Step, result: StepResult) -> list[tuple[Request, RowResult, str | None]]:
        """Append sampled tokens, apply stop criteria, free finished requests.

        Returns (request, row result, finish reason or None) for each generated token.
        """
        by_id = {r.request_id: r for r in self.running}
        events, finished = [], []
        for row, res in zip(step.rows, result.rows):
            request = by_id.get(row.request_id)
            if request is None:
                continue            # finished or aborted while this step was in flight
            if res.prompt_logprobs is not None:
                if request.prompt_logprobs is None:
                    request.prompt_logprobs = [None]
                request.prompt_logprobs.extend(res.prompt_logprobs)
            if res.error is not None:
                finished.append(request)              # no token: the request ends with the error
                events.append((request, res, None))
                continue
            if res.token_id is None:
                continue
            if self._append_tokens(request, row, res, events):
                finished.append(request)
        started = time.perf_counter()
        for request in finished:
            self._finish(request)
        self.last_filter_s = time.perf_counter() - started
        return events

    def _append_tokens(self, request: Request, row: StepRow, res: RowResult, events: list) -> bool:
        """A row's tokens (a verify row's: the accepted drafts and one more) through the stop criteria,
        one by one, up to a stop or a kept draft that failed in the worker (its error ends the request after
        the tokens before it); returns whether the request ended. A speculating request then drops the slots
        past its newest token's position (rejected drafts' KV, or tokens after a stop)."""
        decode = row.input_ids[0] == FED_BACK
        request.pending -= len(row.input_ids) if decode else 1
        ended, appended = False, 0
        for token in [res, *res.following]:
            if token.error is not None:
                events.append((request, token, None))
                ended = True
                break
            request.generated.append(token.token_id)
            appended += 1
            reason = self._stop_reason(request, token.token_id)
            events.append((request, token, reason))
            if reason:
                ended = True
                break
        self.speculation.applied(len(row.input_ids) - 1 if decode else 0, appended - 1)
        if decode and len(row.input_ids) > 1:
            request.verifying = False
            request.draft_gain = (request.draft_gain + len(res.following)) / 2
            if res.following:
                request.draft_misses = 0
            else:
                request.draft_missed(self.config.max_draft_pause)
        if request.speculates:
            request.drafter.extend(request.generated[len(request.drafter.tokens) - len(request.prompt_ids) :],
                                   score=True)
            if res.drafts is not None:
                request.drafter.receive(res.drafts)  # the shard's draft heads, for the positions after them
            if request.drafter.streak >= RESUME_STREAK:
                request.draft_pause = 0             # the drafter foresaw the newest tokens: draft again
                request.draft_gain = max(request.draft_gain, PRIOR_DRAFT_GAIN)
            if decode:
                self.allocator.truncate(request.request_id, request.held_tokens - 1)
        return ended

    @staticmethod
    def _stop_reason(request: Request, token_id: int) -> str | None:
        if len(request.generated) >= request.max_new_tokens:
            return "length"
        if token_id in request.stop_token_ids:
            return "eos_token"
        return None

    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        if self.shared is not None:
            self.shared.leave(request.request_id)
        if self.cache is not None:
            self._cache_finished(request)
        self.allocator.release(request.request_id)
        self._released.append(request.request_id)

    def _cache_finished(self, request: Request) -> None:
        """Cache the tokens whose KV a planned row writes, then unlock.

        Slot i holds position i. A token sampled by a step still in flight is not known
        here and has no KV yet: ``prompt + generated`` stops before it. The newest known
        token has KV only if a decode row fed it (then it has a slot).
        """
        slots = self.allocator.slots(request.request_id)
        tokens = (request.prompt_ids + request.generated)[: min(len(slots), self._cacheable(request))]
        slots = slots[: len(tokens)]
        if tokens and self.cache.extend(request.lock_node, request.cached_len, tokens, slots) is None:
            self.cache.insert(tokens, slots)
        self.cache.unlock_node(request.lock_node)
        request.lock_node = None

    def check_idle(self) -> None:
        """With nothing running or waiting: the allocator's counts (``SlotAllocator.check_idle``), no tree node
        locked, no shared-prefix group left (cheap enough for the router to run whenever it goes idle)."""
        if self.has_work():
            raise RuntimeError("check_idle with requests running or waiting: use check_integrity")
        self.allocator.check_idle()
        if self.cache is not None:
            self.shared.check(set())
            if self.cache.evictable_slots != self.cache.cached_slots:
                raise AllocatorError(f"{self.cache.cached_slots - self.cache.evictable_slots} cached slots stay "
                                     f"locked with no request running")

    def check_integrity(self) -> None:
        """The allocator's checks, plus: every lock count equals the running requests whose lock
        path passes the node, and each request's cached positions map its lock path's slots."""
        self.allocator.check_integrity()
        if self.cache is None:
            return
        self.shared.check({r.request_id for r in self.running})
        expected: dict[int, int] = {}
        for request in self.running:
            path = list(request.lock_node.path_to_root())
            for node in path:
                expected[id(node)] = expected.get(id(node), 0) + 1
            path_slots = [s for node in reversed(path) for s in node.slots]
            if self.allocator.slots(request.request_id)[: request.cached_len] != path_slots:
                raise AssertionError(f"request {request.request_id}: cached positions do not map its lock path")
        for node in self.cache.nodes():
            if node.lock_count != expected.get(id(node), 0):
                raise AssertionError(f"a node is locked {node.lock_count} times by {expected.get(id(node), 0)} "
                                     f"running requests")


class PrefixTable:
    """One step's cached prefixes (``Step.prefixes``). The first prefix that starts at a slot is sent whole;
    a row whose prefix is a prefix of it reads it, one that extends it or parts from it sends only its own
    slots past the common part (a burst of conversations behind one system prompt sends that prompt's
    slots once)."""

    def __init__(self):
        self.lists: list[PrefixSlots] = []
        self._whole: dict[int, int] = {}      # slot of position 0 -> the entry sent whole that starts there

    def index(self, slots: list[int], length: int) -> int:
        """The entry whose first ``length`` slots are ``slots[:length]`` (added if none)."""
        first = self._whole.get(slots[0])
        if first is None:
            self._whole[slots[0]] = len(self.lists)
            self.lists.append(PrefixSlots(slots[:length]))
            return len(self.lists) - 1
        common = common_prefix_length(self.lists[first].slots, slots[:length])
        if common == length:
            return first
        self.lists.append(PrefixSlots(slots[common:length], base=first, base_len=common))
        return len(self.lists) - 1


class DraftRoom:
    """The slots one step's drafts may take: those free beyond the step's decode rows and prompt
    chunks (drafts never evict the prefix cache nor take a slot admission counted on)."""

    def __init__(self, slots: int):
        self.slots = max(slots, 0)

    def take(self, want: int) -> int:
        granted = min(max(want, 0), self.slots)
        self.slots -= granted
        return granted

    def give_back(self, unused: int) -> None:
        self.slots += max(unused, 0)


@dataclass
class StepBudget:
    """What one step's prompt chunks may take: ``tokens`` (the step's size, which bounds the
    activation memory the warm-up measured) and, while requests decode, ``cost`` (time)."""
    tokens: int
    cost: float | None = None

    @classmethod
    def for_step(cls, config: SchedulerConfig, decoding: list[Request]) -> "StepBudget":
        """The cost cap holds whenever a request decodes. Before, a burst of new prompts that
        outnumbered the decoding requests took whole steps. One H100 through HTTP (stop 43's note):
        64 prompts of 2k-16k tokens at once, Llama-3.1-8B: ITL p99 187 -> 74 ms, TTFT p50 11.35 ->
        11.54 s (with ``_admission_key``'s order and a cap of 704); the cost, more prompt steps while a
        burst of short prompts is prefilled: 512 prompts of 64-512 tokens, Llama-2-7B, 6,682 -> 6,490
        output tokens/s (two runs each; ITL p99 110-127 -> 99-106 ms). A cap of 1,500 only while the
        prompts outnumber the decoding requests lost 10% there. Stop 46: a smaller cap for a lone stream
        and a share per decoding request instead (``STALL_FREE_ROW_TOKENS``; its numbers there)."""
        cost = None
        if config.stall_free_tokens is not None and decoding:
            context = sum(r.held_tokens for r in decoding)
            cost = (config.stall_free_tokens * (1 + context / config.kv_weight_tokens)
                    + config.stall_free_row_tokens * len(decoding))
        return cls(config.max_prefill_tokens - len(decoding), cost)

    def fit(self, start: int, want: int, span: int, tile: int = 1, shared: int = 0) -> int:
        """The most tokens (at most ``want``) of a chunk from position ``start`` within the budget."""
        tokens = min(want, self.tokens)
        if self.cost is not None and tokens > 0:
            # without tiles chunk_cost(n) = a n^2 + b n: the largest n with cost <= self.cost bounds it
            a, b = 1 / (2 * span), 1 + (start - 0.5) / span
            n = int((-b + math.sqrt(b * b + 4 * a * max(self.cost, 0))) / (2 * a))
            while n > 0 and chunk_cost(start, n, span, tile, shared) > self.cost:
                n -= 1
            tokens = min(tokens, n)
        return max(tokens, 0)

    def take(self, start: int, tokens: int, span: int, tile: int = 1, shared: int = 0) -> None:
        self.tokens -= tokens
        if self.cost is not None:
            self.cost -= chunk_cost(start, tokens, span, tile, shared)


def chunk_cost(start: int, tokens: int, span: int, tile: int = 1, shared: int = 0) -> float:
    """A prompt chunk's cost in tokens: its matmuls plus its attention over positions 0..start+tokens, that
    of whole ``tile``s of new tokens (a program of the prefill attention takes a tile and walks the whole
    context for it, however few of its rows are used). One H200, Llama-3.1-8B (32-token tiles), a chunk at
    90,000 keys beside one stream: 32 tokens 9.9 ms, 128 tokens 21.3 ms (3.8 ms a tile), and 33-38 tokens
    (two tiles) about 13.7 ms a step where 32 took 10.6 (``bench.profile_step``, ``bench.beside_steps``)."""
    tiles = -(-tokens // tile) * tile
    if 0 < shared <= start:
        # ``shared`` positions come from the shared-prefix kernel, which tiles the new tokens of all its rows
        # together: no whole tile of its own there for this chunk's few (a burst behind one system prompt has
        # 16-64 new tokens a request; charged whole tiles over the 3,000 shared positions, the cap let a step
        # beside 42 decoding requests take 85 of them, 2,726 tokens: one H200, stop 54's debug log)
        return tokens + (tokens * shared + tiles * (start - shared + (tokens - 1) / 2)) / span
    return tokens + tiles * (start + (tokens - 1) / 2) / span


def largest_step_tokens(max_prefill_tokens: int, max_requests: int, speculate: int) -> int:
    """The most tokens a planned step carries (module docstring: the step budget): the budget, or a row per
    request with its drafts where that is more. The worker's warm-up runs a step of this size."""
    return max(max_prefill_tokens, max_requests * (1 + speculate))


def prefill_delay_bound(config: SchedulerConfig, num_slots: int, max_requests: int) -> int:
    """Steps within which an admitted prompt is all planned, whatever else arrives: every step the first
    prompt in order gets at least ``MIN_PROMPT_CHUNK`` tokens, or what the plain decode rows (at most
    ``max_requests - 1`` beside a prompt) leave of the budget, one at least (``Scheduler._plan_chunks``), so
    this one's priority (remaining tokens less the others' since admission, ``_prefill_priority``) falls by
    that much a step until it finishes or goes before every newcomer (within ``max_seq_len`` / that many
    steps); then only the prompts ahead of it (at most ``num_slots`` tokens) and its own remain."""
    min_chunk = min(MIN_PROMPT_CHUNK, max(config.max_prefill_tokens - (max_requests - 1), 1))
    return math.ceil(config.max_seq_len / min_chunk) + math.ceil(num_slots / min_chunk) + 1


class PinnedTokens:
    """The (L, R) pairs of the admission formula with the prefix cache.

    R of a running request = its exclusive tokens (held or planned, not in the tree) plus
    the tokens of each locked tree node on its lock path for which it is the locker with
    the longest remaining output L (ties: the first seen). A locked node stays until its
    last locker finishes, at the latest when that locker would: so a token shared by many
    requests counts once, until the last of them may end. Unlocked nodes count as free
    (``allocate`` evicts them). ``trial`` adds a candidate with its match: it takes the
    nodes it would pin longest, and newly pins unlocked ones (conservative where a match
    ends inside a node).
    """

    def __init__(self, running: list[Request], prefill_delay: int):
        self.prefill_delay = prefill_delay
        self.entries: dict[int, list[int]] = {}   # request id -> [L, R, delay, growth] (see peak_usage)
        for r in running:
            self.entries[r.request_id] = self._entry(r, r.held_tokens - r.cached_len, r.prefilled)
        self.owner: dict[TreeNode, tuple[int, int]] = {}   # node -> (L, request id) of its pinner
        for r in running:
            if r.lock_node is not None:
                life = self.entries[r.request_id][0]
                path = [(node, len(node.slots)) for node in r.lock_node.path_to_root()]
                self._apply(r.request_id, life, r.lock_node, self._claims(life, path))
        self.reserved = sum(e[1] + e[3] for e in self.entries.values())   # reserved_usage of the entries

    def _entry(self, request: Request, tokens: int, prefilled: int) -> list[int]:
        """[L, R, delay, growth] of a request. ``growth``: its remaining rows, counted from now
        (delay 0); a request whose prompt is not all planned lives up to ``prefill_delay`` steps
        longer (whatever the order prompts are planned in). L adds one step because steps are
        pipelined (the result that frees a request is seen after the next step is planned)."""
        wait = self.prefill_delay if prefilled < len(request.prompt_ids) else 0
        if request.speculates:
            # It may hold its whole length at any step, and it has a row at least every other step
            # (none while one is in flight): its life is at most twice its remaining tokens.
            return [wait + 2 * request.remaining + 2, tokens + request.remaining, 0, 0]
        return [wait + request.remaining + 1, tokens, 0, request.remaining]

    def _claims(self, remaining: int, path) -> tuple[int, dict[int, int]]:
        """(tokens the request newly pins, {request id: tokens it stops pinning}). Where a
        path ends inside a node, ``lock`` splits it: the upper part gets the new pinner."""
        added, taken = 0, {}
        for node, used in path:
            current = self.owner.get(node)
            if current is None or remaining > current[0]:
                added += used
                if current is not None:
                    taken[current[1]] = taken.get(current[1], 0) + used
        return added, taken

    def _apply(self, request_id: int, remaining: int, lock_node: TreeNode | None, claims) -> None:
        added, taken = claims
        self.entries[request_id][1] += added
        for other, count in taken.items():
            self.entries[other][1] -= count
        for node in lock_node.path_to_root() if lock_node is not None else ():
            current = self.owner.get(node)
            if current is None or remaining > current[0]:
                self.owner[node] = (remaining, request_id)

    def bound(self, request: Request, match: Match) -> int:
        """``reserved_usage`` with the candidate, in O(its match path): an upper bound of the peak
        (a request never holds more than R + growth), so a candidate within it fits without
        ``peak_usage`` over every entry (which admitting hundreds of requests at once made
        quadratic)."""
        entry = self._entry(request, request.held_tokens - match.length, match.length)
        added, taken = self._claims(entry[0], match.path)
        return self.reserved + entry[1] + added + entry[3] - sum(taken.values())

    def trial(self, request: Request, match: Match) -> list[tuple]:
        entry = self._entry(request, request.held_tokens - match.length, match.length)
        added, taken = self._claims(entry[0], match.path)
        entry[1] += added
        rows = [(e[0], e[1] - taken.get(rid, 0), e[2], e[3]) for rid, e in self.entries.items()]
        return rows + [tuple(entry)]

    def commit(self, request: Request, match: Match, lock_node: TreeNode | None) -> None:
        """Count an admitted request (after ``_start``); ``lock_node`` is where ``PrefixCache.lock``
        ended its match."""
        entry = self.entries[request.request_id] = self._entry(request, request.held_tokens - match.length,
                                                               match.length)
        claims = self._claims(entry[0], match.path)
        if match.path and match.path[-1][0] is not lock_node and match.path[-1][0] in self.owner:
            self.owner[lock_node] = self.owner[match.path[-1][0]]     # the split-off upper part
        self._apply(request.request_id, entry[0], lock_node, claims)
        self.reserved += entry[1] + entry[3] - sum(claims[1].values())


def _admission_key(request: Request) -> int:
    """Waiting requests go shortest prompt first, aged by the prompt tokens the others were given since
    they arrived: ``len(prompt) - (prompt_work - arrived_at_work)``. ``prompt_work`` is the same for
    every waiting request, so this key orders them as that priority does at every step, and the list
    stays sorted as requests arrive. A prompt waits at most until the others got as many prompt tokens
    as it has (then it goes before any newcomer); arrivals with equal keys keep their order (FIFO)."""
    return len(request.prompt_ids) + request.arrived_at_work


def _longest_first(request: tuple) -> int:
    return -request[0]


def reserved_usage(requests: list[tuple], presorted: bool = False) -> int:
    """TGI-style reservation: every request holds room for its maximum length from the start."""
    return sum(entry[1] + (entry[3] if len(entry) > 2 else entry[0]) for entry in requests)


def peak_usage(requests: list[tuple], presorted: bool = False) -> int:
    """The peak over future steps t of the tokens held, each request given as (L, R): it holds
    R + t tokens while t <= L (so the peak is max_k (k * L_k + sum_{j<=k} R_j) over L
    descending), or as (L, R, delay, growth) with growth >= L - 1: it holds
    R + clamp(t - delay, 0, growth) while t <= L (any growth: the entries with delay or with
    growth < L - 1 are the few of prompts still being planned).

    The peak is reached at some t = L_k: the k requests of longest L are alive then. A
    request without delay adds t there, less L - growth if its own L is that t (the tie
    group); delayed ones (prompts still being planned: few) are summed one by one.
    """
    ordered = requests if presorted else sorted(requests, key=_longest_first)
    peak = held = growing = tie_short = 0
    tie_at, delayed = None, []
    for entry in ordered:
        life, tokens = entry[0], entry[1]
        delay, growth = (entry[2], entry[3]) if len(entry) > 2 else (0, life)
        held += tokens
        if life != tie_at:
            tie_at, tie_short = life, 0
        if delay or growth < life - 1:
            delayed.append((delay, growth))
        else:
            growing += 1
            tie_short += life - growth
        late = sum(min(max(life - d, 0), g) for d, g in delayed)
        peak = max(peak, held + growing * life - tie_short + late)
    return peak
