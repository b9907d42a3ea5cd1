import pytest
import torch
import torch.nn.functional as F
import triton

from kernels.skinny_gemm import (
    FMA_ACC_BUDGET,
    H100_SMS,
    MAX_ROWS,
    SKINNY_ROWS,
    TUNED,
    SkinnyConfig,
    _config,
    _validate_config,
    linear,
    skinny_gemm,
    skinny_gemm_ref,
)

TOL = {torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2), torch.float32: (1e-5, 1e-5)}
N, K = 200, 136  # neither a multiple of any block: masked last column block and K tile

# Small blocks keep the CPU interpreter fast; K = 136 is 5 tiles of 32 or 3 tiles of 64.
CONFIGS = {
    "fma": SkinnyConfig(64, 32, 1, 4, 2),
    "fma_split3": SkinnyConfig(64, 32, 3, 4, 2),            # tiles 2 + 2 + 1
    "dot": SkinnyConfig(64, 32, 1, 4, 2, use_dot=True),
    "dot_split2": SkinnyConfig(32, 64, 2, 4, 2, use_dot=True),  # tiles 2 + 1
    "default": None,
}
LLAMA_7B_SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096)]


def make_inputs(rows, n, k, dtype, device, bias=True):
    x = torch.randn(rows, k, device=device).to(dtype)
    weight = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = (0.5 * torch.randn(n, device=device)).to(dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("rows,has_bias", [(1, False), (3, True), (8, False), (MAX_ROWS, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_skinny_gemm_matches_reference(device, dtype, rows, has_bias, config_name):
    x, weight, bias = make_inputs(rows, N, K, dtype, device, bias=has_bias)
    out = skinny_gemm(x, weight, bias, config=CONFIGS[config_name])
    assert out.shape == (rows, N) and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, skinny_gemm_ref(x, weight, bias), atol=atol, rtol=rtol)


@pytest.mark.parametrize("config_name", ["fma", "dot_split2"])
def test_skinny_gemm_rounds_the_float32_sum_once(device, config_name):
    """bf16 output within half an ulp of the exact sum: float32 accumulation, one round to nearest."""
    x, weight, bias = make_inputs(2, N, K, torch.bfloat16, device)
    out = skinny_gemm(x, weight, bias, config=CONFIGS[config_name])
    exact = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=2.0 ** -8 + 1e-5)


@pytest.mark.parametrize("use_dot", [False, True])
def test_split_k_is_bit_reproducible_and_matches_one_split(device, use_dot):
    x, weight, bias = make_inputs(5, N, K, torch.float32, device)
    split = SkinnyConfig(32, 32, 4, 4, 2, use_dot)  # 5 tiles -> 3 splits of 2 + 2 + 1
    first = skinny_gemm(x, weight, bias, config=split)
    assert torch.equal(first, skinny_gemm(x, weight, bias, config=split))
    whole = skinny_gemm(x, weight, bias, config=split._replace(split_k=1))
    torch.testing.assert_close(first, whole, atol=1e-5, rtol=1e-5)


def test_skinny_gemm_is_bit_reproducible_in_bfloat16(device):
    x, weight, bias = make_inputs(4, N, K, torch.bfloat16, device)
    for config in (CONFIGS["fma_split3"], CONFIGS["dot"]):
        assert torch.equal(skinny_gemm(x, weight, bias, config=config), skinny_gemm(x, weight, bias, config=config))


def test_skinny_gemm_takes_row_strided_inputs(device):
    wide_x = torch.randn(3, K + 24, device=device)
    wide_w = torch.randn(2 * N, K + 8, device=device) / K ** 0.5
    x, weight = wide_x[:, :K], wide_w[::2, :K]  # row strides K + 24 and 2 * (K + 8)
    bias = torch.randn(N, device=device)
    for config in (CONFIGS["fma"], CONFIGS["dot_split2"]):
        out = skinny_gemm(x, weight, bias, config=config)
        torch.testing.assert_close(out, skinny_gemm_ref(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_skinny_gemm_small_and_empty_shapes(device):
    x, weight, bias = make_inputs(2, 1, 20, torch.float32, device)  # one column, K below one tile
    torch.testing.assert_close(skinny_gemm(x, weight, bias), skinny_gemm_ref(x, weight, bias), atol=1e-5, rtol=1e-5)
    x, weight, _ = make_inputs(0, N, K, torch.float32, device)
    assert skinny_gemm(x, weight).shape == (0, N)
    x, weight, bias = make_inputs(3, 7, 0, torch.float32, device)  # K = 0: the bias alone
    torch.testing.assert_close(skinny_gemm(x, weight, bias), bias.expand(3, 7))


def test_skinny_gemm_ref_is_linear(device):
    x, weight, bias = make_inputs(3, N, K, torch.bfloat16, device)
    assert torch.equal(skinny_gemm_ref(x, weight, bias), F.linear(x, weight, bias))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 16])
def test_default_configs_fill_an_h100(rows):
    for n, k in LLAMA_7B_SHAPES + [(1024, 4096)]:
        cfg = _validate_config(_config(rows, n, k, H100_SMS))
        splits = min(cfg.split_k, triton.cdiv(k, cfg.block_k))
        assert triton.cdiv(n, cfg.block_n) * splits * 4 >= H100_SMS * 3, (rows, n, k, cfg)
        if not cfg.use_dot:
            acc_regs = triton.next_power_of_2(rows) * cfg.block_n * cfg.block_k // (32 * cfg.num_warps)
            assert acc_regs <= FMA_ACC_BUDGET, (rows, cfg)
    assert _config(rows, 256, 4096, H100_SMS).split_k > 1  # few column blocks: split K


def test_tuned_configs_are_valid_and_taken_on_their_device_only():
    """``TUNED``: every entry a valid config on its path (FMA at one row within the accumulator budget, dot for
    the rest); ``_config`` takes it for M = 1 and every M > 2 on that device, the rules for M = 2 and elsewhere."""
    for device, table in TUNED.items():
        for (path, n, k), cfg in table.items():
            assert _validate_config(cfg) == cfg and cfg.use_dot == (path == "dot"), (path, n, k, cfg)
            if path == 1:
                assert cfg.block_n * cfg.block_k // (32 * cfg.num_warps) <= FMA_ACC_BUDGET, cfg
            for rows in ((1,) if path == 1 else (3, 5, 8, 16)):
                assert _config(rows, n, k, H100_SMS, device) == cfg
                assert _config(rows, n, k, H100_SMS, "NVIDIA H100 80GB HBM3") == _config(rows, n, k, H100_SMS)
            assert _config(2, n, k, H100_SMS, device) == _config(2, n, k, H100_SMS)


@pytest.mark.parametrize("cfg", sorted({c for table in TUNED.values() for c in table.values()}), ids=str)
def test_each_tuned_config_computes_the_product(cfg, device):
    """Each tuned config's launch (its blocks, warps, stages and path) on a shape of a few of its tiles."""
    rows = 1 if not cfg.use_dot else 5
    x, weight, bias = make_inputs(rows, 2 * cfg.block_n + 3, 2 * cfg.block_k + 16, torch.bfloat16, device)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(skinny_gemm(x, weight, bias, config=cfg), skinny_gemm_ref(x, weight, bias),
                               atol=atol, rtol=rtol)


def test_skinny_gemm_config_argument(device):
    x, weight, _ = make_inputs(2, N, K, torch.float32, device)
    out = skinny_gemm(x, weight, config=(64, 32, 1, 4, 2))  # a plain 5-tuple: the FMA path
    torch.testing.assert_close(out, skinny_gemm_ref(x, weight), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"block_n must be a power of two >= 16 \(dot path\), got 8"):
        skinny_gemm(x, weight, config=(8, 32, 1, 4, 2, True))
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16, got 100"):
        skinny_gemm(x, weight, config=(16, 100, 1, 4, 2))
    with pytest.raises(ValueError, match="split_k must be an int in 1..16, got 0"):
        skinny_gemm(x, weight, config=(16, 32, 0, 4, 2))
    with pytest.raises(ValueError, match="config must be"):
        skinny_gemm(x, weight, config=(16, 32))


def test_skinny_gemm_rejects_bad_arguments(device):
    x, weight, bias = make_inputs(2, N, K, torch.bfloat16, device)
    with pytest.raises(ValueError, match=rf"at most {MAX_ROWS} rows of x .*, got {MAX_ROWS + 1}"):
        skinny_gemm(torch.randn(MAX_ROWS + 1, K, device=device).to(torch.bfloat16), weight)
    with pytest.raises(ValueError, match=rf"weight has shape \({N}, {K - 1}\); expected \(\*, {K}\)"):
        skinny_gemm(x, weight[:, : K - 1])
    with pytest.raises(ValueError, match="weight has dtype torch.float16 but must match torch.bfloat16"):
        skinny_gemm(x, weight.half())
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        skinny_gemm(torch.ones(2, K, dtype=torch.int64, device=device), weight)
    with pytest.raises(ValueError, match=r"x must have 2 dims, got shape \(2, 1, 136\)"):
        skinny_gemm(x[:, None], weight)
    with pytest.raises(ValueError, match=rf"bias has shape \({N - 1},\); expected \({N},\)"):
        skinny_gemm(x, weight, bias[1:])
    with pytest.raises(ValueError, match="bias has dtype torch.float32 but must match torch.bfloat16"):
        skinny_gemm(x, weight, bias.float())
    with pytest.raises(ValueError, match="weight must have a contiguous last dim"):
        skinny_gemm(x, weight.t().contiguous().t())


@pytest.mark.parametrize("rows", [1, SKINNY_ROWS, SKINNY_ROWS + 1])
def test_linear_is_f_linear_on_both_sides_of_the_skinny_limit(device, rows):
    """The model's linear op: the skinny GEMM up to SKINNY_ROWS rows (half precision on CUDA), cuBLAS above."""
    x, weight, bias = make_inputs(rows, N, K, torch.bfloat16, device)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias), atol=atol, rtol=rtol)
    if device.type == "cuda" and rows <= SKINNY_ROWS:
        torch.testing.assert_close(linear(x, weight, bias), skinny_gemm(x, weight, bias), atol=0, rtol=0)
