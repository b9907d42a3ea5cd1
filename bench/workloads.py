"""Identical token lists for our engine and the peer: seeded, reproducible."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: int

    @property
    def total_new_tokens(self) -> int:
        return len(self.prompts) * self.max_new_tokens


def random_prompts(count: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def batch1(vocab_size: int, prompt_len: int = 128, new_tokens: int = 256) -> Workload:
    return Workload("batch 1", random_prompts(1, prompt_len, prompt_len, vocab_size, seed=1), new_tokens)


def many(vocab_size: int, count: int = 256, min_len: int = 64, max_len: int = 512, new_tokens: int = 256) -> Workload:
    return Workload(f"{count} requests", random_prompts(count, min_len, max_len, vocab_size, seed=2), new_tokens)
