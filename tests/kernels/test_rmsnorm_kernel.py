import pytest
import torch

from kernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref

# one or two units in the last place of the output dtype (rsqrt may differ by an ulp)
TOL = {torch.float16: (1e-3, 2e-3), torch.bfloat16: (8e-3, 1.6e-2), torch.float32: (1e-5, 1e-5)}
SHAPES = [(1, 64), (7, 100), (5, 4096)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_rmsnorm_matches_reference(device, dtype, tokens, hidden):
    wide = torch.randn(tokens, hidden + 8, device=device).to(dtype)
    x = wide[:, 3:3 + hidden]  # a strided view, last dim contiguous
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    out = rmsnorm(x, weight, 1e-6)
    expected = rmsnorm_ref(x, weight, 1e-6)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_add_rmsnorm_updates_residual_exactly(device, dtype, tokens, hidden):
    x = (4 * torch.randn(tokens, hidden, device=device)).to(dtype)
    residual = torch.randn(tokens, hidden, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    expected_residual = residual.clone()
    expected = add_rmsnorm_ref(x, expected_residual, weight, 1e-5)
    out = add_rmsnorm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)  # bitwise: HF adds in the dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def test_rmsnorm_ref_follows_hugging_face_rounding(device):
    x = torch.randn(3, 32, device=device).to(torch.bfloat16)
    weight = torch.randn(32, device=device).to(torch.bfloat16)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(rmsnorm_ref(x, weight, 1e-6), weight * h.to(torch.bfloat16))


def test_rmsnorm_rejects_bad_arguments(device):
    x = torch.randn(4, 32, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"weight has shape \(31,\); expected \(32,\)"):
        rmsnorm(x, torch.randn(31, device=device, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="weight has dtype torch.float32 but must match torch.float16"):
        rmsnorm(x, torch.randn(32, device=device), 1e-6)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rmsnorm(x.t(), torch.randn(4, device=device, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="residual has shape"):
        add_rmsnorm(x, x[:2].clone(), torch.randn(32, device=device, dtype=torch.float16), 1e-6)
