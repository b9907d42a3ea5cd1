"""Tiny random checkpoints saved with transformers' ``save_pretrained`` (for tests).

Weights use a larger init scale than transformers' default so that logits are peaked:
greedy choices then never hinge on float rounding noise.
"""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, vocab_size=384,
              max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.15,
              bos_token_id=1, eos_token_id=2)

FAMILIES = {
    # name: (config class, model class, overrides)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2,
                                                             head_dim=8, sliding_window=4096)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1,
                                                       tie_word_embeddings=True)),
    # a window far shorter than prompt + generation, so the kernels' window really matters
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2,
                                                                    head_dim=8, sliding_window=7)),
    # Qwen2 slides only from max_window_layers on: layer 1 of 2
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                              use_sliding_window=True, sliding_window=5,
                                                              max_window_layers=1)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=24)),
    # layer 0 slides (window 6), layer 1 is global; soft-caps small enough to bend random scores
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
        attn_logit_softcapping=3.0, final_logit_softcapping=8.0, hidden_activation="gelu_pytorch_tanh")),
    # longrope (short factors and the attention factor here: no sequence passes 64 tokens; the long
    # factors are proven by tests/unit/test_phi3_longrope.py, see there why not here)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, original_max_position_embeddings=64, pad_token_id=0,
        sliding_window=9,   # shorter than prompt + generation: the kernels' window matters
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                      "long_factor": [1.2, 1.9, 2.8, 4.0, 5.5, 7.3, 9.4, 12.0]})),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, use_bias=True, norm_epsilon=1e-5,
        hidden_act="gelu_pytorch_tanh", sliding_window=8, tie_word_embeddings=True, pad_token_id=0)),
    # 6 heads: not a power of two, so the ALiBi slopes take the odd steps of the next power's sequence
    # (and each of 2 shards holds 3 heads' slopes, sliced from the list for all 6); no rotary embedding
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=96, n_head=6, layer_norm_epsilon=1e-5,
                                                       pad_token_id=0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2,
                                                             num_local_experts=8, num_experts_per_tok=2)),
    # top-4 of 8 without renormalisation, the shared expert, layer 1 dense (mlp_only_layers)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=4,
        moe_intermediate_size=48, shared_expert_intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=True)),
}


def save_tiny_model(family: str, path: Path, seed: int = 0, dtype=torch.float32, **config_overrides) -> Path:
    config_cls, model_cls, overrides = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, **config_overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)   # transformers zero-inits biases; make them matter
            elif "norm" in name:
                p.uniform_(0.5, 1.5)  # and ones-inits norms
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf(path: Path, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


TOKENIZER_CORPUS = ["the quick brown fox jumps over the lazy dog. hello world, hello there! def main(): return 0\n"
                    "generation inference server tokens stream of text: 0123456789 " * 8]


def save_tiny_tokenizer(path: Path, vocab_size: int = 384) -> Path:
    """A byte-level BPE tokenizer (<unk>=0, <s>=1, </s>=2; prompts start with <s>) trained on
    ASCII text, so non-ASCII characters stay split into byte-level tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TOKENIZER_CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    return path


def save_tiny_server_model(family: str, path: Path, seed: int = 0) -> Path:
    """A tiny checkpoint with a tokenizer: what `launcher.py --model-id` needs."""
    save_tiny_model(family, path, seed)
    return save_tiny_tokenizer(path)


def save_medusa_heads(path: Path, base: Path, num_heads: int = 3, num_layers: int = 1, own_out: bool = True,
                      fit_prompts: tuple[list[int], ...] = (), new_tokens: int = 20, seed: int = 0) -> Path:
    """Medusa heads for the tiny checkpoint ``base``, saved as TGI loads them: config.json
    (``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``) and
    ``medusa_lm_head.safetensors``. The residual blocks are random; with ``own_out`` each head has its
    own out projection, fitted (least squares over the blocks' outputs) where ``fit_prompts`` are given,
    so that along those prompts' greedy continuations every head names exactly the token it drafts
    (at most hidden_size positions per head), else random; without it the heads share the model's head."""
    import json

    from safetensors.torch import save_file

    from engine.models.medusa import residual_blocks

    model = load_hf(base)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for k in range(num_heads):
        for j in range(num_layers):
            tensors[f"{k}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=generator) * 0.1
            tensors[f"{k}.{j}.linear.bias"] = torch.randn(hidden, generator=generator) * 0.1
    if own_out:
        states, targets = _continuation_states(model, fit_prompts, new_tokens, num_heads)
        for k in range(num_heads):
            out = torch.randn(vocab, hidden, generator=generator) * 0.3
            if states:
                x = residual_blocks(tensors, k, num_layers, torch.cat(states))
                wanted = torch.nn.functional.one_hot(torch.tensor(targets[k]), vocab).double() * 10
                out = (torch.linalg.pinv(x.double()) @ wanted).T.float()
            tensors[f"{k}.{num_layers}.weight"] = out
    path.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "medusa_lm_head.safetensors"))
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": str(base)}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _continuation_states(model, prompts, new_tokens: int, num_heads: int):
    """(final hidden states at each position from every prompt's last token on, per head k the token at
    position + 2 + k), along each prompt's greedy continuation; positions whose target lies past the
    continuation are dropped for every head (so all heads share the rows)."""
    states, targets = [], [[] for _ in range(num_heads)]
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            sequence = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0]
            hidden = model(sequence[None], output_hidden_states=True).hidden_states[-1][0]
        positions = range(len(prompt) - 1, len(sequence) - 1 - num_heads)
        states.append(hidden[list(positions)])
        for k in range(num_heads):
            targets[k].extend(sequence[t + 2 + k].item() for t in positions)
    return states, targets

