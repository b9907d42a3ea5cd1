"""The quantized KV cache on a GPU (issue 17's proof), each ``--kv-cache-dtype`` beside the model's dtype.

    python -m bench.kv_quant_bench --model-dir /tmp/llama2-7b --long-model-dir /tmp/llama31-8b --json out.json

Phases (``--phases``, all by default), every server the real launcher over HTTP:

  serve   per KV dtype, on --model-dir: the KV slots (/info), the 512-request load (bench.serving_bench's
          ``batch``: prompts 64-512, 256 new, all at once, --max-concurrent-requests 1024) and batch-1
          decode (128-token prompt, 256 new; best of 3) -> slots, output tokens/s, decode tokens/s and
          their ratios to the unquantized cache's
  long    per --long-kv-dtypes, on --long-model-dir: one --long-tokens prompt, then --long-new tokens decoded
          -> decode tokens/s (1 / TPOT) and the ratio to the unquantized cache's
  drift   in-process, --model-dir in float32: 4 prompts' greedy 64 tokens with the unquantized cache,
          then each KV dtype scores the same tokens (prompt logprobs, teacher forced) -> the mean and
          max |logprob difference| over the new tokens

Targets (issue 17): slots >= 1.9x, the 512-request load >= 9,500 output tokens/s with int8 or fp8,
batch-1 decode within 3% of bfloat16's, 100k-context decode >= 1.5x.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
import urllib.request

from . import load
from .serving_bench import build_specs, measure, start_server, stop_server, warm_up

PLAIN = "auto"            # the model's dtype: no --kv-cache-dtype
DRIFT_PROMPTS = ("The history of the city begins", "def quicksort(items):\n", "Q: What is the capital of France?\nA:",
                 "Once upon a time, in a small village,")


def server_flags(kv: str) -> list[str]:
    return [] if kv == PLAIN else ["--kv-cache-dtype", kv]


def serve_phase(args: argparse.Namespace, kv: str) -> dict:
    """Slots, the 512-request load and batch-1 decode on one server with this KV dtype."""
    run_args = argparse.Namespace(**{**vars(args), "workloads": ("batch1", "batch")})
    server = start_server(run_args, *server_flags(kv))
    try:
        with urllib.request.urlopen(server.url + "/info", timeout=10) as response:
            info = json.loads(response.read())
        tokenizer = load.ServerTokenizer(server.url)
        specs = build_specs(run_args, tokenizer)
        warm_up(server.url, tokenizer)
        numbers = {name: measure(server.url, spec, run_args) for name, spec in specs.items()}
    finally:
        stop_server(server, run_args)
    return {"kv_cache_dtype": info.get("kv_cache_dtype"), "slots": info.get("kv_cache_slots"),
            "batch_output_tokens_per_s": numbers["batch"]["output_throughput"],
            "batch_failed": numbers["batch"]["failed"], "batch1_decode_tokens_per_s":
                numbers["batch1"]["decode_tokens_per_s"]}


def long_phase(args: argparse.Namespace, kv: str) -> dict:
    """Decode speed after one --long-tokens prompt on --long-model-dir."""
    run_args = argparse.Namespace(**{**vars(args), "model_dir": args.long_model_dir})
    total = args.long_tokens + args.long_new + 64
    server = start_server(run_args, "--max-input-tokens", str(args.long_tokens + 32), "--max-total-tokens", str(total),
                          *server_flags(kv))
    try:
        tokenizer = load.ServerTokenizer(server.url)
        warm_up(server.url, tokenizer)
        prompt = load.build_requests(tokenizer, [(args.long_tokens, args.long_new)], seed=args.seed + 7)
        run = asyncio.run(load.run_load(server.url, prompt))
        summary = load.summarize_run(run)
    finally:
        stop_server(server, run_args)
    if summary["failed"]:
        raise RuntimeError(f"the {args.long_tokens}-token request failed: {summary['errors']}")
    return {"ttft_s": summary["ttft_s"]["p50"], "decode_tokens_per_s": 1.0 / summary["tpot_s"]["mean"]}


def drift_phase(args: argparse.Namespace, kv_dtypes: list[str]) -> dict:
    """float32 model: each KV dtype's logprobs of the unquantized cache's greedy tokens (teacher forced)."""
    import transformers

    from engine.generation import Engine, EngineConfig, GenerationRequest
    from engine.protocol.messages import SamplingParams

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    prompts = [tokenizer(p)["input_ids"] for p in DRIFT_PROMPTS]

    def engine(kv: str | None) -> Engine:
        return Engine(EngineConfig(model_dir=args.model_dir, dtype="float32", kv_cache_dtype=kv, num_slots=8192,
                                   max_requests=8, cuda_graphs=()))

    reference = engine(None)
    out = reference.generate([GenerationRequest(i, p, args.drift_new, stop_token_ids=[])
                              for i, p in enumerate(prompts)])
    full = [p + [e.token_id for e in out[i]] for i, p in enumerate(prompts)]

    def scores(eng: Engine) -> list[list[float]]:
        res = eng.generate([GenerationRequest(i, ids, 1, SamplingParams(prompt_logprobs=True))
                            for i, ids in enumerate(full)])
        return [res[i][0].prompt_logprobs[len(prompts[i]):] for i in range(len(full))]

    base = scores(reference)
    release(reference)
    drift = {}
    for kv in kv_dtypes:
        eng = engine(kv)
        diffs = [abs(a - b) for got, want in zip(scores(eng), base) for a, b in zip(got, want)]
        release(eng)
        drift[kv] = {"mean_abs": sum(diffs) / len(diffs), "max_abs": max(diffs), "tokens": len(diffs)}
        print(f"drift {kv}: mean |dlogprob| {drift[kv]['mean_abs']:.4f}, max {drift[kv]['max_abs']:.4f} over "
              f"{len(diffs)} tokens", flush=True)
    return drift


def release(engine) -> None:
    """Free an engine's device memory before the next one loads (float32 7B: 27 GB each)."""
    import torch

    engine.close()
    engine.worker = engine.router = engine.allocator = None
    gc.collect()
    torch.cuda.empty_cache()


def ratios(results: dict, phase: str, key: str) -> dict:
    plain = results[phase].get(PLAIN, {}).get(key)
    return {kv: (r[key] / plain if plain else None) for kv, r in results[phase].items()
            if kv != PLAIN and not kv.startswith("ratio_")}


def build_parser() -> argparse.ArgumentParser:
    """The command line; ``parse_args`` adds the fixed settings bench.serving_bench's functions read."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, help="serve and drift: e.g. the random Llama-2-7B")
    parser.add_argument("--long-model-dir", help="long: e.g. the random Llama-3.1-8B")
    parser.add_argument("--kv-dtypes", default="int8,fp8_e4m3fn",
                        help="serve and drift: comma-separated quantized KV dtypes, each beside the model's "
                             "(default: %(default)s)")
    parser.add_argument("--phases", default="serve,long,drift",
                        help="comma-separated phases, run in this order: serve (per KV dtype on --model-dir: KV "
                             "slots, the --num-requests load, batch-1 decode), long (per --long-kv-dtypes on "
                             "--long-model-dir: decode after one --long-tokens prompt), drift (in-process, float32: "
                             "each KV dtype's logprobs of the unquantized cache's greedy tokens) "
                             "(default: %(default)s)")
    parser.add_argument("--long-kv-dtypes", default="int8", help="long: quantized KV dtypes (each a server start "
                        "and a 100k-token prefill, about a minute: the default keeps the GPU stage near 9 minutes) "
                        "(default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=512,
                        help="serve: requests of the load, sent at once (default: %(default)s)")
    parser.add_argument("--prompt-len", default="64-512",
                        help="serve: the load's prompt tokens, 'n' or a range 'a-b' (uniform, both ends included) "
                             "(default: %(default)s)")
    parser.add_argument("--output-len", default="256",
                        help="serve: the load's max_new_tokens, 'n' or a range 'a-b' (default: %(default)s)")
    parser.add_argument("--batch1-prompt-len", type=int, default=128,
                        help="serve: batch-1 decode's prompt tokens (default: %(default)s)")
    parser.add_argument("--batch1-output-len", type=int, default=256,
                        help="serve: batch-1 decode's new tokens (default: %(default)s)")
    parser.add_argument("--batch1-repeats", type=int, default=3,
                        help="serve: batch-1 runs, one after the other; the best decode tokens/s is kept "
                             "(default: %(default)s)")
    parser.add_argument("--long-tokens", type=int, default=100_000,
                        help="long: tokens of the one prompt; the server gets --max-input-tokens this + 32 "
                             "(default: %(default)s)")
    parser.add_argument("--long-new", type=int, default=128,
                        help="long: tokens decoded after the prompt; their mean TPOT gives decode tokens/s "
                             "(default: %(default)s)")
    parser.add_argument("--drift-new", type=int, default=64,
                        help="drift: greedy tokens per prompt with the unquantized cache, which each KV dtype then "
                             "scores (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="serve: seed of the load's lengths and prompt words; long: its prompt's words use "
                             "seed + 7 (default: %(default)s)")
    parser.add_argument("--max-concurrent-requests", type=int, default=1024,
                        help="serve and long: the launcher's flag (default: %(default)s)")
    parser.add_argument("--server-timeout", type=float, default=600.0,
                        help="seconds to wait for each server's /health (default: %(default)s)")
    parser.add_argument("--server-log-dir", help="copy each server's log here (the folder is made if missing)")
    parser.add_argument("--json", help="also write every phase's numbers and seconds to this file")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.peak_batch, args.rate, args.duration, args.server_arg = "on", 8.0, 0.0, []
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    phases = args.phases.split(",")
    quantized = [kv for kv in args.kv_dtypes.split(",") if kv]
    results: dict = {"serve": {}, "long": {}, "drift": {}, "seconds": {}}
    for phase in phases:
        start = time.monotonic()
        if phase == "serve":
            for kv in (PLAIN, *quantized):
                results["serve"][kv] = serve_phase(args, kv)
                print(f"serve {kv}: {results['serve'][kv]}", flush=True)
            for key in ("slots", "batch_output_tokens_per_s", "batch1_decode_tokens_per_s"):
                results["serve"][f"ratio_{key}"] = ratios(results, "serve", key)
        elif phase == "long":
            if not args.long_model_dir:
                raise SystemExit("the long phase needs --long-model-dir")
            for kv in (PLAIN, *[k for k in args.long_kv_dtypes.split(",") if k]):
                results["long"][kv] = long_phase(args, kv)
                print(f"long {kv}: {results['long'][kv]}", flush=True)
            results["long"]["ratio_decode"] = ratios(results, "long", "decode_tokens_per_s")
        elif phase == "drift":
            results["drift"] = drift_phase(args, quantized)
        else:
            raise SystemExit(f"unknown phase {phase!r}; choose from serve, long, drift")
        results["seconds"][phase] = time.monotonic() - start
    print(json.dumps({k: v for k, v in results.items()}, indent=1, default=str), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()
