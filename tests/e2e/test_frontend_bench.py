"""bench.frontend_bench on the demo tokenizer: a burst against the front end alone."""
import os

import pytest

from bench import frontend_bench
from tests.e2e.demo_server import DEMO


@pytest.mark.parametrize("route", ["generate_stream", "chat"])
def test_frontend_bench_reports_the_burst(tmp_path, route):
    """Every request's 4 token events come back (the chat stream's [DONE] is not one), on either route."""
    result = frontend_bench.main(["--tokenizer", str(DEMO), "--requests", "12", "--prompt-tokens", "200",
                                  "--new-tokens", "4", "--step-ms", "10", "--route", route,
                                  "--json", str(tmp_path / "out.json")])
    assert result["ttft_s"]["count"] == 12 and 0 < result["ttft_s"]["p50"] <= result["wall_s"]
    assert result["itl_s"]["count"] == 12 * 3 and result["itl_s"]["p50"] > 0
    assert 0 < result["validation_mean_s"] < result["wall_s"]
    assert result["frontend_cpu_s"] > 0 and result["cpu_us_per_event"] > 0
    # the kernel rounds each thread's and the process's time to clock ticks separately
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert 0 <= result["event_loop_cpu_s"] <= result["frontend_cpu_s"] + 2 * tick
    assert (tmp_path / "out.json").exists()
