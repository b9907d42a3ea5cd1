"""Reads before the PDL wait (``kernels._pdl``) on the GPU.

A launch may read before ``griddepcontrol.wait`` only what launches at least two back wrote. The decode
attention reads its request's row and length before its wait (the step's inputs) and everything else after
it; the newest key and value rows are written by the launch just before it (``rotary_store_kv``). Here the
launch just before is a stand-in that lets the next launch start, then waits ``DELAY_NS`` and only then
writes the newest rows: an attention that read its keys before its wait (all of them, or a block gathered
early without the newest position read again after it) would attend to the old rows. A control kernel that
does read before its wait shows the window is real (it sees the old row). Every kernel runs once before
(compiled: a compile between the two launches would close the window).

The rotary kernel reads the positions and slots before its wait (the step's inputs, written before the norm and
the qkv projection) and q, k, v after it (the projection, the launch just before): a late writer of the positions
and slots two launches back, then one of q, k, v just before. So does the decode attention with its lengths.

The one-token MoE down kernel reads the chosen experts and their router weights before its wait (written two
launches back) and the gate|up output after it (the launch just before): two late writers in a row, each
delayed, stand in for the routing and the gate|up launch."""
import math

import pytest
import torch
import triton
import triton.language as tl

from kernels._pdl import allow_next_kernel, use_pdl, wait_for_prior_kernel
from kernels.decode_attention import decode_attention, decode_attention_ref
from kernels.fused_moe import one_token_down
from kernels.rotary import rotary_store_kv

DELAY_NS = 2_000_000   # far longer than the host takes to launch the next kernel
BLOCK = 1024


@triton.jit
def _late_copy_kernel(src_ptr, dst_ptr, n, delay_ns, BLOCK: tl.constexpr):
    """dst[:n] = src[:n], written ``delay_ns`` after this launch let the next one start."""
    wait_for_prior_kernel(True)
    allow_next_kernel(True)
    start = tl.extra.cuda.globaltimer()
    while tl.extra.cuda.globaltimer() - start < delay_ns:
        pass
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _early_read_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """The control: dst[:n] = src[:n] read before the wait (what the rule forbids for the launch just before)."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n, cache_modifier=".cg")
    wait_for_prior_kernel(True)
    allow_next_kernel(True)
    tl.store(dst_ptr + offs, x, mask=offs < n)


def late_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    _late_copy_kernel[(1,)](src, dst, src.numel(), DELAY_NS, BLOCK=BLOCK, launch_pdl=True)


def one_request(seq_len: int, q_heads: int, kv_heads: int, head_dim: int, dtype, device):
    """A cache of seq_len + 8 slots in a shuffled order, one request over the first seq_len of them."""
    slots = seq_len + 8
    kv_layer = torch.randn(slots + 1, 2 * kv_heads, head_dim, device=device).to(dtype)
    table = torch.zeros(1, seq_len + 16, dtype=torch.int32, device=device)
    table[0, :seq_len] = (torch.randperm(slots, device=device)[:seq_len] + 1).to(torch.int32)
    q = torch.randn(1, q_heads, head_dim, device=device).to(dtype)
    rows = torch.zeros(1, dtype=torch.int32, device=device)
    lengths = torch.tensor([seq_len], dtype=torch.int32, device=device)
    return q, kv_layer, table, rows, lengths, 1 / math.sqrt(head_dim)


@pytest.fixture(autouse=True)
def needs_pdl():
    if not use_pdl(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs compute capability 9 or newer (and ENGINE_PDL not 0)")


def test_the_control_reads_the_old_row_before_its_wait():
    old = torch.zeros(256, device="cuda")
    new = torch.ones(256, device="cuda")
    seen = torch.full((256,), -1.0, device="cuda")
    late_copy(old, old)
    _early_read_kernel[(1,)](old, seen, 256, BLOCK=256, launch_pdl=True)
    torch.cuda.synchronize()
    late_copy(new, old)
    _early_read_kernel[(1,)](old, seen, 256, BLOCK=256, launch_pdl=True)
    torch.cuda.synchronize()
    assert old.eq(1).all()
    assert seen.eq(0).all(), "the early read saw the late write: no overlap, so the tests below prove nothing"


@pytest.mark.parametrize("seq_len", [1, 20, 33, 384, 1000])
@pytest.mark.parametrize("q_heads,kv_heads", [(32, 32), (32, 4)])
@pytest.mark.parametrize("num_splits", [1, 16])
def test_decode_attention_sees_the_newest_key_written_by_the_launch_before(seq_len, q_heads, kv_heads, num_splits):
    q, kv_layer, table, rows, lengths, scale = one_request(seq_len, q_heads, kv_heads, 128, torch.bfloat16, "cuda")
    newest = int(table[0, seq_len - 1])
    fresh = torch.randn(2 * kv_heads, 128, device="cuda").to(torch.bfloat16) * 4
    stale = kv_layer[newest].clone()
    late_copy(stale, kv_layer[newest])
    decode_attention(q, kv_layer, table, rows, lengths, scale, num_splits=num_splits)
    torch.cuda.synchronize()
    late_copy(fresh, kv_layer[newest])
    out = decode_attention(q, kv_layer, table, rows, lengths, scale, num_splits=num_splits)
    torch.cuda.synchronize()
    assert kv_layer[newest].equal(fresh)
    settled = decode_attention(q, kv_layer, table, rows, lengths, scale, num_splits=num_splits)
    assert out.equal(settled)
    kv_layer[newest] = stale
    with_stale = decode_attention(q, kv_layer, table, rows, lengths, scale, num_splits=num_splits)
    assert not out.equal(with_stale)
    kv_layer[newest] = fresh
    torch.testing.assert_close(out, decode_attention_ref(q, kv_layer, table, rows, lengths, scale),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("seq_len", [20, 384])
def test_decode_attention_reads_the_length_two_back_and_the_newest_key_written_by_the_launch_before(seq_len):
    q, kv_layer, table, _, _, scale = one_request(seq_len, 32, 4, 128, torch.bfloat16, "cuda")
    meta = torch.tensor([0, seq_len - 8], dtype=torch.int32, device="cuda")    # (row, length): the old length
    rows, lengths = meta[0:1], meta[1:2]
    new_meta = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")
    newest = int(table[0, seq_len - 1])
    fresh = torch.randn(8, 128, device="cuda").to(torch.bfloat16) * 4

    def launches(meta_src):
        late_copy(meta_src, meta)                       # the step's inputs, two launches back
        late_copy(fresh, kv_layer[newest])              # the rotary launch, just before
        out = decode_attention(q, kv_layer, table, rows, lengths, scale)
        torch.cuda.synchronize()
        return out

    launches(meta.clone())                              # compiled, the old length kept
    raced = launches(new_meta)
    assert meta.equal(new_meta)
    settled = decode_attention(q, kv_layer, table, rows, lengths, scale)
    assert raced.equal(settled), "the decode attention read its length or the newest key before they were written"
    old_length = decode_attention(q, kv_layer, table, rows, torch.tensor([seq_len - 8], dtype=torch.int32,
                                                                         device="cuda"), scale)
    assert not raced.equal(old_length), "the old length gives the same output: the race proves nothing"
    # the control: the length written by the launch just before (the order the rule forbids) is read old
    meta[1] = seq_len - 8
    late_copy(new_meta, meta)
    out = decode_attention(q, kv_layer, table, rows, lengths, scale)
    torch.cuda.synchronize()
    assert meta.equal(new_meta)
    assert out.equal(old_length), "the length was read after the launch before wrote it: the window is shut"


def rope_cache(positions: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    angles = torch.arange(positions, device="cuda").float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@pytest.mark.parametrize("head_norms", [False, True])
def test_rotary_reads_positions_and_slots_two_back_and_q_k_v_written_by_the_launch_before(head_norms):
    tokens, q_heads, kv_heads, head_dim = 3, 32, 4, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.empty(tokens, width, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    new_qkv = torch.randn(tokens, width, device="cuda", generator=g).to(torch.bfloat16)
    meta = torch.tensor([[5, 6, 7], [1, 2, 3]], dtype=torch.int64, device="cuda")       # (positions, slots): old
    new_meta = torch.tensor([[900, 17, 3000], [9, 10, 11]], dtype=torch.int64, device="cuda")
    cache = rope_cache(4096, head_dim)
    kv_layer = torch.zeros(16, 2 * kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    norms = (torch.rand(head_dim, device="cuda", generator=g).to(torch.bfloat16) + 0.5,
             torch.rand(head_dim, device="cuda", generator=g).to(torch.bfloat16) + 0.5, 1e-6) if head_norms else None

    def launches(meta_src, meta_first=True):
        kv_layer.zero_()
        writers = [(meta_src, meta), (new_qkv, qkv)]        # the step's inputs two launches back, then q, k, v
        for src, dst in writers if meta_first else writers[::-1]:
            late_copy(src, dst)
        rotary_store_kv(q, k, v, meta[0], cache, kv_layer, meta[1], head_norms=norms)
        torch.cuda.synchronize()
        return q.clone(), kv_layer.clone()

    launches(meta.clone())                                   # compiled, the old positions and slots kept
    raced_q, raced_kv = launches(new_meta)
    assert meta.equal(new_meta)
    qkv.copy_(new_qkv)
    kv_layer.zero_()
    rotary_store_kv(q, k, v, meta[0], cache, kv_layer, meta[1], head_norms=norms)
    assert raced_q.equal(q) and raced_kv.equal(kv_layer), "the rotary read something before it was written"
    assert raced_kv[9:12].abs().sum() > 0 and raced_kv[1:4].abs().sum() == 0
    # the control: the positions and slots written by the launch just before are read old
    meta.copy_(torch.tensor([[5, 6, 7], [1, 2, 3]], device="cuda"))
    control_q, control_kv = launches(new_meta, meta_first=False)
    assert meta.equal(new_meta)
    assert not control_q.equal(raced_q) and control_kv[1:4].abs().sum() > 0, \
        "the positions were read after the launch before wrote them: the window is shut"


def down_inputs(top_k: int, experts: int, inter: int, seed: int):
    """act [k, I] and a routing buffer (int32: k expert ids, then k float32 router weights as their bits)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    act = torch.randn(top_k, inter, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randperm(experts, device="cuda", generator=g)[:top_k].to(torch.int32)
    weights = torch.rand(top_k, device="cuda", generator=g).softmax(0)
    return act, torch.cat([ids, weights.view(torch.int32)])


def down_reference(act, routing, w_down, top_k):
    """The down half of fused_moe_ref in float32: sum_j act[j] @ w_down[ids[j]].T * weights[j]."""
    ids, weights = routing[:top_k].long(), routing[top_k:].view(torch.float32)
    return sum(((act[j:j + 1].float() @ w_down[ids[j]].float().T) * weights[j]) for j in range(top_k))


@pytest.mark.parametrize("top_k,experts,inter,hidden", [(8, 16, 768, 2048), (4, 8, 1408, 2048)])
def test_moe_down_reads_the_routing_two_back_and_the_act_written_by_the_launch_before(top_k, experts, inter,
                                                                                       hidden):
    w_down = (torch.randn(experts, hidden, inter, device="cuda") * 0.05).to(torch.bfloat16)
    act, routing = torch.empty(top_k, inter, device="cuda", dtype=torch.bfloat16), torch.empty(
        2 * top_k, dtype=torch.int32, device="cuda")
    ids, weights = routing[:top_k], routing[top_k:].view(torch.float32)
    out = torch.empty(1, hidden, device="cuda", dtype=torch.bfloat16)
    old_act, old_routing = down_inputs(top_k, experts, inter, 1)
    new_act, new_routing = down_inputs(top_k, experts, inter, 2)

    def launches(act_src, routing_src):
        late_copy(routing_src, routing)        # the routing, two launches back
        late_copy(act_src, act)                # the gate|up output, the launch just before
        one_token_down(act, w_down, ids, weights, out)
        torch.cuda.synchronize()
        return out.clone()

    launches(old_act, old_routing)             # compiled, and the buffers hold the old values
    raced = launches(new_act, new_routing)
    assert act.equal(new_act) and routing.equal(new_routing)
    one_token_down(act, w_down, ids, weights, out)
    assert raced.equal(out), "the down launch read something before it was written"
    act.copy_(old_act)
    one_token_down(act, w_down, ids, weights, out)
    assert not raced.equal(out), "the old act gives the same output: the race proves nothing"
    torch.testing.assert_close(raced.float(), down_reference(new_act, new_routing, w_down, top_k),
                               atol=2e-2, rtol=2e-2)
    # the control: with the routing written by the launch just before (the order the rule forbids), the
    # reads before the wait see the old routing, so the output is not the settled one
    act.copy_(new_act)
    routing.copy_(old_routing)
    late_copy(new_routing, routing)
    one_token_down(act, w_down, ids, weights, out)
    torch.cuda.synchronize()
    assert routing.equal(new_routing)
    assert not out.equal(raced), "the routing was read after the launch before wrote it: the window is shut"
