import pytest
import torch
import torch.nn.functional as F

from kernels.layernorm import add_layernorm, add_layernorm_ref, layernorm, layernorm_ref

# one or two units in the last place of the output dtype (rsqrt may differ by an ulp)
TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float32: (1e-5, 1e-5)}
SHAPES = [(1, 64), (7, 100)]


def params(hidden, device, dtype):
    weight = (1 + 0.3 * torch.randn(hidden, device=device)).to(dtype)
    bias = (0.5 * torch.randn(hidden, device=device)).to(dtype)
    return weight, bias


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_layernorm_matches_reference(device, dtype, tokens, hidden):
    wide = (2 + 3 * torch.randn(tokens, hidden + 8, device=device)).to(dtype)   # a mean far from 0
    x = wide[:, 3:3 + hidden]  # a strided view, last dim contiguous
    weight, bias = params(hidden, device, dtype)
    out = layernorm(x, weight, bias, 1e-5)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, layernorm_ref(x, weight, bias, 1e-5), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_add_layernorm_updates_residual_exactly(device, dtype, tokens, hidden):
    x = (4 * torch.randn(tokens, hidden, device=device)).to(dtype)
    residual = torch.randn(tokens, hidden, device=device).to(dtype)
    weight, bias = params(hidden, device, dtype)
    expected_residual = residual.clone()
    expected = add_layernorm_ref(x, expected_residual, weight, bias, 1e-5)
    out = add_layernorm(x, residual, weight, bias, 1e-5)
    assert torch.equal(residual, expected_residual)  # bitwise: transformers adds in the dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def test_layernorm_ref_is_torch_layer_norm(device):
    x = torch.randn(3, 32, device=device).to(torch.bfloat16)
    norm = torch.nn.LayerNorm(32, eps=1e-5, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
        assert torch.equal(layernorm_ref(x, norm.weight, norm.bias, 1e-5), norm(x))
        assert torch.equal(layernorm_ref(x, norm.weight, norm.bias, 1e-5),
                           F.layer_norm(x.float(), (32,), norm.weight.float(), norm.bias.float(), 1e-5).to(x.dtype))


def test_layernorm_rejects_bad_arguments(device):
    x = torch.randn(4, 32, device=device, dtype=torch.float16)
    weight, bias = params(32, device, torch.float16)
    with pytest.raises(ValueError, match=r"bias has shape \(31,\); expected \(32,\)"):
        layernorm(x, weight, bias[:31], 1e-5)
    with pytest.raises(ValueError, match="weight has dtype torch.float32 but must match torch.float16"):
        layernorm(x, weight.float(), bias, 1e-5)
    with pytest.raises(ValueError, match="residual has shape"):
        add_layernorm(x, x[:2].clone(), weight, bias, 1e-5)
