import pytest
import torch

from kernels.kv_copy import copy_kv, copy_kv_ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,kv_heads,head_dim", [(1, 1, 16), (11, 2, 32), (6, 3, 80), (37, 8, 128)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_copy_kv_writes_k_and_v_into_scattered_slots(device, dtype, tokens, kv_heads, head_dim, index_dtype):
    num_slots = 3 * tokens + 4
    # k and v as strided views of a fused qkv projection
    qkv = torch.randn(tokens, 3, kv_heads, head_dim, device=device).to(dtype)
    k, v = qkv[:, 1], qkv[:, 2]
    kv_layer = torch.full((num_slots + 1, 2 * kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    slots = (torch.randperm(num_slots)[:tokens] + 1).to(device=device, dtype=index_dtype)
    expected = kv_layer.clone()
    copy_kv_ref(k, v, expected, slots)
    copy_kv(k, v, kv_layer, slots)
    torch.testing.assert_close(kv_layer, expected, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(kv_layer[slots.long(), :kv_heads], k)
    assert torch.equal(kv_layer[slots.long(), kv_heads:], v)
    untouched = torch.ones(num_slots + 1, dtype=torch.bool, device=device)
    untouched[slots.long()] = False
    assert kv_layer[untouched].isnan().all()


def test_copy_kv_rejects_bad_arguments(device):
    k = torch.randn(4, 2, 16, device=device, dtype=torch.float16)
    kv_layer = torch.empty(9, 4, 16, device=device, dtype=torch.float16)
    slots = torch.arange(1, 5, device=device, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"kv_layer has shape \(9, 2, 16\); expected \(\*, 4, 16\)"):
        copy_kv(k, k, kv_layer[:, :2], slots)
    with pytest.raises(ValueError, match="kv_layer has dtype torch.bfloat16 but must match torch.float16"):
        copy_kv(k, k, kv_layer.bfloat16(), slots)
    with pytest.raises(ValueError, match="slots has dtype torch.float32"):
        copy_kv(k, k, kv_layer, slots.float())
    with pytest.raises(ValueError, match=r"v has shape \(3, 2, 16\); expected \(4, 2, 16\)"):
        copy_kv(k, k[:3], kv_layer, slots)
