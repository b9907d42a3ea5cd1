import pytest
import torch
import torch.nn.functional as F

from kernels.silu_and_mul import act_and_mul, act_and_mul_ref, silu_and_mul, silu_and_mul_ref

TOL = {torch.float16: (1e-3, 2e-3), torch.bfloat16: (8e-3, 1.6e-2), torch.float32: (1e-5, 1e-5)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,inter", [(1, 16), (7, 100), (3, 2500)])
def test_silu_and_mul_matches_reference(device, dtype, tokens, inter):
    wide = (3 * torch.randn(tokens, 2 * inter + 5, device=device)).to(dtype)
    gate_up = wide[:, : 2 * inter]  # row stride larger than the width
    out = silu_and_mul(gate_up)
    expected = silu_and_mul_ref(gate_up)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def test_silu_and_mul_ref_mirrors_hugging_face(device):
    gate_up = torch.randn(4, 32, device=device).to(torch.bfloat16)
    assert torch.equal(silu_and_mul_ref(gate_up), F.silu(gate_up[:, :16]) * gate_up[:, 16:])


def test_silu_and_mul_rejects_bad_arguments(device):
    with pytest.raises(ValueError, match="gate_up's last dim must be even"):
        silu_and_mul(torch.randn(2, 7, device=device))
    with pytest.raises(ValueError, match="gate_up has dtype torch.int64"):
        silu_and_mul(torch.ones(2, 8, device=device, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"gate_up must have 2 dims, got shape \(2, 3, 8\)"):
        silu_and_mul(torch.randn(2, 3, 8, device=device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,inter", [(1, 16), (7, 100)])
def test_gelu_tanh_and_mul_matches_reference(device, dtype, tokens, inter):
    """Gemma's activation: the same kernel with the GeLU-tanh constexpr; large inputs saturate tanh."""
    gate_up = (4 * torch.randn(tokens, 2 * inter, device=device)).to(dtype)
    out = act_and_mul(gate_up, "gelu_tanh")
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, act_and_mul_ref(gate_up, "gelu_tanh"), atol=atol, rtol=rtol)
    hf = F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]
    assert torch.equal(act_and_mul_ref(gate_up, "gelu_tanh"), hf)
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        act_and_mul(gate_up, "relu")
