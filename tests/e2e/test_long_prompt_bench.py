"""bench.long_prompt_bench end to end on the demo model (one real server)."""
from bench import long_prompt_bench
from tests.e2e.server import REPO


def test_long_prompt_bench_measures_every_load(capsys):
    results = long_prompt_bench.main(["--model-dir", str(REPO / "weights" / "demo"), "--max-input-tokens", "1200",
                                      "--long", "200,900,200", "--beside-tokens", "1000", "--stream-new", "400",
                                      "--mixed-requests", "4", "--mixed-prompt", "100-300", "--mixed-new", "4"])
    assert {n: len(ts) for n, ts in results["long"].items()} == {"200": 2, "900": 1}     # a repeat is kept
    assert all(t > 0 for ts in results["long"].values() for t in ts)
    beside = results["beside"]
    assert beside["long_ttft_s"] > 0 and beside["during_tokens"] >= 1 and beside["idle_itl_s"]["count"] > 10
    mixed = results["mixed"]
    assert mixed["completed"] == 4 and mixed["failed"] == 0 and mixed["mismatches"] == 0
    assert mixed["output_tokens"] == 16
    table = capsys.readouterr().out
    assert "TTFT of one 900-token prompt" in table and "batch-1 stream beside a 1000-token prefill" in table
