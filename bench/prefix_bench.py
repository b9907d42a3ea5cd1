"""Prefix-cache workloads through HTTP, on a server with the cache on and one with it off.

    python -m bench.prefix_bench --model-dir /tmp/llama2-7b --json out.json
    python -m bench.prefix_bench --model-dir weights/demo --shared-requests 8 --prefix-len 200 \\
        --conversations 2 --turns 2 --turn-words 20 --new-tokens 8        # a CPU smoke run

  shared     --shared-requests requests sent at once, each a --prefix-len-token prefix (the
             same for all) plus 16-64 unique words, --new-tokens new tokens each
             -> TTFT p50/p99, output tokens/s; --more-bursts K: K more such bursts on the same
             (warm) server, each behind a prefix of its own -> the spread of their TTFT p50
  multiturn  --conversations chats of --turns turns each, all chats at once, each chat's
             turns one after the other: a turn's prompt is the previous prompt, its answer
             and --turn-words new words -> TTFT p50/p99 of each turn

Each workload runs on a fresh server with `--prefix-caching true`, then on one with
`--prefix-caching false` (`--cache on|off` runs one of them); the table puts them side by
side, with the server's own step numbers after the shared-prefix load (`/metrics`: steps,
mean forward time of prefill and decode steps, mean queue time). `LAUNCHER_REPO=<tree>`
serves another tree's launcher (a before/after comparison in one run).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import aiohttp
import requests

from . import load
from .serving_bench import start_server, stop_server


def shared_prefix_requests(tokenizer: load.ServerTokenizer, args) -> list[load.PromptRequest]:
    """One long common prefix, then a few unique words per request (exact token lists via /tokenize)."""
    pool, rng = load.single_token_words(tokenizer.tokens), random.Random(args.seed)
    prefix, _ = load.build_prompt(args.prefix_len, pool, rng, tokenizer.ids)
    requests = []
    for _ in range(args.shared_requests):
        text = prefix + " " + " ".join(rng.choice(pool) for _ in range(rng.randint(16, 64)))
        requests.append(load.PromptRequest(text, tuple(tokenizer.ids(text)), args.new_tokens))
    return requests


async def stream_text(session: aiohttp.ClientSession, url: str, text: str, new_tokens: int) -> tuple[float, str]:
    """(TTFT in seconds, the generated text) of one streamed request."""
    body = {"inputs": text, "parameters": {"max_new_tokens": new_tokens, "do_sample": False}}
    start, first, answer = time.perf_counter(), None, ""
    async with session.post(url + "/generate_stream", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            first = first or time.perf_counter()
            answer = event.get("generated_text") or answer
    return first - start, answer


async def one_conversation(session, url: str, words: list[str], rng: random.Random, args) -> list[float]:
    prompt, ttfts = "", []
    for _ in range(args.turns):
        prompt += " " + " ".join(rng.choice(words) for _ in range(args.turn_words))
        ttft, answer = await stream_text(session, url, prompt.strip(), args.new_tokens)
        ttfts.append(ttft)
        prompt += answer
    return ttfts


async def multiturn(url: str, words: list[str], args) -> list[list[float]]:
    """TTFTs per turn: result[t] holds turn t's TTFT of every conversation."""
    timeout = aiohttp.ClientTimeout(total=load.HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        chats = [one_conversation(session, url, words, random.Random(args.seed + i), args)
                 for i in range(args.conversations)]
        per_chat = await asyncio.gather(*chats)
    return [list(turn) for turn in zip(*per_chat)]


def run_on_server(args, caching: bool) -> dict:
    server = start_server(args, "--prefix-caching", "true" if caching else "false")
    try:
        tokenizer = load.ServerTokenizer(server.url)
        shared = load.summarize_run(asyncio.run(load.run_load(server.url, shared_prefix_requests(tokenizer, args))))
        shared["server"] = server_step_numbers(server.url)
        more = [load.summarize_run(asyncio.run(load.run_load(server.url, shared_prefix_requests(
            tokenizer, argparse.Namespace(**{**vars(args), "seed": args.seed + 1 + i}))))) for i in range(args.more_bursts)]
        turns = asyncio.run(multiturn(server.url, load.single_token_words(tokenizer.tokens), args))
    finally:
        stop_server(server, args)
    return {"shared": shared, "more_shared": more, "multiturn_ttft_s": [load.describe(turn) for turn in turns]}


def server_step_numbers(url: str) -> dict:
    """Steps and mean times from the server's /metrics (absent metrics: an older server)."""
    text = requests.get(url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith("tgi_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    out = {}
    for method in ("prefill", "decode"):
        count = values.get(f'tgi_batch_forward_duration_count{{method="{method}"}}')
        if count:
            out[f"{method}_steps"] = int(count)
            out[f"{method}_forward_ms"] = 1000 * values[f'tgi_batch_forward_duration_sum{{method="{method}"}}'] / count
    for phase in ("validation", "queue"):      # queue: submission to the first token
        count = values.get(f"tgi_request_{phase}_duration_count")
        if count:
            out[f"{phase}_ms"] = 1000 * values[f"tgi_request_{phase}_duration_sum"] / count
    return out


def format_table(columns: dict[str, dict]) -> str:
    ms = lambda v: f"{v * 1000:.1f}"  # noqa: E731
    runs = list(columns.values())
    rows = [("shared prefix: TTFT p50 / p99 (ms)",
             *(f"{ms(r['shared']['ttft_s']['p50'])} / {ms(r['shared']['ttft_s']['p99'])}" for r in runs)),
            ("shared prefix: output tok/s", *(f"{r['shared']['output_throughput']:.1f}" for r in runs)),
            ("shared prefix: failed / mismatches", *(f"{r['shared']['failed']} / {r['shared']['mismatches']}" for r in runs)),
            ("shared prefix: prefill steps, mean forward ms", *(
                f"{r['shared']['server'].get('prefill_steps', '-')}, {r['shared']['server'].get('prefill_forward_ms', 0):.1f}"
                for r in runs)),
            ("shared prefix: decode steps, mean forward ms", *(
                f"{r['shared']['server'].get('decode_steps', '-')}, {r['shared']['server'].get('decode_forward_ms', 0):.1f}"
                for r in runs)),
            ("shared prefix: server mean validation / queue ms", *(
                f"{r['shared']['server'].get('validation_ms', 0):.0f} / {r['shared']['server'].get('queue_ms', 0):.0f}"
                for r in runs))]
    if any(r.get("more_shared") for r in runs):
        rows.append((f"{len(runs[0]['more_shared'])} more bursts, new prefixes: TTFT p50 ms, median (min-max)",
                     *(_spread([b["ttft_s"]["p50"] * 1000 for b in r["more_shared"]]) for r in runs)))
    for t, turn in enumerate(zip(*(r["multiturn_ttft_s"] for r in runs)), start=1):
        rows.append((f"multi-turn, turn {t}: TTFT p50 / p99 (ms)", *(f"{ms(a['p50'])} / {ms(a['p99'])}" for a in turn)))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}" + "".join(f"  {name:>18}" for name in columns)]
    lines += [f"{row[0]:<{width}}" + "".join(f"  {cell:>18}" for cell in row[1:]) for row in rows]
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({min(values):.0f}-{max(values):.0f})"


def build_parser() -> argparse.ArgumentParser:
    """The command line (``load.HelpFormatter`` shows every default)."""
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_bench", description=__doc__,
                                     formatter_class=load.HelpFormatter)
    parser.add_argument("--model-dir", required=True, help="checkpoint directory with a tokenizer, served by the "
                                                           "launcher")
    parser.add_argument("--shared-requests", type=int, default=256,
                        help="shared: requests sent at once behind the common prefix")
    parser.add_argument("--prefix-len", type=int, default=3000, help="tokens of the common prefix")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="max_new_tokens of each shared-prefix request and of each turn's answer (greedy)")
    parser.add_argument("--conversations", type=int, default=64, help="multiturn: chats, all run at once")
    parser.add_argument("--turns", type=int, default=4, help="multiturn: turns of each chat, one after the other")
    parser.add_argument("--turn-words", type=int, default=200, help="new words (about tokens) per turn")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the shared prefix and its requests' words (--more-bursts: seed + 1, + 2, ...) "
                             "and of chat i's words (seed + i)")
    parser.add_argument("--more-bursts", type=int, default=0,
                        help="after the first shared-prefix burst, this many more on the same server, each behind a "
                             "prefix of its own (seed + 1, + 2, ...): samples of the load on a warm server")
    parser.add_argument("--max-concurrent-requests", type=int, default=1024, help="the launcher's flag")
    parser.add_argument("--server-timeout", type=float, default=1200.0,
                        help="seconds to wait for each server's /health")
    parser.add_argument("--server-log-dir", help="copy each server's log here (the folder is made if missing)")
    parser.add_argument("--cache", choices=["on", "off", "both"], default="both", help="which servers to run")
    parser.add_argument("--json", help="also write each server's numbers (shared, more bursts, turns) to this file")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.server_arg = []
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.cache]
    results = {f"cache_{'on' if caching else 'off'}": run_on_server(args, caching) for caching in modes}
    print(format_table({name.replace("_", " "): run for name, run in results.items()}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
