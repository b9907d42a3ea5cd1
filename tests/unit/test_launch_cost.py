"""bench.launch_cost on the CPU: the skips it patches in and out, and its runs (no timing assertion)."""
import json

import pytest
import torch

from bench import launch_cost
from engine.ops import TorchOps, TritonOps
from kernels import decode_attention, skinny_gemm


def test_skips_patch_both_backends_and_restore_them():
    ops = TorchOps()
    x, residual, weight = torch.randn(2, 8), torch.randn(2, 8), torch.ones(8)
    originals = {name: getattr(TritonOps, name) for name in ("add_rmsnorm", "moe_route", "rotary_store_kv")}
    merge, reduce = decode_attention._decode_merge_kernel, skinny_gemm._split_k_reduce_kernel
    replaced = launch_cost.apply_skips({"norms", "route", "merge", "rotary", "reduce"})
    try:
        assert ops.add_rmsnorm(x, residual, weight, 1e-6) is x and ops.rmsnorm(x, weight, 1e-6) is x
        weights, ids = ops.moe_route(torch.randn(3, 16), 4, True)
        assert ids.tolist() == [[0, 1, 2, 3]] * 3 and torch.all(weights == 0.25)
        again = ops.moe_route(torch.randn(3, 16), 4, True)      # the same tensors: no launch a call in a graph
        assert again[0] is weights and again[1] is ids
        assert ops.rotary_store_kv(None, None, None, None, None, None, None) is None
        assert decode_attention._decode_merge_kernel is not merge
        out = torch.zeros(1, 4)
        skinny_gemm.reduce_split_k(torch.ones(2, 1, 4), None, out)   # the reduce launches nothing
        assert torch.all(out == 0)
        assert TritonOps.add_rmsnorm is not originals["add_rmsnorm"]
    finally:
        launch_cost.restore(replaced)
    assert {name: getattr(TritonOps, name) for name in originals} == originals
    assert decode_attention._decode_merge_kernel is merge and skinny_gemm._split_k_reduce_kernel is reduce
    before = residual.clone()
    assert not torch.equal(ops.add_rmsnorm(x, residual, weight, 1e-6), x)
    assert torch.equal(residual, before + x)


@pytest.mark.parametrize("args,message", [
    (["--variants", "base,bogus"], "unknown variant 'bogus'"),
    (["--variants", "norms,rope"], "unknown variant 'rope'"),
    (["--batch-size", "0"], "--batch-size: must be a whole number >= 1"),
    (["--repeats", "-2"], "--repeats: must be a whole number >= 1"),
    (["--model-dir", "/nonexistent"], "has no config.json"),
])
def test_bad_arguments_are_refused_before_any_run(monkeypatch, capsys, args, message):
    monkeypatch.setattr(launch_cost, "run_variant", lambda *a: pytest.fail("a variant ran"))
    with pytest.raises(SystemExit) as exited:
        launch_cost.main(["--model-dir", "weights/demo", *args])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_variant_runs_in_a_process_of_its_own():
    result = launch_cost.run_variant("norms", ["--model-dir", "weights/demo", "--batch-sizes", "1", "--context", "8",
                                               "--repeats", "2"])
    assert result["variant"] == "norms" and result["gpu_ms"] > 0 and result["piped_ms"] > 0


def test_each_variant_is_measured_against_the_mean_of_the_base_runs(tmp_path, monkeypatch):
    timings = iter([1.0, 0.75, 1.1])
    ran = []

    def run_variant(variant, profile_args):
        ran.append((variant, profile_args))
        return {"variant": variant, "gpu_ms": next(timings), "piped_ms": 2.0}

    monkeypatch.setattr(launch_cost, "run_variant", run_variant)
    out = tmp_path / "cost.json"
    results = launch_cost.main(["--model-dir", "weights/demo", "--variants", "base,norms,base", "--context", "8",
                                "--json", str(out)])
    assert [v for v, _ in ran] == ["base", "norms", "base"]
    assert ran[0][1] == ["--model-dir", "weights/demo", "--batch-sizes", "1", "--context", "8", "--repeats", "50"]
    assert [r["saved_ms"] for r in results] == [0.05, 0.3, -0.05]
    assert json.loads(out.read_text()) == results
