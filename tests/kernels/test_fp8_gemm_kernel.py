"""The FP8 GEMM against its reference (the same per-token quantized activations, float32 maths)."""
import pytest
import torch

from kernels.fp8_gemm import (FP8_MAX, Fp8Config, Fp8Weight, _config, fp8_gemm, fp8_gemm_ref, quantize_per_token,
                              quantize_rows)

# float32: Hopper's fp8 tensor cores add a tile's products with about 14 bits (DeepSeek-V3 report, 3.3.2), so an
# H100 differs from the float32 reference by up to ~1.6e-4 here (the CPU interpreter is exact)
TOL = {torch.float16: (2e-2, 1e-2), torch.bfloat16: (1.5e-1, 2e-2), torch.float32: (4e-4, 1e-4)}
N, K = 40, 80          # N: a masked last column block of 16; K: 2.5 tiles of 32
SMALL = Fp8Config(16, 16, 32, 4, 1)
SPLIT = Fp8Config(16, 16, 32, 4, 1, 2)   # K: tiles 0-1 and tile 2 in two programs, summed by the reduce kernel
FMA = Fp8Config(2, 8, 32, 4, 1, 2)      # decode rows' FMA path: 2-row blocks (3 rows: two blocks), split K
SWAP = Fp8Config(16, 16, 32, 4, 1, 2, True)   # the swapped dot w @ x.T (the default for 3-16 rows), split K


def make_weight(n, k, device):
    weight = (torch.randn(n, k, device=device) * 4).to(torch.float8_e4m3fn)
    return Fp8Weight(weight, torch.rand(n, device=device) * 0.01 + 0.001)


def test_per_token_quantization_scales_each_row_to_the_fp8_range(device):
    x = torch.randn(5, K, device=device) * torch.tensor([0.01, 1, 10, 100, 1000], device=device)[:, None]
    x_fp8, scale = quantize_per_token(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and scale.shape == (5,)
    assert torch.equal(x_fp8.float().abs().amax(dim=1), torch.full((5,), FP8_MAX, device=device))
    torch.testing.assert_close(x_fp8.float() * scale[:, None], x, rtol=2**-4, atol=0)


@pytest.mark.parametrize("config", [SMALL, FMA._replace(block_n=64), SWAP], ids=["dot", "fma", "swap"])
def test_the_kernel_rounds_activations_as_quantize_per_token(device, config):
    """Through an identity weight each output is one quantized activation times its scale: bit-equal to torch's
    round-to-nearest-even cast (values spread over many binades, subnormals and ties included). The FMA path
    quantizes its rows in each program: its 2-row blocks here over the 64 columns in one block (FMA's 8 columns
    repeated the same quantization eight times)."""
    k = 64
    x = torch.randn(20, k, device=device) * torch.exp(torch.randn(20, k, device=device) * 3)
    x[0, :4] = torch.tensor([448.0, 0.4989, -7.8, 1e-9])
    identity = Fp8Weight(torch.eye(k, device=device).to(torch.float8_e4m3fn), torch.ones(k, device=device))
    x_fp8, scale = quantize_per_token(x)
    assert torch.equal(fp8_gemm(x, identity, config=config), x_fp8.float() * scale[:, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [64, 1100])     # 1100: a masked second block of QUANTIZE_BLOCK
def test_quantize_rows_is_bit_equal_to_quantize_per_token(device, dtype, k):
    """The one-launch quantization of fp8_linear's cuBLASLt route: the same fp8 values and scales (rows over many
    binades, ties and subnormals, and an all-zero row); values that round to zero may differ in sign."""
    x = (torch.randn(6, k, device=device) * torch.exp(torch.randn(6, k, device=device) * 3)).to(dtype)
    x[0, :4] = torch.tensor([448.0, 0.4989, -7.8, 1e-9], dtype=dtype)
    x[5] = 0
    q, scale = quantize_rows(x)
    q_ref, scale_ref = quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())


GEMM_CONFIGS = {"small": SMALL, "split": SPLIT, "fma": FMA, "swap": SWAP, "default": None}
GEMM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def gemm_params():
    """Each config with one row, a few and many (several 16-row tiles, the last masked; "fma"'s 2-row blocks: 5 rows,
    three blocks, the last masked, as 37 rows' nineteen), each case in another dtype: each config meets all three,
    as does each row count. The dtype enters only at x's load and the output's rounding (bfloat16's own, in the
    store or the split-K reduce), which do not depend on the rows; the full product ran every program three times."""
    params = []
    for c, (name, config) in enumerate(GEMM_CONFIGS.items()):
        for r, (rows, has_bias) in enumerate([(1, True), (3, False), (5 if config is FMA else 37, True)]):
            dtype = GEMM_DTYPES[(c + r) % 3]
            params.append(pytest.param(dtype, rows, has_bias, config, id=f"{name}-{rows}-{has_bias}-{str(dtype)[6:]}"))
    return params


@pytest.mark.parametrize("dtype,rows,has_bias,config", gemm_params())
def test_fp8_gemm_matches_reference(device, dtype, rows, has_bias, config):
    weight = make_weight(N, K, device)
    x = torch.randn(rows, K, device=device).to(dtype)
    bias = torch.randn(N, device=device).to(dtype) if has_bias else None
    out = fp8_gemm(x, weight, bias, config=config)
    assert out.shape == (rows, N) and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, fp8_gemm_ref(x, weight, bias), atol=atol, rtol=rtol)


def test_reference_is_close_to_the_dequantized_float_product(device):
    """What the FP8 path approximates: x @ (weight * scale).T, within the activations' fp8 rounding."""
    weight = make_weight(N, K, device)
    x = torch.randn(4, K, device=device)
    exact = x @ (weight.weight.float() * weight.scale[:, None]).T
    assert ((fp8_gemm_ref(x, weight) - exact).abs().max() / exact.abs().max()) < 0.05


def test_bad_inputs_are_clear_errors(device):
    weight = make_weight(N, K, device)
    with pytest.raises(ValueError, match=r"config must be \(block_m, block_n, block_k"):
        fp8_gemm(torch.randn(2, K, device=device), weight, config=(1, 16))
    with pytest.raises(ValueError, match="block_n must be a power of two, got 12"):
        fp8_gemm(torch.randn(2, K, device=device), weight, config=(1, 12, 32, 4, 1))
    with pytest.raises(ValueError, match="tensor-core path"):
        fp8_gemm(torch.randn(2, K, device=device), weight, config=(16, 8, 32, 4, 1))
    with pytest.raises(ValueError, match="swapped dot"):
        fp8_gemm(torch.randn(2, K, device=device), weight, config=(2, 16, 32, 4, 1, 1, True))
    with pytest.raises(ValueError, match="swap_ab must be True or False, got 'yes'"):
        fp8_gemm(torch.randn(2, K, device=device), weight, config=(16, 16, 32, 4, 1, 1, "yes"))
    with pytest.raises(ValueError, match="weight has dtype torch.float32"):
        fp8_gemm(torch.randn(2, K, device=device), Fp8Weight(weight.weight.float(), weight.scale))
    with pytest.raises(ValueError, match=r"scale has shape \(1,\); expected \(40,\)"):
        fp8_gemm(torch.randn(2, K, device=device), Fp8Weight(weight.weight, weight.scale[:1]))


def test_decode_rows_route_to_the_fma_path_then_the_swapped_dot():
    """1-2 rows: the FMA path (its own rows' scales); 3-16: the swapped tensor-core dot on x quantized first; more:
    the 64-row dot. (On one H100 the swapped dot took the 7B's linear layers at 4 rows 4.69 -> 3.28 ms a step and
    doubled them at 1 row: kernels/fp8_gemm.py's _config.)"""
    shapes = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]
    for rows in range(1, 33):
        for n, k in shapes:
            cfg = _config(rows, n, k, 132)
            if rows <= 2:
                assert cfg.block_m == rows and not cfg.swap_ab, (rows, cfg)
            elif rows <= 16:
                assert cfg.block_m == 16 and cfg.swap_ab and cfg.block_n >= 64, (rows, cfg)   # wgmma's 64-row side
            else:
                assert cfg.block_m == 64 and not cfg.swap_ab, (rows, cfg)
