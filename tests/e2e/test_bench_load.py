"""bench.load and bench.serving_bench against the real launcher (tiny Llama on CPU): the
accounting of requests, tokens and times, never their speed; and the statistics
functions on known inputs."""
from __future__ import annotations

import asyncio
import json
import math
import random

import numpy as np
import pytest

from bench import load, serving_bench
from bench.load import RequestResult
from tests.e2e.server import LaunchedServer
from tests.tiny_models import save_tiny_server_model

EOS_ID = 2          # tests.tiny_models: <unk>=0, <s>=1, </s>=2
MAX_CONCURRENCY = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_server_model("llama", tmp_path_factory.mktemp("bench") / "tiny-llama")


@pytest.fixture(scope="module")
def server(model_dir):
    srv = LaunchedServer(model_dir, "--max-total-tokens", "256", "--max-input-tokens", "192")
    srv.wait_healthy()
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def prompts(server):
    """20 requests: 10 of fixed lengths (24 prompt, 12 new), 10 drawn from ranges."""
    tokenizer = load.ServerTokenizer(server.url)
    fixed = load.build_requests(tokenizer, load.sample_lengths(10, (24, 24), (12, 12), seed=1), seed=1)
    ranged = load.build_requests(tokenizer, load.sample_lengths(10, (2, 96), (1, 40), seed=2), seed=2)
    return fixed + ranged


@pytest.fixture(scope="module")
def runs(server, prompts):
    all_at_once = load.run_load(server.url, prompts, peak_batch=True)
    poisson = load.run_load(server.url, prompts, rate=40.0, seed=3, max_concurrency=MAX_CONCURRENCY)
    return {"all at once": asyncio.run(all_at_once), "poisson": asyncio.run(poisson)}


@pytest.fixture(params=["all at once", "poisson"])
def run(request, runs) -> load.LoadRun:
    return runs[request.param]


# ---- against the server -----------------------------------------------------------------

def test_prompts_have_the_asked_token_counts(server, prompts):
    tokenizer = load.ServerTokenizer(server.url)
    asked = load.sample_lengths(10, (24, 24), (12, 12), 1) + load.sample_lengths(10, (2, 96), (1, 40), 2)
    assert [(p.prompt_len, p.max_new_tokens) for p in prompts] == asked
    assert all(tuple(tokenizer.ids(p.text)) == p.prompt_ids and p.prompt_ids[0] == 1 for p in prompts)


def test_every_request_gets_the_tokens_it_asked_for(run, prompts):
    results = run.results
    assert len(results) == 20 and all(r.success for r in results), [r.error for r in results]
    for r, prompt in zip(results, prompts):
        assert r.input_length == r.prompt_len == prompt.prompt_len
        assert len(r.token_times) == len(r.token_ids) == r.generated_tokens
        if r.finish_reason == "length":
            assert r.generated_tokens == prompt.max_new_tokens
        else:
            assert r.finish_reason == "eos_token" and r.token_ids[-1] == EOS_ID
            assert r.generated_tokens <= prompt.max_new_tokens
    summary = load.summarize_run(run)
    assert (summary["completed"], summary["failed"], summary["mismatches"]) == (20, 0, 0)
    assert summary["eos_early"] == sum(r.finish_reason == "eos_token" and r.generated_tokens < r.max_new_tokens
                                       for r in results)
    assert summary["output_tokens"] == sum(r.generated_tokens for r in results)
    assert summary["input_tokens"] == sum(p.prompt_len for p in prompts)


def test_statistics_match_an_independent_computation(run):
    results, summary = run.results, load.summarize_run(run)
    ttft = np.array([r.token_times[0] - r.send_time for r in results])
    gaps = np.concatenate([np.diff(r.token_times) for r in results])
    tpot = np.array([np.mean(np.diff(r.token_times)) for r in results if len(r.token_times) > 1])
    latency = np.array([r.end_time - r.send_time for r in results])
    for key, values in [("ttft_s", ttft), ("itl_s", gaps), ("tpot_s", tpot), ("e2e_latency_s", latency)]:
        expected = [values.mean(), *np.percentile(values, [50, 99])]
        got = [summary[key][stat] for stat in ("mean", "p50", "p99")]
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12), key
        assert summary[key]["count"] == len(values)
    assert summary["request_throughput"] == pytest.approx(20 / run.duration_s)
    assert summary["output_throughput"] == pytest.approx((len(gaps) + len(results)) / run.duration_s)


def test_times_are_ordered(run):
    for r in run.results:
        assert r.scheduled_time <= r.send_time <= r.token_times[0]
        assert r.token_times == sorted(r.token_times) and r.token_times[-1] <= r.end_time
        assert 0 < r.ttft <= r.latency
        assert r.end_time - run.start_time <= run.duration_s


def test_poisson_arrivals_and_max_concurrency(runs):
    run = runs["poisson"]
    offsets = [r.scheduled_time - run.start_time for r in run.results]
    assert offsets == pytest.approx(load.arrival_offsets(20, 40.0, seed=3), abs=1e-9)
    events = sorted([(r.send_time, 1) for r in run.results] + [(r.end_time, -1) for r in run.results])
    in_flight = np.cumsum([step for _, step in events])
    assert in_flight.max() <= MAX_CONCURRENCY
    at_once = runs["all at once"]
    assert all(r.scheduled_time == at_once.start_time for r in at_once.results)


def test_the_peak_batch_comes_from_the_step_size_histogram(runs):
    peak = runs["all at once"].peak_batch_size
    assert peak is not None and 1 <= peak <= 20
    assert load.summarize_run(runs["all at once"])["peak_batch_size"] == peak
    assert runs["poisson"].peak_batch_size is None          # not asked for


def test_failed_requests_are_counted_not_raised(server):
    tokenizer = load.ServerTokenizer(server.url)
    too_long = load.build_requests(tokenizer, [(150, 120)], seed=0)      # > --max-total-tokens 256
    run = asyncio.run(load.run_load(server.url, too_long))
    (result,) = run.results
    assert not result.success and "256" in result.error and result.token_times == []
    missing = asyncio.run(load.run_load(server.url + "/no-such-route", too_long, peak_batch=True))
    assert missing.results[0].error.startswith("HTTP 404") and missing.peak_batch_size is None
    closed = asyncio.run(load.run_load("http://127.0.0.1:9", too_long, peak_batch=True))   # nothing listens
    assert closed.results[0].error.startswith("ClientConnectorError") and closed.peak_batch_size is None
    summary = load.summarize_run(run)
    assert (summary["completed"], summary["failed"], summary["output_tokens"]) == (0, 1, 0)
    assert math.isnan(summary["ttft_s"]["p50"]) and "Failed requests" in load.format_summary("x", summary)


def test_command_line_with_a_length_file(server, tmp_path, capsys):
    lengths = tmp_path / "lengths.jsonl"
    lengths.write_text('{"prompt_len": 8, "output_len": 3}\n\n{"prompt_len": 30, "output_len": 5}\n')
    out = tmp_path / "out.json"
    load.main(["--url", server.url, "--length-file", str(lengths), "--rate", "100", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["summary"]["completed"] == 2 and saved["summary"]["failed"] == 0
    assert [(r["input_length"], r["max_new_tokens"]) for r in saved["requests"]] == [(8, 3), (30, 5)]
    assert "Output token throughput" in capsys.readouterr().out


def test_serving_bench_runs_every_workload_and_the_ablation(model_dir, tmp_path, capsys):
    out = tmp_path / "serving.json"
    numbers = serving_bench.main([
        "--model-dir", str(model_dir), "--num-requests", "6", "--prompt-len", "8-40", "--output-len", "6",
        "--batch1-prompt-len", "16", "--batch1-output-len", "8", "--batch1-repeats", "2", "--rate", "20",
        "--duration", "0.3", "--ablation", "--ablation-requests", "6", "--ablation-prompt-len", "16-64",
        "--ablation-output-len", "4-32", "--server-args", "--max-total-tokens 256 --max-input-tokens 192",
        "--server-log-dir", str(tmp_path), "--no-peer", "--json", str(out)])
    ours, ablation = numbers["ours"], numbers["ablation"]
    assert {name: s["completed"] for name, s in ours.items()} == {"batch1": 1, "batch": 6, "poisson": 6}
    assert {rule: s["completed"] for rule, s in ablation.items()} == {"peak": 6, "reserve": 6}
    assert all(s["failed"] == s["mismatches"] == 0 for s in [*ours.values(), *ablation.values()])
    assert len(ours["batch1"]["decode_tokens_per_s_runs"]) == 2
    assert all(s["peak_batch_size"] is not None for s in ablation.values())
    assert len(list(tmp_path.glob("server-*.log"))) == 3
    assert json.loads(out.read_text())["table"][-1] in capsys.readouterr().out


# ---- pure functions ---------------------------------------------------------------------

def test_percentile_on_known_values():
    assert load.percentile([4, 1, 3, 2], 50) == 2.5
    assert load.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert (load.percentile([1, 2, 3, 4], 0), load.percentile([1, 2, 3, 4], 100)) == (1, 4)
    assert load.percentile([7.0], 99) == 7.0 and math.isnan(load.percentile([], 50))
    values = [random.Random(0).random() for _ in range(101)]
    for q in (1, 25, 50, 90, 99):
        assert load.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_describe():
    assert load.describe([1.0, 2.0, 6.0]) == {"mean": 3.0, "p50": 2.0, "p99": pytest.approx(5.92), "count": 3}
    assert math.isnan(load.describe([])["mean"])


def _result(index, send, tokens, asked, finish="length", error=None) -> RequestResult:
    return RequestResult(index, prompt_len=10, max_new_tokens=asked, scheduled_time=send, send_time=send,
                         end_time=tokens[-1] if tokens else send + 1, token_times=list(tokens),
                         token_ids=[5] * len(tokens), input_length=None if error else 10,
                         generated_tokens=None if error else len(tokens), finish_reason=None if error else finish,
                         error=error)


def test_summarize_known_timestamps():
    results = [_result(0, 0.0, [1.0, 2.0, 4.0], 3), _result(1, 1.0, [3.0, 3.5], 5, finish="eos_token"),
               _result(2, 0.0, [], 3, error="HTTP 500: boom")]
    s = load.summarize(results, duration_s=5.0)
    assert (s["completed"], s["failed"], s["eos_early"], s["mismatches"]) == (2, 1, 1, 0)
    assert (s["input_tokens"], s["output_tokens"]) == (20, 5)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (0.4, 1.0, 5.0)
    assert (s["ttft_s"]["mean"], s["ttft_s"]["p50"]) == (1.5, 1.5)
    assert s["tpot_s"]["mean"] == 1.0 and s["tpot_s"]["count"] == 2          # 1.5 and 0.5
    assert (s["itl_s"]["p50"], s["itl_s"]["count"]) == (1.0, 3)              # 1, 2, 0.5
    assert s["e2e_latency_s"]["mean"] == 3.25 and s["errors"] == ["HTTP 500: boom"]


def test_token_count_problems():
    assert load.token_count_problem(_result(0, 0, [1, 2], 2)) is None
    assert "asked 3" in load.token_count_problem(_result(0, 0, [1, 2], 3))
    assert load.token_count_problem(_result(0, 0, [1], 3, finish="eos_token")) is None
    assert "stop_sequence" in load.token_count_problem(_result(0, 0, [1], 3, finish="stop_sequence"))
    wrong_count = _result(0, 0, [1, 2], 2)
    wrong_count.generated_tokens = 3
    assert "2 token events" in load.token_count_problem(wrong_count)
    wrong_prompt = _result(0, 0, [1, 2], 2)
    wrong_prompt.input_length = 11
    assert "input_length 11" in load.token_count_problem(wrong_prompt)


def test_read_events_parses_tgi_sse_lines():
    async def lines(*items):
        for item in items:
            yield item

    def parse(*items) -> RequestResult:
        result = RequestResult(0, 3, 2)
        asyncio.run(load.read_events(lines(*items), result))
        return result

    token = b'data:{"index":%d,"token":{"id":%d,"text":"a","logprob":-1.0,"special":false},"details":%s}\n'
    final = b'{"finish_reason":"length","generated_tokens":2,"seed":null,"input_length":3}'
    ok = parse(token % (1, 7, b"null"), b"\n", b":\n", b"\n", token % (2, 9, final), b"\n")
    assert (ok.token_ids, ok.generated_tokens, ok.input_length, ok.error) == ([7, 9], 2, 3, None)
    assert parse(b'data:{"error":"Request failed during generation","error_type":"generation"}\n').error \
        == "error event (generation): Request failed during generation"
    assert "without a final event" in parse(token % (1, 7, b"null")).error


def test_length_parsing_and_sampling(tmp_path):
    assert load.parse_length_range("256") == (256, 256)
    assert load.parse_length_range(" 64 - 512 ") == (64, 512)
    for bad in ["0", "5-3", "a-b", "1-2-3", ""]:
        with pytest.raises(ValueError):
            load.parse_length_range(bad)
    pairs = load.sample_lengths(500, (16, 1024), (3, 3), seed=7)
    assert pairs == load.sample_lengths(500, (16, 1024), (3, 3), seed=7) != load.sample_lengths(500, (16, 1024),
                                                                                                 (3, 3), seed=8)
    assert min(p for p, _ in pairs) >= 16 and max(p for p, _ in pairs) <= 1024 and {o for _, o in pairs} == {3}
    bad_file = tmp_path / "lengths.jsonl"
    bad_file.write_text('{"prompt_len": 8, "output_len": 3}\n{"prompt": 8}\n')
    with pytest.raises(ValueError, match="lengths.jsonl:2"):
        load.read_length_file(str(bad_file))


def test_arrival_offsets():
    assert load.arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    offsets = load.arrival_offsets(20_000, 8.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) == load.arrival_offsets(20_000, 8.0, seed=1)
    assert np.mean(np.diff(offsets)) == pytest.approx(1 / 8.0, rel=0.05)
    with pytest.raises(ValueError):
        load.arrival_offsets(3, 0.0, seed=0)


def test_peak_rows_from_two_readings_of_the_step_size_histogram():
    def reading(counts):           # cumulative counts of the buckets le=1..4 and +Inf
        text = "".join(f'tgi_batch_next_size_bucket{{le="{le}"}} {c}\n' for le, c in zip(["1.0", "2.0", "3.0", "4.0",
                                                                                          "+Inf"], counts))
        return load.parse_buckets("# HELP x\ntgi_batch_next_size_count 9.0\n" + text, "tgi_batch_next_size")

    before = reading([2, 5, 5, 5, 5])             # 2 steps of one row, 3 of two
    assert before == {"1.0": 2.0, "2.0": 5.0, "3.0": 5.0, "4.0": 5.0, "+Inf": 5.0}
    assert load.peak_rows(before, reading([3, 6, 8, 8, 8])) == 3.0      # then steps of 1, 2, 3 and 3 rows
    assert load.peak_rows(before, reading([2, 5, 5, 6, 6])) == 4.0
    assert load.peak_rows(before, before) is None                        # no step in between
    assert load.peak_rows({}, reading([0, 0, 0, 0, 2])) == math.inf      # past the largest bucket
    assert load.parse_buckets("tgi_queue_size 1.0\n", "tgi_batch_next_size") == {}


def test_parse_gauge():
    text = "# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size 12\ntgi_batch_current_size_x 3\n" \
           'tgi_request_count{method="POST"} 4\n'
    assert load.parse_gauge(text, "tgi_batch_current_size") == 12.0
    assert load.parse_gauge(text, "tgi_queue_size") is None


def test_prompts_of_exact_length_with_the_tokenizer_alone(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def tokens_of(text):
        encoding = tokenizer(text, return_offsets_mapping=True)
        return [{"id": i, "start": a, "stop": b} for i, (a, b) in zip(encoding.input_ids, encoding.offset_mapping)]

    pool = load.single_token_words(tokens_of)
    assert {"quick", "world"} <= set(pool) and "generation" not in pool     # not one token in this vocabulary
    rng = random.Random(0)
    for length in [2, 3, 17, 100, 250]:
        text, ids = load.build_prompt(length, pool, rng, lambda t: tokenizer(t).input_ids)
        assert len(ids) == length and ids == tokenizer(text).input_ids
    with pytest.raises(ValueError, match="exactly 1 tokens"):
        load.build_prompt(1, pool, rng, lambda t: tokenizer(t).input_ids)      # BOS alone is one token


def test_serving_bench_arguments_and_table():
    with pytest.raises(SystemExit):
        serving_bench.parse_args(["--model-dir", "x", "--workloads", "batch,nope"])
    args = serving_bench.parse_args(["--model-dir", "x", "--workloads", "batch"])
    summary = {"output_throughput": 300.0, "completed": 1, "failed": 0, "eos_early": 0, "mismatches": 0}
    table = serving_bench.format_table(args, {"batch": summary}, {"batch": 100.0}, {})
    assert "3.00x" in table and "512 requests output tok/s" in table


# ---- the latency/throughput sweep's PNG (bench.plot) ------------------------------------

def test_sweep_draws_latency_against_throughput_png(tmp_path):
    from PIL import Image

    from bench import plot
    from tests.e2e.demo_server import serve_demo

    png, saved = tmp_path / "sweep.png", tmp_path / "sweep.json"
    with serve_demo() as url:
        points = plot.main(["--url", url, "--rates", "20,inf", "--num-requests", "6", "--prompt-len", "8-24",
                            "--output-len", "6", "--png", str(png), "--json", str(saved)])
    assert [p["rate"] for p in points] == [20.0, math.inf]
    assert all(p["summary"]["completed"] == 6 and p["summary"]["failed"] == 0 for p in points)
    with Image.open(png) as image:
        image.load()                      # decodes every pixel: a truncated or corrupt file raises
        assert image.format == "PNG" and image.size == (1100, 450)
        assert image.text["Series"] == "TTFT p50, TTFT p99, TPOT p50, TPOT p99"
        assert len(image.getcolors(maxcolors=1 << 16) or ()) > 10     # something was drawn
    figure = plot.plot_sweep(points, tmp_path / "again.png")
    ttft, tpot = figure.axes
    assert [line.get_label() for line in ttft.get_lines()] == ["TTFT p50", "TTFT p99"]
    assert [line.get_label() for line in tpot.get_lines()] == ["TPOT p50", "TPOT p99"]
    x, p99 = tpot.get_lines()[1].get_data()
    assert list(x) == [p["summary"]["output_throughput"] for p in points]
    assert list(p99) == [p["summary"]["tpot_s"]["p99"] * 1000 for p in points]
    plot.main(["--from-json", str(saved), "--png", str(tmp_path / "redrawn.png")])
    assert (tmp_path / "redrawn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_rates_are_checked():
    from bench import plot

    assert plot.parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("", "0,1", "-1", "nan"):
        with pytest.raises(ValueError, match="--rates"):
            plot.parse_rates(bad)
