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


@pytest.mark.parametrize("chunk_context", [None, 12])
def test_mixed_steps_carry_the_prompt_chunk_beside_the_decode_rows(monkeypatch, chunk_context):
    """--prompt-chunk: every measured step is the decode rows plus the other request's chunk, at the same
    positions each time (after the prompts' own prefill, which goes first); --chunk-context: that request's
    own length before its chunk."""
    forwards, sampled = [], []
    real = profile_step.ModelWorker

    def build(config):
        worker = real(config)
        eager = worker._forward

        def recording(step, results, meanwhile=None, **kwargs):
            forwards.append([(len(r.input_ids), r.start_pos, r.sample) for r in step.rows])
            return eager(step, results, meanwhile, **kwargs)
        worker._forward = recording
        launch = worker.sampler.launch
        worker.sampler.launch = lambda logits, rows, **kw: sampled.append((logits.shape[0], len(rows))) or launch(
            logits, rows, **kw)
        return worker

    monkeypatch.setattr(profile_step, "ModelWorker", build)
    extra = [] if chunk_context is None else ["--chunk-context", str(chunk_context)]
    results = profile_step.main(["--model-dir", "weights/demo", "--batch-sizes", "2", "--context", "8",
                                 "--repeats", "2", "--prompt-chunk", "5", *extra])
    held = chunk_context or 8
    assert results[0]["prompt_chunk"] == 5 and results[0]["launch_ms"] > 0 and results[0]["gpu_ms"] > 0
    assert forwards[0] == [(8, 0, True)] * 2 + [(held, 0, True)]        # the three prompts
    measured = forwards[1:]
    assert len(measured) > 10
    assert all(rows[:2] == [(1, rows[0][1], True)] * 2 and rows[2] == (5, held, False) for rows in measured)
    assert sampled[0] == (3, 3) and all(pair == (2, 2) for pair in sampled[1:])   # the prompts, then 2 rows each


def test_the_kernel_table_profiles_the_steps_own_work(monkeypatch, tmp_path):
    """The table's forward is the step's: a mixed step's LM head runs on the decode rows it samples, not on the
    prompt chunk's tokens too (before, it multiplied every token of the step, 1,000 times more at a 4,096-token
    chunk, and showed that GEMM and its float32 copy as part of the step)."""
    head_rows = []
    real = profile_step.ModelWorker

    def build(config):
        worker = real(config)
        logits = worker.model.compute_logits
        worker.model.compute_logits = lambda hidden: head_rows.append(hidden.shape[0]) or logits(hidden)
        return worker

    monkeypatch.setattr(profile_step, "ModelWorker", build)
    profile_step.main(["--model-dir", "weights/demo", "--batch-sizes", "2", "--context", "8", "--repeats", "1",
                       "--prompt-chunk", "5", "--table-dir", str(tmp_path)])
    assert (tmp_path / "kernels_b2.txt").read_text().count("aten::") > 0
    assert head_rows[-4:] == [2] * 4        # the table's warm-up and its three profiled forwards


def test_a_negative_prompt_chunk_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        profile_step.main(["--model-dir", "weights/demo", "--prompt-chunk", "-1"])
    assert exited.value.code == 2 and "--prompt-chunk: must be a whole number >= 0, got -1" in capsys.readouterr().err


def test_a_prompt_chunk_alone_is_measured_at_batch_size_zero():
    """--batch-sizes 0 with --prompt-chunk: steps of the chunk alone (a long prompt with nothing decoding beside
    it); no row samples, so the sampler is not timed (before, timing it on no logits raised)."""
    results = profile_step.main(["--model-dir", "weights/demo", "--batch-sizes", "0", "--context", "8",
                                 "--repeats", "1", "--prompt-chunk", "5", "--chunk-context", "6"])
    assert [r["batch_size"] for r in results] == [0]
    assert results[0]["gpu_ms"] > 0 and results[0]["sample_ms"] == 0 and results[0]["tokens_per_s"] == 0


@pytest.mark.parametrize("args,message", [
    (["--batch-sizes", "0"], "--batch-sizes: 0 (no decode rows) needs --prompt-chunk"),
    (["--batch-sizes", "1,x"], "expected comma-separated whole numbers >= 0, got '1,x'"),
    (["--batch-sizes", "-1"], "expected comma-separated whole numbers >= 0, got '-1'"),
])
def test_bad_batch_sizes_are_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exited:
        profile_step.main(["--model-dir", "weights/demo", *args])
    assert exited.value.code == 2 and message in capsys.readouterr().err
