"""Phi-3's longrope on a tiny checkpoint with a 20-token original context: both factor sets.

Which set transformers uses: a forward pass whose sequence (``max(position_ids) + 1``) is longer
than ``original_max_position_embeddings`` rotates with the long factors, else the short ones.
Our engine applies that rule as ``generate`` meets it: a prompt's tokens by the prompt's length, a decoded
token by its position + 1, whatever the chunks (``layers.Rotary``, ``tests/unit/test_rope_by_length.py``).
One difference is deliberate:
when a sequence crosses the original context *during decoding*, transformers' Phi-3
``prepare_inputs_for_generation`` throws its cache away and re-prefills the whole sequence with
the long factors; we (like TGI and vLLM) keep the keys already cached. So ``generate`` parity is
proven for sequences that stay on one side, and the crossing against transformers' own forward
pass with its cache kept.
"""
import json

import pytest
import torch
import transformers

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.models import load_model_config
from engine.models.config import ModelConfigError
from engine.models.layers import Rotary
from tests.tiny_models import load_hf, save_tiny_model

ORIGINAL = 20


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = save_tiny_model("phi3", tmp_path_factory.mktemp("phi3") / "phi3", original_max_position_embeddings=ORIGINAL)
    return path, load_hf(path)


def engine_tokens(path, prompts, new_tokens, backend="torch"):
    engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend=backend, num_slots=512,
                                 dtype="float32", max_requests=8, max_prefill_tokens=64))
    out = engine.generate([GenerationRequest(i, p, new_tokens, stop_token_ids=[]) for i, p in enumerate(prompts)])
    return [[e.token_id for e in out[i]] for i in range(len(prompts))], out


def test_the_config_reads_both_factor_sets_and_the_attention_factor(phi3):
    rope = load_model_config(phi3[0]).rope
    assert rope.rope_type == "longrope" and rope.original_max_position_embeddings == ORIGINAL
    assert rope.short_factor[1] == 1.1 and rope.long_factor[-1] == 12.0
    factor = 512 / ORIGINAL        # no `factor`: the context ratio, as transformers
    assert rope.attention_factor == pytest.approx((1 + torch.log(torch.tensor(factor)).item() / torch.log(
        torch.tensor(float(ORIGINAL))).item()) ** 0.5)


def test_the_tables_are_transformers_cos_and_sin_for_both_sets(phi3):
    """Row p (short) and row p + max_positions (long) of our table: transformers' cos | sin (attention
    factor included) for a forward pass of 20 (short) and of 21 or 33 tokens (long)."""
    path, hf = phi3
    rotary = Rotary(load_model_config(path), 64, torch.float32, "cpu")
    for seq_len in (20, 21, 33):
        cos, sin = hf.model.rotary_emb(torch.zeros(1), torch.arange(seq_len)[None])
        rows = rotary.table[torch.arange(seq_len) + (64 if seq_len > ORIGINAL else 0)]
        assert torch.equal(rows, torch.cat([cos[0, :, :8], sin[0, :, :8]], dim=-1)), seq_len


def test_the_triton_rotary_kernel_reads_the_long_rows(phi3):
    path, hf = phi3
    prompts = [[5, 9, 11], list(range(30, 55))]           # short; long from the prefill on
    ours, _ = engine_tokens(path, prompts, 4, backend="triton")
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt):].tolist()


def test_short_and_long_sequences_match_transformers_generate(phi3):
    """Prompts of 3 and 6 tokens stay within 20 (short factors); of 25 and 40 beyond it from the
    prefill on (long factors)."""
    path, hf = phi3
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (3, 6, 25, 40)]
    ours, events = engine_tokens(path, prompts, 12)
    for prompt, tokens, out in zip(prompts, ours, events.values()):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
        assert tokens == ref.sequences[0, len(prompt):].tolist(), len(prompt)
        for e, logits in zip(out, ref.logits):
            assert e.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[e.token_id].item(), abs=1e-4)


def cached_greedy(hf, prompt, new_tokens):
    """transformers' model decoding with its KV cache kept at the crossing (no re-prefill)."""
    cache = transformers.DynamicCache(config=hf.config)
    ids, tokens = torch.tensor([prompt]), []
    position = 0
    with torch.no_grad():
        for _ in range(new_tokens):
            positions = torch.arange(position, position + ids.shape[1])[None]
            logits = hf(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).logits
            position += ids.shape[1]
            tokens.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens


def test_a_sequence_crossing_the_original_context_while_decoding_keeps_its_cached_keys(phi3):
    path, hf = phi3
    prompt = torch.randint(3, 384, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    ours, _ = engine_tokens(path, [prompt], 20)       # positions 10..29: the switch at 20
    assert ours[0] == cached_greedy(hf, prompt, 20)


def edited_config(tmp_path, **fields):
    path = save_tiny_model("phi3", tmp_path / "phi3")
    raw = json.loads((path / "config.json").read_text())
    raw.update(fields)
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_partial_rotary_factor_is_refused(tmp_path):
    with pytest.raises(ModelConfigError, match="partial_rotary_factor=0.75 is not supported"):
        load_model_config(edited_config(tmp_path, partial_rotary_factor=0.75))


def test_su_is_longrope_and_factors_of_the_wrong_length_are_refused(tmp_path):
    su = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    config = load_model_config(edited_config(tmp_path / "a", rope_scaling=su, rope_parameters=None))
    assert config.rope.rope_type == "longrope"
    with pytest.raises(ModelConfigError, match="head_dim / 2 = 8 values each; config.json has 8 and 3"):
        load_model_config(edited_config(tmp_path / "b", rope_scaling={**su, "long_factor": [1.0] * 3},
                                        rope_parameters=None))
