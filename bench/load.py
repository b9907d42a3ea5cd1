"""HTTP load generator: drives TGI's `/generate_stream` the way vLLM's `benchmark_serving.py` does.

    python -m bench.load --url http://127.0.0.1:3000 --num-requests 512 --prompt-len 64-512 \\
        --output-len 256 --rate inf --seed 0 [--max-concurrency 64] [--json out.json]

Prompts: TGI's API takes text, so each prompt is text made of words that the server's
tokenizer maps to one token each; it is measured with the server's `/tokenize` route and
grown or shrunk until it has exactly the asked number of tokens (special tokens such as
BOS included). The ids `/tokenize` returned are the prompt's token list (what a peer
must be given), and the final stream event's `details.input_length` is checked against it.

EOS: TGI has no "ignore EOS" parameter and the server honours EOS, so a request that ends
with finish_reason "eos_token" before its max_new_tokens is a legitimate short answer: it
is counted apart ("EOS-finished early") and its tokens count in the throughput. A
"length" finish with another token count, a token-event count that differs from
`details.generated_tokens`, or a prompt whose `input_length` differs from its token list
is a mismatch.

Times are `time.perf_counter()` seconds taken when each `data:` line is read. TTFT: send
to first token; TPOT: (last - first) / (n - 1) per request of n >= 2 tokens; ITL: every gap
between consecutive tokens; E2E: send to the end of the stream. Percentiles interpolate
linearly between order statistics (numpy's default, as vLLM).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import aiohttp
import requests

# Common English words; the ones the server's tokenizer keeps as one token form the prompts.
CANDIDATE_WORDS = (
    "the quick brown fox jumps over lazy dog hello world there main return generation inference server "
    "tokens stream of text time people year way day man thing woman life child school state family student "
    "group country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car city "
    "community name president team minute idea kid body information back parent face others level office "
    "door health person art war history party result change morning reason research girl guy moment air "
    "teacher force education and for with from that this have will would about which their what"
).split()
HTTP_TIMEOUT_S = 6 * 3600


# ---- request lengths --------------------------------------------------------------------

def parse_length_range(text: str) -> tuple[int, int]:
    """'256' -> (256, 256); '64-512' -> (64, 512) (both ends included)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not match:
        raise ValueError(f"length {text!r} is neither a number ('256') nor a range ('64-512')")
    low = int(match.group(1))
    high = int(match.group(2) or low)
    if low < 1 or high < low:
        raise ValueError(f"length range {text!r} must satisfy 1 <= low <= high")
    return low, high


def sample_lengths(count: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                   seed: int) -> list[tuple[int, int]]:
    """``count`` (prompt_len, output_len) pairs, each uniform in its range; same seed, same pairs."""
    rng = random.Random(seed)
    return [(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(count)]


def read_length_file(path: str) -> list[tuple[int, int]]:
    """JSON lines ``{"prompt_len": .., "output_len": ..}``; blank lines are skipped."""
    pairs = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            try:
                pairs.append((int(record["prompt_len"]), int(record["output_len"])))
            except (KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: expected {{\"prompt_len\": int, \"output_len\": int}}, "
                                 f"got {line.strip()!r}") from e
    return pairs


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start: all 0 for an infinite rate, else a Poisson
    process (exponential gaps of mean 1 / rate) that starts with a request at 0."""
    if math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s or inf, got {rate}")
    rng, now, offsets = random.Random(seed), 0.0, []
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


# ---- prompts of an exact token count ------------------------------------------------------

@dataclass(frozen=True)
class PromptRequest:
    text: str
    prompt_ids: tuple[int, ...]     # the server's tokenization of ``text`` (special tokens included)
    max_new_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


class ServerTokenizer:
    """The server's own tokenizer, through `POST /tokenize` (ids and byte offsets)."""

    def __init__(self, url: str):
        self.url, self.session = url.rstrip("/"), requests.Session()

    def tokens(self, text: str) -> list[dict]:
        response = self.session.post(self.url + "/tokenize", json={"inputs": text}, timeout=60)
        if response.status_code != 200:
            raise RuntimeError(f"POST {self.url}/tokenize answered {response.status_code}: {response.text[:300]}")
        return response.json()

    def ids(self, text: str) -> list[int]:
        return [token["id"] for token in self.tokens(text)]


def token_counts(tokens_of: Callable[[str], list[dict]], words: list[str]) -> list[int]:
    """How many tokens each word of the sentence ``" ".join(words)`` takes (one `/tokenize`
    call, matched by byte offsets; a word's leading space counts with it)."""
    text = " ".join(words)
    starts = [m.start() for m in re.finditer(r"\S+", text)]
    counts = [0] * len(words)
    for token in tokens_of(text):
        if token["stop"] > token["start"]:                       # skips BOS and other added tokens
            counts[max(i for i, s in enumerate(starts) if s <= token["start"] + 1)] += 1
    return counts


def single_token_words(tokens_of: Callable[[str], list[dict]], candidates=CANDIDATE_WORDS,
                       words_per_call: int = 16) -> list[str]:
    """The candidates (after the first) that tokenize to exactly one token, space included.
    Asked ``words_per_call`` at a time, each sentence led by the word before (so that every
    word has its space): a few dozen tokens per call, within any --max-input-tokens."""
    pool = set()
    for begin in range(1, len(candidates), words_per_call):
        words = list(candidates[begin - 1: begin + words_per_call])
        pool.update(w for w, n in zip(words[1:], token_counts(tokens_of, words)[1:]) if n == 1)
    if not pool:
        raise RuntimeError("the tokenizer splits every candidate word into several tokens; "
                           "extend CANDIDATE_WORDS with words of this vocabulary")
    return sorted(pool)


def build_prompt(target_len: int, pool: list[str], rng: random.Random,
                 ids_of: Callable[[str], list[int]], attempts: int = 8) -> tuple[str, list[int]]:
    """Text of ``target_len`` tokens (special tokens included) and its ids. Words after the
    first are one token each; the first (no space before it) may take more, then the
    word count is adjusted, or, for a one-word prompt, the next pool word is tried."""
    words = [rng.choice(pool) for _ in range(target_len)]
    count, tried = target_len, set()
    for _ in range(attempts + len(pool)):
        words += [rng.choice(pool) for _ in range(count - len(words))]
        text = " ".join(words[:count])
        ids = ids_of(text)
        if len(ids) == target_len:
            return text, ids
        tried.add(count)
        if count == 1 and len(ids) > target_len:
            words[0] = pool[(pool.index(words[0]) + 1) % len(pool)]
        else:
            count = max(1, count + target_len - len(ids))
            if count in tried:      # a tokenizer that merges across words: other words, not another count
                words = [rng.choice(pool) for _ in range(count)]
    raise ValueError(f"cannot build a prompt of exactly {target_len} tokens from single-token words "
                     f"(the tokenizer adds special tokens; ask for a longer prompt)")


def build_requests(tokenizer: ServerTokenizer, lengths: list[tuple[int, int]], seed: int) -> list[PromptRequest]:
    """One request per (prompt_len, output_len); same seed and tokenizer, same texts."""
    pool, rng = single_token_words(tokenizer.tokens), random.Random(seed)
    built = []
    for prompt_len, output_len in lengths:
        text, ids = build_prompt(prompt_len, pool, rng, tokenizer.ids)
        built.append(PromptRequest(text, tuple(ids), output_len))
    return built


# ---- one streamed request ---------------------------------------------------------------

@dataclass
class RequestResult:
    """What the client saw of one request; times are ``time.perf_counter()`` seconds."""
    index: int
    prompt_len: int                   # tokens sent (from /tokenize)
    max_new_tokens: int
    scheduled_time: float = 0.0       # when its arrival was due
    send_time: float = 0.0            # when the POST went out (after any concurrency wait)
    end_time: float = 0.0             # end of the stream (or of the failure)
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    input_length: int | None = None   # details.input_length
    generated_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send_time

    @property
    def latency(self) -> float:
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n >= 2 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def eos_early(self) -> bool:
        return self.finish_reason == "eos_token" and (self.generated_tokens or 0) < self.max_new_tokens


def generate_body(request: PromptRequest) -> dict:
    return {"inputs": request.text,
            "parameters": {"max_new_tokens": request.max_new_tokens, "details": True, "do_sample": False}}


async def send_request(session: aiohttp.ClientSession, url: str, request: PromptRequest,
                       result: RequestResult) -> RequestResult:
    """POST /generate_stream; an HTTP error, an error event or a broken stream fails the request."""
    result.send_time = time.perf_counter()
    try:
        async with session.post(url + "/generate_stream", json=generate_body(request)) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
            else:
                await read_events(response.content, result)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.end_time = time.perf_counter()
    return result


async def read_events(lines, result: RequestResult) -> None:
    """Parse TGI's SSE lines (``data:{json}``; ``:`` keep-alives and blank lines skipped)."""
    async for raw in lines:
        now = time.perf_counter()
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        event = json.loads(line[5:])
        if "error" in event:
            result.error = f"error event ({event.get('error_type')}): {event['error']}"
            return
        result.token_times.append(now)
        result.token_ids.append(event["token"]["id"])
        if event.get("details"):
            details = event["details"]
            result.input_length, result.generated_tokens = details["input_length"], details["generated_tokens"]
            result.finish_reason = details["finish_reason"]
    if result.finish_reason is None:
        result.error = f"stream ended after {len(result.token_times)} tokens without a final event"


# ---- a run ------------------------------------------------------------------------------

@dataclass
class LoadRun:
    results: list[RequestResult]
    start_time: float
    duration_s: float                 # first scheduled send to the last stream's end
    peak_batch_size: float | None     # the most rows of a step recorded during the run (/metrics; None: off,
                                      # unreadable or no step)


def parse_gauge(metrics_text: str, name: str) -> float | None:
    """The value of an unlabelled Prometheus gauge, or None when absent."""
    match = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+|NaN)$", metrics_text, re.M)
    return float(match.group(1)) if match else None


STEP_ROWS = "tgi_batch_next_size"     # the server's histogram of rows (requests) per step, one bucket per count


def parse_buckets(metrics_text: str, name: str) -> dict[str, float]:
    """An unlabelled Prometheus histogram's cumulative bucket counts by their ``le`` bound ({} when absent)."""
    pattern = rf'^{re.escape(name)}_bucket{{le="([^"]+)"}} ([0-9.eE+-]+)$'
    return {le: float(count) for le, count in re.findall(pattern, metrics_text, re.M)}


def peak_rows(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The most rows of a step observed between two readings of ``STEP_ROWS`` (the smallest bound that holds
    every new step), or None when no step was observed."""
    steps = after.get("+Inf", 0.0) - before.get("+Inf", 0.0)
    if steps <= 0:
        return None
    for le in sorted((le for le in after if le != "+Inf"), key=float):
        if after[le] - before.get(le, 0.0) >= steps:
            return float(le)
    return math.inf


async def read_step_rows(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """``STEP_ROWS``' buckets now, from /metrics ({} when it cannot be read: the peak is then None, and the
    requests' own failures say what was wrong)."""
    try:
        async with session.get(url + "/metrics") as response:
            return parse_buckets(await response.text(), STEP_ROWS) if response.status == 200 else {}
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}


async def _scheduled(session, url, request: PromptRequest, result: RequestResult,
                     limit: asyncio.Semaphore | None) -> RequestResult:
    await asyncio.sleep(max(0.0, result.scheduled_time - time.perf_counter()))
    if limit is None:
        return await send_request(session, url, request, result)
    async with limit:
        return await send_request(session, url, request, result)


async def run_load(url: str, prompts: list[PromptRequest], rate: float = math.inf, seed: int = 0,
                   max_concurrency: int | None = None, peak_batch: bool = False) -> LoadRun:
    """Send every request at its arrival time (``arrival_offsets``) and wait for all of them. ``peak_batch``:
    read the server's step-size histogram before and after, for the most rows any step of the run had (exact,
    where polling ``tgi_batch_current_size`` could miss a short run)."""
    url = url.rstrip("/")
    offsets = arrival_offsets(len(prompts), rate, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S),
                                     read_bufsize=2**20) as session:
        before = await read_step_rows(session, url) if peak_batch else {}
        start = time.perf_counter()
        results = [RequestResult(i, p.prompt_len, p.max_new_tokens, scheduled_time=start + offset)
                   for i, (p, offset) in enumerate(zip(prompts, offsets))]
        await asyncio.gather(*(_scheduled(session, url, p, r, limit) for p, r in zip(prompts, results)))
        duration = time.perf_counter() - start
        peak = peak_rows(before, await read_step_rows(session, url)) if peak_batch else None
    return LoadRun(results, start, duration, peak)


# ---- statistics (pure) --------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between order statistics (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def describe(values: list[float]) -> dict:
    """Mean, p50, p99 (NaN when empty) and the count."""
    mean = sum(values) / len(values) if values else math.nan
    return {"mean": mean, "p50": percentile(values, 50), "p99": percentile(values, 99), "count": len(values)}


def token_count_problem(result: RequestResult) -> str | None:
    """Why a completed request's token accounting is wrong, or None when it is right."""
    events = len(result.token_times)
    if result.input_length != result.prompt_len:
        return f"request {result.index}: input_length {result.input_length}, sent {result.prompt_len} tokens"
    if events != result.generated_tokens:
        return f"request {result.index}: {events} token events, details.generated_tokens {result.generated_tokens}"
    if result.finish_reason == "length" and events != result.max_new_tokens:
        return f"request {result.index}: finish 'length' after {events} tokens, asked {result.max_new_tokens}"
    if result.finish_reason == "eos_token" and events <= result.max_new_tokens:
        return None
    if result.finish_reason != "length":
        return f"request {result.index}: finish {result.finish_reason!r} after {events}/{result.max_new_tokens}"
    return None


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """The benchmark's numbers (times in seconds); failed requests count only as failures."""
    done = [r for r in results if r.success]
    output_tokens = sum(len(r.token_times) for r in done)
    input_tokens = sum(r.input_length or 0 for r in done)
    problems = [p for p in map(token_count_problem, done) if p]
    return {
        "completed": len(done), "failed": len(results) - len(done),
        "eos_early": sum(r.eos_early for r in done), "mismatches": len(problems),
        "mismatch_examples": problems[:5], "errors": [r.error for r in results if r.error][:5],
        "duration_s": duration_s, "input_tokens": input_tokens, "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s, "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_s": describe([r.ttft for r in done if r.token_times]),
        "tpot_s": describe([r.tpot for r in done if r.tpot is not None]),
        "itl_s": describe([gap for r in done for gap in r.itls]),
        "e2e_latency_s": describe([r.latency for r in done]),
    }


def summarize_run(run: LoadRun) -> dict:
    summary = summarize(run.results, run.duration_s)
    summary["peak_batch_size"] = run.peak_batch_size
    return summary


def format_summary(title: str, s: dict) -> str:
    """vLLM-style table of one run (times in ms)."""
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("EOS-finished early", s["eos_early"]), ("Token-count mismatches", s["mismatches"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"), ("Total input tokens", s["input_tokens"]),
            ("Total generated tokens", s["output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    if s.get("peak_batch_size") is not None:
        rows.append(("Peak rows in a step (/metrics)", f"{s['peak_batch_size']:.0f}"))
    for label, key in [("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E latency", "e2e_latency_s")]:
        rows += [(f"{stat.capitalize()} {label} (ms)", f"{s[key][stat] * 1000:.2f}") for stat in ("mean", "p50", "p99")]
    lines = [f"{' ' + title + ' ':=^56}", *(f"{label:<40}{value:>16}" for label, value in rows), "=" * 56]
    lines += [f"  error: {e}" for e in s["errors"]] + [f"  mismatch: {m}" for m in s["mismatch_examples"]]
    return "\n".join(lines)


def result_records(results: list[RequestResult]) -> list[dict]:
    """Per-request numbers for a JSON file (no per-token times)."""
    keep = ("index", "prompt_len", "max_new_tokens", "input_length", "generated_tokens", "finish_reason", "error")
    return [{**{k: v for k, v in asdict(r).items() if k in keep},
             "ttft_s": r.ttft if r.token_times else None, "tpot_s": r.tpot, "latency_s": r.latency,
             "token_events": len(r.token_times)} for r in results]


# ---- command line -----------------------------------------------------------------------

class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:3000", help="base URL of the running server")
    parser.add_argument("--num-requests", type=int, default=512, help="requests to send (ignored with --length-file)")
    parser.add_argument("--prompt-len", default="64-512",
                        help="prompt tokens (special tokens included): a number or an inclusive range 'a-b' "
                             "drawn uniformly per request")
    parser.add_argument("--output-len", default="256", help="max_new_tokens: a number or an inclusive range 'a-b'")
    parser.add_argument("--length-file", help="JSON lines {\"prompt_len\": .., \"output_len\": ..}, one request "
                                              "each; replaces --num-requests, --prompt-len and --output-len")
    parser.add_argument("--rate", type=float, default=math.inf,
                        help="arrivals: 'inf' sends every request at once, else a Poisson process of this many "
                             "requests/s")
    parser.add_argument("--seed", type=int, default=0, help="seed of lengths, prompt words and arrival times")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight (later arrivals wait)")
    parser.add_argument("--peak-batch", choices=["on", "off"], default="off",
                        help="read /metrics' step-size histogram (tgi_batch_next_size) before and after the run "
                             "and report the most rows (requests) of any step")
    parser.add_argument("--json", help="also write the summary and per-request numbers to this file")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def lengths_from_args(args: argparse.Namespace) -> list[tuple[int, int]]:
    if args.length_file:
        return read_length_file(args.length_file)
    return sample_lengths(args.num_requests, parse_length_range(args.prompt_len),
                          parse_length_range(args.output_len), args.seed)


def main(argv=None) -> dict:
    args = parse_args(argv)
    prompts = build_requests(ServerTokenizer(args.url), lengths_from_args(args), args.seed)
    run = asyncio.run(run_load(args.url, prompts, args.rate, args.seed, args.max_concurrency,
                               args.peak_batch == "on"))
    summary = summarize_run(run)
    print(format_summary(f"{len(prompts)} requests, rate {args.rate}", summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "requests": result_records(run.results)}, f,
                      indent=1)
    return summary


if __name__ == "__main__":
    main()
