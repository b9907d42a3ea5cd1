"""Per-step times of the shared-prefix load in one process (no HTTP): where its TTFT goes.

Runs ``--rounds`` rounds of ``--requests`` prompts that share a ``--prefix-len``-token prefix (a new
random prefix each round, so every round misses the cache once and then hits it), all added at once,
through ``engine.generation.Engine``. Prints each prefill step of each round (rows, wall ms) and each
round's TTFT p50 / p99: the first round pays every lazily compiled kernel, later rounds do not.
With ``--profile`` (CUDA) the last round runs under torch.profiler until every request has its first
token: the kernels of its prefill steps (and the decode steps between them), device ms in all, largest
first.

    python -m bench.prefix_steps --model-dir /tmp/llama2-7b [--profile]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import SamplingParams


def round_requests(first_id: int, args, rng: random.Random, vocab: int) -> list[GenerationRequest]:
    prefix = [rng.randrange(3, vocab) for _ in range(args.prefix_len)]
    return [GenerationRequest(first_id + i, prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))],
                              args.new_tokens, SamplingParams(), stop_token_ids=[])
            for i in range(args.requests)]


def run_round(engine: Engine, requests: list[GenerationRequest], profiler=None) -> dict:
    """TTFTs and prefill steps of one round; ``profiler`` (started) is stopped once every request has its first
    token."""
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    first: dict[int, float] = {}
    steps = []
    while engine.has_work():
        t0 = time.perf_counter()
        events = engine.step()
        stats = engine.router.take_stats()
        for event in events:
            first.setdefault(event.request_id, time.perf_counter() - start)
        if profiler is not None and len(first) == len(requests):
            profiler.stop()
            profiler = None
        for s in stats:
            if s.method == "prefill":
                steps.append({"rows": s.size, "forward_ms": 1000 * s.forward_s, "wall_ms": 1000 * (time.perf_counter() - t0)})
    ttft = sorted(first.values())
    return {"ttft_p50_s": statistics.median(ttft), "ttft_p99_s": ttft[int(0.99 * (len(ttft) - 1))],
            "total_s": time.perf_counter() - start, "prefill_steps": steps}


def print_kernels(profiler, top: int) -> dict[str, float]:
    """Device ms of each kernel over the profiled steps, largest first (the ``top`` of them printed); on a CPU the
    ops' self CPU ms (a smoke run)."""
    cuda = torch.cuda.is_available()
    totals = {e.key: (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1000
              for e in profiler.key_averages() if not cuda or e.device_type.name == "CUDA"}
    ranked = dict(sorted(((k, ms) for k, ms in totals.items() if ms > 0), key=lambda kv: -kv[1]))
    print(f"{'kernels' if cuda else 'ops'} until every first token: {sum(ranked.values()):.1f} ms in all")
    for name, ms in list(ranked.items())[:top]:
        print(f"  {ms:9.1f} ms  {name[:110]}")
    return ranked


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True,
                        help="checkpoint directory (the prompts are random token ids below its vocab size)")
    parser.add_argument("--requests", type=int, default=256,
                        help="prompts of each round, all added at once (default: %(default)s)")
    parser.add_argument("--prefix-len", type=int, default=3000,
                        help="tokens of the prefix a round's prompts share (a new random one each round); 16-64 "
                             "random tokens of its own follow in each prompt (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="tokens generated per request; no stop token ends them sooner (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds, one after the other on one engine; the first pays every lazily compiled "
                             "kernel (default: %(default)s)")
    parser.add_argument("--max-requests", type=int, default=256,
                        help="the engine's request rows, EngineConfig.max_requests: the largest running batch "
                             "(default: %(default)s)")
    parser.add_argument("--profile", action="store_true", help="the last round's kernels until every first token "
                                                                "(CUDA)")
    parser.add_argument("--top", type=int, default=20,
                        help="--profile: kernels printed, largest first (default: %(default)s)")
    parser.add_argument("--json", help="also write each round's TTFTs and prefill steps (with --profile, the last "
                                       "round's kernel ms) to this file")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    engine = Engine(EngineConfig(model_dir=args.model_dir, max_requests=args.max_requests))
    rng = random.Random(0)
    rounds = []
    profiler = None
    for r in range(args.rounds):
        if args.profile and r == args.rounds - 1:
            activity = torch.profiler.ProfilerActivity
            profiler = torch.profiler.profile(activities=[activity.CUDA if torch.cuda.is_available() else activity.CPU])
            profiler.start()
        result = run_round(engine, round_requests(r * args.requests, args, rng, engine.model_config.vocab_size),
                           profiler)
        rounds.append(result)
        print(f"round {r}: TTFT p50 {result['ttft_p50_s'] * 1000:.0f} ms, p99 {result['ttft_p99_s'] * 1000:.0f} ms, "
              f"total {result['total_s']:.2f} s")
        for s in result["prefill_steps"]:
            print(f"   prefill step: {s['rows']} rows, forward {s['forward_ms']:.1f} ms, wall {s['wall_ms']:.1f} ms")
    if profiler is not None:
        rounds[-1]["kernels_ms"] = print_kernels(profiler, args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
