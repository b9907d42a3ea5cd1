"""Replay the router's scheduler on a load, with a step-time model in place of the GPU (CPU only, seconds).

    python -m bench.schedule_replay --load mixed [--stall-free-tokens 704] [--tree .baseline]
    python -m bench.schedule_replay --load mixed --arrivals-log server.log    # the burst's arrival as served
    python -m bench.schedule_replay --load load512 --spread 1                 # arrivals over a second

It drives the tree's own ``engine.router.scheduler.Scheduler`` (``--tree``: another checkout's, to compare
before and after) step by step, as ``tests/unit/test_step_budget.py`` does, every row answering a token at
once, and advances a clock by each step's modelled time. It reports what the HTTP benches report: TTFT
(from a request's arrival to the end of the step that sampled its first token) and ITL (between a request's
consecutive tokens) percentiles, and output tokens per second. It is for choosing what to measure on the
GPU (a policy, a constant), never for claiming a speed.

The loads (the numbers of ``bench.long_prompt_bench``'s mixed phase and ``bench/gpu_run.sh compare``):

  mixed     64 prompts of 2,000-16,000 tokens at once, 128 new each, Llama-3.1-8B, 413,589 KV slots
  load512   512 prompts of 64-512 tokens at once, 256 new each, Llama-2-7B, 118,158 KV slots
  shared    256 prompts behind one 3,000-token prefix (+ 20-80 tokens), 64 new each, Llama-2-7B
  beside    a stream (32-token prompt, 1,500 new) from 0 s, a 100,000-token prompt from 1 s, then prompts of
            100 and 2,000 tokens (16 new) at 6 and 6.5 s, Llama-3.1-8B: each request's TTFT is printed

A step's time, from the model's shapes (``weights.random_checkpoint``'s config) and one H100:

  max(weights / 3.0 TB/s + 0.2 ms                          a decode step's weight reads and launches
      + per decode row: 10 us + its context's KV / 2.6 TB/s
      + per prompt chunk of n tokens from position p: n * tau * (1 + (p + n/2) / attention_span),
      8 ms if the step has a prompt chunk)                 the piecewise graphs' launches (stop 44), or
                                                           25 ms: the eager forward's (stop 37's note), in a
                                                           tree without them or past 2,048 tokens

with tau = 2 * (a token's weights) / 560 TFLOP/s (Llama-3.1-8B: 25 us, which gives the 1.63 s of one
32,000-token prompt measured on the H100) and attention_span, the scheduler's own
(``engine.assembly.step_cost_model``).

Fit and known error (one H100, stop 42, the server's own arrival waves replayed with ``--arrivals-log``):
on the mixed load the replay of ab314ec's scheduler gives TTFT p50 11.5 s / ITL p99 188 ms where HTTP
measured 11.6 s / 191 ms. A scheduler that capped every step beside decoding requests (cost cap 704, no
yield to bursts, shortest prompt admitted first) replayed at 13.2 s / 55 ms and measured 15.4 s / 99 ms:
the replay had the direction, but not the tail of capped steps' ITL nor all of their TTFT.
Stop 43, that policy with the cap kept and admission aged by work (the default since): the mixed load
replayed at 8.6 s / 55 ms and measured 11.5 s / 74 ms. On the 512-request load it replayed TTFT p50
1.4 s (all 512 at 0 s: the shortest prompts fill the first wave) and measured 8.7-8.8 s; the HTTP burst
arrives over about a second (``--spread 1`` replays 7.3 s). Nor does the replay show what more,
smaller prompt steps cost there: 6,781 against 6,773 tokens/s replayed, -2.9% measured.
Stop 44: the piecewise floor is the graphs' measured launch; no HTTP run has been replayed against it yet.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench import positive_int

WEIGHT_BYTES_PER_S = 3.0e12
KV_BYTES_PER_S = 2.6e12
MATMUL_FLOPS = 560e12
STEP_OVERHEAD_S = 0.2e-3
ROW_S = 10e-6
EAGER_STEP_S = 25e-3
# Steps of up to PIECEWISE_TOKENS tokens replay the piecewise CUDA graphs (engine.worker.piecewise): their launch
# took 6.5-9.7 ms on the H100 host (stop 44: a 704-token chunk beside 1-200 decode rows, Llama-3.1-8B)
PIECEWISE_STEP_S = 8e-3
PIECEWISE_TOKENS = 2048


@dataclass(frozen=True)
class Load:
    config: str                 # a weights.random_checkpoint config name
    kv_slots: int
    max_seq_len: int
    requests: list[tuple[float, list[int], int]]   # (arrival s, prompt ids, max_new_tokens)


@dataclass(frozen=True)
class StepModel:
    tau: float                  # s per prompt token's matmuls
    attention_span: int
    weights_s: float            # a decode step's weight reads + launches
    kv_s_per_token: float       # s per context token a decode row reads

    def step_s(self, rows, fed_back: int, piecewise: bool = True) -> float:
        """``piecewise``: steps with prompt tokens launch through the piecewise graphs (trees since stop 44)."""
        gpu, prompt, tokens = self.weights_s, False, 0
        for r in rows:
            n = len(r.input_ids)
            tokens += n
            if r.input_ids[0] == fed_back:
                gpu += ROW_S + self.kv_s_per_token * (r.start_pos + 1)
            else:
                prompt = True
                gpu += self.tau * n * (1 + (r.start_pos + n / 2) / self.attention_span)
        if not prompt:
            return gpu
        return max(gpu, PIECEWISE_STEP_S if piecewise and tokens <= PIECEWISE_TOKENS else EAGER_STEP_S)


def step_model(config_name: str) -> tuple[StepModel, int, int]:
    """(the step-time model, attention_span, kv_weight_tokens) of a random_checkpoint config, bf16."""
    from engine.assembly import step_cost_model
    from engine.models import family_for, load_model_config
    from weights.random_checkpoint import resolve_config
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps(resolve_config(config_name)))
        c = load_model_config(folder)
    span, kv_weight_tokens = step_cost_model(c)
    shapes = family_for(c.architecture).checkpoint_shapes(c)
    token_weights = sum(math.prod(shape) for name, shape in shapes.items()       # a layer's (step_cost_model's)
                        if re.search(r"\.\d+\.", name) and len(shape) == 2)
    weights = sum(math.prod(shape) for shape in shapes.values())
    if "lm_head.weight" not in shapes:                   # tied: the head reads the embedding again
        weights += c.vocab_size * c.hidden_size
    kv_per_token = 2 * c.num_layers * 2 * c.num_kv_heads * c.head_dim
    model = StepModel(tau=2 * token_weights / MATMUL_FLOPS, attention_span=span,
                      weights_s=2 * weights / WEIGHT_BYTES_PER_S + STEP_OVERHEAD_S,
                      kv_s_per_token=kv_per_token / KV_BYTES_PER_S)
    return model, span, kv_weight_tokens


def builtin_load(name: str) -> Load:
    import random

    from bench.load import sample_lengths
    if name == "mixed":
        pairs = sample_lengths(64, (2000, 16000), (128, 128), seed=0)
        return Load("llama-3.1-8b", 413_589, 120_000 + 4000 + 64, distinct_prompts([(0.0, *p) for p in pairs]))
    if name == "load512":
        pairs = sample_lengths(512, (64, 512), (256, 256), seed=0)
        return Load("llama-2-7b", 118_158, 4096, distinct_prompts([(0.0, *p) for p in pairs]))
    if name == "beside":
        requests = [(0.0, 32, 1500), (1.0, 100_000, 1), (6.0, 100, 16), (6.5, 2000, 16)]
        return Load("llama-3.1-8b", 413_589, 120_000 + 4000 + 64, distinct_prompts(requests))
    rng = random.Random(0)
    prefix = list(range(10, 3010))
    tails = distinct_prompts([(0.0, rng.randint(20, 80), 64) for _ in range(256)], first=5000)
    return Load("llama-2-7b", 118_158, 4096, [(t, prefix + ids, new) for t, ids, new in tails])


def distinct_prompts(requests: list[tuple[float, int, int]], first: int = 100) -> list[tuple[float, list[int], int]]:
    """(arrival, prompt ids, max_new_tokens) for each (arrival, prompt length, max_new_tokens): prompts that
    share no token (no prefix-cache hits)."""
    out = []
    for arrival, length, new in requests:
        out.append((arrival, list(range(first, first + length)), new))
        first += length
    return out


VALIDATED = re.compile(r"^(\S+ \S+) INFO \S+: request (\d+) validated: (\d+) input tokens, max_new_tokens=(\d+)")


def arrivals_from_log(text: str, lengths: range, new_tokens: set[int]) -> list[tuple[float, int, int]]:
    """(seconds after the first, prompt tokens, max_new_tokens) of each request a server log shows validated,
    of those whose prompt length is in ``lengths`` and max_new_tokens in ``new_tokens`` (the load's, not the
    bench's warm-up requests)."""
    seen = []
    for line in text.splitlines():
        m = VALIDATED.match(line)
        if m and int(m[3]) in lengths and int(m[4]) in new_tokens:
            seen.append((datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(m[3]), int(m[4])))
    if not seen:
        raise ValueError("no 'request N validated: L input tokens' line with a prompt length in the load's range")
    start = min(t for t, _, _ in seen)
    return sorted((t - start, n, new) for t, n, new in seen)


def replay(load: Load, stall_free_tokens: int | None, max_prefill_tokens: int, row_tokens: int = 0) -> dict:
    """Run the load through the scheduler; the clock advances by each step's modelled time."""
    from engine.protocol.messages import FED_BACK, RowResult, SamplingParams, StepResult
    from engine.router.allocator import SlotAllocator
    from engine.router.scheduler import Request, Scheduler, SchedulerConfig
    import importlib.util
    piecewise = importlib.util.find_spec("engine.worker.piecewise") is not None    # the tree's own worker
    model, span, kv_weight_tokens = step_model(load.config)
    per_row = {"stall_free_row_tokens": row_tokens} if row_tokens else {}     # a tree before it has no such field
    config = SchedulerConfig(max_prefill_tokens=max_prefill_tokens, stall_free_tokens=stall_free_tokens,
                             attention_span=span, kv_weight_tokens=kv_weight_tokens, max_seq_len=load.max_seq_len,
                             **per_row)
    scheduler = Scheduler(SlotAllocator(num_slots=load.kv_slots, max_requests=1024), config)
    pending = sorted((t, i, ids, new) for i, (t, ids, new) in enumerate(load.requests))
    arrived, first, last, itls, now, steps = {}, {}, {}, [], 0.0, 0
    while pending or scheduler.has_work():
        while pending and pending[0][0] <= now:
            t, i, ids, new = pending.pop(0)
            scheduler.add(Request(request_id=i, prompt_ids=ids, max_new_tokens=new, params=SamplingParams(), seed=0))
            arrived[i] = t
        if not scheduler.has_work():
            now = pending[0][0]
            continue
        step = scheduler.schedule()
        now += model.step_s(step.rows, FED_BACK, piecewise)
        steps += 1
        scheduler.process(step, StepResult([RowResult(r.request_id, token_id=7 if r.sample else None, logprob=-1.0)
                                            for r in step.rows]))
        for r in step.rows:
            if r.sample:
                if r.request_id in first:
                    itls.append(now - last[r.request_id])
                else:
                    first[r.request_id] = now - arrived[r.request_id]
                last[r.request_id] = now
    from bench.load import percentile
    ttfts = list(first.values())
    return {"requests": len(first), "steps": steps, "seconds": now,
            "output_tokens_per_s": sum(new for _, _, new in load.requests) / now,
            "ttft_s": {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)},
            "ttft_by_request_s": {str(i): first[i] for i in sorted(first)},
            "itl_s": {"p50": percentile(itls, 50), "p99": percentile(itls, 99)}}


def spread_arrivals(load: Load, seconds: float, seed: int = 0) -> Load:
    """The load with each request arriving at a uniform random time in [0, seconds) (seeded), in place of
    all at 0 s: an HTTP burst reaches the router over about a second (stop 43: the 512-request burst's
    TTFT p50 replayed 1.4 s all at once, 7.3 s spread over 1 s; measured 8.7-8.8 s)."""
    import random
    rng = random.Random(seed)
    return Load(load.config, load.kv_slots, load.max_seq_len,
                [(t + rng.uniform(0, seconds), ids, new) for t, ids, new in load.requests])


def _non_negative(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.schedule_replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", choices=["mixed", "load512", "shared", "beside"], default="mixed",
                        help="the load (above)")
    parser.add_argument("--tree", help="replay this checkout's scheduler (and launcher defaults) instead of ours")
    parser.add_argument("--stall-free-tokens", type=positive_int,
                        help="the scheduler's stall_free_tokens (default: the tree's launcher default)")
    parser.add_argument("--stall-free-row-tokens", type=_non_negative,
                        help="the scheduler's stall_free_row_tokens (default: the tree's launcher default)")
    parser.add_argument("--max-prefill-tokens", type=positive_int, help="the step budget (default: the launcher's)")
    parser.add_argument("--arrivals-log",
                        help="a server log of this load: requests arrive when it shows them validated")
    parser.add_argument("--spread", type=_non_negative, default=0.0,
                        help="seconds over which the load's requests arrive, each at a seeded random time "
                             "(default 0: all at their load's times)")
    parser.add_argument("--json", help="write the result here")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.spread and args.arrivals_log:
        parser.error("--spread and --arrivals-log both set the arrival times: give one")
    if args.tree and not Path(args.tree, "engine", "router", "scheduler.py").is_file():
        parser.error(f"--tree {args.tree}: no engine/router/scheduler.py there (give a checkout of this project)")
    if args.arrivals_log and not Path(args.arrivals_log).is_file():
        parser.error(f"--arrivals-log {args.arrivals_log}: no such file")
    if args.tree:
        sys.path.insert(0, str(Path(args.tree).resolve()))
        for name in [m for m in sys.modules if m == "engine" or m.startswith(("engine.", "tgi_compat"))]:
            del sys.modules[name]
    from tgi_compat import launch_config
    from tgi_compat.launch_config import STALL_FREE_TOKENS, STEP_TOKENS
    load = builtin_load(args.load)
    if args.arrivals_log:
        lengths = [len(ids) for _, ids, _ in load.requests]
        try:
            arrivals = arrivals_from_log(Path(args.arrivals_log).read_text(errors="replace"),
                                         range(min(lengths), max(lengths) + 1), {new for _, _, new in load.requests})
        except ValueError as e:
            parser.error(f"--arrivals-log {args.arrivals_log}: {e}")
        load = Load(load.config, load.kv_slots, load.max_seq_len, distinct_prompts(arrivals))
    if args.spread:
        load = spread_arrivals(load, args.spread)
    stall_free = args.stall_free_tokens if args.stall_free_tokens is not None else STALL_FREE_TOKENS
    row_tokens = args.stall_free_row_tokens
    if row_tokens is None:
        row_tokens = getattr(launch_config, "STALL_FREE_ROW_TOKENS", 0)     # a tree before it has none
    row_tokens = int(row_tokens)
    budget = args.max_prefill_tokens if args.max_prefill_tokens is not None else STEP_TOKENS
    result = replay(load, stall_free, budget, row_tokens)
    ms = lambda s: s * 1000     # noqa: E731
    print(f"{args.load} ({len(load.requests)} requests, stall_free_tokens {stall_free} + {row_tokens} a row): TTFT p50 "
          f"{result['ttft_s']['p50']:.2f} s p99 {result['ttft_s']['p99']:.2f} s; ITL p50 {ms(result['itl_s']['p50']):.0f} "
          f"ms p99 {ms(result['itl_s']['p99']):.0f} ms; {result['output_tokens_per_s']:.0f} output tokens/s; "
          f"{result['steps']} steps")
    if len(load.requests) <= 8:
        print("TTFT by request (s): " + ", ".join(f"{i}: {t:.2f}" for i, t in result["ttft_by_request_s"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
