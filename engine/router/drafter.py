"""N-gram drafts (prompt lookup) for speculative decoding, on the router side.

A request's next tokens often repeat its own earlier ones (code edits, extraction, chat that
quotes its input). ``NgramDrafter`` matches the last ``n`` tokens of the request's prompt +
output (``n`` from ``max_ngram`` down to 1) against their most recent earlier occurrence and
proposes the tokens that followed it. The shard verifies the drafts exactly
(``engine.worker.model_worker``): a draft only decides how many tokens one forward pass may
produce, never which.

The index is incremental: ``follow[n][ngram]`` is the position right after the latest
occurrence of ``ngram`` whose next token is known, so a proposal costs ``max_ngram`` dict
look-ups whatever the request's length.
"""
from __future__ import annotations

MAX_NGRAM = 3     # longest suffix matched (TGI's prompt lookup and vLLM's default use 3 or less)


class NgramDrafter:
    """The n-gram index of one request's tokens (prompt + output, as the router knows them)."""

    def __init__(self, max_ngram: int = MAX_NGRAM):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.follow: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]

    def extend(self, tokens: list[int]) -> None:
        """Index new tokens appended to the request's sequence."""
        own, follow = self.tokens, self.follow
        for token in tokens:
            end = len(own)      # the n-grams ending just before ``token`` are now followed by it
            for n in range(1, min(self.max_ngram, end) + 1):
                follow[n][tuple(own[end - n : end])] = end
            own.append(token)

    def propose(self, max_drafts: int) -> list[int]:
        """Up to ``max_drafts`` tokens that followed the latest earlier occurrence of the longest
        matching suffix; [] when no suffix occurred before."""
        own = self.tokens
        if max_drafts <= 0:
            return []
        for n in range(min(self.max_ngram, len(own)), 0, -1):
            start = self.follow[n].get(tuple(own[-n:]))
            if start is not None:
                return own[start : start + max_drafts]
        return []


def propose_ngram(tokens: list[int], max_drafts: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """The reference of ``NgramDrafter.propose`` by a plain backward search (tests)."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):      # an occurrence ending before the last token
            if tokens[end - n : end] == suffix:
                return tokens[end : end + max_drafts]
    return []
