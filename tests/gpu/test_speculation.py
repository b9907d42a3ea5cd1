"""Speculative decoding on one GPU: the tokens (bench/gpu_run.sh stage ``spec``, which also runs the speed benches).

* the demo model, one request at a time, on prompts that quote their input (standard-library
  functions "renamed"), with 4 and 8 drafts: the tokens on every prompt up to a near-tie: in bfloat16
  a verify row's logits (prefill attention over 1 + N rows) may round apart from a decode step's,
  which changes the greedy token only where the best two nearly tie (tests/gpu/greedy.py
  ``near_tie_problem``, on the top tokens of an untimed pass of each engine; the count of identical
  prompts is printed; the float32 CPU tests demand identical tokens). The run's speed-ups are printed,
  not asserted: issue 20's targets (>= 1.8x at batch 1; a verify step <= 1.15x a decode step,
  ``bench.spec_bench verify``; random prompts >= 0.95x with --speculate 2, ``bench.spec_bench load``)
  are benchmarks, read from the stage's output;
* the demo's Medusa heads through the CUDA graphs, likewise.
"""
from argparse import Namespace

from bench import spec_bench


def _assert_only_near_ties(summary: dict) -> None:
    """No prompt parts from --speculate 0 but at a near-tie (bfloat16); the identical ones are counted."""
    for n, result in summary["by_speculate"].items():
        print(f"speculate {n}: {result['identical_prompts']}/{len(result['prompts'])} prompts identical to "
              f"speculate 0; {result['prompts']}")
    assert summary["not_near_tie_prompts"] == 0, summary["by_speculate"]


def test_demo_model_rename_prompts_with_4_and_8_drafts_keep_the_tokens():
    """Batch-1 tokens/s with --speculate 4 and 8 beside 0 printed (the numbers the CPU replay
    ``python -m bench.spec_bench steps`` explains: tokens per step, waiting steps)."""
    summary = spec_bench.demo(Namespace(new_tokens=256, speculate="4,8"))
    print(summary)
    _assert_only_near_ties(summary)
    assert all(r["accepted"] > 0 for r in summary["by_speculate"].values()), summary


def test_demo_medusa_heads_through_the_cuda_graphs_keep_the_tokens():
    """The bundled Medusa heads (weights/demo/medusa) read the hidden states that the decode and verify
    CUDA graphs return beside their logits: on write prompts (the heads draft where the request does not
    quote itself) the tokens are --speculate 0's up to near-ties, and drafts are accepted."""
    summary = spec_bench.demo(Namespace(new_tokens=128, task="write", draft_heads=str(spec_bench.DEMO / "medusa")))
    print(summary)
    _assert_only_near_ties(summary)
    assert summary["by_speculate"]["4"]["accepted"] > 0, summary
