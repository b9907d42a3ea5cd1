"""The quantized KV cache (kernels._kv_quant): the rotary/store kernel quantizes as it writes, the
attention kernels dequantize as they read; each against its torch reference, per KV dtype."""
import math

import pytest
import torch
import triton
import triton.language as tl
from kernel_inputs import ON_GPU, build_kv_cache
from test_rotary_kernel import make_case, split_qkv

from kernels._kv_quant import (
    FP8_AS_FLOAT32,
    FP8_FORMATS,
    fp8_as_float32,
    gather_kv_ref,
    int8_as_float16,
    int8_as_float32,
    quantize_ref,
)
from kernels.decode_attention import decode_attention, decode_attention_ref
from kernels.prefill_attention import prefill_attention, prefill_attention_ref
from kernels.rotary import rotary_store_kv, rotary_store_kv_ref

KV_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
GQA = [(2, 2), (8, 2), (8, 1)]          # groups of 1, 4 and 8 q heads per kv head
# model dtype: float32 on the interpreter (its bf16 dots are not usable), bf16 on the GPU
MODEL_DTYPE = torch.bfloat16 if ON_GPU else torch.float32
# attention over dequantized K/V: the kernel dequantizes into the model dtype (bf16 on the GPU)
TOL = (3e-2, 3e-2) if ON_GPU else (2e-5, 2e-5)


def empty_scales(kv_dtype, num_slots, kv_heads, device, tensor_scales=(0.5, 2.0)):
    """int8: per slot and head scales, NaN until written; fp8: the per-tensor K and V scales."""
    if kv_dtype == torch.int8:
        return torch.full((num_slots, 2 * kv_heads), float("nan"), device=device)
    return torch.tensor(tensor_scales, dtype=torch.float32, device=device)


def quantized_cache(seq_lens, kv_heads, head_dim, kv_dtype, device):
    """``kernel_inputs.build_kv_cache`` stored in ``kv_dtype``: unused slots poisoned (int8: NaN scales;
    fp8: NaN values), so a kernel that reads outside its keys produces NaN."""
    cache = build_kv_cache(seq_lens, kv_heads, head_dim, torch.float32, device)
    x = cache.kv_layer * 3.0
    scales = empty_scales(kv_dtype, x.shape[0], kv_heads, device)
    data = torch.zeros(x.shape, dtype=kv_dtype, device=device)
    used = ~x[:, 0, 0].isnan()
    for half, per_tensor in ((slice(None, kv_heads), 0), (slice(kv_heads, None), 1)):
        tensor_scale = scales[per_tensor] if kv_dtype != torch.int8 else None
        values, row_scales = quantize_ref(x[used][:, half], kv_dtype, tensor_scale)
        data[used, half] = values
        if kv_dtype == torch.int8:
            scales[used, half] = row_scales
    if kv_dtype != torch.int8:
        data.view(torch.uint8)[~used] = 0x7F      # a NaN in both fp8 formats
    quantized_cache.last_input = x
    return cache, data, scales


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(13, 8, 2, 32), (5, 2, 2, 80)])
def test_rotary_store_quantizes_as_the_reference(device, kv_dtype, tokens, q_heads, kv_heads, head_dim):
    qkv, _, slots, positions, cache = make_case(tokens, q_heads, kv_heads, head_dim, MODEL_DTYPE, device)
    qkv = qkv * 4
    kv_layer = torch.zeros((slots.max().item() + 3, 2 * kv_heads, head_dim), dtype=kv_dtype, device=device)
    scales = empty_scales(kv_dtype, kv_layer.shape[0], kv_heads, device)
    expected_qkv, expected_kv, expected_scales = qkv.clone(), kv_layer.clone(), scales.clone()
    rotary_store_kv_ref(*split_qkv(expected_qkv, q_heads, kv_heads, head_dim), positions, cache, expected_kv, slots,
                        expected_scales)
    rotary_store_kv(*split_qkv(qkv, q_heads, kv_heads, head_dim), positions, cache, kv_layer, slots, scales)
    torch.testing.assert_close(qkv, expected_qkv)                          # q rotated, unquantized
    torch.testing.assert_close(scales, expected_scales, equal_nan=True)   # int8: written scales only
    got, want = kv_layer[slots.long()].float(), expected_kv[slots.long()].float()
    if ON_GPU:      # float32 rotation may round differently by an ulp: at most one quantization step apart
        step = 1.0 if kv_dtype == torch.int8 else want.abs() * 2.0 ** -FP8_FORMATS[kv_dtype][1]
        assert ((got - want).abs() <= step + 1e-30).all()
    else:
        assert torch.equal(got, want)
    k, v = gather_kv_ref(kv_layer, scales, slots.long())                  # dequantized: close to the input
    _, _, v_in = split_qkv(qkv, q_heads, kv_heads, head_dim)
    rel = 2 / 254 if kv_dtype == torch.int8 else 2.0 ** -FP8_FORMATS[kv_dtype][1]
    assert ((v - v_in.float()).abs() <= v_in.float().abs().amax(-1, keepdim=True) * rel + 1e-6).all()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_store_without_rotation_quantizes_k_unrotated(device, kv_dtype):
    """No cos_sin_cache (Bloom): K quantized as it is, with the same scales as the reference; q untouched."""
    tokens, q_heads, kv_heads, head_dim = 6, 6, 6, 16
    qkv, _, slots, _, _ = make_case(tokens, q_heads, kv_heads, head_dim, MODEL_DTYPE, device)
    qkv = qkv * 4
    kv_layer = torch.zeros((slots.max().item() + 3, 2 * kv_heads, head_dim), dtype=kv_dtype, device=device)
    scales = empty_scales(kv_dtype, kv_layer.shape[0], kv_heads, device)
    expected_kv, expected_scales, original = kv_layer.clone(), scales.clone(), qkv.clone()
    rotary_store_kv_ref(*split_qkv(original.clone(), q_heads, kv_heads, head_dim), None, None, expected_kv, slots,
                        expected_scales)
    rotary_store_kv(*split_qkv(qkv, q_heads, kv_heads, head_dim), None, None, kv_layer, slots, scales)
    assert torch.equal(qkv, original)
    torch.testing.assert_close(scales, expected_scales, equal_nan=True)
    assert torch.equal(kv_layer[slots.long()].float(), expected_kv[slots.long()].float())
    k, _ = gather_kv_ref(kv_layer, scales, slots.long())                  # dequantized: close to k, unrotated
    _, k_in, _ = split_qkv(qkv, q_heads, kv_heads, head_dim)
    rel = 2 / 254 if kv_dtype == torch.int8 else 2.0 ** -FP8_FORMATS[kv_dtype][1]
    assert ((k - k_in.float()).abs() <= k_in.float().abs().amax(-1, keepdim=True) * rel + 1e-6).all()


def limit_values(kv_dtype) -> torch.Tensor:
    """Values at the format's limits: every finite fp8 value, the midpoints between neighbours (ties round
    to even), values past the largest (clamped), subnormals; for int8 rows whose amax hits 127 exactly and
    halves that tie."""
    if kv_dtype == torch.int8:
        return torch.tensor([127.0, -127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 63.5, 0.0, 1e-30, -126.5, 3.0])
    codes = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    grid = codes[codes.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    limit = FP8_FORMATS[kv_dtype][0]
    beyond = torch.tensor([limit * 1.01, -limit * 1.5, 1e30, -1e30, limit + 1.0])
    return torch.cat([grid, mids, beyond])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_values_at_the_format_limits_are_stored_as_torch_rounds_them(device, kv_dtype):
    """V is stored unrotated: the kernel's rounding of chosen values against torch's (round to nearest
    even, clamped to the range)."""
    values = limit_values(kv_dtype)
    head_dim = 32
    rows = math.ceil(values.numel() / head_dim)
    v = torch.zeros(rows * head_dim)
    v[: values.numel()] = values
    v = v.view(rows, 1, head_dim).to(device)
    q, k = torch.randn(rows, 1, head_dim, device=device), torch.randn(rows, 1, head_dim, device=device)
    positions = torch.zeros(rows, dtype=torch.int32, device=device)
    cache = torch.cat([torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2)], dim=1).to(device)
    slots = torch.arange(rows, dtype=torch.int32, device=device)
    kv_layer = torch.zeros((rows + 1, 2, head_dim), dtype=kv_dtype, device=device)
    scales = empty_scales(kv_dtype, rows + 1, 1, device, tensor_scales=(1.0, 1.0))
    rotary_store_kv(q, k, v, positions, cache, kv_layer, slots, scales)
    stored = kv_layer[:rows, 1].float()
    if kv_dtype == torch.int8:
        expected, row_scales = quantize_ref(v, kv_dtype)
        torch.testing.assert_close(scales[:rows, 1], row_scales[:, 0])
        assert torch.equal(stored, expected[:, 0].float())
        assert stored.abs().amax(-1).eq(127).all()                  # every row's amax maps to 127
    else:
        limit = FP8_FORMATS[kv_dtype][0]
        expected = v[:, 0].clamp(-limit, limit).to(kv_dtype).float()
        assert torch.equal(stored, expected)
        assert stored.abs().max() == limit


def decode_case(lengths, q_heads, kv_heads, head_dim, kv_dtype, device):
    cache, data, scales = quantized_cache(lengths, kv_heads, head_dim, kv_dtype, device)
    q = torch.randn(len(lengths), q_heads, head_dim, device=device).to(MODEL_DTYPE)
    return q, data, cache.req_to_token, cache.b_req_row, cache.b_seq_len, 1 / math.sqrt(head_dim), scales


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", GQA)
def test_decode_attention_dequantizes_as_the_reference(device, kv_dtype, q_heads, kv_heads):
    q, data, table, rows, seq_len, scale, scales = decode_case([1, 2, 17, 45], q_heads, kv_heads, 32, kv_dtype,
                                                               device)
    out = decode_attention(q, data, table, rows, seq_len, scale, kv_scales=scales)
    expected = decode_attention_ref(q, data, table, rows, seq_len, scale, kv_scales=scales)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, atol=TOL[0], rtol=TOL[1])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_attention_with_a_shared_prefix_dequantizes_it(device, kv_dtype):
    from test_decode_attention_kernel import share_a_prefix

    q, data, table, rows, seq_len, scale, scales = decode_case([40, 33, 1, 36], 8, 2, 32, kv_dtype, device)
    shared = share_a_prefix(table, rows.tolist(), [0, 1, 3], 30)
    out = decode_attention(q, data, table, rows, seq_len, scale, shared=shared, kv_scales=scales)
    expected = decode_attention_ref(q, data, table, rows, seq_len, scale, kv_scales=scales)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, atol=TOL[0], rtol=TOL[1])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", GQA)
def test_prefill_attention_dequantizes_as_the_reference(device, kv_dtype, q_heads, kv_heads):
    """Ragged chunks: whole prompts, a chunk after cached positions, a one-token row."""
    seq_lens, q_lens = [5, 40, 33, 1], [5, 7, 33, 1]
    cache, data, scales = quantized_cache(seq_lens, kv_heads, 32, kv_dtype, device)
    q = torch.randn(sum(q_lens), q_heads, 32, device=device).to(MODEL_DTYPE)
    q_len = torch.tensor(q_lens, dtype=torch.int32, device=device)
    q_start = (torch.cumsum(q_len, 0) - q_len).int()
    args = (q, data, cache.req_to_token, cache.b_req_row, q_start, q_len, cache.b_seq_len, 32 ** -0.5, max(q_lens))
    out = prefill_attention(*args, kv_scales=scales)
    expected = prefill_attention_ref(*args, kv_scales=scales)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, atol=TOL[0], rtol=TOL[1])


@pytest.mark.parametrize("kv_dtype,bound", [(torch.int8, 0.02), (torch.float8_e4m3fn, 0.1),
                                            (torch.float8_e5m2, 0.15)])
def test_quantized_attention_stays_near_the_unquantized(device, kv_dtype, bound):
    """The format is worth its bytes: attention over the quantized cache is near the float cache's, in
    relative RMS error (int8 steps amax / 127; e4m3 keeps 3 mantissa bits, e5m2 2; logits of std ~3 make
    the softmax amplify them: the values alone are 0.5%, 2.6% and 5.3% off)."""
    q, data, table, rows, seq_len, scale, scales = decode_case([17, 64], 8, 2, 32, kv_dtype, device)
    original = quantized_cache.last_input                  # the values before quantization
    out = decode_attention(q, data, table, rows, seq_len, scale, kv_scales=scales).float()
    plain = decode_attention_ref(q.float(), original, table, rows, seq_len, scale)
    error = ((out - plain).pow(2).mean() / plain.pow(2).mean()).sqrt().item()
    print(f"{kv_dtype}: relative RMS error {error:.4f}")
    assert 0 < error < bound


def test_a_quantized_cache_without_its_scales_is_refused(device):
    q, data, table, rows, seq_len, scale, scales = decode_case([3, 4], 4, 2, 16, torch.int8, device)
    with pytest.raises(ValueError, match="a torch.int8 kv_layer needs float32 kv_scales"):
        decode_attention(q, data, table, rows, seq_len, scale)
    with pytest.raises(ValueError, match=r"int8 kv_scales have shape \(\d+, 2\); expected"):
        decode_attention(q, data, table, rows, seq_len, scale, kv_scales=scales[:, :2])
    fp8 = data.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"fp8 kv_scales have shape .*expected \(2,\)"):
        decode_attention(q, fp8, table, rows, seq_len, scale, kv_scales=scales)
    with pytest.raises(ValueError, match="kv_scales given for an unquantized kv_layer"):
        decode_attention(q, data.to(q.dtype), table, rows, seq_len, scale, kv_scales=scales)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_prefill_with_a_shared_prefix_and_split_keys_dequantizes_both(device, kv_dtype):
    """The prefill's shared-prefix start (kernels.shared_prefix) and its split keys read the scales too."""
    from kernels.prefill_attention import launch, prefill_launch

    seq_lens, q_lens, prefix = [80, 75, 71], [7, 3, 20], 40
    cache, data, scales = quantized_cache(seq_lens, 2, 32, kv_dtype, device)
    table, rows = cache.req_to_token, cache.b_req_row
    for m in (1, 2):
        table[rows[m], :prefix] = table[rows[0], :prefix]
    shared = (torch.full((3,), prefix, dtype=torch.int32, device=device),
              torch.tensor([int(rows[0]), prefix], dtype=torch.int32, device=device))
    q = torch.randn(sum(q_lens), 4, 32, device=device).to(MODEL_DTYPE)
    q_len = torch.tensor(q_lens, dtype=torch.int32, device=device)
    q_start = (torch.cumsum(q_len, 0) - q_len).int()
    args = (q, data, table, rows, q_start, q_len, cache.b_seq_len, 32 ** -0.5, max(q_lens))
    out = launch(*args, params=prefill_launch(32, q.device, q.dtype), splits=2, shared=shared, kv_scales=scales)
    assert out.isfinite().all()
    torch.testing.assert_close(out, prefill_attention_ref(*args, kv_scales=scales), atol=TOL[0], rtol=TOL[1])



@triton.jit
def _int8_to_float_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr, FLOAT32: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, int8_as_float32(x) if FLOAT32 else int8_as_float16(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_int8_values_become_float_integers_exactly(device, dtype):
    """``int8_as_float16`` (the int8 cache's dots) and ``int8_as_float32`` (the rowwise decode walk's float32 sums),
    the conversions of the attention's fast paths, on all 256 values."""
    x = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).to(device)
    y = torch.empty(256, dtype=dtype, device=device)
    _int8_to_float_kernel[(1,)](x, y, BLOCK=256, FLOAT32=dtype == torch.float32)
    assert torch.equal(y, x.to(dtype))


@triton.jit
def _fp8_to_float32_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, fp8_as_float32(tl.load(x_ptr + offs), SHIFT))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_values_become_float32_times_their_offset_exactly(device, dtype):
    """``fp8_as_float32`` (the rowwise decode walk's fp8 reads) on every finite value, the subnormals included:
    the value times 2**-bias offset, which the walk's power-of-two factors undo."""
    shift, offset = FP8_AS_FLOAT32[dtype]
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(device)
    y = torch.empty(256, dtype=torch.float32, device=device)
    _fp8_to_float32_kernel[(1,)](x, y, BLOCK=256, SHIFT=shift)
    expected = x.to(torch.float64)
    finite = expected.isfinite()
    assert finite.sum() == (254 if dtype == torch.float8_e4m3fn else 248)      # less the NaNs (and e5m2's infinities)
    assert torch.equal(y.to(torch.float64)[finite] * 2.0 ** offset, expected[finite])


def test_the_rowwise_walk_brings_fp8_back_by_its_format_offset_less_the_lift():
    """``fp8_row_read``: the shift and the factor that undoes the read's 2**-offset and the 2**64 lift, both from
    ``FP8_AS_FLOAT32`` (e4m3: 2**(120 - 64), e5m2: 2**(112 - 64)); a cache that is not fp8 reads no fp8."""
    from kernels.decode_attention import ROW_LIFT_LOG2, fp8_row_read

    assert ROW_LIFT_LOG2 == 64
    assert fp8_row_read(torch.float8_e4m3fn) == (20, 2.0 ** 56)
    assert fp8_row_read(torch.float8_e5m2) == (21, 2.0 ** 48)
    for dtype in (torch.int8, torch.bfloat16):
        assert fp8_row_read(dtype) == (0, 1.0)


def test_the_rowwise_walk_takes_its_own_launch_and_split_count():
    """Where the walk is rowwise (a quantized cache without GQA, enough requests) its launch is
    ``CUDA_LAUNCH_ROWWISE`` in ``rowwise_splits``' count; a smaller batch keeps the dot walk's launch and splits."""
    from kernels.decode_attention import CUDA_LAUNCH_INT8, CUDA_LAUNCH_ROWWISE, cuda_walk

    for dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2):
        cache = torch.zeros(1, 64, 8, dtype=dtype)                                # 32 kv heads
        assert cuda_walk(cache, 512, 1, None, 1, 132) == (1, *CUDA_LAUNCH_ROWWISE, 32, True)
        assert cuda_walk(cache, 16, 1, None, 1, 132) == (4, *CUDA_LAUNCH_ROWWISE, 32, True)
        assert cuda_walk(cache, 512, 4, None, 1, 132)[-1] is False                 # GQA: the dot walk
    assert cuda_walk(torch.zeros(1, 64, 8, dtype=torch.int8), 8, 1, None, 2, 132) == (2, *CUDA_LAUNCH_INT8, 32, False)
    assert CUDA_LAUNCH_ROWWISE != CUDA_LAUNCH_INT8


def test_decode_launch_follows_the_cache_dtype_and_the_split_count():
    """int8 caches take their own decode launches on CUDA: twice the splits in 32-key blocks where a request takes
    4 to 32 splits, else longer key blocks (half the bytes a key), each with a shorter tail block; others bf16's."""
    from kernels.decode_attention import CUDA_LAUNCH, CUDA_LAUNCH_INT8, CUDA_LAUNCH_INT8_FEW, MAX_SPLITS, cuda_launch

    int8 = torch.zeros(1, 2, 8, dtype=torch.int8)
    assert cuda_launch(int8, 4) == (8, *CUDA_LAUNCH_INT8_FEW, 16)
    assert cuda_launch(int8, MAX_SPLITS // 2) == (MAX_SPLITS, *CUDA_LAUNCH_INT8_FEW, 16)
    for splits in (1, 2, MAX_SPLITS):
        assert cuda_launch(int8, splits) == (splits, *CUDA_LAUNCH_INT8, 32)
    assert CUDA_LAUNCH_INT8 != CUDA_LAUNCH != CUDA_LAUNCH_INT8_FEW
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
        for splits in (1, 16, MAX_SPLITS):
            assert cuda_launch(torch.zeros(1, 2, 8, dtype=dtype), splits) == (splits, *CUDA_LAUNCH, CUDA_LAUNCH[0])


# each pair of the three factors in all four of its combinations (half of the 2 x 2 x 2 product): the tail walk
# branches on the cache's scales (int8: per slot, loaded under the bounds mask; fp8: per tensor) and on the score
# modifications; the group is the kernel's runtime row count (16-row tiles either way). Two kv heads: the second
# reads at a head offset.
@pytest.mark.parametrize("kv_dtype,group,with_mods", [(torch.int8, 1, False), (torch.int8, 4, True),
                                                      (torch.float8_e4m3fn, 1, True), (torch.float8_e4m3fn, 4, False)],
                         ids=["int8-1-plain", "int8-4-mods", "e4m3-1-mods", "e4m3-4-plain"])
def test_decode_tail_blocks_give_the_reference(device, kv_dtype, group, with_mods):
    """A split's keys after its last full block walked in shorter blocks (``tail_n``, int8's CUDA launches) give
    the reference, with and without a window, soft-cap and ALiBi: chunks shorter than one block, of one block and
    a tail longer than one tail block, and requests of one key; keys outside a request's own would read NaN."""
    from kernels.decode_attention import launch
    from kernels.score_mods import ScoreMods, alibi_slopes

    q, data, table, rows, seq_len, scale, scales = decode_case([1, 70, 33, 129], 2 * group, 2, 32, kv_dtype,
                                                               device)
    mods = ScoreMods(window=50, softcap=1.0, alibi_slopes=alibi_slopes(2 * group).to(device)) if with_mods else None
    ref = decode_attention_ref(q, data, table, rows, seq_len, scale, mods=mods, kv_scales=scales)
    for splits, block_n, tail_n in ((1, 64, 16), (3, 64, 32), (5, 32, 16)):
        out = torch.empty_like(q)
        launch(q, data, table, rows, seq_len, scale, out, splits, block_n, 2, 1, mods=mods, kv_scales=scales,
               tail_n=tail_n, rowwise=False)
        assert out.isfinite().all()
        torch.testing.assert_close(out, ref, atol=TOL[0], rtol=TOL[1],
                                   msg=f"splits {splits}, block {block_n}, tail {tail_n}")


# each pair of the three factors in all four of its combinations (half of the 2 x 2 x 2 product): each walk with one
# split and three, and with and without a shared prefix (the split kernel starts after it)
@pytest.mark.parametrize("kv_dtype,rowwise,splits,shared", [
    (torch.int8, True, 1, False), (torch.int8, True, 3, True), (torch.int8, False, 1, True),
    (torch.int8, False, 3, False), (torch.float8_e4m3fn, True, 3, True), (torch.float8_e5m2, True, 1, False)])
def test_quantized_decode_walks_rows_without_dots_as_the_reference(device, kv_dtype, rowwise, splits, shared):
    """A quantized cache without GQA: the split kernel's walk without ``tl.dot`` (``rowwise``) and with it give the
    reference, whatever the split count and with a shared prefix walked by its own kernel; lengths past one block and
    not whole blocks (keys outside a request's own would read NaN scales, or for fp8 the poison's value)."""
    from test_decode_attention_kernel import share_a_prefix

    from kernels.decode_attention import launch

    q, data, table, rows, seq_len, scale, scales = decode_case([1, 70, 33, 129], 4, 4, 32, kv_dtype, device)
    prefix = share_a_prefix(table, rows.tolist(), [1, 2, 3], 30) if shared else None
    out = torch.empty_like(q)
    launch(q, data, table, rows, seq_len, scale, out, splits, 32, 2, 1, shared=prefix, kv_scales=scales,
           rowwise=rowwise)
    expected = decode_attention_ref(q, data, table, rows, seq_len, scale, kv_scales=scales)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, atol=TOL[0], rtol=TOL[1])


def test_the_rowwise_walk_takes_enough_requests_only_on_a_gpu():
    """From ROWWISE_MIN_PROGRAMS_PER_SM (request, kv head) programs an SM: one H200 (132 SMs) measured it slower at 8
    requests of 32 heads and faster from 16; the interpreter always (its tests cover the walk)."""
    from kernels.decode_attention import default_rowwise

    int8 = torch.zeros((1, 64, 8), dtype=torch.int8)          # 32 kv heads
    assert default_rowwise(int8, 16, 1, None, 132)
    assert default_rowwise(int8, 512, 1, None, 132)
    assert not default_rowwise(int8, 8, 1, None, 132)
    assert not default_rowwise(int8, 12, 1, None, 132)        # 384 programs: 2.9 an SM
    assert default_rowwise(int8, 1, 1, None, None)
    assert not default_rowwise(int8, 512, 4, None, 132)       # GQA
    assert default_rowwise(int8.to(torch.float32).to(torch.float8_e4m3fn), 512, 1, None, 132)
    assert not default_rowwise(int8.to(torch.bfloat16), 512, 1, None, 132)


def test_rowwise_splits_fill_the_gpu_with_at_most_its_programs_per_sm():
    """The largest power of two of splits whose (request, kv head, split) programs stay within
    ROWWISE_PROGRAMS_PER_SM an SM; at least one, at most MAX_SPLITS."""
    from kernels.decode_attention import MAX_SPLITS, ROWWISE_PROGRAMS_PER_SM, rowwise_splits

    assert ROWWISE_PROGRAMS_PER_SM * 132 == 2112
    assert [rowwise_splits(batch, 32, 132) for batch in (16, 24, 32, 40, 66, 512)] == [4, 2, 2, 1, 1, 1]
    assert rowwise_splits(1, 1, 132) == MAX_SPLITS
    assert rowwise_splits(2112, 1, 132) == 1 and rowwise_splits(2113, 1, 132) == 1


def test_the_rowwise_walk_takes_a_quantized_cache_without_gqa_or_score_mods_only(device):
    from kernels.decode_attention import launch, rowwise_applies
    from kernels.score_mods import ScoreMods

    q, data, table, rows, seq_len, scale, scales = decode_case([3, 9], 4, 4, 32, torch.int8, device)
    assert rowwise_applies(data, 1, None)
    assert rowwise_applies(data, 1, ScoreMods())
    assert not rowwise_applies(data, 4, None)
    assert not rowwise_applies(data, 1, ScoreMods(softcap=30.0))
    assert rowwise_applies(data.to(torch.float32).to(torch.float8_e5m2), 1, None)
    assert not rowwise_applies(data.to(torch.float32), 1, None)
    gqa_q, gqa, gqa_table, gqa_rows, gqa_len, _, gqa_scales = decode_case([3, 9], 8, 2, 32, torch.int8, device)
    with pytest.raises(ValueError, match="int8 or fp8 cache without GQA"):
        launch(gqa_q, gqa, gqa_table, gqa_rows, gqa_len, scale, torch.empty_like(gqa_q), 1, 32, 2, 1,
               kv_scales=gqa_scales, rowwise=True)


def test_decode_attention_asks_default_rowwise_when_not_told(device, monkeypatch):
    """``launch`` without ``rowwise`` takes ``default_rowwise``'s answer for its batch (int8, no GQA)."""
    from kernels import decode_attention as module

    asked = []

    def recording(kv_layer, batch, group, mods, sms):
        asked.append((batch, group, sms))
        return True

    monkeypatch.setattr(module, "default_rowwise", recording)
    q, data, table, rows, seq_len, scale, scales = decode_case([5, 40], 4, 4, 32, torch.int8, device)
    out = decode_attention(q, data, table, rows, seq_len, scale, num_splits=1, kv_scales=scales)
    sms = module.device_sms(q.device) if q.is_cuda else None
    assert asked == [(2, 1, sms)]
    torch.testing.assert_close(out, decode_attention_ref(q, data, table, rows, seq_len, scale, kv_scales=scales),
                               atol=TOL[0], rtol=TOL[1])
