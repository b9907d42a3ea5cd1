"""The fused MoE kernel equals its per-expert torch reference (and a plain dense computation)."""
import pytest
import torch
import torch.nn.functional as F

from kernels.fused_moe import align_by_expert, fused_moe, fused_moe_ref

TOL = {torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-5, 1e-5)}


def moe_inputs(device, dtype, tokens, experts, top_k, hidden=32, inter=48, unused=()):
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, device=device)
    logits[:, list(unused)] = -1e9                        # these experts get no token
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return x, w_gate_up, w_down, weights, ids


def dense(x, w_gate_up, w_down, weights, ids):
    """Every token through every expert, masked to its chosen ones."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_gate_up.shape[0]):
        h = x.float() @ w_gate_up[e].float().T
        inter = h.shape[1] // 2
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w_down[e].float().T
        out += y * (weights * (ids == e)).sum(-1, keepdim=True)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k,unused", [
    (1, 4, 1, ()),            # decode, top-1
    (5, 8, 2, (0, 3, 6)),     # ragged runs, experts with no token
    (3, 8, 8, ()),            # every expert chosen by every token
    (70, 4, 2, (1,)),         # more pairs than a 64-row block
])
def test_fused_moe_matches_reference(device, dtype, tokens, experts, top_k, unused):
    args = moe_inputs(device, dtype, tokens, experts, top_k, unused=unused)
    out = fused_moe(*args)
    ref = fused_moe_ref(*args)
    assert out.shape == ref.shape and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    if dtype == torch.float32:
        torch.testing.assert_close(ref, dense(*args), atol=1e-4, rtol=1e-4)


def test_align_groups_pairs_by_expert_in_padded_blocks(device):
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=device)
    sorted_ids, block_expert, used = align_by_expert(ids, 4, 4)
    assert used.item() == 12                                   # experts 0, 2, 3: one 4-row block each
    assert sorted_ids[:12].tolist() == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6]
    assert block_expert[:3].tolist() == [0, 2, 3]
    assert sorted_ids.numel() == 20 and torch.all(sorted_ids[12:] == 6)     # 6 + min(4, 6) * 3 -> 20
    one = align_by_expert(torch.tensor([[5, 1]], device=device), 128, 16)[0]
    assert one.numel() == 32                                   # 2 pairs: 2 + 2 * 15, not one block per expert


def test_fused_moe_rejects_mismatched_shapes(device):
    x, w_gate_up, w_down, weights, ids = moe_inputs(device, torch.float32, 2, 4, 2)
    with pytest.raises(ValueError, match=r"expected \[E, 2I, H\] and \[E, H, I\]"):
        fused_moe(x, w_gate_up, w_down[:, :, :5], weights, ids)
    with pytest.raises(ValueError, match="must both be"):
        fused_moe(x, w_gate_up, w_down, weights[:1], ids[:1])


def test_only_the_chosen_experts_weights_are_read(device):
    """Experts no token chose hold NaN: the output stays finite and equal to the reference
    (a block reads its own expert's weights only; at decode, only the chosen experts')."""
    x, w_gate_up, w_down, weights, ids = moe_inputs(device, torch.float32, 1, 8, 2)
    unused = [e for e in range(8) if e not in ids.tolist()[0]]
    w_gate_up[unused], w_down[unused] = float("nan"), float("nan")
    out = fused_moe(x, w_gate_up, w_down, weights, ids)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, fused_moe_ref(x, w_gate_up, w_down, weights, ids), atol=1e-5, rtol=1e-5)
