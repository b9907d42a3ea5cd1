"""The watermark (Kirchenbauer et al.): green lists, the logit bias, the detector, the flags."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers

from engine.generation import Engine, EngineConfig, GenerationRequest
from tgi_compat.launch_config import LaunchConfig, LaunchError, resolve_limits
from engine.ops import KernelOps
from engine.sampling.sampler import RowSampling, Sampler
from engine.protocol.messages import SamplingParams
from engine.assembly import plan_engine
from tgi_compat.launch_plan import engine_config
from engine.sampling.watermark import WatermarkConfig, apply_watermark, detect, is_green

DEMO = Path(__file__).resolve().parents[2] / "weights" / "demo"
VOCAB = 50000


@pytest.mark.parametrize("gamma", [0.1, 0.25, 0.5, 0.75])
def test_green_lists_hold_a_gamma_fraction_and_change_with_the_previous_token(gamma):
    vocab = torch.arange(VOCAB)[None, :]
    green = is_green(torch.tensor([[7], [8], [123456]]), vocab, gamma)
    assert torch.allclose(green.float().mean(1), torch.full((3,), gamma), atol=0.01)
    overlap = (green[0] & green[1]).float().mean().item()           # independent lists overlap by gamma^2
    assert abs(overlap - gamma**2) < 0.01
    assert torch.equal(green, is_green(torch.tensor([[7], [8], [123456]]), vocab, gamma))   # deterministic


def test_apply_watermark_adds_delta_to_the_green_logits_of_the_chosen_rows_only():
    scores = torch.randn(3, 1000)
    before = scores.clone()
    config = WatermarkConfig(gamma=0.3, delta=1.5)
    apply_watermark(scores, [0, 2], [11, 42], config)
    vocab = torch.arange(1000)[None, :]
    expected_green = is_green(torch.tensor([[11], [42]]), vocab, 0.3)
    assert torch.equal(scores[1], before[1])
    assert torch.allclose(scores[[0, 2]] - before[[0, 2]], 1.5 * expected_green.float())


def test_detect_scores_all_green_text_at_sqrt_t_and_refuses_foreign_ids():
    tokens, prev = [], 5
    for _ in range(64):                       # each next token: the first green one after prev
        prev = next(t for t in range(100) if is_green(torch.tensor(prev), torch.tensor(t), 0.5))
        tokens.append(prev)
    score = detect(tokens, 100, 0.5, context_token=5)
    assert (score.green, score.scored) == (64, 64) and score.z_score == pytest.approx(math.sqrt(64))
    assert detect(tokens, 100, 0.5).scored == 63          # no context: the first token is not scored
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 100\)"):
        detect([3, 100], 100)


def test_sampler_biases_watermarked_rows_before_logprobs():
    sampler = Sampler(KernelOps.create("torch"), torch.device("cpu"), watermark=WatermarkConfig(0.25, 4.0))
    logits = torch.randn(2, 500) * 0.1
    rows = [RowSampling(SamplingParams(watermark=True, top_n_tokens=3), seed=0, step=0, prev_token=9),
            RowSampling(SamplingParams(top_n_tokens=3), seed=0, step=0, prev_token=9)]
    out = sampler(logits.clone(), rows)
    green = is_green(torch.tensor([9]), torch.arange(500), 0.25)
    expected = torch.log_softmax(logits[0] + 4.0 * green.float(), -1)
    assert green[out.token_ids[0]] and out.logprobs[0] == pytest.approx(expected.max().item(), abs=1e-5)
    assert out.token_ids[1] == logits[1].argmax().item()


def test_launcher_flags_reach_the_worker_config():
    config = LaunchConfig(watermark_gamma=0.25, watermark_delta=3.0)
    assert not any("watermark" in notice for notice in config.notices)
    worker = plan_engine(engine_config(config, resolve_limits(config, 2048), str(DEMO))).worker
    assert (worker.watermark_gamma, worker.watermark_delta) == (0.25, 3.0)
    default = plan_engine(engine_config(LaunchConfig(), resolve_limits(LaunchConfig(), 2048), str(DEMO))).worker
    assert (default.watermark_gamma, default.watermark_delta) == (0.5, 2.0)        # TGI's defaults
    with pytest.raises(LaunchError, match=r"--watermark-gamma must be in \(0, 1\), got 1.0"):
        LaunchConfig(watermark_gamma=1.0)
    with pytest.raises(LaunchError, match="--watermark-delta must be >= 0.0"):
        LaunchConfig(watermark_delta=-1.0)


def test_detector_separates_watermarked_from_plain_demo_model_generations():
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO)
    engine = Engine(EngineConfig(model_dir=str(DEMO), device="cpu", kernel_backend="torch", num_slots=8192,
                                 max_requests=16, max_prefill_tokens=2048))
    prompts = ["def ", "import os\n", "class Parser:\n    def __init__(self", "for i in range(",
               "# utility functions\n", "with open(path) as f:\n"]
    requests = [GenerationRequest(len(prompts) * mark + i, tokenizer(p)["input_ids"], 200,
                                  SamplingParams(do_sample=True, seed=i, watermark=bool(mark)), stop_token_ids=[])
                for mark in (0, 1) for i, p in enumerate(prompts)]
    out = engine.generate(requests)
    z = [detect([e.token_id for e in out[r.request_id]], 4096, 0.5, context_token=r.prompt_ids[-1]).z_score
         for r in requests]
    plain, marked = z[:len(prompts)], z[len(prompts):]
    print(f"z plain {[round(v, 2) for v in plain]} watermarked {[round(v, 2) for v in marked]}")
    assert max(plain) < 2 and min(marked) > 4
