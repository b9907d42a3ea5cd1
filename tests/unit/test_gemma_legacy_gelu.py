"""Gemma 1's configs say ``hidden_act: "gelu"``, a legacy value for the tanh GeLU it was trained with (the
Gemma team's fix, and transformers 5.24's mapping in GemmaConfig). The engine runs the tanh one for it,
whatever the installed transformers does with the value (the GPU machine's 5.17 builds the exact GeLU)."""
import json

import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import SamplingParams
from tests.tiny_models import load_hf, save_tiny_model

PROMPTS = [[5, 77, 300, 12, 9], [200, 3, 41]]
NEW_TOKENS = 6


def legacy_gemma(tmp_path):
    """A tiny Gemma 1 checkpoint whose config.json says "gelu" as the released ones do (transformers may
    rewrite the value when it saves)."""
    path = save_tiny_model("gemma", tmp_path / "gemma")
    config_file = path / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "hidden_act": "gelu"}))
    return path


def reference_logprobs(path, activation: torch.nn.Module) -> list[list[torch.Tensor]]:
    """transformers' float32 greedy run with every MLP's activation set to ``activation``: each step's logprobs."""
    hf = load_hf(path)
    for layer in hf.model.layers:
        layer.mlp.act_fn = activation
    runs = []
    for prompt in PROMPTS:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
        runs.append([torch.log_softmax(step[0].float(), -1) for step in out.logits])
    return runs


def engine_outputs(path):
    requests = [GenerationRequest(i, p, NEW_TOKENS, SamplingParams(), stop_token_ids=[]) for i, p in enumerate(PROMPTS)]
    with Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend="torch", dtype="float32",
                             num_slots=256, max_requests=4)) as engine:
        out = engine.generate(requests)
    return [out[i] for i in range(len(PROMPTS))]


def largest_gap(ours, reference) -> float:
    """Largest |logprob| difference of our chosen tokens, the reference's greedy path assumed the same."""
    return max(abs(o.logprob - ref[o.token_id].item()) for run, refs in zip(ours, reference)
               for o, ref in zip(run, refs))


def test_a_legacy_gelu_config_runs_the_tanh_gelu(tmp_path):
    path = legacy_gemma(tmp_path)
    ours = engine_outputs(path)
    tanh = reference_logprobs(path, torch.nn.GELU(approximate="tanh"))
    exact = reference_logprobs(path, torch.nn.GELU())
    assert [[o.token_id for o in run] for run in ours] == [[int(r.argmax()) for r in refs] for refs in tanh]
    tanh_gap, exact_gap = largest_gap(ours, tanh), largest_gap(ours, exact)
    assert tanh_gap < 2e-5
    assert exact_gap > 20 * tanh_gap and exact_gap > 1e-4, "the exact GeLU must be told apart from the tanh one"
