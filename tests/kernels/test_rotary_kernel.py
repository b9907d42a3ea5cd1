import pytest
import torch

from kernels.rotary import rotary_store_kv, rotary_store_kv_ref

TOL = {torch.float16: (1e-3, 2e-3), torch.bfloat16: (8e-3, 1.6e-2), torch.float32: (1e-5, 1e-5)}


def cos_sin_cache(max_positions, head_dim, device, scale=1.0):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos() * scale, angles.sin() * scale), dim=-1).to(device)


def split_qkv(qkv, q_heads, kv_heads, head_dim):
    """q, k and v as strided views of one [T, (Hq + 2 Hk) * D] projection, as the model has them."""
    tokens, q_size, kv_size = qkv.shape[0], q_heads * head_dim, kv_heads * head_dim
    q = qkv[:, :q_size].view(tokens, q_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(tokens, kv_heads, head_dim)
    return q, k, v


def make_case(tokens, q_heads, kv_heads, head_dim, dtype, device, index_dtype=torch.int32):
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    num_slots = 3 * tokens + 4
    kv_layer = torch.full((num_slots + 1, 2 * kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    slots = (torch.randperm(num_slots)[:tokens] + 1).to(device=device, dtype=index_dtype)
    positions = torch.randint(0, 4096, (tokens,), device=device, dtype=index_dtype)
    return qkv, kv_layer, slots, positions, cos_sin_cache(4096, head_dim, device, scale=1.1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(1, 4, 1, 16), (13, 8, 2, 32), (5, 2, 2, 80),
                                                                (9, 32, 8, 128), (3, 32, 32, 128)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_rotary_store_kv_matches_reference(device, dtype, tokens, q_heads, kv_heads, head_dim, index_dtype):
    qkv, kv_layer, slots, positions, cache = make_case(tokens, q_heads, kv_heads, head_dim, dtype, device,
                                                       index_dtype)
    expected_qkv, expected_kv = qkv.clone(), kv_layer.clone()
    rotary_store_kv_ref(*split_qkv(expected_qkv, q_heads, kv_heads, head_dim), positions, cache, expected_kv, slots)
    original_kv = qkv[:, q_heads * head_dim:].clone()
    rotary_store_kv(*split_qkv(qkv, q_heads, kv_heads, head_dim), positions, cache, kv_layer, slots)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(qkv, expected_qkv, atol=atol, rtol=rtol)                    # q rotated
    assert torch.equal(qkv[:, q_heads * head_dim:], original_kv)                            # k and v untouched
    torch.testing.assert_close(kv_layer, expected_kv, atol=atol, rtol=rtol, equal_nan=True)
    _, k, v = split_qkv(qkv, q_heads, kv_heads, head_dim)
    assert torch.equal(kv_layer[slots.long(), kv_heads:], v)                                # v copied exactly
    untouched = torch.ones(kv_layer.shape[0], dtype=torch.bool, device=device)
    untouched[slots.long()] = False
    assert kv_layer[untouched].isnan().all()                                                # no other slot written


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(1, 32, 4, 128), (6, 4, 2, 80), (3, 2, 1, 16)])
def test_head_norms_before_rotary_match_rmsnorm_then_rotary(device, dtype, tokens, q_heads, kv_heads, head_dim):
    """Qwen3's per-head q/k RMSNorm inside the rotary kernel equals kernels.rmsnorm's reference on
    each head followed by the plain rotation."""
    from kernels.rmsnorm import rmsnorm_ref

    qkv, kv_layer, slots, positions, cache = make_case(tokens, q_heads, kv_heads, head_dim, dtype, device)
    qkv = qkv * 3                                            # norms far from 1: the normalisation shows
    q_norm = (1 + torch.randn(head_dim, device=device) / 4).to(dtype)
    k_norm = (1 + torch.randn(head_dim, device=device) / 4).to(dtype)
    source = qkv.clone()
    q, k, v = split_qkv(source.clone(), q_heads, kv_heads, head_dim)
    q, k = rmsnorm_ref(q, q_norm, 1e-6), rmsnorm_ref(k, k_norm, 1e-6)
    expected_kv = kv_layer.clone()
    rotary_store_kv_ref(q, k, v, positions, cache, expected_kv, slots)
    rotary_store_kv(*split_qkv(qkv, q_heads, kv_heads, head_dim), positions, cache, kv_layer, slots,
                    head_norms=(q_norm, k_norm, 1e-6))
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(qkv[:, :q_heads * head_dim].view_as(q), q, atol=atol, rtol=rtol)   # q normed, rotated
    torch.testing.assert_close(kv_layer, expected_kv, atol=atol, rtol=rtol, equal_nan=True)
    assert torch.equal(kv_layer[slots.long(), kv_heads:], v)                                       # v as it was
    ref_qkv, ref_kv = source.clone(), torch.full_like(kv_layer, float("nan"))
    rotary_store_kv_ref(*split_qkv(ref_qkv, q_heads, kv_heads, head_dim), positions, cache, ref_kv, slots,
                        head_norms=(q_norm, k_norm, 1e-6))
    torch.testing.assert_close(ref_kv, expected_kv, atol=atol, rtol=rtol, equal_nan=True)          # the ops' reference
    torch.testing.assert_close(ref_qkv[:, :q_heads * head_dim].view_as(q), q, atol=atol, rtol=rtol)


def test_rotary_ref_is_the_half_split_rotation(device):
    qkv = torch.randn(3, (2 + 2) * 8, device=device)
    q, k, v = split_qkv(qkv, 2, 1, 8)
    q0, k0 = q.clone(), k.clone()
    kv_layer = torch.zeros(4, 2, 8, device=device)
    slots = torch.tensor([2, 0, 3], device=device)
    cache = cos_sin_cache(16, 8, device)
    positions = torch.tensor([0, 5, 15], device=device)
    rotary_store_kv_ref(q, k, v, positions, cache, kv_layer, slots)
    cos, sin = cache[positions, :4][:, None], cache[positions, 4:][:, None]
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)

    def rotate_half(x):
        return torch.cat((-x[..., 4:], x[..., :4]), -1)

    torch.testing.assert_close(q, q0 * cos + rotate_half(q0) * sin)
    torch.testing.assert_close(kv_layer[slots, :1], k0 * cos + rotate_half(k0) * sin)
    assert torch.equal(kv_layer[slots, 1:], v)
    assert torch.equal(q[0], q0[0])  # position 0 is the identity
    assert torch.equal(k, k0)        # k itself is not rotated


def test_rotary_store_kv_rejects_bad_arguments(device):
    qkv, kv_layer, slots, positions, cache = make_case(4, 2, 1, 16, torch.float16, device)
    q, k, v = split_qkv(qkv, 2, 1, 16)
    with pytest.raises(ValueError, match="cos_sin_cache has dtype torch.float16"):
        rotary_store_kv(q, k, v, positions, cache.half(), kv_layer, slots)
    with pytest.raises(ValueError, match=r"positions has shape \(3,\); expected \(4,\)"):
        rotary_store_kv(q, k, v, positions[:3], cache, kv_layer, slots)
    with pytest.raises(ValueError, match="positions has dtype torch.float32"):
        rotary_store_kv(q, k, v, positions.float(), cache, kv_layer, slots)
    with pytest.raises(ValueError, match=r"k has shape \(4, 1, 8\); expected \(4, \*, 16\)"):
        rotary_store_kv(q, k[..., :8], v, positions, cache, kv_layer, slots)
    with pytest.raises(ValueError, match=r"kv_layer has shape \(17, 1, 16\); expected \(\*, 2, 16\)"):
        rotary_store_kv(q, k, v, positions, cache, kv_layer[:, :1], slots)
    with pytest.raises(ValueError, match="kv_layer has dtype torch.bfloat16 but must match torch.float16"):
        rotary_store_kv(q, k, v, positions, cache, kv_layer.bfloat16(), slots)
    with pytest.raises(ValueError, match="slots has dtype torch.float32"):
        rotary_store_kv(q, k, v, positions, cache, kv_layer, slots.float())
    with pytest.raises(ValueError, match=r"v has shape \(3, 1, 16\); expected \(4, 1, 16\)"):
        rotary_store_kv(q, k, v[:3], positions, cache, kv_layer, slots)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rotary_store_kv(q[..., :15], k[..., :15], v[..., :15], positions, cache[:, :15], kv_layer[..., :15], slots)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(1, 6, 6, 16), (7, 8, 2, 32), (4, 3, 3, 128)])
def test_without_a_cos_sin_cache_only_k_and_v_are_stored_exactly(device, dtype, tokens, q_heads, kv_heads, head_dim):
    """Models without rotary embedding (Bloom's ALiBi): q stays as it is, K and V land in their slots bit for bit."""
    qkv, kv_layer, slots, _, _ = make_case(tokens, q_heads, kv_heads, head_dim, dtype, device)
    original, expected_kv = qkv.clone(), kv_layer.clone()
    rotary_store_kv_ref(*split_qkv(original.clone(), q_heads, kv_heads, head_dim), None, None, expected_kv, slots)
    rotary_store_kv(*split_qkv(qkv, q_heads, kv_heads, head_dim), None, None, kv_layer, slots)
    assert torch.equal(qkv, original)                                                       # q not rotated
    _, k, v = split_qkv(qkv, q_heads, kv_heads, head_dim)
    assert torch.equal(kv_layer[slots.long(), :kv_heads], k) and torch.equal(kv_layer[slots.long(), kv_heads:], v)
    torch.testing.assert_close(kv_layer, expected_kv, atol=0, rtol=0, equal_nan=True)
    untouched = torch.ones(kv_layer.shape[0], dtype=torch.bool, device=device)
    untouched[slots.long()] = False
    assert kv_layer[untouched].isnan().all()


def test_positions_without_a_cache_are_refused(device):
    qkv, kv_layer, slots, positions, _ = make_case(4, 2, 1, 16, torch.float32, device)
    with pytest.raises(ValueError, match="positions given without a cos_sin_cache"):
        rotary_store_kv(*split_qkv(qkv, 2, 1, 16), positions, None, kv_layer, slots)
