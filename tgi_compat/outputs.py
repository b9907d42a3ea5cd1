"""What one generation produced, before it becomes JSON (``responses``) or SSE (``sse``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    logprob: float          # NaN when unknown: serialized as null
    special: bool


@dataclass(frozen=True)
class PrefillToken:
    id: int
    text: str
    logprob: float | None   # None for the first prompt token


@dataclass
class Timing:
    """Monotonic timestamps of one request (seconds)."""
    received: float = field(default_factory=time.monotonic)
    validated: float | None = None     # tokenized, limits checked, submitted
    first_token: float | None = None
    finished: float | None = None

    def mark(self, name: str) -> None:
        setattr(self, name, time.monotonic())

    @property
    def validation_s(self) -> float:
        return _span(self.received, self.validated)

    @property
    def queue_s(self) -> float:
        """Submission to first token (includes the prefill: we cannot see when it starts)."""
        return _span(self.validated, self.first_token)

    @property
    def inference_s(self) -> float:
        return _span(self.first_token, self.finished)

    @property
    def total_s(self) -> float:
        return _span(self.received, self.finished or time.monotonic())


def _span(start: float | None, end: float | None) -> float:
    return max(0.0, end - start) if start is not None and end is not None else 0.0


@dataclass
class GenerationResult:
    request_id: int
    generated_text: str
    finish_reason: str                       # length | eos_token | stop_sequence
    tokens: list[Token]
    top_tokens: list[list[Token]]            # one list per token; empty lists when not asked
    prefill: list[PrefillToken]
    seed: int | None
    input_length: int
    timing: Timing

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)

    @property
    def mean_logprob(self) -> float:
        """best_of ranks sequences by this (TGI `generate_best_of`)."""
        values = [t.logprob for t in self.tokens if t.logprob == t.logprob]
        return sum(values) / len(values) if values else float("-inf")

    @property
    def time_per_token_s(self) -> float:
        return self.timing.inference_s / max(1, self.generated_tokens - 1)


@dataclass(frozen=True)
class GeneratedStep:
    """One generated token as a stream sees it; ``result`` is set on the last step only."""
    index: int                               # 1-based
    token: Token
    top_tokens: list[Token]
    result: GenerationResult | None = None
