"""Cost of the prefix cache's bookkeeping on a full tree (pure Python, no device): once the tree fills
the KV memory the router evicts on nearly every step (``Scheduler._make_room``, ``SlotAllocator.allocate``),
so ``evict`` runs on the router loop between two decode steps.

    python -m bench.prefix_evict_bench                                   # 10,000 nodes, 860,000 slots
    python -m bench.prefix_evict_bench --module /tmp/prefix_cache_head.py  # another version of the file

The tree: --nodes // --fanout shared prefixes (one node each), each with --fanout - 1 leaves below it,
every node --tokens-per-node tokens, filled in a shuffled order so leaf ages interleave. Then --calls
steady-state rounds, each timed op by op: ``evict(--wanted)`` (one leaf at the defaults), the insert of
a new leaf that refills the tree, and a lock then unlock of that leaf (a request's lock path).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import statistics
import sys
import time

from engine.router.allocator import SlotAllocator

VOCAB = 32000


def load_prefix_cache(path: str | None):
    """The ``PrefixCache`` class of engine/router/prefix_cache.py, or of the file at ``path`` (a saved older
    version: ``git show HEAD:engine/router/prefix_cache.py > /tmp/prefix_cache_head.py``)."""
    if path is None:
        from engine.router.prefix_cache import PrefixCache
        return PrefixCache
    spec = importlib.util.spec_from_file_location("prefix_cache_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module           # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module.PrefixCache


class TreeFiller:
    """Inserts prompts the way the scheduler's requests do: a request allocates its slots, the tree keeps
    the ones it lacks, the request's copies of the shared prefix are freed on release."""

    def __init__(self, cache, args, rng: random.Random):
        self.cache, self.args, self.rng = cache, args, rng
        groups = range(args.nodes // args.fanout)
        self.prefixes = [[group] + self.random_tokens(args.tokens_per_node - 1) for group in groups]
        self.inserted = 0

    def random_tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def insert(self, group: int):
        """A prompt of the group's prefix and a new leaf's tokens (first token unique under the prefix)."""
        tokens = self.prefixes[group] + [self.inserted] + self.random_tokens(self.args.tokens_per_node - 1)
        self.inserted += 1
        allocator = self.cache.allocator
        allocator.open_request("fill")
        leaf = self.cache.insert(tokens, allocator.allocate("fill", len(tokens)))
        allocator.release("fill")
        return leaf


def timed_us(fn, *args) -> float:
    start = time.perf_counter_ns()
    fn(*args)
    return (time.perf_counter_ns() - start) / 1000


def lock_and_unlock(cache, node) -> None:
    cache.lock_node(node)
    cache.unlock_node(node)


def run(args) -> dict[str, list[float]]:
    cache_class, rng = load_prefix_cache(args.module), random.Random(args.seed)
    groups = args.nodes // args.fanout
    allocator = SlotAllocator(args.nodes * args.tokens_per_node + 4 * args.tokens_per_node, 4)
    cache = cache_class(allocator)
    filler = TreeFiller(cache, args, rng)
    order = [g for g in range(groups) for _ in range(args.fanout - 1)]
    rng.shuffle(order)
    for group in order:
        filler.insert(group)
    nodes = sum(1 for _ in cache.nodes())
    print(f"tree: {nodes} nodes, {cache.cached_slots} cached slots, {cache.evictable_slots} evictable")
    times: dict[str, list[float]] = {f"evict({args.wanted})": [], "insert a prompt": [], "lock + unlock": []}
    gc.collect()
    for _ in range(args.calls):
        times[f"evict({args.wanted})"].append(timed_us(cache.evict, args.wanted))
        start = time.perf_counter_ns()
        leaf = filler.insert(rng.randrange(groups))
        times["insert a prompt"].append((time.perf_counter_ns() - start) / 1000)
        times["lock + unlock"].append(timed_us(lock_and_unlock, cache, leaf))
    return times


def print_table(times: dict[str, list[float]]) -> None:
    print(f"{'op':<16}{'calls':>7}{'mean us':>11}{'p50 us':>11}{'p99 us':>11}")
    for op, samples in times.items():
        ordered = sorted(samples)
        p99 = ordered[int(0.99 * (len(ordered) - 1))]
        mean, p50 = statistics.mean(samples), statistics.median(samples)
        print(f"{op:<16}{len(samples):>7}{mean:>11.1f}{p50:>11.1f}{p99:>11.1f}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10_000, help="tree nodes (prefixes and leaves; default 10,000)")
    parser.add_argument("--fanout", type=int, default=100,
                        help="nodes per shared prefix, the prefix included (default 100)")
    parser.add_argument("--tokens-per-node", type=int, default=86, help="tokens (KV slots) of each node (default 86)")
    parser.add_argument("--wanted", type=int, default=64, help="slots each evict call asks for (default 64)")
    parser.add_argument("--calls", type=int, default=200, help="timed rounds of evict, insert, lock + unlock "
                        "(default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tokens and the fill order (default 0)")
    parser.add_argument("--module", help="a prefix_cache.py file to measure instead of the engine's (default: the "
                        "engine's)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.fanout < 2 or args.nodes < args.fanout:
        parser.error(f"--fanout {args.fanout} needs to be at least 2 and at most --nodes {args.nodes}")
    print_table(run(args))


if __name__ == "__main__":
    main()
