"""Long prompts beside decoding streams, through HTTP, on one launched server.

    python -m bench.long_prompt_bench --model-dir /tmp/llama31-8b --json out.json
    python -m bench.long_prompt_bench --model-dir weights/demo --max-input-tokens 1500 --long 300,1200 \\
        --beside-tokens 1200 --mixed-requests 6 --mixed-prompt 100-400 --mixed-new 8    # a CPU smoke run

  startup  the KV slots the server reported (its log line ``KV cache: N slots``)
  long     TTFT of one prompt of each --long length, alone, one after the other (a length given twice: twice)
  beside   a batch-1 stream (short prompt, greedy): its inter-token latencies while idle, then
           while a --beside-tokens prompt is prefilled beside it (from that prompt's send to its
           first token): ITL p50/p99 and TPOT of both, and the long prompt's TTFT
  mixed    --mixed-requests requests at once, prompts --mixed-prompt tokens (uniform), --mixed-new
           new tokens each: TTFT p50/p99, ITL p50/p99, TPOT p50

The server runs with ``--max-input-tokens`` and ``--max-total-tokens`` (= it + --stream-new
+ 64) plus --server-args. ``LAUNCHER_REPO=<tree>`` serves another tree's launcher (a
before/after comparison in one run). Every prompt is built to an exact token count with the
server's own tokenizer (different words for each, so the prefix cache finds nothing to share).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import time
from pathlib import Path

import aiohttp

from . import load
from .serving_bench import start_server, stop_server, warm_up


def one_prompt(tokenizer: load.ServerTokenizer, tokens: int, new_tokens: int, seed: int) -> load.PromptRequest:
    return load.build_requests(tokenizer, [(tokens, new_tokens)], seed=seed)[0]


def timed(url: str, prompts: list[load.PromptRequest]) -> dict:
    """All at once; the load summary (TTFT, ITL, TPOT...)."""
    run = asyncio.run(load.run_load(url, prompts))
    failed = [r.error for r in run.results if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:2]}")
    return load.summarize_run(run)


async def _stream_until(session, url: str, request: load.PromptRequest, times: list[float],
                        stop: asyncio.Event) -> None:
    """Stream ``request``, appending each token's arrival time, until ``stop`` (then disconnect)."""
    async with session.post(url + "/generate_stream", json=load.generate_body(request)) as response:
        if response.status != 200:
            raise RuntimeError(f"stream: HTTP {response.status}: {(await response.text())[:200]}")
        async for raw in response.content:
            if raw.startswith(b"data:"):
                if b'"error"' in raw[:40]:
                    raise RuntimeError(f"stream: {raw[:200]!r}")
                times.append(time.perf_counter())
            if stop.is_set():
                return
    raise RuntimeError(f"the stream ended after {len(times)} tokens, before the long prompt's first token: "
                       f"raise --stream-new")


async def _beside(url: str, stream: load.PromptRequest, long: load.PromptRequest, idle_tokens: int) -> dict:
    times: list[float] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=load.HTTP_TIMEOUT_S)) as session:
        streaming = asyncio.create_task(_stream_until(session, url, stream, times, stop))
        while len(times) < idle_tokens:
            if streaming.done():
                await streaming
            await asyncio.sleep(0.005)
        idle_end = times[-1]
        result = load.RequestResult(0, long.prompt_len, long.max_new_tokens)
        await load.send_request(session, url, long, result)
        await asyncio.sleep(0.2)
        stop.set()
        await streaming
    if result.error:
        raise RuntimeError(f"the long prompt failed: {result.error}")
    first_token = result.token_times[0]
    idle = [b - a for a, b in zip(times, times[1:]) if b <= idle_end][8:]     # past the first tokens
    during = [b - a for a, b in zip(times, times[1:]) if result.send_time < b <= first_token]
    return {"long_ttft_s": result.ttft, "idle_itl_s": load.describe(idle), "during_itl_s": load.describe(during),
            "during_tokens": len(during), "during_gaps_ms": [round(gap * 1000, 2) for gap in during]}


def beside(url: str, stream: load.PromptRequest, long: load.PromptRequest, idle_tokens: int = 64) -> dict:
    return asyncio.run(_beside(url, stream, long, idle_tokens))


def kv_slots(log_path: str) -> int | None:
    found = re.findall(r"KV cache: (\d+) slots", Path(log_path).read_text(errors="replace"))
    return int(found[-1]) if found else None


def run(args: argparse.Namespace) -> dict:
    server_args = ["--max-input-tokens", str(args.max_input_tokens),
                   "--max-total-tokens", str(args.max_input_tokens + args.stream_new + 64), *args.server_arg]
    server = start_server(args, *server_args)
    try:
        url = server.url
        tokenizer = load.ServerTokenizer(url)
        warm_up(url, tokenizer)
        timed(url, [one_prompt(tokenizer, min(4096, args.max_input_tokens // 2), 1, seed=98)])   # prefill kernels
        results = {"kv_slots": kv_slots(server.log_path), "long": {}}
        for i, tokens in enumerate(args.long):
            summary = timed(url, [one_prompt(tokenizer, tokens, 1, seed=100 + i)])
            results["long"].setdefault(str(tokens), []).append(summary["ttft_s"]["p50"])   # a length given twice: both
            print(f"one {tokens}-token prompt: TTFT {summary['ttft_s']['p50']:.3f} s", flush=True)
        stream = one_prompt(tokenizer, 32, args.stream_new, seed=200)
        results["beside"] = beside(url, stream, one_prompt(tokenizer, args.beside_tokens, 1, seed=201))
        b = results["beside"]
        print(f"batch-1 stream: idle ITL p50 {b['idle_itl_s']['p50'] * 1000:.1f} ms p99 "
              f"{b['idle_itl_s']['p99'] * 1000:.1f} ms; beside a {args.beside_tokens}-token prefill "
              f"({b['long_ttft_s']:.2f} s to its first token, {b['during_tokens']} stream tokens meanwhile): ITL "
              f"p50 {b['during_itl_s']['p50'] * 1000:.1f} ms p99 {b['during_itl_s']['p99'] * 1000:.1f} ms, "
              f"mean {b['during_itl_s']['mean'] * 1000:.1f} ms; {sum(g < 1 for g in b['during_gaps_ms'])} gaps "
              f"under 1 ms (tokens delivered together)", flush=True)
        lengths = load.sample_lengths(args.mixed_requests, load.parse_length_range(args.mixed_prompt),
                                      (args.mixed_new, args.mixed_new), seed=args.seed)
        results["mixed"] = timed(url, load.build_requests(tokenizer, lengths, seed=300))
        print(load.format_summary(f"{args.mixed_requests} at once, prompts {args.mixed_prompt}", results["mixed"]),
              flush=True)
    finally:
        stop_server(server, args)
    return results


def format_table(r: dict, args: argparse.Namespace) -> str:
    b, m = r["beside"], r["mixed"]
    ms = lambda s: f"{s * 1000:.1f}"    # noqa: E731
    lines = [f"KV slots at startup: {r['kv_slots']}"]
    lines += [f"TTFT of one {n}-token prompt: {', '.join(f'{t:.3f}' for t in ts)} s" for n, ts in r["long"].items()]
    lines.append(f"batch-1 stream beside a {args.beside_tokens}-token prefill: ITL p99 {ms(b['during_itl_s']['p99'])}"
                 f" ms (idle TPOT {ms(b['idle_itl_s']['mean'])} ms, ratio "
                 f"{b['during_itl_s']['p99'] / b['idle_itl_s']['mean']:.2f}x); the prefill's TTFT "
                 f"{b['long_ttft_s']:.2f} s")
    lines.append(f"mixed ({args.mixed_requests} at once, {args.mixed_prompt} tokens, {args.mixed_new} new): TTFT p50 "
                 f"{m['ttft_s']['p50']:.2f} s p99 {m['ttft_s']['p99']:.2f} s; ITL p50 {ms(m['itl_s']['p50'])} ms "
                 f"p99 {ms(m['itl_s']['p99'])} ms; TPOT p50 {ms(m['tpot_s']['p50'])} ms; "
                 f"{m['output_throughput']:.0f} output tokens/s")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line; ``parse_args`` splits --long and --server-args."""
    parser = argparse.ArgumentParser(prog="python -m bench.long_prompt_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="checkpoint directory with a tokenizer")
    parser.add_argument("--max-input-tokens", type=int, default=120_000,
                        help="the launcher's flag; --max-total-tokens is this + --stream-new + 64 "
                             "(default: %(default)s)")
    parser.add_argument("--long", default="32000,100000",
                        help="long: prompt lengths, comma-separated (default: %(default)s)")
    parser.add_argument("--beside-tokens", type=int, default=100_000,
                        help="beside: the long prompt's tokens (default: %(default)s)")
    parser.add_argument("--stream-new", type=int, default=4000,
                        help="beside: the stream's max_new_tokens (it is cut once the long prompt answered) "
                             "(default: %(default)s)")
    parser.add_argument("--mixed-requests", type=int, default=64,
                        help="mixed: requests sent at once (default: %(default)s)")
    parser.add_argument("--mixed-prompt", default="2000-16000",
                        help="mixed: prompt tokens, 'n' or a range 'a-b' (uniform) (default: %(default)s)")
    parser.add_argument("--mixed-new", type=int, default=128,
                        help="mixed: max_new_tokens of each request (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="mixed: seed of the prompt lengths (every prompt's words have a fixed seed of their "
                             "own) (default: %(default)s)")
    parser.add_argument("--max-concurrent-requests", type=int, default=1024,
                        help="the launcher's flag (default: %(default)s)")
    parser.add_argument("--server-args", default="", help="more launcher flags, one string")
    parser.add_argument("--server-timeout", type=float, default=1200.0,
                        help="seconds to wait for the server's /health (default: %(default)s)")
    parser.add_argument("--server-log-dir", help="copy the server's log here")
    parser.add_argument("--json", help="also write the arguments, the results and the table to this file")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.long = [int(n) for n in args.long.split(",") if n]
    args.server_arg = shlex.split(args.server_args)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = run(args)
    table = format_table(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "results": results,
                       "table": table.splitlines()}, f, indent=1)
    print("\n" + table, flush=True)
    return results


if __name__ == "__main__":
    main()
