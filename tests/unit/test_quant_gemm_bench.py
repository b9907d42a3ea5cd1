"""bench.quant_gemm_bench's sweep on the CPU: the configs it builds (no timing)."""
import torch

from bench.quant_gemm_bench import int4_candidates
from kernels.quant_gemm import Int4Weight, idot_fits, int4_gemm, int4_gemm_ref


def test_the_integer_walk_is_swept_where_it_fits_and_its_configs_run():
    """Beside the FMA configs, one row of a weight the integer walk can take gets its configs too; each of them
    runs (here at a small shape under the interpreter) and gives the reference's product."""
    assert not any(c.idot for c in int4_candidates(1, 22016, 4096, 132))
    idot = [c for c in int4_candidates(1, 22016, 4096, 132, idot=True) if c.idot]
    assert {(c.block_n, c.rows) for c in idot} == {(n, r) for n in (128, 256) for r in (2, 4, 8)}
    assert not any(c.idot for c in int4_candidates(4, 22016, 4096, 132, idot=True))
    pair = [c for c in int4_candidates(2, 22016, 4096, 132, idot=True) if c.idot]      # two rows: 256 columns
    assert {(c.block_m, c.block_n, c.rows) for c in pair} == {(2, 256, r) for r in (1, 2, 4)} and len(pair) == 9
    g = torch.Generator().manual_seed(0)
    weight = Int4Weight(torch.randint(-2**31, 2**31 - 1, (32, 256), dtype=torch.int32, generator=g),
                        (torch.rand(2, 256, generator=g) * 0.01).to(torch.bfloat16),
                        torch.randint(0, 16, (2, 256), generator=g).to(torch.bfloat16), None, 128)
    x = torch.randn(1, 256, generator=g).to(torch.bfloat16)
    assert idot_fits(x, weight, 128)
    ref = int4_gemm_ref(x, weight).float()
    small = [c for c in int4_candidates(1, 256, 256, 2, idot=True) if c.idot]
    assert len(small) >= 6
    for cfg in small:
        out = int4_gemm(x, weight, config=cfg).float()
        assert (out - ref).abs().max() <= 2e-2 * ref.abs().max(), cfg
    x2 = torch.randn(2, 256, generator=g).to(torch.bfloat16)
    ref2 = int4_gemm_ref(x2, weight).float()
    pair = [c for c in int4_candidates(2, 256, 256, 2, idot=True) if c.idot]
    assert len(pair) == 3          # a load of 1, 2 or 4 word rows (1, 2 and 4 programs an SM split alike here)
    for cfg in pair:
        out = int4_gemm(x2, weight, config=cfg).float()
        assert (out - ref2).abs().max() <= 2e-2 * ref2.abs().max(), cfg
