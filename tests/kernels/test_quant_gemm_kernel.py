"""The 4-bit dequantizing GEMM against its reference (dequantize to float32, multiply)."""
import pytest
import torch

from kernels.quant_gemm import (_NIBBLE_PAIRS_PTX, Int4Config, Int4Weight, _config, dequantized_linear,
                                int4_dequantize, int4_dequantize_kn, int4_gemm, int4_gemm_ref)
from weights.quant_formats import act_order_g_idx, pack_int4

TOL = {torch.float16: (2e-2, 1e-2), torch.bfloat16: (1.5e-1, 2e-2), torch.float32: (1e-4, 1e-5)}
N, K = 40, 288         # N: a masked last column block of 16; K: 9 tiles of 32, 4.5 of 64, 2.25 of 128
# K of the FMA configs in test_int4_gemm_matches_reference (the interpreter's time goes by the K tiles a program
# walks, a nibble row at a time in these): 5 tiles of 32 and 2.5 of 64 take the branches K's 9 and 4.5 take (whole
# tiles of 32; tiles of 64, the last one half masked)
K_FMA = 160
CONFIGS = {
    "fma": Int4Config(1, 16, 32, 1, 4, 1),
    "fma_split2": Int4Config(1, 16, 64, 2, 4, 1),      # tiles of 64: 3 + 2 (K_FMA: 2 + 1), the last masked
    "fma_sub": Int4Config(1, 32, 64, 2, 4, 1, False, 16),   # two sub-tiles of 16 columns, the second block's masked
    "fma_rows": Int4Config(1, 32, 64, 2, 4, 1, False, 16, 2),   # four loads of 2 word rows a tile, the last masked
    "dot": Int4Config(16, 16, 128, 1, 4, 1),
    "dot_split3": Int4Config(16, 16, 128, 3, 4, 1),    # tiles 1 + 1 + 1
    "expand_split2": Int4Config(16, 16, 32, 2, 4, 1, True),   # one-dot tiles of 32: 5 + 4 (group 32: a tile each)
    "default": None,
}


def make_weight(n, k, group, dtype, device, act_order=False, seed=0):
    """Random 4-bit values, zeros and scales in the kernel's layout; also the values as [K, N] ints."""
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group == -1 else k // group
    values = torch.randint(0, 16, (k, n), generator=g)
    scales = (torch.rand(groups, n, generator=g) * 0.05 + 0.01).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=g).to(dtype)
    g_idx = act_order_g_idx(k, group, g).to(device) if act_order else None
    weight = Int4Weight(pack_int4(values, 0).to(device), scales.to(device), zeros.to(device), g_idx,
                        k if group == -1 else group)
    return weight, values.to(device)


@pytest.mark.parametrize("group,act_order", [(32, False), (16, False), (-1, False), (16, True)])
def test_dequantize_follows_the_packed_layout(device, group, act_order):
    weight, values = make_weight(N, K, group, torch.float32, device, act_order)
    rows = (weight.g_idx.long() if act_order else torch.arange(K, device=device) // weight.group_size)
    expected = (values.float() - weight.zeros[rows]) * weight.scales[rows]          # [K, N]
    torch.testing.assert_close(int4_dequantize(weight), expected.T, atol=0, rtol=0)


# (rows, group, act_order, has_bias). Rows: one, or two (the FMA configs: a program per row, the same program whatever
# their number, so a second row covers the row offset, in the last two cases; the dot configs and the default one's
# for 2-16 rows: one masked 16-row tile, the same for 2 rows as for 16)
GEMM_CASES = [(1, 32, False, True), (1, 16, False, False), (2, -1, False, True), (2, 16, True, True)]
GEMM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (config, case index): dtypes run besides the rotation's, where the kernel branches on the dtype. "fma" (whole K
# tiles of 32, no perm): bfloat16 x is read as int32 pairs (X_PAIRS), float32 and float16 one value a load; the
# rotation gives it pairs on group 16 (a dequantized nibble each) and plain loads on groups 32 and -1 (a group a
# tile) and act-order, so bfloat16 on group -1 adds pairs on a group a tile, over two rows. The dot configs with a
# group a tile (group -1; blocks of 128): bfloat16 x takes the offset bfloat16 nibbles (BF16_NIBBLES), the others
# the float32 nibbles: both on each.
GEMM_EXTRA_DTYPES = {("fma", 2): [torch.bfloat16], ("dot", 2): [torch.bfloat16], ("dot_split3", 2): [torch.float16],
                     ("default", 2): [torch.bfloat16]}


def gemm_params():
    """Each config meets every case, the dtypes in turn (each config all three), plus GEMM_EXTRA_DTYPES: the
    full product repeated the same programs for each dtype where the kernel does not branch on it (3x the time)."""
    params = []
    for c, name in enumerate(CONFIGS):
        for i, case in enumerate(GEMM_CASES):
            for dtype in [GEMM_DTYPES[(c + i) % 3], *GEMM_EXTRA_DTYPES.get((name, i), [])]:
                case_id = "-".join(map(str, case))
                params.append(pytest.param(dtype, *case, name, id=f"{name}-{str(dtype)[6:]}-{case_id}"))
    return params


@pytest.mark.parametrize("dtype,rows,group,act_order,has_bias,config_name", gemm_params())
def test_int4_gemm_matches_reference(device, dtype, rows, group, act_order, has_bias, config_name):
    config = CONFIGS[config_name]      # the FMA configs take several rows as one program per row
    k = K_FMA if config is not None and config.block_m == 1 else K
    weight, _ = make_weight(N, k, group, dtype, device, act_order)
    x = torch.randn(rows, k, device=device).to(dtype)
    bias = torch.randn(N, device=device).to(dtype) if has_bias else None
    out = int4_gemm(x, weight, bias, config=config)
    assert out.shape == (rows, N) and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, int4_gemm_ref(x, weight, bias), atol=atol, rtol=rtol)


@pytest.mark.parametrize("config", [Int4Config(1, 64, 128, 2, 4, 1), Int4Config(1, 64, 128, 2, 4, 1, False, 32, 4)],
                         ids=["one_load", "four_loads"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e4])
def test_one_row_tiles_inside_a_group_round_as_float32(device, dtype, magnitude, config):
    """The decode path's fast tiles (one row, a group a tile, whole K tiles: nibbles read in place as denormals
    against x scaled by powers of two; bfloat16 x read as int32 pairs), in one load of word rows or in four,
    give the float32 product of the same inputs up to the output's own rounding, for tiny and large activations
    and exact zeros alike."""
    weight, _ = make_weight(128, 512, 128, dtype, device)
    x = (torch.randn(1, 512, device=device) * magnitude).to(dtype)
    x[0, ::7] = 0
    out = int4_gemm(x, weight, config=config)
    w = int4_dequantize(Int4Weight(weight.qweight, weight.scales.float(), weight.zeros.float(), None,
                                   weight.group_size))
    exact = x.double() @ w.double().T
    terms = x.double().abs() @ w.double().abs().T           # float32 sums in another order: eps a term at most
    rounding = 2 ** -8 if dtype == torch.bfloat16 else 0     # the bfloat16 output's one rounding
    assert ((out.double() - exact).abs() <= rounding * exact.abs() + 512 * 2 ** -24 * terms).all()


def test_one_row_of_a_view_that_starts_mid_pair(device):
    """x whose row starts at an odd column (a view): not read as int32 pairs (a misaligned four-byte load on the
    GPU), and the same product as a copy of it."""
    weight, _ = make_weight(64, 256, 128, torch.bfloat16, device)
    wide = torch.randn(1, 257, device=device).to(torch.bfloat16)
    x = wide[:, 1:]
    assert x.data_ptr() % 4 != 0
    config = Int4Config(1, 64, 128, 1, 4, 1)
    assert torch.equal(int4_gemm(x, weight, config=config), int4_gemm(x.contiguous(), weight, config=config))


def test_prefill_tiles_match_reference(device):
    weight, _ = make_weight(N, K, 32, torch.float32, device)
    x = torch.randn(37, K, device=device)      # more rows than one 16-row tile, ragged
    out = int4_gemm(x, weight, config=Int4Config(16, 16, 128, 1, 4, 1))
    torch.testing.assert_close(out, int4_gemm_ref(x, weight), atol=1e-4, rtol=1e-5)


def test_expanded_prefill_tiles_match_reference(device):
    """The one-dot path on prefill tiles: act-order rows (g_idx: each row its own group) and groups of 128 in
    tiles of 64 (each tile inside one group)."""
    for act_order, group, block_k in ((True, 16, 32), (False, 128, 64)):
        weight, _ = make_weight(N, 256, group, torch.float32, device, act_order)
        x = torch.randn(37, 256, device=device)
        out = int4_gemm(x, weight, config=Int4Config(16, 16, block_k, 1, 4, 1, True))
        torch.testing.assert_close(out, int4_gemm_ref(x, weight), atol=1e-4, rtol=1e-5)


def test_default_configs_split_decode_and_tile_prefill():
    one, few = _config(1, 4096, 4096, 132), _config(8, 4096, 4096, 132)
    mid, many = _config(128, 4096, 4096, 132), _config(512, 4096, 4096, 132)
    assert one.block_m == 1 and one.split_k == 4      # 64 column blocks x 4 splits: about 2 programs an SM
    assert one.block_n == 64 and one.sub_n == 32 and one.rows == 0
    wide = _config(1, 22016, 4096, 132)    # gate_up: 86 blocks of 256 columns fill half the SMs
    assert (wide.block_n, wide.sub_n, wide.rows, wide.split_k) == (256, 128, 4, 3)
    assert _config(1, 22016, 4096, 132, torch.float32).block_n == 64   # measured for bfloat16 only
    # g_idx: each nibble's zero and scale loads, staged for 256 columns, need 296 KB of shared memory (sm_90)
    assert _config(1, 22016, 4096, 132, group_per_tile=False).block_n == 64
    assert few.block_m == 16 and few.block_n == 128 and few.split_k == 8   # 32 column blocks: 256 programs
    assert _config(8, 4096, 4096, 132, torch.float32).block_n == 64   # measured wider for bfloat16 only
    assert mid.block_m == 64 and mid.split_k == 4     # 2 x 32 tiles: split until the SMs are busy
    assert many.block_m == 64 and many.split_k == 1


def test_tiles_inside_a_group_multiply_offset_bfloat16_nibbles(device):
    """The dot path on bfloat16 x with a group a tile multiplies 128 + q and folds the offset into the zero
    (``_offset_nibbles``; on the GPU its PTX): four tiles of 128 rows, each its own group, split or not. 7 rows: the
    masked 16-row tile that one row takes too (each row's own sum of x folded with the zero)."""
    weight, _ = make_weight(48, 512, 128, torch.bfloat16, device, seed=3)
    x = torch.randn(7, 512, device=device).to(torch.bfloat16)
    bias = torch.randn(48, device=device).to(torch.bfloat16)
    expected = (x.float() @ int4_dequantize(weight).T + bias.float())
    for config in (Int4Config(16, 16, 128, 1, 4, 1), Int4Config(16, 32, 128, 2, 4, 1)):
        out = int4_gemm(x, weight, bias, config=config)
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=1e-2)


def _run_ptx(text: str, registers: dict[str, int]) -> dict[str, int]:
    """The prmt (default mode) / shr.u32 / lop3.b32 lines of an inline PTX block on 32-bit unsigned values."""
    def value(arg):
        return int(arg, 16) if arg.startswith("0x") else int(arg) if arg.isdigit() else registers[arg]
    for line in text.strip("{}\n").splitlines():
        op, args = line.rstrip(";").split(" ", 1)
        dst, *src = [a.strip() for a in args.split(",")]
        if op == ".reg":
            continue
        if op == "prmt.b32":
            pool = value(src[0]) | value(src[1]) << 32
            selector = value(src[2])
            assert all((selector >> (4 * i)) & 8 == 0 for i in range(4))      # no sign replication
            registers[dst] = sum(((pool >> (8 * ((selector >> (4 * i)) & 7))) & 255) << (8 * i) for i in range(4))
        elif op == "shr.u32":
            registers[dst] = value(src[0]) >> value(src[1])
        elif op == "lop3.b32":
            a, b, c, lut = (value(x) for x in src)
            registers[dst] = sum(((lut >> (((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1))) & 1) << i
                                 for i in range(32))
        else:
            raise AssertionError(f"unexpected PTX {line!r}")
    return registers


def test_nibble_pair_ptx_gives_offset_bfloat16_nibbles_of_both_words():
    """The GPU's PTX for ``_offset_nibbles``, run here line by line: register j holds nibble j of the first word
    (low half) and of the second (high half) as bfloat16 128 + q, for random words and the extremes."""
    g = torch.Generator().manual_seed(0)
    words = [0, 0xFFFFFFFF, 0x76543210, 0x89ABCDEF] + torch.randint(0, 2**32, (60,), generator=g).tolist()
    for w0, w1 in zip(words[0::2], words[1::2]):
        out = _run_ptx(_NIBBLE_PAIRS_PTX.value, {"$8": w0, "$9": w1})
        for j in range(8):
            halves = torch.tensor([out[f"${j}"] & 0xFFFF, out[f"${j}"] >> 16], dtype=torch.int32)
            got = (halves << 16).view(torch.float32).tolist()
            assert got == [128 + ((w0 >> (4 * j)) & 15), 128 + ((w1 >> (4 * j)) & 15)], (hex(w0), hex(w1), j)


def test_bad_inputs_are_clear_errors(device):
    weight, _ = make_weight(N, K, 32, torch.float32, device)
    with pytest.raises(ValueError, match=r"x has shape \(2, 64\); expected \(\*, 288\)"):
        int4_gemm(torch.randn(2, 64, device=device), weight)
    with pytest.raises(ValueError, match="scales has dtype torch.float32 but must match torch.float16"):
        int4_gemm(torch.randn(2, K, device=device).half(), weight)
    short = Int4Weight(weight.qweight, weight.scales[:2], weight.zeros[:2], None, 32)
    with pytest.raises(ValueError, match="2 groups of 32 rows do not cover K = 288"):
        int4_gemm(torch.randn(2, K, device=device), short)
    with pytest.raises(ValueError, match="the expanded dot path takes block_m and block_k of at least 16"):
        int4_gemm(torch.randn(2, K, device=device), weight, config=Int4Config(1, 16, 32, 1, 4, 1, True))
    with pytest.raises(ValueError, match="the dot path .* takes block_k in multiples of 128"):
        int4_gemm(torch.randn(2, K, device=device), weight, config=Int4Config(16, 16, 64, 1, 4, 1))
    for sub_n in (24, -16):
        with pytest.raises(ValueError, match="sub_n must be positive and divide block_n"):
            int4_gemm(torch.randn(1, K, device=device), weight, config=Int4Config(1, 32, 32, 1, 4, 1, False, sub_n))
    with pytest.raises(ValueError, match="sub-tiles are the one-row path's"):
        int4_gemm(torch.randn(2, K, device=device), weight, config=Int4Config(16, 32, 128, 1, 4, 1, False, 16))
    for rows in (3, 8, -2):   # not a power of two; more than block_k / 8 = 4; negative
        with pytest.raises(ValueError, match="rows must be a power of two dividing block_k / 8"):
            int4_gemm(torch.randn(1, K, device=device), weight, config=Int4Config(1, 32, 32, 1, 4, 1, False, 0, rows))
    with pytest.raises(ValueError, match="rows is the one-row path's"):
        int4_gemm(torch.randn(2, K, device=device), weight, config=Int4Config(16, 32, 128, 1, 4, 1, False, 0, 4))


@pytest.mark.parametrize("uniform", [True, False])
def test_rows_sorted_by_group_read_x_through_perm(device, uniform):
    """An act-order weight with its rows sorted by group and x read through ``perm`` is the same product:
    groups of equal size take the one-scale-a-tile path (no g_idx), uneven ones keep the sorted g_idx."""
    weight, values = make_weight(N, K, 16, torch.float32, device)
    g = torch.Generator().manual_seed(5)
    g_idx = (act_order_g_idx(K, 16, g) if uniform else torch.randint(0, K // 16, (K,), generator=g)).to(device)
    act_order = Int4Weight(weight.qweight, weight.scales, weight.zeros, g_idx.to(torch.int32), 16)
    perm = torch.argsort(g_idx, stable=True)
    sorted_g_idx = None if uniform else g_idx[perm].to(torch.int32)
    sorted_weight = Int4Weight(pack_int4(values[perm], 0), weight.scales, weight.zeros, sorted_g_idx, 16,
                               perm.to(torch.int32))
    x = torch.randn(2, K, device=device)      # "fma": a program a row, the second at a row offset
    expected = int4_gemm_ref(x, act_order)
    torch.testing.assert_close(int4_gemm_ref(x, sorted_weight), expected, atol=1e-4, rtol=1e-5)
    for config in (CONFIGS["fma"], CONFIGS["dot"]):
        torch.testing.assert_close(int4_gemm(x, sorted_weight, config=config), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("group,act_order", [(32, False), (-1, False), (16, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_kernel_equals_the_reference(device, dtype, group, act_order):
    """The Triton dequantization (int4_linear's many-row path) gives int4_dequantize's weight, transposed,
    rounded once to the dtype."""
    weight, _ = make_weight(N, K, group, dtype, device, act_order)
    expected = int4_dequantize(weight).T.to(dtype)
    assert torch.equal(int4_dequantize_kn(weight, dtype), expected)


@pytest.mark.parametrize("group,act_order,has_bias", [(32, False, True), (16, True, False)])
def test_the_many_row_route_dequantizes_then_multiplies(device, group, act_order, has_bias):
    """dequantized_linear (int4_linear past FUSED_ROWS on a GPU), rows sorted by group and x read through perm
    included, against the reference."""
    from engine.models.quantized import sorted_by_group

    weight, _ = make_weight(N, K, group, torch.float32, device, act_order)
    served = sorted_by_group(Int4Weight(weight.qweight, weight.scales, weight.zeros, None, group), weight.g_idx) \
        if act_order else weight
    x = torch.randn(37, K, device=device)
    bias = torch.randn(N, device=device) if has_bias else None
    expected = int4_gemm_ref(x, weight, bias)
    torch.testing.assert_close(dequantized_linear(x, served, bias), expected, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match=r"x has shape \(2, 64\); expected \(\*, 288\)"):
        dequantized_linear(torch.randn(2, 64, device=device), weight)


# ---- the integer walk (1-2 bfloat16 rows by dp4a; the interpreter sums the same bytes in Triton ops) -------------

IDOT = Int4Config(1, 64, 128, 2, 4, 1, rows=4, idot=True)


@pytest.mark.parametrize("splits,has_bias,rows", [(1, True, 1), (2, False, 1), (3, True, 1), (1, False, 2),
                                                  (3, True, 2)])
def test_integer_walk_gives_the_float32_product_within_a_bfloat16_rounding(device, splits, has_bias, rows):
    """x rounded to 15-bit integers per row and tile of 128 (against its largest value) and the nibbles summed
    exactly: within the output's own rounding and the float32 sums' of the exact product, outliers of 1000x, zeros
    and tiny values included, each row of two at its own scale; one split stores bfloat16 with the bias, several go
    through the reduce."""
    weight, _ = make_weight(128, 384, 128, torch.bfloat16, device)
    x = torch.randn(rows, 384, device=device)
    x[0, 5], x[0, 200], x[0, 7:20] = 1000.0, -3000.0, 0.0
    x[0, 300:310] = 1e-30
    x[rows - 1, 130:135] *= 1e-3
    x = x.to(torch.bfloat16)
    bias = torch.randn(128, device=device).to(torch.bfloat16) if has_bias else None
    out = int4_gemm(x, weight, bias, config=IDOT._replace(block_m=rows, split_k=splits, rows=4 // rows))
    w = int4_dequantize(Int4Weight(weight.qweight, weight.scales.float(), weight.zeros.float(), None, 128))
    exact = x.double() @ w.double().T + (bias.double() if has_bias else 0)
    largest = x.double().abs().view(rows, 3, 128).amax(dim=2)
    steps = torch.exp2(torch.floor(torch.log2(largest)) - 13).repeat_interleave(128, dim=1)   # x's integer steps
    x_rounding = (steps / 2) @ w.double().abs().T
    terms = x.double().abs() @ w.double().abs().T
    bound = 2 ** -8 * exact.abs() + x_rounding + 2 ** -20 * terms    # the output's rounding, x's, float32 sums'
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("column,value", [(64, float("inf")), (201, float("-inf")), (383, float("nan"))])
@pytest.mark.parametrize("rows", [1, 2])
def test_integer_walk_makes_outputs_of_a_non_finite_x_nan(device, column, value, rows):
    """An inf or NaN in x (an even or odd column of its pair, any tile) makes every output of its row NaN, where
    the float product makes each inf or NaN; the integers of its tile are never read as numbers, and the other row
    stays as it was."""
    weight, _ = make_weight(128, 384, 128, torch.bfloat16, device)
    x = torch.randn(rows, 384, device=device).to(torch.bfloat16)
    config = IDOT._replace(block_m=rows, split_k=2)
    finite = int4_gemm(x, weight, config=config)
    x[rows - 1, column] = value
    out = int4_gemm(x, weight, config=config)
    assert not torch.isfinite(int4_gemm_ref(x, weight)[-1]).any()
    assert torch.isnan(out[-1]).all()
    assert torch.equal(out[:-1], finite[:-1])


def test_integer_walk_refuses_what_it_cannot_take(device):
    weight, _ = make_weight(128, 384, 128, torch.bfloat16, device)
    x = torch.randn(1, 384, device=device).to(torch.bfloat16)
    with pytest.raises(ValueError, match="1 to 2 bfloat16 rows"):
        int4_gemm(x.float(), Int4Weight(weight.qweight, weight.scales.float(), weight.zeros.float(), None, 128),
                  config=IDOT)
    with pytest.raises(ValueError, match="1 to 2 bfloat16 rows"):
        int4_gemm(torch.cat([x, x, x]), weight, config=IDOT._replace(block_m=3))
    with pytest.raises(ValueError, match=r"all of x's rows in a program \(block_m 2\)"):
        int4_gemm(torch.cat([x, x]), weight, config=IDOT)
    with pytest.raises(ValueError, match="1 to 2 bfloat16 rows"):      # rows 4 bytes apart, not paired
        int4_gemm(torch.randn(2, 385, device=device).to(torch.bfloat16)[:, :384], weight,
                  config=IDOT._replace(block_m=2))
    odd, _ = make_weight(128, 384, 32, torch.bfloat16, device)       # groups of 32: several groups a tile
    with pytest.raises(ValueError, match="1 to 2 bfloat16 rows"):
        int4_gemm(x, odd, config=IDOT)
    with pytest.raises(ValueError, match="power-of-two block_n dividing N"):
        int4_gemm(x, make_weight(96, 384, 128, torch.bfloat16, device)[0], config=IDOT)
    with pytest.raises(ValueError, match="power-of-two block_n dividing N"):
        int4_gemm(x, make_weight(96, 384, 128, torch.bfloat16, device)[0], config=IDOT._replace(block_n=48))
    with pytest.raises(ValueError, match="no expand or sub_n"):     # a field the walk would not apply
        int4_gemm(x, weight, config=IDOT._replace(sub_n=32))
    with pytest.raises(ValueError, match="rows must be a power of two"):
        int4_gemm(x, weight, config=IDOT._replace(rows=3))


def test_default_config_takes_the_integer_walk_for_wide_or_deep_weights():
    """Llama-2-7B at batch 1 in bfloat16: gate_up (N 22,016) and down (K 11,008) take it, qkv and o_proj not."""
    gate_up, down = _config(1, 22016, 4096, 132, idot=True), _config(1, 4096, 11008, 132, idot=True)
    assert gate_up.idot and gate_up.split_k == 3 and down.idot and down.split_k == 16
    assert not _config(1, 12288, 4096, 132, idot=True).idot and not _config(1, 4096, 4096, 132, idot=True).idot
    assert not _config(1, 22016, 4096, 132).idot and not _config(3, 22016, 4096, 132, idot=True).idot
    for n, k, splits in ((12288, 4096, 6), (4096, 4096, 8), (22016, 4096, 3), (4096, 11008, 16)):  # two rows: all
        assert _config(2, n, k, 132, idot=True) == Int4Config(2, 256, 128, splits, 4, 3, rows=1, idot=True)
    assert not _config(2, 1536, 8960, 132, idot=True).idot and not _config(2, 8192, 2048, 132, idot=True).idot
    assert not _config(1, 1536, 8960, 132, idot=True).idot          # deep but narrow: not measured, the FMA walk
    assert _config(1, 4096, 14336, 132, idot=True).split_k == 16    # Llama-3-8B's down: 112 tiles, 7 a split
    assert _config(1, 16384, 1024, 132, idot=True).split_k == 2     # 4 would leave 2 of its 8 tiles a split
