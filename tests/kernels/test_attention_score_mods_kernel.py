"""Sliding window, logit soft-capping and ALiBi inside the prefill, decode and shared-prefix
attention kernels, against their torch references (``kernels.score_mods.apply_ref``), and the
references against transformers' own definitions."""

import pytest
import torch
from kernel_inputs import ATTENTION_TOL, ON_GPU, build_kv_cache
from test_prefill_attention_kernel import prefill_inputs

from kernels.decode_attention import decode_attention, decode_attention_ref
from kernels.prefill_attention import launch, prefill_attention, prefill_attention_ref, prefill_launch
from kernels.score_mods import ScoreMods, alibi_slopes, apply_ref

# groups 1 and 4 (2 on the GPU); in the interpreter few heads (its time goes by programs, a program per kv head or
# per query block of each q head): group 1 over two kv heads, the second at a head offset (ALiBi's slopes too)
GQA = [(2, 2), (4, 1)] if not ON_GPU else [(32, 32), (32, 8), (16, 8)]
HEAD_DIM = 32 if not ON_GPU else 256        # Gemma's head dim on the GPU (its own launch table row)


def mods_cases(q_heads: int, device) -> dict[str, ScoreMods]:
    slopes = alibi_slopes(q_heads).to(device)
    return {
        "window 1": ScoreMods(window=1),
        "window 7": ScoreMods(window=7),
        "window 40": ScoreMods(window=40),      # more than a key block: whole blocks skipped before it
        "softcap": ScoreMods(softcap=0.5),      # small, so the cap bends the scores of random q, k
        "alibi": ScoreMods(alibi_slopes=slopes),
        "all three": ScoreMods(window=9, softcap=1.0, alibi_slopes=slopes),
    }


# new tokens, cached prefix per request: prompts longer than the windows, chunks late in a context
LAYOUT = ([5, 1, 45, 17], [0, 60, 31, 0])


@pytest.mark.parametrize("mods_name", list(mods_cases(4, "cpu")))
@pytest.mark.parametrize("q_heads,kv_heads", GQA)
def test_prefill_attention_with_score_mods(device, mods_name, q_heads, kv_heads):
    mods = mods_cases(q_heads, device)[mods_name]
    args = prefill_inputs(*LAYOUT, q_heads, kv_heads, HEAD_DIM, torch.float32, device)
    out = prefill_attention(*args, mods=mods)
    assert out.isfinite().all()
    torch.testing.assert_close(out, prefill_attention_ref(*args, mods=mods), atol=2e-5, rtol=2e-5)
    assert not torch.allclose(out, prefill_attention_ref(*args), atol=1e-3)   # the modification matters


@pytest.mark.parametrize("mods_name", ["window 7", "all three"])
def test_prefill_split_keys_with_score_mods(device, mods_name):
    """Split-KV parts of a windowed / capped / biased range merge to the same result (GQA group 4 on one kv head:
    the merge kernel runs a program per token and q head)."""
    mods = mods_cases(4, device)[mods_name]
    args = prefill_inputs([5, 40], [150, 90], 4, 1, HEAD_DIM, torch.float32, device)
    out = launch(*args, params=prefill_launch(args[0].shape[2], device, args[0].dtype), splits=3, mods=mods)
    torch.testing.assert_close(out, prefill_attention_ref(*args, mods=mods), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mods_name", list(mods_cases(4, "cpu")))
@pytest.mark.parametrize("q_heads,kv_heads", GQA)
def test_decode_attention_with_score_mods(device, mods_name, q_heads, kv_heads):
    """Three splits of each request's keys (some empty once the window bounds them)."""
    mods = mods_cases(q_heads, device)[mods_name]
    cache = build_kv_cache([1, 6, 50, 97], kv_heads, HEAD_DIM, torch.float32, device)
    q = torch.randn(4, q_heads, HEAD_DIM, device=device)
    args = (q, cache.kv_layer, cache.req_to_token, cache.b_req_row, cache.b_seq_len, HEAD_DIM ** -0.5)
    out = decode_attention(*args, num_splits=3, mods=mods)
    assert out.isfinite().all()
    torch.testing.assert_close(out, decode_attention_ref(*args, mods=mods), atol=2e-5, rtol=2e-5)


def test_softcap_with_a_shared_prefix(device):
    """The shared-prefix kernel applies the soft-cap; a window drops the shared prefix (same result)."""
    q_lens, prefixes, prefix = [7, 1, 20], [40, 45, 31], 30
    q, kv_layer, table, rows, q_start, q_len, seq_len, scale, max_q_len = prefill_inputs(
        q_lens, prefixes, 8, 2, HEAD_DIM, torch.float32, device)
    for m in (1, 2):
        table[rows[m], :prefix] = table[rows[0], :prefix]
    shared = (torch.full((3,), prefix, dtype=torch.int32, device=device),
              torch.tensor([int(rows[0]), prefix], dtype=torch.int32, device=device))
    args = (q, kv_layer, table, rows, q_start, q_len, seq_len, scale, max_q_len)
    for mods in (ScoreMods(softcap=0.5), ScoreMods(window=5, softcap=0.5)):
        out = prefill_attention(*args, shared=shared, mods=mods)
        torch.testing.assert_close(out, prefill_attention_ref(*args, mods=mods), atol=1e-4, rtol=1e-4)
        q1 = torch.randn(3, 8, HEAD_DIM, device=device)
        dec = (q1, kv_layer, table, rows, seq_len, scale)
        torch.testing.assert_close(decode_attention(*dec, shared=shared, mods=mods),
                                   decode_attention_ref(*dec, mods=mods), atol=1e-4, rtol=1e-4)


BF16_LAYOUT = ([300, 1, 129, 64], [0, 513, 77, 2000]) if ON_GPU else ([9, 1], [30, 20])


@pytest.mark.parametrize("mods_name", ["window 7", "all three"])
def test_bf16_prefill_with_score_mods(device, mods_name):
    """bf16 (the GPU's launch tables and split keys there)."""
    q_heads, kv_heads = GQA[-1]
    mods = mods_cases(q_heads, device)[mods_name]
    args = prefill_inputs(*BF16_LAYOUT, q_heads, kv_heads, HEAD_DIM, torch.bfloat16, device)
    atol, rtol = ATTENTION_TOL[torch.bfloat16]
    max_seq_len = max(q + p for q, p in zip(*BF16_LAYOUT))
    torch.testing.assert_close(prefill_attention(*args, mods=mods, max_seq_len=max_seq_len),
                               prefill_attention_ref(*args, mods=mods), atol=atol, rtol=rtol)


def test_alibi_slopes_are_blooms():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    for heads in (1, 4, 6, 12, 32):
        bloom = build_alibi_tensor(torch.ones(1, 3), heads, torch.float32)      # [heads, 1, 3]: slope * k_pos
        torch.testing.assert_close(alibi_slopes(heads), bloom[:, 0, 1])


def test_reference_mods_match_transformers_definitions():
    """The window is transformers' ``sliding_window_overlay`` on a causal mask; soft-capping is Gemma 2's."""
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay
    q_pos, k_pos = torch.arange(3, 9), torch.arange(9)
    scores = torch.randn(2, 6, 9) * 5
    out = apply_ref(scores, q_pos, k_pos, ScoreMods(window=4, softcap=2.0))
    overlay = sliding_window_overlay(4)
    expected_mask = torch.tensor([[bool(causal_mask_function(0, 0, q, k)) and bool(overlay(0, 0, q, k))
                                   for k in k_pos.tolist()] for q in q_pos.tolist()])
    assert torch.equal(out[0].isfinite(), expected_mask)
    capped = torch.tanh(scores / 2.0) * 2.0
    torch.testing.assert_close(out[:, expected_mask], capped[:, expected_mask])


def test_score_mods_are_checked(device):
    with pytest.raises(ValueError, match="sliding window"):
        ScoreMods(window=0)
    with pytest.raises(ValueError, match="soft-cap"):
        ScoreMods(softcap=-1.0)
    cache = build_kv_cache([3], 2, 32, torch.float32, device)
    q = torch.randn(1, 4, 32, device=device)
    with pytest.raises(ValueError, match="alibi_slopes"):
        decode_attention(q, cache.kv_layer, cache.req_to_token, cache.b_req_row, cache.b_seq_len, 1.0,
                         mods=ScoreMods(alibi_slopes=torch.ones(3, device=device)))
