import math

import pytest
import torch
from kernel_inputs import ATTENTION_TOL, ON_GPU, build_kv_cache

from kernels import shared_prefix
from kernels.decode_attention import CUDA_LAUNCH, decode_attention, decode_attention_ref, default_min_chunk, launch
from kernels.prefill_attention import prefill_attention_ref

SEQ_LENS = {
    "single": [1],
    "ragged": [1, 2, 17, 33, 64, 100],  # 17, 100: not divisible by the split counts below
}
if ON_GPU:
    SEQ_LENS["long"] = [1, 4097, 513, 2000, 31, 128, 7, 1025]
GQA = [(2, 2), (8, 2), (8, 1)] if not ON_GPU else [(32, 32), (32, 8), (32, 4), (28, 4)]
HEAD_DIMS = [32] if not ON_GPU else [64, 128]


def decode_inputs(seq_lens, q_heads, kv_heads, head_dim, dtype, device):
    cache = build_kv_cache(seq_lens, kv_heads, head_dim, dtype, device)
    # q as a strided view of a fused qkv projection
    qkv = torch.randn(len(seq_lens), (q_heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q = qkv[:, : q_heads * head_dim].view(len(seq_lens), q_heads, head_dim)
    return q, cache.kv_layer, cache.req_to_token, cache.b_req_row, cache.b_seq_len, 1 / math.sqrt(head_dim)


DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def lengths_gqa_dtypes():
    """Every set of lengths with every GQA group, the dtypes in turn: each set of lengths meets all three (as does
    each group on the GPU, with its three sets). The dtype enters the kernels only at the loads of q and K/V, the
    dots (float32 operands for float32, and everywhere in the interpreter) and the merge's rounding (bfloat16's
    own); the group only at run time (16-row tiles for every group here); the full product repeated the same walks
    for each dtype (3x the time)."""
    return [pytest.param(lengths, q_heads, kv_heads, DTYPES[(i + j) % 3], id=f"{lengths}-{q_heads}-{kv_heads}-"
                         f"{str(DTYPES[(i + j) % 3])[6:]}")
            for i, lengths in enumerate(SEQ_LENS) for j, (q_heads, kv_heads) in enumerate(GQA)]


@pytest.mark.parametrize("lengths,q_heads,kv_heads,dtype", lengths_gqa_dtypes())
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_attention_matches_reference(device, dtype, q_heads, kv_heads, lengths, head_dim):
    args = decode_inputs(SEQ_LENS[lengths], q_heads, kv_heads, head_dim, dtype, device)
    out = decode_attention(*args)
    expected = decode_attention_ref(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert out.isfinite().all()  # every row written, no read of a NaN-poisoned slot
    atol, rtol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
def test_decode_attention_split_counts(device, num_splits):
    """More splits than keys (empty splits) and chunks that do not divide the lengths."""
    args = decode_inputs([1, 3, 37, 90], 8, 2, 24 if not ON_GPU else 96, torch.float16, device)
    out = decode_attention(*args, num_splits=num_splits)
    torch.testing.assert_close(out, decode_attention_ref(*args), atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("min_chunk", [16, 64])
def test_a_split_walks_at_least_min_chunk_keys(device, min_chunk):
    """With ``min_chunk`` a short context takes fewer splits (the rest empty), and the attention is the same."""
    args = decode_inputs([1, 3, 37, 90, 130], 8, 2, 24 if not ON_GPU else 96, torch.float16, device)
    out = torch.empty_like(args[0])
    launch(*args, out, 8, 32, 4, 1, min_chunk=min_chunk)
    torch.testing.assert_close(out, decode_attention_ref(*args), atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("min_chunk", [-1, 2.5, None])
def test_a_bad_min_chunk_is_a_clear_error(device, min_chunk):
    args = decode_inputs([5], 4, 2, 32, torch.float32, device)
    with pytest.raises(ValueError, match="min_chunk must be an int >= 0"):
        launch(*args, torch.empty_like(args[0]), 2, 32, 4, 1, min_chunk=min_chunk)


def test_a_min_chunk_longer_than_every_context_walks_each_request_in_one_split(device):
    """Bit for bit the one-split walk, where 8 splits of ceil(len / 8) keys differ from it: the splits are taken."""
    args = decode_inputs([40, 77, 130], 4, 2, 32, torch.float32, device)
    one, eight, capped = (torch.empty_like(args[0]) for _ in range(3))
    launch(*args, one, 1, 32, 4, 1)
    launch(*args, eight, 8, 32, 4, 1)
    launch(*args, capped, 8, 32, 4, 1, min_chunk=256)
    assert not torch.equal(eight, one)
    assert torch.equal(capped, one)


def test_a_split_of_a_float_cache_walks_at_least_one_block_on_cuda_and_of_a_quantized_one_any_keys():
    """``default_min_chunk``: measured faster with a float cache, slower with int8 (its comment)."""
    layer = lambda dtype: torch.zeros(4, 2, 8).to(dtype)  # noqa: E731
    assert [default_min_chunk(layer(d)) for d in (torch.bfloat16, torch.float16, torch.float32)] == [CUDA_LAUNCH[0]] * 3
    assert default_min_chunk(layer(torch.int8)) == default_min_chunk(layer(torch.float8_e4m3fn)) == 0


def test_decode_reference_is_the_last_row_of_prefill(device):
    seq_lens = [1, 6, 19]
    q, kv_layer, table, rows, seq_len, scale = decode_inputs(seq_lens, 4, 2, 16, torch.float32, device)
    ones = torch.ones(len(seq_lens), dtype=torch.int32, device=device)
    starts = torch.arange(len(seq_lens), dtype=torch.int32, device=device)
    expected = prefill_attention_ref(q, kv_layer, table, rows, starts, ones, seq_len, scale, 1)
    torch.testing.assert_close(decode_attention_ref(q, kv_layer, table, rows, seq_len, scale), expected)


def test_decode_attention_rejects_bad_arguments(device):
    q, kv_layer, table, rows, seq_len, scale = decode_inputs([3, 4], 4, 2, 16, torch.float16, device)
    with pytest.raises(ValueError, match=r"kv_layer has shape \(\d+, 4, 8\); expected \(slots, 2 \* kv_heads, 16\)"):
        decode_attention(q, kv_layer[..., :8], table, rows, seq_len, scale)
    with pytest.raises(ValueError, match="req_to_token has dtype torch.int64"):
        decode_attention(q, kv_layer, table.long(), rows, seq_len, scale)
    with pytest.raises(ValueError, match=r"b_seq_len has shape \(3,\); expected \(2,\)"):
        decode_attention(q, kv_layer, table, rows, torch.cat([seq_len, seq_len[:1]]), scale)
    with pytest.raises(ValueError, match="num_splits must be None or an int in 1..64"):
        decode_attention(q, kv_layer, table, rows, seq_len, scale, num_splits=0)


def share_a_prefix(table, rows, members: list[int], prefix: int):
    """Point the first ``prefix`` positions of the member requests at the first member's slots
    (what the prefix cache does); returns (b_prefix_len, source) for ``decode_attention``."""
    source_row = rows[members[0]]
    for m in members[1:]:
        table[rows[m], :prefix] = table[source_row, :prefix]
    first = torch.zeros(len(rows), dtype=torch.int32, device=table.device)
    first[members] = prefix
    return first, torch.tensor([int(source_row), prefix], dtype=torch.int32, device=table.device)


SHARED_CASES = {
    # lengths, members, prefix length
    "some rows share": ([40, 33, 1, 50, 41, 7, 45, 36], [0, 1, 3, 4, 6, 7], 30),
    "every row, prefix but one token": ([31] * 5, [0, 1, 2, 3, 4], 30),
    "more rows than one program's tile": ([70 + i % 5 for i in range(70)], list(range(1, 70, 2)), 64),
    "no group": ([5, 9, 12], [0], 0),
}
if ON_GPU:
    SHARED_CASES["3k prefix, 256 rows"] = ([3000 + i % 60 for i in range(256)], list(range(256)), 2990)


def shared_params():
    """Every case with every GQA group, but in the interpreter "more rows than one program's tile" only with the
    groups > 1: group 1's tile is 64 requests (72 rows, 144 programs of the split kernel and of the merge: the
    costliest case by far), the same program over a second tile as the others' (``b = program_id(0) * BLOCK_B
    + row // BLOCK_G``, which group 1's BLOCK_G of 1 would not tell from a wrong BLOCK_B * BLOCK_G); group 1's tile
    of one q head a request meets every other case."""
    return [pytest.param(case, q_heads, kv_heads, id=f"{q_heads}-{kv_heads}-{case}") for case in SHARED_CASES
            for q_heads, kv_heads in GQA
            if ON_GPU or case != "more rows than one program's tile" or q_heads > kv_heads]


@pytest.mark.parametrize("case,q_heads,kv_heads", shared_params())
def test_a_shared_prefix_gives_the_same_attention(device, case, q_heads, kv_heads):
    """Cascade attention: the shared prefix walked once for all its requests, the rest per request."""
    lengths, members, prefix = SHARED_CASES[case]
    tile = 64 // (q_heads // kv_heads)          # requests per shared-prefix program (kernels.decode_attention)
    if len(lengths) > tile + 8:                 # a few more than one tile: fast under the interpreter
        lengths, members = lengths[: tile + 8], [m for m in members if m < tile + 8]
    head_dim = HEAD_DIMS[-1]
    q, kv_layer, table, rows, seq_len, scale = decode_inputs(lengths, q_heads, kv_heads, head_dim,
                                                             torch.bfloat16, device)
    shared = share_a_prefix(table, rows.tolist(), members, prefix)
    out = decode_attention(q, kv_layer, table, rows, seq_len, scale, shared=shared)
    expected = decode_attention_ref(q, kv_layer, table, rows, seq_len, scale)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, atol=ATTENTION_TOL[torch.bfloat16][0], rtol=ATTENTION_TOL[torch.bfloat16][1])


def test_a_shared_prefix_is_checked(device):
    q, kv_layer, table, rows, seq_len, scale = decode_inputs([3, 4], 4, 2, 16, torch.float16, device)
    with pytest.raises(ValueError, match="shared prefix lengths"):
        decode_attention(q, kv_layer, table, rows, seq_len, scale,
                         shared=(seq_len[:1], torch.zeros(2, dtype=torch.int32, device=device)))


@pytest.mark.parametrize("params", [shared_prefix.SHARED_LAUNCH, shared_prefix.SHARED_LAUNCH_FP32_WIDE])
def test_the_shared_prefix_launches_of_cuda_give_the_same_attention(device, params):
    """Each shared-prefix launch the CUDA table picks (float32 past head dim 128 takes the small tile: ptxas
    ran past a 75 s box on the 64-row one) through the kernel, float32 at head dim 256 (Gemma's), GQA 2, more
    rows than one tile of the small launch."""
    assert shared_prefix.default_launch(torch.device("cuda"), 256, torch.float32) == shared_prefix.SHARED_LAUNCH_FP32_WIDE
    assert shared_prefix.default_launch(torch.device("cuda"), 128, torch.float32) == shared_prefix.SHARED_LAUNCH
    assert shared_prefix.default_launch(torch.device("cuda"), 256, torch.bfloat16) == shared_prefix.SHARED_LAUNCH
    lengths = [24 + i % 3 for i in range(11)]
    q, kv_layer, table, rows, seq_len, scale = decode_inputs(lengths, 4, 2, 256, torch.float32, device)
    shared = share_a_prefix(table, rows.tolist(), list(range(1, 11)), 20)
    out = torch.empty_like(q)
    launch(q, kv_layer, table, rows, seq_len, scale, out, 2, 32, 4, 1, shared=shared, shared_launch=params)
    torch.testing.assert_close(out, decode_attention_ref(q, kv_layer, table, rows, seq_len, scale),
                               atol=ATTENTION_TOL[torch.float32][0], rtol=ATTENTION_TOL[torch.float32][1])
