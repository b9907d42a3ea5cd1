"""Benchmarks: the engine-level runner (engine_bench), the peer (transformers) runner."""

import argparse


def positive_int(text: str) -> int:
    """An argparse ``type``: a whole number >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text}")
    return value
