"""Engine-level throughput (no HTTP) beside transformers, on identical token lists.

    python -m bench.engine_bench --model-dir /tmp/llama2-7b [--requests 256] [--no-peer]

Prints batch-1 decode tokens/s (128-token prompt, 256 new tokens) and output tokens/s for
N requests (prompts uniform 64-512 tokens, 256 new tokens each, all queued at once).
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import SamplingParams

from . import peer
from .workloads import Workload, batch1, many


def _requests(workload: Workload, first_id: int = 0) -> list[GenerationRequest]:
    return [GenerationRequest(first_id + i, p, workload.max_new_tokens, SamplingParams(), stop_token_ids=[])
            for i, p in enumerate(workload.prompts)]


def ours_decode_tokens_per_s(engine: Engine, workload: Workload) -> float:
    """Time between the first and the last token of one request (the decode phase)."""
    best = 0.0
    for attempt in range(2):
        engine.add_request(_requests(workload, first_id=10_000 + attempt)[0])
        stamps = []
        while engine.has_work():
            events = engine.step()          # returns once the step's tokens are on the host
            stamps.extend(time.perf_counter() for _ in events)
        best = max(best, (len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return best


def ours_batch_tokens_per_s(engine: Engine, workload: Workload) -> tuple[float, int]:
    requests = _requests(workload, first_id=20_000)
    start = time.perf_counter()
    results = engine.generate(requests)
    generated = sum(len(v) for v in results.values())
    assert generated == workload.total_new_tokens, (generated, workload.total_new_tokens)
    return generated / (time.perf_counter() - start), generated


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="checkpoint directory (e.g. a random Llama-2-7B)")
    parser.add_argument("--requests", type=int, default=256, help="requests in the throughput workload")
    parser.add_argument("--no-peer", action="store_true", help="skip the transformers runs")
    parser.add_argument("--num-shards", type=int, default=1, help="tensor-parallel shards (one GPU each)")
    parser.add_argument("--cuda-graphs", choices=["on", "off"], default="on", help="decode CUDA graphs")
    parser.add_argument("--json", help="also write the numbers to this file")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    from engine.models import load_model_config

    vocab = load_model_config(args.model_dir).vocab_size
    single, batch = batch1(vocab), many(vocab, count=args.requests)
    engine = Engine(EngineConfig(model_dir=args.model_dir, max_requests=max(args.requests, 8),
                                 num_shards=args.num_shards, cuda_graphs=None if args.cuda_graphs == "on" else ()))
    engine.generate(_requests(Workload("warm-up", batch.prompts[:8], 8), first_id=30_000))
    numbers = {"ours_decode": ours_decode_tokens_per_s(engine, single),
               "ours_batch": ours_batch_tokens_per_s(engine, batch)[0],
               "kv_slots": engine.kv_usage()[1], "num_shards": args.num_shards, "cuda_graphs": args.cuda_graphs}
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    if not args.no_peer:
        model = peer.load(args.model_dir)
        numbers["peer_decode"] = peer.decode_tokens_per_s(model, single)
        numbers["peer_batch"] = peer.batch_tokens_per_s(model, batch)[0]
    _print_table(numbers, args.requests)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(numbers, f, indent=2)
    return numbers


def _print_table(n: dict, requests: int) -> None:
    rows = [("batch-1 decode tokens/s (128 prompt, 256 new)", "ours_decode", "peer_decode", "generate"),
            (f"{requests} requests output tokens/s (64-512 prompt, 256 new)", "ours_batch", "peer_batch",
             "generate_batch")]
    print(f"\n{'workload':58} {'ours':>10} {'transformers':>14} {'ratio':>7}")
    for label, ours, theirs, how in rows:
        peer_value = n.get(theirs)
        ratio = f"{n[ours] / peer_value:6.1f}x" if peer_value else "-"
        peer_text = f"{peer_value:10.1f} ({how})" if peer_value else "-"
        print(f"{label:58} {n[ours]:10.1f} {peer_text:>14} {ratio:>7}")
    print(f"KV capacity: {n['kv_slots']} token slots; shards: {n['num_shards']}; CUDA graphs: {n['cuda_graphs']}")


if __name__ == "__main__":
    main()
