"""The messages of the engine, plain data that one msgpack codec (``engine.ipc``) carries.

  front end -> router : GenerationRequest, Abort
  router -> front end : TokenEvent (one per generated token, or an error)
  router -> shards    : Step (the same bytes to every shard)
  shard 0 -> router   : StepResult
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .sampling import SamplingParams


FED_BACK = -1    # a decode row's input id: "the token the worker sampled last for this row"


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
    input_ids: list[int]          # new tokens: a prompt chunk, or [FED_BACK] (decode)
    slots: list[int]              # KV slot of each new token
    sample: bool                  # the last new token's logits choose the next token
    params: SamplingParams | None = None   # sent with the request's first chunk only
    seed: int = 0
    logprob_targets: list[int] | None = None  # next prompt token of each position (prompt logprobs)


@dataclass
class Step:
    rows: list[StepRow]
    released: list[int] = field(default_factory=list)   # requests whose worker state can go

    @property
    def num_tokens(self) -> int:
        return sum(len(r.input_ids) for r in self.rows)


@dataclass
class RowResult:
    request_id: int
    token_id: int | None = None
    logprob: float | None = None
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None   # one per logprob target of the row


@dataclass
class StepResult:
    rows: list[RowResult]
