"""The fused MoE kernel equals its per-expert torch reference (and a plain dense computation); the
one-program alignment equals torch's; the routing kernel equals transformers' softmax / top-k."""
import pytest
import torch
import torch.nn.functional as F

from kernels import fused_moe as fused_moe_module
from kernels.fused_moe import (ALIGN_MAX_PAIRS, SharedExpert, align_by_expert, align_by_expert_torch, fused_moe,
                               fused_moe_ref)
from kernels.moe_route import moe_route, moe_route_ref

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,top_k,hidden,inter", [
    (128, 8, 32, 48),         # Qwen3-MoE's routing at batch 1
    (8, 2, 80, 40),           # widths that are no multiple of the tiles: masked rows and K tails
    (3, 3, 16, 8),            # every expert, fewer rows than one tile
])
def test_one_token_path_matches_reference(device, dtype, experts, top_k, hidden, inter):
    """One token (batch-1 decode) takes the two matrix-vector kernels: the same result as the
    per-expert reference, and as the grouped path computes for that token among others."""
    x, w_gate_up, w_down, weights, ids = moe_inputs(device, dtype, 3, experts, top_k, hidden, inter)
    out = fused_moe(x[:1], w_gate_up, w_down, weights[:1], ids[:1])
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, fused_moe_ref(x[:1], w_gate_up, w_down, weights[:1], ids[:1]), atol=atol, rtol=rtol)
    torch.testing.assert_close(out, fused_moe(x, w_gate_up, w_down, weights, ids)[:1], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5])
def test_shared_expert_is_added_with_its_sigmoid_gate(device, dtype, tokens):
    """Qwen2-MoE's shared expert: one token mixes it in inside the down kernel, more tokens after the
    grouped GEMMs; both equal the reference, which is transformers' formula written out."""
    hidden, inter, shared_inter = 48, 40, 72          # the shared expert is wider than an expert, as in Qwen1.5-MoE
    x, w_gate_up, w_down, weights, ids = moe_inputs(device, dtype, tokens, 6, 2, hidden, inter)
    shared = SharedExpert((torch.randn(2 * shared_inter, hidden, device=device) / hidden**0.5).to(dtype),
                          (torch.randn(hidden, shared_inter, device=device) / shared_inter**0.5).to(dtype),
                          torch.randn(tokens, 1, device=device).to(dtype))
    out = fused_moe(x, w_gate_up, w_down, weights, ids, shared)
    ref = fused_moe_ref(x, w_gate_up, w_down, weights, ids, shared)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    h = x.float() @ shared.gate_up.float().T
    expert = (F.silu(h[:, :shared_inter]) * h[:, shared_inter:]) @ shared.down.float().T
    formula = dense(x, w_gate_up, w_down, weights, ids) + torch.sigmoid(shared.gate_logits.float()) * expert
    torch.testing.assert_close(ref.float(), formula, atol=max(atol, 1e-4) * 4, rtol=max(rtol, 1e-4) * 4)
    with pytest.raises(ValueError, match="shared expert shapes disagree"):
        fused_moe(x, w_gate_up, w_down, weights, ids, shared._replace(gate_logits=shared.gate_logits[:, :0]))


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


def test_the_one_token_gate_up_launch_passes_no_stride_of_one_without_a_shared_expert(device, monkeypatch):
    """Without a shared expert the gate|up launch's shared-expert arguments are unread, but its row stride enters
    the kernel's choice of each pair's stride. Triton compiles an int argument equal to 1 as the constant 1, and
    that stand-in lost the proof that every weight row starts 16-aligned: 2-byte weight loads instead of 16-byte
    ones (one H200, Qwen3-30B-A3B's launch 20.5 -> 15.2 us with the experts' own stride there)."""
    real, launches = fused_moe_module._one_token_gate_up_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(args)
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(fused_moe_module, "_one_token_gate_up_kernel", Recorder())
    x, w_gate_up, w_down, weights, ids = moe_inputs(device, torch.bfloat16, 1, 8, 2)
    out = fused_moe(x, w_gate_up, w_down, weights, ids)
    (args,) = launches
    stride_wn, shared_stride_wn = args[7], args[11]       # the experts' row stride; the shared expert's (unread)
    assert shared_stride_wn == stride_wn == w_gate_up.stride(1)
    torch.testing.assert_close(out, fused_moe_ref(x, w_gate_up, w_down, weights, ids), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [
    (1, 8, 128, 16),       # Qwen3-30B-A3B at batch 1
    (16, 8, 128, 16),      # ALIGN_MAX_PAIRS pairs: the most one program takes
    (32, 2, 8, 64),        # Mixtral's 64-row blocks (more pairs than 4 x experts)
    (7, 3, 5, 4),          # ragged runs, an expert count that is not a power of two
    (2, 1, 1, 16),         # one expert
])
def test_one_program_aligns_like_torch(device, tokens, top_k, experts, block_m):
    """The one-program alignment (up to ALIGN_MAX_PAIRS pairs) builds torch's layout exactly: every
    sorted pair, the padding, each block's expert and the used length."""
    g = torch.Generator().manual_seed(tokens * 100 + experts)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(device)
    assert ids.numel() <= ALIGN_MAX_PAIRS
    ours = align_by_expert(ids.to(torch.int32), experts, block_m)
    torch_ops = align_by_expert_torch(ids, experts, block_m)
    for name, a, b in zip(("sorted_ids", "block_expert", "used"), ours, torch_ops):
        assert torch.equal(a.cpu().long(), b.cpu().long()), name


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k,renormalize,rounded", [
    (1, 8, 2, True, False),        # Mixtral
    (5, 128, 8, True, True),       # Qwen3-MoE
    (3, 60, 4, False, True),       # Qwen1.5-MoE
    (4, 7, 7, False, False),       # every expert, an odd count
])
def test_routing_equals_softmax_topk(device, logits_dtype, tokens, experts, top_k, renormalize, rounded):
    # distinct logits, exact in bfloat16: no tie at the k-th place, where either expert would be right
    logits = torch.stack([torch.randperm(experts) * (4 / experts) for _ in range(tokens)]).to(device, logits_dtype)
    round_dtype = torch.bfloat16 if rounded else None
    weights, ids = moe_route(logits, top_k, renormalize, round_dtype)
    ref_weights, ref_ids = moe_route_ref(logits, top_k, renormalize, round_dtype)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 == ref_ids.dtype
    # compared expert by expert (the order of the k slots is not the contract)
    order, ref_order = ids.argsort(dim=-1), ref_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(-1, order), ref_ids.gather(-1, ref_order))
    tol = 2 ** -8 if rounded else 1e-6
    torch.testing.assert_close(weights.gather(-1, order), ref_weights.gather(-1, ref_order), atol=tol, rtol=tol)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens, device=device), atol=tol * top_k, rtol=0)


def test_routing_refuses_what_it_cannot_route(device):
    logits = torch.randn(2, 4, device=device)
    with pytest.raises(ValueError, match="top_k 5 must be 1 to the 4 experts"):
        moe_route(logits, 5, True)
    with pytest.raises(ValueError, match="contiguous along the experts"):
        moe_route(logits.T, 1, True)
    with pytest.raises(ValueError, match="round_dtype"):
        moe_route(logits, 1, True, torch.int8)


# the interpreter's numpy warns of the NaN arithmetic that this test is about
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("experts,top_k", [(128, 8), (60, 4), (8, 2)])
def test_routing_of_nan_logits_chooses_only_real_experts(device, experts, top_k):
    # NaN activations (a float16 overflow, a broken checkpoint) must not pick an expert past the last: the expert
    # kernels would read (and the batch path's alignment write) out of bounds, and a CUDA fault ends the worker
    logits = torch.randn(4, experts, device=device)
    logits[0] = float("nan")                     # the whole row
    logits[1, 3] = float("nan")                  # one expert
    logits[2, :-1] = float("nan")                # all but the last
    logits[3, ::2] = float("inf")                # infinite logits give NaN probabilities
    weights, ids = moe_route(logits, top_k, True, torch.bfloat16)
    assert ids.min().item() >= 0 and ids.max().item() < experts, ids
    assert weights.isnan().all(), weights        # NaN in, NaN out: nothing pretends the row was routed
    x, w_gate_up, w_down, _, _ = moe_inputs(device, torch.float32, 4, experts, top_k)
    fused_moe(x, w_gate_up, w_down, weights, ids)                        # batch path: aligns by these ids
    fused_moe(x[:1], w_gate_up, w_down, weights[:1], ids[:1])             # one-token path
