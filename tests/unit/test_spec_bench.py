"""bench.spec_bench verify on the CPU: a tiny random checkpoint, batch sizes 1 and 32 (no timing assertion)."""
import statistics
from argparse import Namespace

import pytest

from bench import spec_bench
from tests.tiny_models import save_tiny_model


def test_verify_runs_every_batch_size_with_its_contexts_in_the_kv_cache(tmp_path):
    """The bench sizes the worker's KV cache for its largest batch (the GPU run's batch 32 ran out of slots):
    on a CPU the worker gets exactly that many slots, so one too few would fail here."""
    model_dir = save_tiny_model("llama", tmp_path / "llama", max_position_embeddings=1024,
                                vocab_size=1024)   # the fixtures feed token ids up to 1009
    result = spec_bench.verify(Namespace(model_dir=str(model_dir), batch_sizes="1,32", context=128, repeats=2))
    assert [r["batch_size"] for r in result["verify"]] == [1, 32]
    assert all(r["decode_ms"] > 0 and r["verify4_ms"] > 0 for r in result["verify"])


def test_compare_prompts_tells_identical_runs_near_ties_and_real_differences():
    from tests.gpu.greedy import Greedy

    def run(tokens, tops):
        return Greedy(tokens, [0.0] * len(tokens), [dict.fromkeys(t, -1.0) for t in tops])

    plain = [run([5, 6, 7], [[5, 9], [6, 8], [7, 1]])] * 3
    speculating = [run([5, 6, 7], [[5, 9], [6, 8], [7, 1]]),
                   run([5, 8, 3], [[5, 9], [8, 6], [3, 2]]),      # 8 in plain's top at step 1, 6 in its own
                   run([5, 6, 9], [[5, 9], [6, 8], [9, 4]])]      # 9 is not among plain's top at step 2
    assert spec_bench.compare_prompts(plain, speculating) == [
        "identical", "near-tie at step 1", "NOT a near-tie at step 2"]


@pytest.mark.parametrize("task,heads", [("rename", None), ("write", spec_bench.DEMO / "medusa")])
def test_demo_reports_each_prompt_from_an_untimed_pass_with_top_tokens(task, heads, monkeypatch):
    """The demo model on the CPU (float32, the torch kernels): the speculating run's tokens are plain
    decoding's on every prompt, with n-gram drafts and with the bundled Medusa heads drafting on prompts
    that ask for a function's body. Three timed passes, not the bench's seven: the median pass still has to
    be the one reported, and no speed is asserted."""
    monkeypatch.setattr(spec_bench, "DEMO_PASSES", 3)
    summary = spec_bench.demo(Namespace(new_tokens=24, prompts=2, speculate="4", kernel_backend="torch",
                                        task=task, draft_heads=heads and str(heads)))
    result = summary["by_speculate"]["4"]
    assert result["prompts"] == ["identical", "identical"] and summary["not_near_tie_prompts"] == 0
    assert result["top_pass_equals_timed"] and summary["outputs_identical"] and result["drafted"] > 0
    assert len(result["passes"]) == len(result["speedups"]) == spec_bench.DEMO_PASSES
    assert result["tokens_per_s"] == statistics.median(result["passes"])
    assert summary["speedup"] == statistics.median(result["speedups"])
    assert result["tokens_per_step"] > 1 and result["accepted"] > 0


def test_verify_states_copy_every_field_of_the_row_state_but_the_draft_position_ones():
    """verify_states builds each draft position's state by the constructor (not dataclasses.replace):
    every other field, present and future, must come from the row's state."""
    from dataclasses import fields, replace

    from engine.protocol.messages import FED_BACK, SamplingParams, StepRow
    from engine.sampling.sampler import RowSampling
    from engine.worker.model_worker import verify_states

    values = dict(params=SamplingParams(top_n_tokens=2), seed=7, step=3, penalty_row=4, num_tokens=11, prev_token=9,
                  grammar=object())
    assert {f.name for f in fields(RowSampling)} == set(values)
    state, plain = RowSampling(**values), RowSampling(SamplingParams(), 1, 0)
    rows = [StepRow(1, 0, 10, [FED_BACK, 21, 22], [0, 1, 2], sample=True),
            StepRow(2, 1, 5, [FED_BACK], [3], sample=True)]
    expanded = verify_states(rows, [state, plain])
    assert expanded == [state, replace(state, step=4, num_tokens=12, prev_token=21),
                        replace(state, step=5, num_tokens=13, prev_token=22), plain]


def test_host_profiles_the_work_around_the_forward_of_decode_and_verify_steps(tmp_path):
    """``host`` on the CPU: the eager PaddedDecoder and PaddedVerifier with the forward replaced by ready logits."""
    model_dir = save_tiny_model("llama", tmp_path / "llama", vocab_size=1024)
    result = spec_bench.host(Namespace(model_dir=str(model_dir), batch_sizes="1,3", context=16, repeats=2))
    assert [(r["batch_size"], r["step"]) for r in result["host"]] == [
        (1, "decode"), (1, "verify"), (3, "decode"), (3, "verify")]
    assert all(r["host_us"] > 0 and r["torch_ops"] > 0 for r in result["host"])


def test_a_decoder_for_one_request_row_takes_its_decode_steps(tmp_path):
    """max_requests = 1 (``--max-batch-size 1``): the padded decoder's inputs still hold the two shared-prefix values
    (a 1-wide buffer had failed the first decode step on the H100)."""
    model_dir = save_tiny_model("llama", tmp_path / "llama", vocab_size=1024)
    result = spec_bench.host(Namespace(model_dir=str(model_dir), batch_sizes="1", context=16, repeats=2))
    assert [(r["batch_size"], r["step"]) for r in result["host"]] == [(1, "decode"), (1, "verify")]


def test_profile_lists_the_ops_of_decode_and_verify_steps_side_by_side(tmp_path):
    """``profile`` on the CPU (op self times instead of kernels): both steps' tables, per batch size."""
    model_dir = save_tiny_model("llama", tmp_path / "llama", vocab_size=1024)
    result = spec_bench.profile(Namespace(model_dir=str(model_dir), batch_sizes="1", context=16, repeats=2))
    [one] = result["profile"]
    assert one["batch_size"] == 1 and one["decode_us"] > 0 and one["verify_us"] > 0
    names = {row["kernel"] for row in one["kernels"]}
    assert "aten::mm" in names or "aten::addmm" in names or "aten::linear" in names
