"""The messages of the engine, plain data that one msgpack codec (``engine.protocol.codec``) carries.

Torch-free: the router and the front end build and read these without loading torch.

  front end -> router : GenerationRequest, Abort
  router -> front end : TokenEvent (one per generated token, or an error)
  router -> shards    : Step (the same bytes to every shard)
  shard 0 -> router   : StepResult
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    top_n_tokens: int = 0
    prompt_logprobs: bool = False
    grammar_type: str | None = None     # "json" (grammar: a JSON schema as text) | "regex" | None
    grammar: str = ""
    watermark: bool = False

    def __post_init__(self):
        checks = [
            (self.temperature > 0, "temperature must be > 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 < self.typical_p <= 1, "typical_p must be in (0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.top_n_tokens >= 0, "top_n_tokens must be >= 0"),
            (self.seed is None or 0 <= self.seed < 2**64, "seed must be in [0, 2**64)"),
            (self.grammar_type in (None, "json", "regex"), "grammar_type must be None, 'json' or 'regex'"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


FED_BACK = -1    # a decode row's input id: "the token the worker sampled last for this row"
NO_PREFIX = -1   # a row's ``prefix`` when it maps no cached prefix


def frontend_of(request_id: int, frontends: int) -> int:
    """The front end (of ``frontends``) that numbered ``request_id``: front end ``k`` numbers ``k + 1``,
    ``k + 1 + frontends``, ... (``tgi_compat.request_ids``), and the router sends a request's events to it."""
    return (request_id - 1) % frontends


@dataclass(frozen=True)
class GenerationRequest:
    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()
    stop_token_ids: list[int] | None = None    # None: the model's EOS ids


@dataclass(frozen=True)
class Abort:
    request_id: int


@dataclass
class TokenEvent:
    request_id: int
    token_id: int = -1
    logprob: float = math.nan
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None            # None | "length" | "eos_token"
    seed: int | None = None                     # the seed used, when sampled
    prompt_logprobs: list[float | None] | None = None  # first event only; entry 0 is None
    error: str | None = None                    # generation failed; nothing follows


@dataclass
class StepRow:
    request_id: int
    row: int                      # request row in req_to_token
    start_pos: int                # tokens of this request already in the KV cache
    input_ids: list[int]          # new tokens: a prompt chunk, or [FED_BACK] (decode), or [FED_BACK, drafts..]
                                  # (a verify row: logits at every position, the accepted drafts come back)
    slots: list[int]              # KV slot of each new token
    sample: bool                  # the last new token's logits choose the next token
    params: SamplingParams | None = None   # sent with the request's first chunk only
    seed: int = 0
    logprob_targets: list[int] | None = None  # next prompt token of each position (prompt logprobs)
    # The request's first row when its prompt starts with a cached prefix (start_pos tokens):
    prefix: int = NO_PREFIX                # its slots: req_to_token[row, 0:start_pos] = the first start_pos of
                                           # Step.prefixes[prefix] (with its base's)
    prefix_ids: list[int] | None = None    # their token ids, sent only with penalties (they count as prompt)
    # A row (prompt chunk or decode) of the step's shared-prefix group: positions 0..shared_prefix_len-1
    # hold the same slots in every member's req_to_token row (engine.router.shared_prefix, cascade attention)
    shared_prefix_len: int = 0
    # A prompt chunk's: the whole prompt's length (a rope whose rotation depends on the forward pass's length
    # rotates every prompt token by it: ``engine.models.rope.plain_rope_length``); 0 in other rows
    prompt_len: int = 0


@dataclass
class PrefixSlots:
    """One cached prefix's KV slots in a step: ``Step.prefixes[base][:base_len]`` (base -1: nothing), then ``slots``."""
    slots: list[int]
    base: int = NO_PREFIX          # an earlier entry of the same step
    base_len: int = 0


@dataclass
class Step:
    rows: list[StepRow]
    released: list[int] = field(default_factory=list)   # requests whose worker state can go
    # The cached prefixes that rows map (``StepRow.prefix``), each slot list once: a burst behind one
    # 3,000-token system prompt sends its slots once, not once a row (1.3 MB a step for 100 rows), and
    # prefixes that extend it (conversations behind it) send only their own slots after it
    prefixes: list[PrefixSlots] = field(default_factory=list)

    def prefix_segments(self, index: int, length: int) -> list[tuple[int, int, int]]:
        """Where the first ``length`` slots of prefix ``index`` come from: (entry, start, end), in order, for
        positions start..end-1 = ``prefixes[entry].slots[: end - start]``."""
        segments = []
        while index != NO_PREFIX and length > 0:
            entry = self.prefixes[index]
            if length > entry.base_len:
                segments.append((index, entry.base_len, min(length, entry.base_len + len(entry.slots))))
            index, length = entry.base, min(length, entry.base_len)
        return segments[::-1]

    def prefix_slots(self, index: int, length: int) -> list[int]:
        """The first ``length`` slots of prefix ``index`` as one list."""
        slots = []
        for entry, start, end in self.prefix_segments(index, length):
            slots.extend(self.prefixes[entry].slots[: end - start])
        return slots



@dataclass
class RowResult:
    request_id: int
    token_id: int | None = None
    logprob: float | None = None
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None   # one per logprob target of the row
    error: str | None = None      # a request feature failed in the worker (a grammar): the request ends with it
    following: list["RowResult"] = field(default_factory=list)   # a verify row's tokens after token_id:
                                                                  # accepted drafts but the first, then one more
    drafts: list[int] | None = None   # draft heads' tokens for the positions after the row's last token
                                      # (engine.models.medusa); None without heads


@dataclass
class StepResult:
    rows: list[RowResult]


@dataclass(frozen=True)
class Ready:
    """A shard has loaded its weights and sized its KV cache."""
    rank: int
    num_slots: int


@dataclass(frozen=True)
class ShardError:
    rank: int
    message: str


@dataclass(frozen=True)
class Shutdown:
    reason: str = ""


@dataclass(frozen=True)
class RouterStatus:
    """Router -> front end: health and the numbers /metrics shows."""
    healthy: bool
    queue_size: int = 0
    batch_size: int = 0
    kv_used: int = 0
    kv_capacity: int = 0
    error: str | None = None
    prefix_cache_tokens: int = 0            # KV slots the prefix cache holds now
    prefix_cache_lookup_tokens: int = 0     # prompt tokens of admitted requests, cumulative
    prefix_cache_hit_tokens: int = 0        # of those, taken from the prefix cache, cumulative
    prefix_cache_evicted_tokens: int = 0    # cached tokens evicted for room, cumulative
    speculation_drafted_tokens: int = 0     # draft tokens sent for verification (--speculate), cumulative
    speculation_accepted_tokens: int = 0    # of those, accepted and appended, cumulative
    speculation_skipped_tokens: list[int] = field(default_factory=list)  # [k]: results that appended k accepted
                                                                         # drafts, cumulative (TGI's ``tgi_request_skipped_tokens``)


@dataclass(frozen=True)
class StepStats:
    """One router step's numbers, for TGI's ``tgi_batch_*`` metrics."""
    method: str               # "prefill" (the step has prompt tokens) | "decode"
    size: int                 # rows (requests) in the step
    joined: bool              # requests joined a batch that was already running (a concatenation)
    concat_s: float           # scheduling: admission and the step's rows
    forward_s: float          # the shards: from submission (or the previous result, if later) to the result
    decode_s: float           # sampled tokens -> token events (stop criteria)
    filter_s: float           # freeing the requests that finished
    inference_s: float        # scheduling start -> token events
    ok: bool = True           # False: the shards failed during this step


@dataclass(frozen=True)
class Events:
    """Router -> front end: every token event of one step, and the numbers of the steps since the last."""
    events: list
    steps: list = field(default_factory=list)    # StepStats
