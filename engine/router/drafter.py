"""Drafts for speculative decoding, on the router side: n-gram lookup (``NgramDrafter``) or the
tokens the shard's Medusa heads proposed (``HeadDrafter``).

A request's next tokens often repeat its own earlier ones (code edits, extraction, chat that
quotes its input). ``NgramDrafter`` proposes the tokens that followed an earlier occurrence of
the request's newest tokens (prompt + output). The shard verifies the drafts exactly
(``engine.worker.model_worker``): a draft only decides how many tokens one forward pass may
produce, never which.

Where it copies from:

  * the copy pointer: once a proposal came from source position ``s``, the request is copying
    from there; while every token since equals the source's (the drafts were accepted, the
    corrected token happened to match too), the next proposal continues at ``s`` plus the tokens
    since. It keeps following the quoted text where a shorter suffix's latest occurrence would
    jump elsewhere (``self.x`` in a function that is being copied occurs all over its source);
  * else the longest suffix (``max_ngram`` tokens down to 1) that occurred before, at its latest
    occurrence.

``ahead`` > 0 proposes for the positions after tokens not known yet (a plain row in flight): the
source's next ``ahead`` tokens stand for them, so the drafts are the tokens after those; a wrong
guess only gets the drafts rejected.

The index is incremental: ``follow[n][ngram]`` is the position right after the latest
occurrence of ``ngram`` whose next token is known, so a proposal costs ``max_ngram`` dict
look-ups whatever the request's length. It lags behind the tokens: ``extend`` only appends, and
``index`` (the scheduler calls it for each prompt chunk it plans, so a long prompt's index is built a
chunk per step while the device runs them) or the first read after it (a proposal, ``foresee``,
``quoting``) indexes the tokens since, each ``n`` in one pass of ``dict.update`` over zipped slices
(the latest occurrence wins). A request costs ``Scheduler.add`` only its prompt's list copy: a
100k-token prompt took 0.12 s there (the 2-core development CPU) when every token was indexed at once, and
now 0.2 ms, its chunks 2.6 ms each (4,096 tokens) as they are planned.
"""
from __future__ import annotations

QUOTE_NGRAM = 2   # a request whose newest 2 tokens occurred before is quoting (``quoting``): on the demo model with its
                  # Medusa heads (bench.spec_bench demo, 6 prompts x 128 tokens, 4 drafts) that drafted 1.934 / 1.720
                  # tokens per step on rename / write prompts, 3 tokens 1.924 / 1.678, the heads alone 1.011 / 1.482
MAX_NGRAM = 3     # longest suffix matched (TGI's prompt lookup, vLLM's default): 8 found the same drafts on the
                  # rename prompts once the copy pointer follows the quote, at an index entry more per token each


class NgramDrafter:
    """The n-gram index of one request's tokens (prompt + output, as the router knows them)."""

    def __init__(self, max_ngram: int = MAX_NGRAM):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._follow: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        self.indexed = 0                   # leading tokens whose n-grams ``_follow`` holds (the index lags behind)
        self.source: int | None = None     # copy pointer: the source position of ``tokens[self.target]``
        self.target = 0                    # (the position the last proposal started predicting at)
        self.streak = 0                    # newest tokens in a row that the drafter foresaw (``extend(score=True)``)

    def extend(self, tokens: list[int], score: bool = False) -> None:
        """Append new tokens to the request's sequence (``index`` takes them in); with ``score``, count in ``streak``
        whether each is the one a proposal would have drafted (a free test of drafting, even while
        the request does not draft)."""
        if not score:
            self.tokens.extend(tokens)
            return
        for token in tokens:
            self.streak = self.streak + 1 if self.foresee() == token else 0
            self.tokens.append(token)

    def index(self, upto: int | None = None) -> None:
        """Index the n-grams followed by the tokens before position ``upto`` (None: every token) not yet in."""
        own, start = self.tokens, self.indexed
        end = len(own) if upto is None else min(upto, len(own))
        if start >= end:
            return
        for n in range(1, min(self.max_ngram, end - 1) + 1):
            first = max(n, start)      # the first position that newly follows an n-gram: own[first - n : first]
            grams = zip(*(own[first - n + i : end - n + i] for i in range(n)))
            self._follow[n].update(zip(grams, range(first, end)))
        self.indexed = end

    @property
    def follow(self) -> list[dict[tuple[int, ...], int]]:
        """``follow[n][ngram]``: the position after the latest occurrence of ``ngram`` whose next token is known."""
        self.index()
        return self._follow

    def propose(self, max_drafts: int, ahead: int = 0) -> list[int]:
        """Up to ``max_drafts`` tokens for the positions after the known tokens and ``ahead`` unknown
        ones (module docstring); [] when nothing occurred before."""
        if max_drafts <= 0:
            return []
        start = self._copied_source()
        if start is None:
            start = latest_match(self.follow, self.tokens, self.max_ngram)
        if start is None or start + ahead >= len(self.tokens):
            self.source = None
            return []
        self.source, self.target = start, len(self.tokens)
        return self.tokens[start + ahead : start + ahead + max_drafts]

    def quoting(self) -> bool:
        """Whether the request is copying earlier text: the copy pointer still follows its source, or the
        newest ``QUOTE_NGRAM`` tokens occurred before."""
        if self._copied_source() is not None:
            return True
        n = min(QUOTE_NGRAM, self.max_ngram)
        return len(self.tokens) > n and tuple(self.tokens[-n:]) in self.follow[n]

    def foresee(self) -> int | None:
        """The token a proposal would draft first now (the copy pointer is left as it is)."""
        start = self._copied_source()
        if start is None:
            start = latest_match(self.follow, self.tokens, self.max_ngram)
        return None if start is None else self.tokens[start]

    def _copied_source(self) -> int | None:
        """Where the copy pointer stands now, if every token since the last proposal followed it."""
        if self.source is None:
            return None
        since = len(self.tokens) - self.target
        start = self.source + since
        if start >= len(self.tokens) or self.tokens[self.target :] != self.tokens[self.source : start]:
            return None
        return start


class HeadDrafter:
    """The drafts of the shard's Medusa heads (``engine.models.medusa``), or n-gram lookup's while the
    request quotes itself; ``NgramDrafter``'s interface.

    Every sampled row's result brings the heads' tokens for the positions after its last token
    (``receive``, once the result's tokens are in). They stay the request's drafts until the next
    result: known tokens since must equal the drafts they overtook, and ``ahead`` unknown tokens
    (a row in flight) take the drafts' places as the drafter's guess, so behind one plain row the
    proposal is the drafts after the first.

    A head reads one hidden state, and text copied from far back is what it foresees worst: on the
    demo model's rename prompts the bundled heads had 0.03 of their drafts accepted, n-gram lookup
    0.68 (``bench.spec_bench demo``). So while the copy pointer follows a quote, or the newest
    ``QUOTE_NGRAM`` tokens occurred before (``NgramDrafter.quoting``), the n-gram drafts go out instead.
    """

    def __init__(self, max_ngram: int = MAX_NGRAM):
        self.ngram = NgramDrafter(max_ngram)   # holds the request's tokens
        self.drafts: list[int] = []
        self.base = 0                      # len(tokens) when the drafts came: drafts[i] is for tokens[base + i]
        self.streak = 0

    @property
    def tokens(self) -> list[int]:
        return self.ngram.tokens

    def extend(self, tokens: list[int], score: bool = False) -> None:
        if not score:
            self.ngram.extend(tokens)
            return
        for token in tokens:
            self.streak = self.streak + 1 if self.foresee() == token else 0
            self.ngram.extend([token])

    def index(self, upto: int | None = None) -> None:
        self.ngram.index(upto)

    def receive(self, drafts: list[int]) -> None:
        self.drafts, self.base = list(drafts), len(self.tokens)

    def propose(self, max_drafts: int, ahead: int = 0) -> list[int]:
        if self.ngram.quoting():
            return self.ngram.propose(max_drafts, ahead)
        return self.head_drafts(max_drafts, ahead)

    def head_drafts(self, max_drafts: int, ahead: int = 0) -> list[int]:
        since = len(self.tokens) - self.base
        if max_drafts <= 0 or self.tokens[self.base :] != self.drafts[:since]:
            return []
        return self.drafts[since + ahead : since + ahead + max_drafts]

    def foresee(self) -> int | None:
        if self.ngram.quoting():
            return self.ngram.foresee()
        drafts = self.head_drafts(1)
        return drafts[0] if drafts else None


def latest_match(follow: list[dict[tuple[int, ...], int]], tokens: list[int], max_ngram: int) -> int | None:
    """The position after the latest earlier occurrence of the longest suffix of ``tokens``."""
    for n in range(min(max_ngram, len(tokens)), 0, -1):
        start = follow[n].get(tuple(tokens[-n:]))
        if start is not None:
            return start
    return None


def propose_ngram(tokens: list[int], max_drafts: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """The reference of a proposal without a copy pointer, by a plain backward search (tests)."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):      # an occurrence ending before the last token
            if tokens[end - n : end] == suffix:
                return tokens[end : end + max_drafts]
    return []
