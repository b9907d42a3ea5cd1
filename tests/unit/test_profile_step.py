"""bench.profile_step on the CPU: the accounting of its table (no timing assertion)."""
import json

import pytest
import torch

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


def test_profile_step_serves_the_kv_cache_dtype_it_is_given(monkeypatch):
    built = []
    real = profile_step.ModelWorker
    monkeypatch.setattr(profile_step, "ModelWorker", lambda config: built.append(real(config)) or built[-1])
    results = profile_step.main(["--model-dir", "weights/demo", "--batch-sizes", "2", "--context", "8",
                                 "--repeats", "1", "--kv-cache-dtype", "int8"])
    assert [r["batch_size"] for r in results] == [2]
    assert built[0].kv_dtype == torch.int8 and built[0].kv_cache.kv_buffer.dtype == torch.int8
