"""Speculative decoding (--speculate): what it gains and what a verify step costs.

    python -m bench.spec_bench demo [--new-tokens 256]                 # batch-1 tokens/s, speculate 0 vs 4
    python -m bench.spec_bench verify --model-dir /tmp/llama2-7b       # verify step vs plain decode step
    python -m bench.spec_bench load --model-dir /tmp/llama2-7b         # random prompts, speculate 0 vs 2

demo: the bundled demo model, one request at a time, on prompts that quote their input ("the same
function, renamed": real standard-library sources read with inspect.getsource, then the first line
of the renamed copy); output tokens/s of the decode phase with --speculate 0 and 4, their ratio and
the acceptance rate (accepted / drafted tokens).
verify: B requests prefilled to --context tokens; the wall time of one ``ModelWorker.execute`` of a
plain decode step ([FED_BACK] per row) and of a verify step (4 drafts per row), and their ratio.
load: N random prompts (no repetition to find) all queued at once, output tokens/s with --speculate
0 and 2 (drafts rarely hit: the cost of trying).
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import time
from pathlib import Path

import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import FED_BACK, SamplingParams, Step, StepRow

DEMO = Path(__file__).resolve().parents[1] / "weights" / "demo"


def stdlib_functions() -> list:
    """Python-level standard-library functions (their sources ship with Python)."""
    import calendar, colorsys, fnmatch, glob, heapq, shutil, statistics, string, textwrap  # noqa: E401
    return [textwrap.dedent, textwrap.indent, string.capwords, shutil.copyfileobj, fnmatch.filter,
            colorsys.rgb_to_hsv, colorsys.hsv_to_rgb, statistics.mean, glob.has_magic, calendar.isleap,
            heapq.nsmallest, calendar.monthrange]


def rename_prompt(tokenizer, function) -> list[int]:
    """A function's source, then the start of its copy under a new name (the model may quote it)."""
    source, name = inspect.getsource(function), function.__name__
    renamed = source.replace(f"def {name}(", f"def renamed_{name}(", 1)
    return tokenizer(f"{source}\n\n# The same function, renamed to renamed_{name}:\n{renamed.splitlines()[0]}\n")[
        "input_ids"]


def decode_tokens_per_s(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    """One request at a time: tokens after the first over the time from the first to the last."""
    tokens, seconds, outputs = 0, 0.0, []
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(i, prompt, new_tokens, SamplingParams(), stop_token_ids=[]))
        stamps, out = [], []
        while engine.has_work():
            for event in engine.step():
                stamps.append(time.perf_counter())
                out.append(event.token_id)
        tokens += len(stamps) - 1
        seconds += stamps[-1] - stamps[0]
        outputs.append(out)
    return tokens / seconds, outputs


def demo(args) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    prompts = [rename_prompt(tokenizer, f) for f in stdlib_functions()]
    results, outputs = {}, {}
    for speculate in (0, 4):
        engine = Engine(EngineConfig(model_dir=str(DEMO), max_requests=8, speculate=speculate))
        decode_tokens_per_s(engine, prompts[:2], 32)                       # warm-up (compiles)
        engine.router.scheduler.speculation.drafted_tokens = engine.router.scheduler.speculation.accepted_tokens = 0
        rate, outputs[speculate] = decode_tokens_per_s(engine, prompts, args.new_tokens)
        stats = engine.router.scheduler.speculation
        results[speculate] = {"tokens_per_s": round(rate, 1), "drafted": stats.drafted_tokens,
                              "accepted": stats.accepted_tokens}
        engine.close()
        del engine
        gc.collect()
    spec = results[4]
    summary = {"speculate0_tokens_per_s": results[0]["tokens_per_s"], "speculate4_tokens_per_s": spec["tokens_per_s"],
               "speedup": round(spec["tokens_per_s"] / results[0]["tokens_per_s"], 3),
               "acceptance_rate": round(spec["accepted"] / max(spec["drafted"], 1), 3),
               "accepted_per_step_bonus_excluded": spec["accepted"], "drafted": spec["drafted"],
               "outputs_identical": outputs[0] == outputs[4]}
    print(f"demo batch 1 ({len(prompts)} rename prompts x {args.new_tokens} tokens): speculate 0 "
          f"{summary['speculate0_tokens_per_s']} tokens/s, speculate 4 {summary['speculate4_tokens_per_s']} tokens/s, "
          f"speed-up {summary['speedup']}x, acceptance {summary['acceptance_rate']}, identical "
          f"{summary['outputs_identical']}")
    return summary


def verify(args) -> dict:
    from bench.profile_step import DecodeFixture
    from engine.models import load_model_config
    from engine.worker.model_worker import ModelWorker, WorkerConfig, resolve_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = load_model_config(args.model_dir)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    worker = ModelWorker(WorkerConfig(
        model_dir=args.model_dir, dtype=resolve_dtype(None, config, device), device=device,
        kernel_backend="triton" if device.type == "cuda" else "torch", max_requests=max(sizes),
        max_seq_len=args.context + 8 * args.repeats + 64, warmup_tokens=max(4096, 5 * max(sizes)), speculate=4))
    results = []
    for batch_size in sizes:
        fixture = DecodeFixture(worker, batch_size, args.context, first_id=batch_size * 100_000)
        plain = _step_ms(worker, lambda: fixture.next_step(), args.repeats)
        verify_ms = _step_ms(worker, lambda: _verify_step(fixture, drafts=4), args.repeats)
        fixture.close()
        results.append({"batch_size": batch_size, "decode_ms": round(plain, 3), "verify4_ms": round(verify_ms, 3),
                        "ratio": round(verify_ms / plain, 3)})
        print(f"batch {batch_size}, context {args.context}: decode step {plain:.3f} ms, verify step (4 drafts) "
              f"{verify_ms:.3f} ms, ratio {verify_ms / plain:.3f}")
    return {"verify": results}


def _verify_step(fixture, drafts: int) -> Step:
    """Every row feeds its newest token and ``drafts`` tokens (arbitrary: the cost does not depend on
    them); the slots past the one kept are given back, as the router truncates rejected drafts."""
    rows = []
    for request_id in fixture.ids:
        pos = fixture.positions[request_id]
        fixture.allocator.truncate(request_id, pos)
        rows.append(StepRow(request_id, fixture.allocator.row(request_id), pos,
                            [FED_BACK] + [(request_id + j) % 300 + 10 for j in range(drafts)],
                            fixture.allocator.allocate(request_id, 1 + drafts), sample=True))
        fixture.positions[request_id] = pos + 1
    return Step(rows=rows)


def _step_ms(worker, make_step, repeats: int) -> float:
    for _ in range(3):
        worker.execute(make_step())          # warm-up (compiles)
    times = []
    for _ in range(repeats):
        step = make_step()
        if worker.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        worker.execute(step)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def load(args) -> dict:
    from engine.models import load_model_config

    from .workloads import many

    vocab = load_model_config(args.model_dir).vocab_size
    workload = many(vocab, count=args.requests, new_tokens=args.new_tokens)
    results = {}
    for speculate in (0, 2):
        engine = Engine(EngineConfig(model_dir=args.model_dir, speculate=speculate))
        engine.generate([GenerationRequest(-1, workload.prompts[0], 8, SamplingParams(), stop_token_ids=[])])
        requests = [GenerationRequest(i, p, workload.max_new_tokens, SamplingParams(), stop_token_ids=[])
                    for i, p in enumerate(workload.prompts)]
        start = time.perf_counter()
        generated = sum(len(v) for v in engine.generate(requests).values())
        results[speculate] = generated / (time.perf_counter() - start)
        stats = engine.router.scheduler.speculation
        print(f"{args.requests} random prompts, speculate {speculate}: {results[speculate]:.1f} output tokens/s "
              f"(drafted {stats.drafted_tokens}, accepted {stats.accepted_tokens})")
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    ratio = results[2] / results[0]
    print(f"speculate 2 / speculate 0 throughput: {ratio:.3f}")
    return {"load_tokens_per_s": {str(k): round(v, 1) for k, v in results.items()}, "load_ratio": round(ratio, 3)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["demo", "verify", "load"])
    parser.add_argument("--model-dir", help="checkpoint directory (verify, load)")
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens per request")
    parser.add_argument("--batch-sizes", default="1,32", help="verify: comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=512, help="verify: tokens each request holds")
    parser.add_argument("--repeats", type=int, default=20, help="verify: timed steps per measurement")
    parser.add_argument("--requests", type=int, default=64, help="load: requests queued at once")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    if args.what != "demo" and not args.model_dir:
        parser.error(f"{args.what} needs --model-dir")
    result = {"demo": demo, "verify": verify, "load": load}[args.what](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
