"""A batch-1 stream beside a long prompt, in process, step by step: the router's own scheduler plans
each step (stall-free cap, chunk order), the worker runs it, and each step's wall time (device
synchronised) is kept with the prompt chunk it carried. No HTTP and no pipelining: what a step costs
the stream, by the position of the chunk beside it.

    python -m bench.beside_steps --model-dir /tmp/llama31-8b --prompt-tokens 100000 --policies 704:0,192:64

A policy ``S:R`` sets the scheduler's ``stall_free_tokens`` S and ``stall_free_row_tokens`` R (default:
the launcher's). For each it prints the steps the prompt took and their total, the step time p50 / p99
/ max, then by tenth of the prompt the steps, their chunk sizes and step time p50 / max, and the
slowest steps. Run as a command, it sets the garbage collector as the server's processes do
(``engine.processes``).

Stop 46 (one H200, Llama-3.1-8B, a 100,000-token prompt, an idle decode step 4.1 ms; run as a script
outside the repository): 704:0 took 652 steps, 13.3 s, step p50 / p99 20.1 / 25.2 ms; 192:64 took
1,620 steps, 22.1 s, 13.6 / 16.9 ms. A step with a 32-token chunk at 90k keys took 13.4 ms.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from bench.load import percentile
from engine.assembly import EngineConfig, plan_engine
from engine.processes import tune_collector_for_serving
from engine.protocol.messages import SamplingParams
from engine.router.allocator import SlotAllocator
from engine.router.scheduler import Request, Scheduler, SchedulerConfig
from engine.worker.model_worker import ModelWorker
from tgi_compat.launch_config import STALL_FREE_ROW_TOKENS, STALL_FREE_TOKENS

STREAM, PROMPT = 1, 2            # request ids
STREAM_PROMPT = list(range(10, 42))
STREAM_WARM_STEPS = 8            # the stream decodes alone before the prompt arrives


@dataclasses.dataclass(frozen=True)
class StepTime:
    position: int       # the prompt chunk's first position
    tokens: int         # its tokens
    ms: float           # the step's wall time, device synchronised


def parse_policies(text: str) -> list[tuple[int, int]]:
    """'704:0,192:64' -> [(704, 0), (192, 64)]."""
    policies = []
    for part in text.split(","):
        base, _, per_row = part.partition(":")
        try:
            policy = (int(base), int(per_row or 0))
        except ValueError:
            raise ValueError(f"policy {part!r}: expected S:R, two integers (stall_free_tokens:stall_free_row_tokens)")
        if policy[0] < 1 or policy[1] < 0:
            raise ValueError(f"policy {part!r}: S must be >= 1 and R >= 0")
        policies.append(policy)
    return policies


def run_step(scheduler: Scheduler, worker: ModelWorker) -> tuple[list, float]:
    """Plan, run and process one step; (its prompt rows' (position, tokens), wall ms)."""
    step = scheduler.schedule()
    chunks = [(row.start_pos, len(row.input_ids)) for row in step.rows if row.request_id == PROMPT]
    started = time.perf_counter()
    result = worker.execute(step)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ms = (time.perf_counter() - started) * 1e3
    scheduler.process(step, result)
    return chunks, ms


def beside(worker: ModelWorker, config: SchedulerConfig, prompt_tokens: int) -> list[StepTime]:
    """The stream decodes alone, then the prompt arrives: each step until its last chunk."""
    scheduler = Scheduler(SlotAllocator(worker.num_slots, 2), config)
    stream_new = min(config.max_seq_len - len(STREAM_PROMPT), 4 * prompt_tokens + STREAM_WARM_STEPS)
    scheduler.add(Request(request_id=STREAM, prompt_ids=STREAM_PROMPT, max_new_tokens=stream_new,
                          params=SamplingParams(), seed=0))
    for _ in range(STREAM_WARM_STEPS):
        run_step(scheduler, worker)
    prompt = [(j * 7919) % 3000 + 10 for j in range(prompt_tokens)]
    scheduler.add(Request(request_id=PROMPT, prompt_ids=prompt, max_new_tokens=1, params=SamplingParams(), seed=0))
    steps = []
    while True:
        chunks, ms = run_step(scheduler, worker)
        if not chunks:
            break
        steps.append(StepTime(chunks[0][0], chunks[0][1], ms))
    scheduler.abort(STREAM)
    run_step(scheduler, worker)             # releases the stream's row and slots on the worker
    return steps


def summarise(steps: list[StepTime], prompt_tokens: int) -> dict:
    times = [s.ms for s in steps]
    tenth = max(prompt_tokens // 10, 1)
    by_tenth = []
    for low in range(0, prompt_tokens, tenth):
        part = [s for s in steps if low <= s.position < low + tenth]
        if part:
            by_tenth.append({"from": low, "steps": len(part), "chunk_min": min(s.tokens for s in part),
                             "chunk_max": max(s.tokens for s in part),
                             "ms_p50": statistics.median(s.ms for s in part), "ms_max": max(s.ms for s in part)})
    return {"steps": len(steps), "total_s": sum(times) / 1e3, "ms_p50": statistics.median(times),
            "ms_p99": percentile(times, 99), "ms_max": max(times), "by_tenth": by_tenth,
            "slowest": [dataclasses.asdict(s) for s in sorted(steps, key=lambda s: -s.ms)[:10]]}


def format_summary(policy: tuple[int, int], s: dict) -> str:
    lines = [f"policy {policy[0]}:{policy[1]}: {s['steps']} steps, {s['total_s']:.2f} s; step p50 {s['ms_p50']:.1f} "
             f"p99 {s['ms_p99']:.1f} max {s['ms_max']:.1f} ms"]
    lines += [f"  from {t['from']:>7}: {t['steps']:5} steps, chunks {t['chunk_min']}-{t['chunk_max']}, "
              f"ms p50 {t['ms_p50']:.1f} max {t['ms_max']:.1f}" for t in s["by_tenth"]]
    lines.append("  slowest (position, tokens, ms): "
                 + ", ".join(f"({x['position']}, {x['tokens']}, {x['ms']:.1f})" for x in s["slowest"]))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.beside_steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="checkpoint directory")
    parser.add_argument("--prompt-tokens", type=int, default=100_000, help="the long prompt's tokens")
    parser.add_argument("--policies", default=f"{STALL_FREE_TOKENS}:{STALL_FREE_ROW_TOKENS}",
                        help="comma-separated S:R (stall_free_tokens:stall_free_row_tokens)")
    parser.add_argument("--kernel-backend", choices=["triton", "torch"],
                        help="the model's kernels (default: the device's, engine.ops.default_backend)")
    parser.add_argument("--json", help="also write the results to this file")
    return parser


def main(argv=None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        policies = parse_policies(args.policies)
    except ValueError as e:
        parser.error(f"--policies: {e}")
    if args.prompt_tokens < 1:
        parser.error(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    plan = plan_engine(EngineConfig(model_dir=args.model_dir, max_requests=2, stall_free_tokens=STALL_FREE_TOKENS,
                                    max_seq_len=max(args.prompt_tokens + 64, 4096), prefix_caching=False,
                                    kernel_backend=args.kernel_backend))
    worker = ModelWorker(plan.worker, plan.model_config)
    results = []
    for policy in policies:
        config = dataclasses.replace(plan.scheduler, stall_free_tokens=policy[0], stall_free_row_tokens=policy[1])
        summary = summarise(beside(worker, config, args.prompt_tokens), args.prompt_tokens)
        print(format_summary(policy, summary), flush=True)
        results.append({"policy": list(policy), **summary})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    tune_collector_for_serving()    # as the server's processes (not in main: a test's process keeps its own)
    main()
