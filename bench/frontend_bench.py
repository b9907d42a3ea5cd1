"""The HTTP front end alone: a burst of long prompts against a stand-in for the engine.

    python -m bench.frontend_bench --tokenizer /tmp/llama2-7b [--requests 256] [--prompt-tokens 3000] \\
        [--new-tokens 64 --step-ms 20] [--route generate_stream|chat] [--profile out.prof]

A child process serves ``tgi_compat.create_app`` over the model's tokenizer and a real
``RouterClient`` whose pipe leads to a paced stand-in router (another process): every
``--step-ms`` it sends one token event to each running request (one ``Events`` message per
step, as the router does), ``--new-tokens`` per request. This process sends ``--requests``
streamed requests (``--route``: /generate_stream, or /v1/chat/completions with the prompt as one user
message) of about ``--prompt-tokens`` tokens all at once and reports the time
until the last first token, the client's TTFT and ITL percentiles, the server's mean
validation time (tokenizing included) and the front end's CPU seconds (all of its threads, and its
event loop's thread alone) per token event.
It bounds what the engine can achieve through the front end: the engine can only be
slower. CPU only; any machine. ``--profile`` writes the front end's cProfile stats.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import time

import aiohttp
import requests

from bench import load
from tests.e2e.server import free_port, wait_for_health


def paced_router(conn, step_s: float) -> None:
    """Stand-in router: one token per running request per step. Like the router, it reads its
    pipe only between steps (a step takes ``step_s``) and admits everything it read."""
    from engine.protocol.codec import decode, encode
    from engine.protocol.messages import Abort, Events, GenerationRequest, RouterStatus, TokenEvent

    conn.send_bytes(encode(RouterStatus(healthy=True, kv_capacity=1 << 20)))
    remaining: dict[int, int] = {}
    while True:
        time.sleep(step_s)
        while conn.poll(0 if remaining else None):
            message = decode(conn.recv_bytes())
            if isinstance(message, GenerationRequest):
                remaining[message.request_id] = message.max_new_tokens
            elif isinstance(message, Abort):
                remaining.pop(message.request_id, None)
        events = []
        for request_id in list(remaining):
            remaining[request_id] -= 1
            last = remaining[request_id] == 0
            events.append(TokenEvent(request_id=request_id, token_id=450 + remaining[request_id] % 100,
                                     logprob=-1.0, finish_reason="length" if last else None))
            if last:
                del remaining[request_id]
        if events:
            conn.send_bytes(encode(Events(events)))


def serve(tokenizer_dir: str, port: int, workers: int, conn, profile: str | None) -> None:
    import sys

    import uvicorn
    from transformers import AutoTokenizer

    from engine.client import RouterClient
    from tgi_compat import ServerSettings, create_app
    from tgi_compat.http_protocol import HeaderTimeoutProtocol

    settings = ServerSettings(model_id="frontend-bench", max_input_tokens=100_000, max_total_tokens=100_001,
                              max_concurrent_requests=100_000, validation_workers=workers)
    app = create_app(settings, AutoTokenizer.from_pretrained(tokenizer_dir), RouterClient(conn))
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        signal.signal(signal.SIGUSR1, lambda *_: (profiler.disable(), profiler.dump_stats(profile)))
        profiler.enable()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http=HeaderTimeoutProtocol)   # the server's
    sys.exit(0)


def prompts(tokenizer_dir: str, count: int, prompt_tokens: int, seed: int) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    prefix = tokenizer.decode([rng.randrange(100, tokenizer.vocab_size) for _ in range(prompt_tokens)])
    return [prefix + " " + " ".join(str(rng.randrange(10**6)) for _ in range(16)) for _ in range(count)]


ROUTES = {   # --route: the path and body of a streamed request of ``text`` for ``new`` tokens
    "generate_stream": ("/generate_stream", lambda text, new: {"inputs": text, "parameters": {"max_new_tokens": new}}),
    "chat": ("/v1/chat/completions", lambda text, new: {"model": "tgi", "messages": [{"role": "user", "content": text}],
                                                        "max_tokens": new, "stream": True}),
}


async def burst(url: str, texts: list[str], new_tokens: int, route: str = "generate_stream") -> list[list[float]]:
    """Each request's event times (seconds after its send), all sent at once."""
    path, make_body = ROUTES[route]

    async def one(session, text):
        start, times = time.perf_counter(), []
        async with session.post(url + path, json=make_body(text, new_tokens)) as response:
            async for line in response.content:
                if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                    times.append(time.perf_counter() - start)
        if len(times) != new_tokens:
            raise RuntimeError(f"{len(times)} events of {new_tokens} (HTTP {response.status})")
        return times

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     read_bufsize=2**20) as session:
        return await asyncio.gather(*(one(session, t) for t in texts))


def process_cpu_s(pid: int, thread: int | None = None) -> float:
    """User + system CPU seconds of a live process, or of one of its threads (Linux /proc)."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    fields = open(path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.frontend_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a model directory with its tokenizer")
    parser.add_argument("--requests", type=int, default=256,
                        help="streamed requests, sent at once (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=3000,
                        help="random token ids decoded into the text every prompt begins with; 16 random numbers "
                             "follow it in each, so a prompt is about this many tokens (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=1,
                        help="tokens streamed to each request (default: %(default)s)")
    parser.add_argument("--step-ms", type=float, default=20.0,
                        help="the stand-in router's step time, in ms (default: %(default)s)")
    parser.add_argument("--validation-workers", type=int, default=2, help="the launcher's flag (TGI's default 2)")
    parser.add_argument("--route", choices=sorted(ROUTES), default="generate_stream",
                        help="the streamed route the burst asks (chat: the tokenizer needs a chat template) "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the prompts' random token ids and numbers (default: %(default)s)")
    parser.add_argument("--profile", help="write the front end's cProfile stats here")
    parser.add_argument("--json", help="also write the result (times, CPU seconds, mean validation) to this file")
    return parser


def _parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _measure_burst(args) -> dict:
    """Start the stand-in router and the front end, send the burst; times, CPU seconds and /metrics."""
    port, context = free_port(), multiprocessing.get_context("spawn")
    router_end, frontend_end = context.Pipe()
    router = context.Process(target=paced_router, args=(router_end, args.step_ms / 1000), daemon=True)
    server = context.Process(target=serve, daemon=True,
                             args=(args.tokenizer, port, args.validation_workers, frontend_end, args.profile))
    router.start()
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_for_health(url, 120, alive=server.is_alive):
            raise TimeoutError("the front end did not start")
        texts = prompts(args.tokenizer, args.requests, args.prompt_tokens, args.seed)
        # the server's main thread runs the event loop (HTTP, validation, streams)
        # the loop's interval lies inside the process's, so its seconds cannot exceed the process's
        cpu_before = process_cpu_s(server.pid)
        loop_before = process_cpu_s(server.pid, server.pid)
        start = time.perf_counter()
        times = asyncio.run(burst(url, texts, args.new_tokens, args.route))
        wall = time.perf_counter() - start
        loop_cpu = process_cpu_s(server.pid, server.pid) - loop_before
        cpu = process_cpu_s(server.pid) - cpu_before
        metrics = requests.get(url + "/metrics", timeout=10).text
        if args.profile:
            os.kill(server.pid, signal.SIGUSR1)
            time.sleep(2)
    finally:
        server.terminate()
        router.terminate()
        server.join(5)
    return dict(times=times, wall=wall, cpu=cpu, loop_cpu=loop_cpu, metrics=metrics)


def main(argv=None) -> dict:
    args = _parse_args(argv)
    run = _measure_burst(args)
    times, cpu, metrics = run["times"], run["cpu"], run["metrics"]
    count = load.parse_gauge(metrics, "tgi_request_validation_duration_count") or 1
    events = args.requests * args.new_tokens
    result = {"requests": args.requests, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "step_ms": args.step_ms, "wall_s": round(run["wall"], 3),
              "ttft_s": load.describe([t[0] for t in times]),
              "itl_s": load.describe([b - a for t in times for a, b in zip(t, t[1:])]),
              "frontend_cpu_s": round(cpu, 3), "event_loop_cpu_s": round(run["loop_cpu"], 3),
              "cpu_us_per_event": round(1e6 * cpu / events, 1),
              "validation_mean_s": round(load.parse_gauge(metrics, "tgi_request_validation_duration_sum") / count, 4)}
    print(f"{args.requests} requests of ~{args.prompt_tokens} tokens at once, {args.new_tokens} new each, "
          f"{args.step_ms:g} ms steps: done after {result['wall_s']:.3f} s; "
          f"TTFT p50 {result['ttft_s']['p50'] * 1000:.0f} ms, p99 {result['ttft_s']['p99'] * 1000:.0f} ms; "
          f"ITL p50 {result['itl_s']['p50'] * 1000:.1f} ms, p99 {result['itl_s']['p99'] * 1000:.1f} ms; "
          f"mean validation {result['validation_mean_s'] * 1000:.0f} ms; front end {result['frontend_cpu_s']:.2f} "
          f"CPU s, {result['event_loop_cpu_s']:.2f} on its event loop ({result['cpu_us_per_event']:.0f} us per token "
          f"event)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result

if __name__ == "__main__":
    main()
