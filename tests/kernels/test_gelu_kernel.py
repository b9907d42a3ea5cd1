import pytest
import torch
import torch.nn.functional as F

from kernels.gelu import gelu, gelu_ref

TOL = {torch.float16: (1e-3, 2e-3), torch.bfloat16: (8e-3, 1.6e-2), torch.float32: (2e-6, 2e-6)}


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,width", [(1, 16), (5, 1100)])
def test_gelu_matches_reference(device, dtype, tokens, width, approximate):
    wide = (4 * torch.randn(tokens, width + 5, device=device)).to(dtype)
    wide[0, :4] = torch.tensor([-30.0, 30.0, 0.0, -0.5])        # both tails, zero, a negative
    x = wide[:, :width]  # row stride larger than the width
    out = gelu(x, approximate)
    assert out.shape == (tokens, width) and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, gelu_ref(x, approximate), atol=atol, rtol=rtol)


def test_gelu_ref_mirrors_transformers_activations(device):
    from transformers.activations import ACT2FN
    x = (3 * torch.randn(4, 32, device=device)).to(torch.bfloat16)
    assert torch.equal(gelu_ref(x, "tanh"), ACT2FN["gelu_pytorch_tanh"](x))
    assert torch.equal(gelu_ref(x, "none"), ACT2FN["gelu"](x))
    assert not torch.equal(F.gelu(x.float(), approximate="tanh"), F.gelu(x.float()))   # the forms differ


def test_gelu_rejects_bad_arguments(device):
    with pytest.raises(ValueError, match="approximate='erf' is not a GeLU form"):
        gelu(torch.randn(2, 8, device=device), "erf")
    with pytest.raises(ValueError, match=r"x must have 2 dims, got shape \(2, 3, 8\)"):
        gelu(torch.randn(2, 3, 8, device=device), "tanh")
