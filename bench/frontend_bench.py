"""The HTTP front end alone: a burst of long prompts against a backend that answers at once.

    python -m bench.frontend_bench --tokenizer /tmp/llama2-7b [--requests 256] [--prompt-tokens 3000]

A child process serves ``tgi_compat.create_app`` over the model's tokenizer with a backend that
answers every request with one token as soon as it arrives; this process sends ``--requests``
streamed requests of about ``--prompt-tokens`` tokens all at once and reports the time until
the last first token, the client's TTFT percentiles and the server's mean validation time
(tokenizing included). It bounds the time to the first token of such a burst from the front
end's side: the engine can only be slower. CPU only; any machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import time

import aiohttp
import requests

from bench import load
from tests.e2e.server import free_port, wait_for_health


class InstantBackend:
    """Answers one token at once; no engine."""

    def healthy(self) -> bool:
        return True

    def stats(self) -> dict:
        return {}

    def observe_steps(self, observer) -> None:
        pass

    async def generate(self, request):
        from engine.protocol.messages import TokenEvent

        yield TokenEvent(request_id=request.request_id, token_id=5, logprob=-1.0, finish_reason="length")


def serve(tokenizer_dir: str, port: int, workers: int) -> None:
    import uvicorn
    from transformers import AutoTokenizer

    from tgi_compat import ServerSettings, create_app

    settings = ServerSettings(model_id="frontend-bench", max_input_tokens=100_000, max_total_tokens=100_001,
                              max_concurrent_requests=100_000, validation_workers=workers)
    app = create_app(settings, AutoTokenizer.from_pretrained(tokenizer_dir), InstantBackend())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def prompts(tokenizer_dir: str, count: int, prompt_tokens: int, seed: int) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    prefix = tokenizer.decode([rng.randrange(100, tokenizer.vocab_size) for _ in range(prompt_tokens)])
    return [prefix + " " + " ".join(str(rng.randrange(10**6)) for _ in range(16)) for _ in range(count)]


async def burst(url: str, texts: list[str]) -> list[float]:
    """TTFT of each request, all sent at once."""
    async def one(session, text):
        start = time.perf_counter()
        body = {"inputs": text, "parameters": {"max_new_tokens": 1}}
        async with session.post(url + "/generate_stream", json=body) as response:
            async for line in response.content:
                if line.startswith(b"data:"):
                    return time.perf_counter() - start
        raise RuntimeError(f"no event (HTTP {response.status})")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return await asyncio.gather(*(one(session, t) for t in texts))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.frontend_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a model directory with its tokenizer")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--validation-workers", type=int, default=2, help="the launcher's flag (TGI's default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(
        target=serve, args=(args.tokenizer, port, args.validation_workers), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_for_health(url, 120, alive=server.is_alive):
            raise TimeoutError("the front end did not start")
        texts = prompts(args.tokenizer, args.requests, args.prompt_tokens, args.seed)
        start = time.perf_counter()
        ttfts = asyncio.run(burst(url, texts))
        wall = time.perf_counter() - start
        metrics = requests.get(url + "/metrics", timeout=10).text
    finally:
        server.terminate()
        server.join(5)
    count = load.parse_gauge(metrics, "tgi_request_validation_duration_count") or 1
    result = {"requests": args.requests, "prompt_tokens": args.prompt_tokens, "wall_s": round(wall, 3),
              "ttft_s": load.describe(ttfts),
              "validation_mean_s": round(load.parse_gauge(metrics, "tgi_request_validation_duration_sum") / count, 4)}
    print(f"{args.requests} requests of ~{args.prompt_tokens} tokens at once: last first token after "
          f"{result['wall_s']:.3f} s; TTFT p50 {result['ttft_s']['p50'] * 1000:.0f} ms, "
          f"p99 {result['ttft_s']['p99'] * 1000:.0f} ms; mean validation {result['validation_mean_s'] * 1000:.0f} ms",
          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
