"""bench.profile_step on the CPU: the accounting of its table (no timing assertion)."""
import json

import pytest

from bench import profile_step


def test_profile_step_reports_every_batch_size(tmp_path):
    out = tmp_path / "profile.json"
    results = profile_step.main(["--model-dir", "weights/demo", "--batch-sizes", "1,3", "--context", "8",
                                 "--repeats", "2", "--table-dir", str(tmp_path), "--json", str(out)])
    assert [r["batch_size"] for r in results] == [1, 3]
    assert json.loads(out.read_text()) == results
    for r in results:
        assert r["gpu_ms"] > 0 and r["step_ms"] > 0 and r["piped_ms"] > 0
        assert r["host_ms"] == pytest.approx(r["step_ms"] - r["gpu_ms"], abs=0.002)
        assert (tmp_path / f"kernels_b{r['batch_size']}.txt").read_text().count("aten::") > 0
