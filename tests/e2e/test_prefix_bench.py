"""bench.prefix_bench end to end on the demo model (two real servers: cache on, then off)."""
from bench import prefix_bench
from tests.e2e.server import REPO


def test_prefix_bench_measures_both_servers_on_the_same_prompts(capsys):
    results = prefix_bench.main(["--model-dir", str(REPO / "weights" / "demo"), "--shared-requests", "6",
                                 "--prefix-len", "200", "--conversations", "2", "--turns", "2",
                                 "--turn-words", "12", "--new-tokens", "4", "--more-bursts", "2"])
    for run in results.values():
        shared = run["shared"]
        assert shared["completed"] == 6 and shared["failed"] == 0 and shared["mismatches"] == 0
        assert [turn["count"] for turn in run["multiturn_ttft_s"]] == [2, 2]
        assert [b["completed"] for b in run["more_shared"]] == [6, 6]          # each behind a prefix of its own
        assert all(b["failed"] == 0 and b["mismatches"] == 0 for b in run["more_shared"])
    on, off = results["cache_on"]["shared"], results["cache_off"]["shared"]
    assert on["input_tokens"] == off["input_tokens"]            # the same prompts on both servers
    assert on["server"]["prefill_steps"] >= 1 and on["server"]["decode_steps"] >= 3 and on["server"]["queue_ms"] > 0
    assert on["server"]["validation_ms"] > 0
    table = capsys.readouterr().out
    assert "shared prefix: TTFT p50 / p99 (ms)" in table and "multi-turn, turn 2" in table
    assert "cache on" in table and "cache off" in table and "decode steps, mean forward ms" in table
    assert "2 more bursts, new prefixes: TTFT p50 ms" in table
