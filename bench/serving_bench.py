"""The serving benchmark in one command: our server over HTTP, then the peer on the same tokens.

    python -m bench.serving_bench --model-dir /tmp/llama2-7b --ablation --json out.json
    python -m bench.serving_bench --model-dir /tmp/llama2-7b --num-requests 64 --duration 20 \\
        --workloads batch1,batch,poisson          # a quick run (a few minutes)

Starts `launcher.py --model-id DIR` on a free loopback port and drives it with
`bench.load` (`/generate_stream`, as vLLM's benchmark_serving.py):

  batch1    one request, 128-token prompt, 256 new tokens, sent --batch1-repeats times in
            turn -> decode tokens/s = 1 / TPOT (best run)
  batch     --num-requests requests, prompts uniform 64-512 tokens, 256 new tokens, all
            at once -> output tokens/s
  poisson   Poisson arrivals at --rate requests/s for --duration s, same lengths
            -> TPOT p50/p99, TTFT p50
  ablation  (--ablation) prompts uniform 16-1024, max_new_tokens uniform 16-1024, all at
            once, on a fresh server per `--admission peak|reserve` -> output tokens/s and
            the most rows of any step (/metrics' tgi_batch_next_size)

Then it stops the server and runs the peer (bench/peer.py: transformers `generate` for
batch1, `generate_batch` for batch) and prints ours, the peer and the ratios.

Identical tokens: every prompt is built as text through the server's own `/tokenize`
route (see bench/load.py); the ids that route returned are the token lists the peer
gets, and every stream's `details.input_length` is checked against their length. EOS
finishes are legitimate short answers (counted as "eos early"; the peer ignores EOS),
and throughput counts the tokens actually streamed.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import shlex
import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path

from . import load
from .workloads import Workload

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("batch1", "batch", "poisson")


@dataclass(frozen=True)
class LoadSpec:
    """One HTTP workload: its requests (token lists built through the server) and arrivals."""
    name: str
    prompts: list[load.PromptRequest]
    rate: float = math.inf
    max_concurrency: int | None = None
    peak_batch: bool = False

    def peer_workload(self) -> Workload:
        lengths = {p.max_new_tokens for p in self.prompts}
        if len(lengths) != 1:
            raise ValueError(f"{self.name}: the peer needs one max_new_tokens for all requests, got {len(lengths)}")
        (new_tokens,) = lengths
        return Workload(self.name, [list(p.prompt_ids) for p in self.prompts], new_tokens)


# ---- the server -------------------------------------------------------------------------

def start_server(args: argparse.Namespace, *extra: str):
    """The real launcher (tests.e2e.server keeps the caller's PYTHONPATH)."""
    from tests.e2e.server import LaunchedServer

    server = LaunchedServer(args.model_dir, "--max-concurrent-requests", str(args.max_concurrent_requests),
                            *args.server_arg, *extra)
    print(f"starting the server on {server.url} (log: {server.log_path})", flush=True)
    try:
        return server.wait_healthy(timeout=args.server_timeout)
    except BaseException:
        stop_server(server, args)
        raise


def stop_server(server, args: argparse.Namespace) -> None:
    code = server.stop()
    if args.server_log_dir:     # created if missing: a bench must not lose its results to a missing folder
        Path(args.server_log_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(server.log_path, Path(args.server_log_dir) / f"server-{server.port}.log")
    if code != 0:
        print(f"the server exited with {code}; log: {server.log_path}", flush=True)


def run_spec(url: str, spec: LoadSpec, seed: int) -> load.LoadRun:
    return asyncio.run(load.run_load(url, spec.prompts, spec.rate, seed=seed, max_concurrency=spec.max_concurrency,
                                     peak_batch=spec.peak_batch))


def warm_up(url: str, tokenizer: load.ServerTokenizer) -> None:
    prompts = load.build_requests(tokenizer, [(32, 16)] * 8, seed=99)
    run = asyncio.run(load.run_load(url, prompts))
    failed = [r.error for r in run.results if r.error]
    if failed:
        raise RuntimeError(f"warm-up requests failed: {failed[:3]}")


# ---- our server: batch1, batch, poisson, ablation ----------------------------------------

def build_specs(args: argparse.Namespace, tokenizer: load.ServerTokenizer) -> dict[str, LoadSpec]:
    """The chosen workloads' requests, prompts tokenized by the server (same seed, same tokens)."""
    def requests_of(count, prompt_len, output_len):
        lengths = load.sample_lengths(count, load.parse_length_range(prompt_len),
                                      load.parse_length_range(output_len), args.seed)
        return load.build_requests(tokenizer, lengths, args.seed)

    specs = {}
    if "batch1" in args.workloads:
        specs["batch1"] = LoadSpec("batch1", requests_of(1, str(args.batch1_prompt_len), str(args.batch1_output_len)),
                                   max_concurrency=1)
    if "batch" in args.workloads:
        specs["batch"] = LoadSpec("batch", requests_of(args.num_requests, args.prompt_len, args.output_len),
                                  peak_batch=args.peak_batch == "on")
    if "poisson" in args.workloads:
        count = max(1, round(args.rate * args.duration))
        specs["poisson"] = LoadSpec("poisson", requests_of(count, args.prompt_len, args.output_len), rate=args.rate,
                                    peak_batch=args.peak_batch == "on")
    return specs


def measure(url: str, spec: LoadSpec, args: argparse.Namespace) -> dict:
    """Run one workload (batch1: --batch1-repeats times, the best decode rate kept); print its table."""
    repeats = args.batch1_repeats if spec.name == "batch1" else 1
    runs = [run_spec(url, spec, args.seed) for _ in range(repeats)]
    summaries = [load.summarize_run(run) for run in runs]
    rates = [1.0 / s["tpot_s"]["mean"] if s["tpot_s"]["count"] else 0.0 for s in summaries]
    best = max(range(repeats), key=rates.__getitem__)
    summary = {**summaries[best], "decode_tokens_per_s": rates[best], "decode_tokens_per_s_runs": rates,
               "requests": load.result_records(runs[best].results)}
    print(load.format_summary(f"{spec.name}: {len(spec.prompts)} requests, rate {spec.rate}", summary), flush=True)
    return summary


def run_ours(args: argparse.Namespace) -> tuple[dict[str, LoadSpec], dict]:
    server = start_server(args)
    try:
        tokenizer = load.ServerTokenizer(server.url)
        specs = build_specs(args, tokenizer)
        warm_up(server.url, tokenizer)
        return specs, {name: measure(server.url, spec, args) for name, spec in specs.items()}
    finally:
        stop_server(server, args)


def run_ablation(args: argparse.Namespace) -> dict:
    """The same requests on a fresh server per admission rule; the first server builds them."""
    numbers, prompts = {}, None
    for rule in ("peak", "reserve"):
        server = start_server(args, "--admission", rule)
        try:
            tokenizer = load.ServerTokenizer(server.url)
            if prompts is None:
                lengths = load.sample_lengths(args.ablation_requests, load.parse_length_range(args.ablation_prompt_len),
                                              load.parse_length_range(args.ablation_output_len), args.seed)
                prompts = load.build_requests(tokenizer, lengths, args.seed)
            warm_up(server.url, tokenizer)
            spec = LoadSpec(f"ablation {rule}", prompts, peak_batch=args.peak_batch == "on")
            numbers[rule] = measure(server.url, spec, args)
        finally:
            stop_server(server, args)
    return numbers


# ---- the peer ---------------------------------------------------------------------------

def run_peer(args: argparse.Namespace, specs: dict[str, LoadSpec]) -> dict:
    """transformers on the identical token lists; a failure is recorded, not raised."""
    import torch

    from . import peer

    numbers: dict = {}
    gc.collect()
    model = peer.load(args.model_dir)
    jobs = {"batch1": peer.decode_tokens_per_s, "batch": lambda m, w: peer.batch_tokens_per_s(m, w)[0]}
    for name in [n for n in jobs if n in specs]:
        try:
            numbers[name] = jobs[name](model, specs[name].peer_workload())
        except Exception as e:           # the table still prints ours
            traceback.print_exc()
            numbers[f"{name}_error"] = f"{type(e).__name__}: {e}"
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return numbers


# ---- the table --------------------------------------------------------------------------

def _ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def _number(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"


def table_rows(args: argparse.Namespace, ours: dict, peer_numbers: dict, ablation: dict) -> list[tuple]:
    """(label, ours, peer, ratio) rows of the workloads that ran."""
    rows = []
    if "batch1" in ours:
        value, theirs = ours["batch1"]["decode_tokens_per_s"], peer_numbers.get("batch1")
        rows.append((f"batch-1 decode tok/s ({args.batch1_prompt_len} prompt, {args.batch1_output_len} new)",
                     _number(value), _number(theirs) + " generate", _ratio(value, theirs)))
    if "batch" in ours:
        value, theirs = ours["batch"]["output_throughput"], peer_numbers.get("batch")
        rows.append((f"{args.num_requests} requests output tok/s ({args.prompt_len} prompt, {args.output_len} new)",
                     _number(value), _number(theirs) + " generate_batch", _ratio(value, theirs)))
    if "poisson" in ours:
        s = ours["poisson"]
        rows.append((f"Poisson {args.rate:g} req/s for {args.duration:g} s: TPOT p50 / p99 (ms)",
                     f"{s['tpot_s']['p50'] * 1e3:.1f} / {s['tpot_s']['p99'] * 1e3:.1f}", "-", "-"))
        rows.append((f"Poisson {args.rate:g} req/s: TTFT p50 (ms), output tok/s",
                     f"{s['ttft_s']['p50'] * 1e3:.1f}, {s['output_throughput']:.1f}", "-", "-"))
    for rule, s in ablation.items():
        rows.append((f"ablation --admission {rule}: output tok/s, peak batch",
                     f"{s['output_throughput']:.1f}, {_number(s['peak_batch_size'])}", "-", "-"))
    if len(ablation) == 2:
        rows.append(("ablation peak / reserve output tok/s", "", "", _ratio(ablation["peak"]["output_throughput"],
                                                                            ablation["reserve"]["output_throughput"])))
    return rows


def format_table(args: argparse.Namespace, ours: dict, peer_numbers: dict, ablation: dict) -> str:
    lines = [f"{'workload':66} {'ours':>16} {'transformers':>24} {'ratio':>7}"]
    lines += [f"{label:66} {value:>16} {theirs:>24} {ratio:>7}"
              for label, value, theirs, ratio in table_rows(args, ours, peer_numbers, ablation)]
    runs = {**ours, **{f"ablation {rule}": s for rule, s in ablation.items()}}
    lines += [f"{name}: {s['completed']} completed, {s['failed']} failed, {s['eos_early']} EOS-finished early, "
              f"{s['mismatches']} token-count mismatches" for name, s in runs.items()]
    lines += [f"peer {key}: {value}" for key, value in peer_numbers.items() if key.endswith("_error")]
    return "\n".join(lines)


# ---- command line -----------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.serving_bench", description=__doc__,
                                     formatter_class=load.HelpFormatter)
    parser.add_argument("--model-dir", required=True, help="checkpoint directory with a tokenizer (e.g. a random "
                                                           "Llama-2-7B from weights.random_checkpoint)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)} ('' for none, e.g. with --ablation)")
    parser.add_argument("--ablation", action="store_true",
                        help="also run the router ablation on two fresh servers, --admission peak and reserve")
    parser.add_argument("--batch1-prompt-len", type=int, default=128, help="batch1: prompt tokens")
    parser.add_argument("--batch1-output-len", type=int, default=256, help="batch1: new tokens")
    parser.add_argument("--batch1-repeats", type=int, default=3, help="batch1: runs in turn; the best is kept")
    parser.add_argument("--num-requests", type=int, default=512, help="batch: requests sent at once")
    parser.add_argument("--prompt-len", default="64-512", help="batch and poisson: prompt tokens, 'n' or 'a-b'")
    parser.add_argument("--output-len", default="256", help="batch and poisson: new tokens, 'n' or 'a-b' "
                                                           "(the peer needs one number)")
    parser.add_argument("--rate", type=float, default=8.0, help="poisson: arrivals per second")
    parser.add_argument("--duration", type=float, default=120.0, help="poisson: seconds of arrivals "
                                                                      "(rate x duration requests)")
    parser.add_argument("--ablation-requests", type=int, default=512, help="ablation: requests sent at once")
    parser.add_argument("--ablation-prompt-len", default="16-1024", help="ablation: prompt tokens")
    parser.add_argument("--ablation-output-len", default="16-1024", help="ablation: max_new_tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed of lengths, prompt words and arrivals")
    parser.add_argument("--peak-batch", choices=["on", "off"], default="on",
                        help="the most rows (requests) of any step of each load, from /metrics' step-size "
                             "histogram read before and after it (two scrapes, outside the timed run)")
    parser.add_argument("--max-concurrent-requests", type=int, default=1024, help="the launcher's flag")
    parser.add_argument("--server-args", default="", help="more launcher flags, one string "
                                                           "(e.g. '--max-batch-total-tokens 200000')")
    parser.add_argument("--server-timeout", type=float, default=1200.0, help="seconds to wait for /health")
    parser.add_argument("--server-log-dir", help="copy each server's log here")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument("--json", help="write every number (and per-request records) to this file")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {','.join(WORKLOADS)}")
    args.server_arg = shlex.split(args.server_args)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    specs, ours = run_ours(args) if args.workloads else ({}, {})
    ablation = run_ablation(args) if args.ablation else {}
    peer_numbers = {} if args.no_peer or not specs else run_peer(args, specs)
    table = format_table(args, ours, peer_numbers, ablation)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ours": ours, "peer": peer_numbers, "ablation": ablation,
                       "table": table.splitlines()}, f, indent=1)
    print("\n" + table, flush=True)
    return {"ours": ours, "peer": peer_numbers, "ablation": ablation}


if __name__ == "__main__":
    main()
