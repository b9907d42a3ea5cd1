import pytest
import torch

from kernels.rotary import rotary_embedding, rotary_embedding_ref

TOL = {torch.float16: (1e-3, 2e-3), torch.bfloat16: (8e-3, 1.6e-2), torch.float32: (1e-5, 1e-5)}


def cos_sin_cache(max_positions, head_dim, device, scale=1.0):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos() * scale, angles.sin() * scale), dim=-1).to(device)


def split_qk(qkv, q_heads, kv_heads, head_dim):
    """q and k as strided views of one [T, (Hq + 2 Hk) * D] projection, as the model has them."""
    tokens = qkv.shape[0]
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    return q, k


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(1, 4, 1, 16), (13, 8, 2, 32), (5, 2, 2, 80),
                                                                (9, 32, 8, 128)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_rotary_matches_reference(device, dtype, tokens, q_heads, kv_heads, head_dim, index_dtype):
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q, k = split_qk(qkv, q_heads, kv_heads, head_dim)
    cache = cos_sin_cache(4096, head_dim, device, scale=1.1)
    positions = torch.randint(0, 4096, (tokens,), device=device, dtype=index_dtype)
    expected_qkv = qkv.clone()
    expected_q, expected_k = split_qk(expected_qkv, q_heads, kv_heads, head_dim)
    rotary_embedding_ref(expected_q, expected_k, positions, cache)
    rotary_embedding(q, k, positions, cache)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(qkv, expected_qkv, atol=atol, rtol=rtol)
    v_start = (q_heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], expected_qkv[:, v_start:])  # v untouched


def test_rotary_ref_is_the_half_split_rotation(device):
    q = torch.randn(3, 2, 8, device=device)
    k = torch.randn(3, 1, 8, device=device)
    cache = cos_sin_cache(16, 8, device)
    positions = torch.tensor([0, 5, 15], device=device)
    q0, k0 = q.clone(), k.clone()
    rotary_embedding_ref(q, k, positions, cache)
    cos, sin = cache[positions, :4][:, None], cache[positions, 4:][:, None]
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)

    def rotate_half(x):
        return torch.cat((-x[..., 4:], x[..., :4]), -1)

    torch.testing.assert_close(q, q0 * cos + rotate_half(q0) * sin)
    torch.testing.assert_close(k, k0 * cos + rotate_half(k0) * sin)
    assert torch.equal(q[0], q0[0])  # position 0 is the identity


def test_rotary_rejects_bad_arguments(device):
    q = torch.randn(4, 2, 16, device=device, dtype=torch.float16)
    k = torch.randn(4, 1, 16, device=device, dtype=torch.float16)
    positions = torch.arange(4, device=device)
    cache = cos_sin_cache(8, 16, device)
    with pytest.raises(ValueError, match="cos_sin_cache has dtype torch.float16"):
        rotary_embedding(q, k, positions, cache.half())
    with pytest.raises(ValueError, match=r"positions has shape \(3,\); expected \(4,\)"):
        rotary_embedding(q, k, positions[:3], cache)
    with pytest.raises(ValueError, match="positions has dtype torch.float32"):
        rotary_embedding(q, k, positions.float(), cache)
    with pytest.raises(ValueError, match=r"k has shape \(4, 1, 8\); expected \(4, \*, 16\)"):
        rotary_embedding(q, k[..., :8], positions, cache)
