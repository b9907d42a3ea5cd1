"""Quantized linear layers on one GPU: the 4-bit (GPTQ layout) and FP8 GEMMs' configs on Llama-2-7B shapes.

    python -m bench.quant_gemm_bench [--rows 1,512] [--formats int4,fp8] [--json FILE]

For each format, row count M and projection (N, K) it times ``_config``'s default and a sweep of configs
(``candidates``), each as a CUDA graph of back-to-back launches cycling through weight copies larger than
4x the L2 cache (``bench.gemm_bench.time_per_launch``: every launch reads its weight from HBM), beside the
bfloat16 GEMM the engine runs unquantized (``engine.ops`` choice: the skinny GEMM up to its row limit, else
cuBLAS). TB/s counts the quantized weight bytes (with scales and zeros). Last it prints a table and the
per-step totals ``(qkv + o_proj + gate_up + down) * 32`` in ms for the default, the best, the route the engine
takes (``int4_linear`` / ``fp8_linear``: the fused GEMM for decode rows, cuBLAS past them) and bf16.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton

from bench.gemm_bench import LAYER_SHAPES, LLAMA2_7B, NUM_LAYERS, time_per_launch
from kernels.fp8_gemm import FP8, Fp8Config, Fp8Weight, fp8_gemm, fp8_linear
from kernels.fp8_gemm import _config as fp8_default
from kernels.quant_gemm import (IDOT_MAX_ROWS, Int4Config, Int4Weight, fill_split_k, idot_fits, int4_gemm,
                                int4_linear)
from kernels.quant_gemm import _config as int4_default
from kernels.skinny_gemm import MAX_ROWS, default_split_k, device_sms, skinny_gemm

GROUP = 128


def int4_weights(N: int, K: int, device) -> list[Int4Weight]:
    """Copies of a random 4-bit weight (groups of 128) that exceed 4x the L2 cache together."""
    def one():
        qweight = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device=device)
        scales = (torch.rand(K // GROUP, N, device=device) * 0.01).to(torch.bfloat16)
        zeros = torch.randint(0, 16, (K // GROUP, N), device=device).to(torch.bfloat16)
        return Int4Weight(qweight, scales, zeros, None, GROUP)
    return [one() for _ in range(_copies(int4_bytes(N, K), device))]


def fp8_weights(N: int, K: int, device) -> list[Fp8Weight]:
    def one():
        return Fp8Weight(torch.randn(N, K, device=device).to(FP8), torch.rand(N, device=device) * 0.01)
    return [one() for _ in range(_copies(fp8_bytes(N, K), device))]


def bf16_weights(N: int, K: int, device) -> list[torch.Tensor]:
    return [(0.02 * torch.randn(N, K, device=device)).to(torch.bfloat16) for _ in range(_copies(2 * N * K, device))]


def _copies(nbytes: int, device) -> int:
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20) or 50 * 2**20
    return max(2, math.ceil(4 * l2 / nbytes))


def int4_bytes(N: int, K: int) -> int:
    return N * K // 2 + 2 * (K // GROUP) * N * 2


def fp8_bytes(N: int, K: int) -> int:
    return N * K + 4 * N


def idot_split(N: int, K: int, block_n: int, per_sm: int, sms: int) -> int:
    """Splits of K giving the integer walk's column blocks about ``per_sm`` programs an SM (at most a tile each)."""
    return max(1, min(K // 128, round(per_sm * sms / triton.cdiv(N, block_n))))


def int4_candidates(M: int, N: int, K: int, sms: int, idot: bool = False) -> list[Int4Config]:
    """``idot``: the integer walk can take the product (``quant_gemm.idot_fits``): its configs too."""
    out = []
    if M == 1:
        for block_n, block_k in ((16, 512), (32, 256), (32, 512), (64, 128), (64, 256), (128, 128)):
            for warps in (4, 8):
                for stages in (3, 4):
                    for per_sm in (1, 2, 4):
                        split = fill_split_k(triton.cdiv(N, block_n), K, block_k, per_sm, sms)
                        for sub_n in dict.fromkeys((block_n, 32, 64)):
                            if sub_n <= block_n:
                                out.append(Int4Config(1, block_n, block_k, split, warps, stages, sub_n=sub_n))
        for per_sm in (1, 2, 4):   # 256 columns in loads of 4 or 8 word rows (Int4Config.rows)
            split = max(1, round(per_sm * sms / triton.cdiv(N, 256)))
            for rows in (4, 8):
                out.append(Int4Config(1, 256, 128, split, 4, 3, sub_n=128, rows=rows))
        for block_n in (128, 256) if idot else ():   # the integer walk, in loads of 2, 4 or 8 word rows
            for per_sm in (1, 2, 4):
                for rows in (2, 4, 8):
                    out.append(Int4Config(1, block_n, 128, idot_split(N, K, block_n, per_sm, sms), 4, 3, rows=rows,
                                          idot=True))
    elif M <= 16:
        for block_n in (64, 128):
            for warps in (4, 8):
                for per_sm in (1, 2, 4):
                    split = fill_split_k(triton.cdiv(N, block_n), K, 128, per_sm, sms)
                    out.append(Int4Config(16, block_n, 128, split, warps, 3))
                    for block_k in (64, 128):     # the expanded one-dot tiles
                        split = fill_split_k(triton.cdiv(N, block_n), K, block_k, per_sm, sms)
                        out.append(Int4Config(16, block_n, block_k, split, warps, 3, True))
        for per_sm in (1, 2, 4) if idot and M <= IDOT_MAX_ROWS else ():   # the integer walk on both rows
            for rows in (1, 2, 4):
                out.append(Int4Config(M, 256, 128, idot_split(N, K, 256, per_sm, sms), 4, 3, rows=rows, idot=True))
    else:
        for block_m in (64, 128):
            for block_n in (128, 256):
                for warps in (4, 8):
                    out.append(Int4Config(block_m, block_n, 128, 1, warps, 3))
                    out.append(Int4Config(block_m, block_n, 64, 1, warps, 3, True))
    return list(dict.fromkeys(out))


FP8_FMA_SWEEP_ROWS = 4   # the FMA path's configs are swept up to here (the default takes it up to 2 rows)


def fp8_candidates(M: int, N: int, K: int, sms: int) -> list[Fp8Config]:
    out = []
    if M <= FP8_FMA_SWEEP_ROWS:
        block_m = triton.next_power_of_2(M)
        for block_n in (8, 16, 32, 64):
            for block_k in (256, 512, 1024):
                for warps in (4, 8):
                    if block_n * block_m * block_k > 128 * 32 * warps:   # float32 accumulator registers a thread
                        continue
                    for stages in (3, 4):
                        split = default_split_k(N, K, block_n, block_k, sms)
                        out.append(Fp8Config(block_m, block_n, block_k, warps, stages, split))
    if M <= 16:
        for block_n in (32, 64, 128):
            for block_k in (128, 256):
                for per_sm in (1, 2, 4, 8):
                    split = fill_split_k(triton.cdiv(N, block_n), K, block_k, per_sm, sms)
                    if M > FP8_FMA_SWEEP_ROWS:
                        out.append(Fp8Config(16, block_n, block_k, 4, 4, split))
                    if block_n >= 64:   # the swapped dot: weight rows on wgmma's 64-row side
                        for stages in (3, 4, 6):
                            if block_n * block_k * stages <= 128 * 1024:   # shared memory
                                out.append(Fp8Config(16, block_n, block_k, 4, stages, split, True))
    else:
        for block_m in (64, 128):
            for block_n in (128, 256):
                for warps in (4, 8):
                    out.append(Fp8Config(block_m, block_n, 128, warps, 3))
    return list(dict.fromkeys(out))


def bf16_us(x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    if x.shape[0] <= MAX_ROWS:
        return time_per_launch(lambda w: skinny_gemm(x, w), weights, 20.0)
    return time_per_launch(lambda w: F.linear(x, w), weights, 100.0)


def sweep(fmt: str, M: int, name: str, sms: int, device, configs: bool = True) -> dict:
    N, K = LLAMA2_7B[name]
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    if fmt == "int4":
        weights, gemm, linear, nbytes = int4_weights(N, K, device), int4_gemm, int4_linear, int4_bytes(N, K)
        idot = idot_fits(x, weights[0], weights[0].group_size)
        default, candidates = int4_default(M, N, K, sms, idot=idot), int4_candidates(M, N, K, sms, idot)
    else:
        weights, gemm, linear, nbytes = fp8_weights(N, K, device), fp8_gemm, fp8_linear, fp8_bytes(N, K)
        default, candidates = fp8_default(M, N, K, sms), fp8_candidates(M, N, K, sms)
    candidates = candidates if configs else []
    linear_us = time_per_launch(lambda w: linear(x, w), weights, 20.0)
    timed = {}
    for cfg in [default] + [c for c in candidates if c != default]:
        try:
            timed[cfg] = time_per_launch(lambda w, cfg=cfg: gemm(x, w, config=cfg), weights, 20.0)
        except Exception as err:  # a config the compiler or the GPU cannot take (shared memory): skipped
            print(f"  {fmt} M={M} {name} {tuple(cfg)}: {type(err).__name__}: {str(err)[:120]}")
    best = min(timed, key=timed.get)
    check = gemm(x, weights[0], config=best).float()
    ref = gemm(x, weights[0], config=default).float()
    assert (check - ref).abs().max().item() <= 2e-2 * ref.abs().max().item() + 1e-3, (fmt, M, name, best)
    del weights
    bf16 = bf16_us(x, bf16_weights(N, K, device))
    torch.cuda.empty_cache()
    row = {"format": fmt, "M": M, "shape": name, "N": N, "K": K, "default": list(default),
           "default_us": round(timed[default], 2), "best": list(best), "best_us": round(timed[best], 2),
           "best_tbps": round(nbytes / timed[best] / 1e6, 3), "bf16_us": round(bf16, 2),
           "linear_us": round(linear_us, 2)}
    print(f"{fmt} M={M:<4} {name:<8} default {row['default_us']:8.2f} us  best {row['best_us']:8.2f} us "
          f"({row['best_tbps']:.2f} TB/s) {tuple(best)}  {fmt}_linear {row['linear_us']:8.2f} us  "
          f"bf16 {row['bf16_us']:8.2f} us", flush=True)
    ranked = sorted(timed, key=timed.get)[:5]
    row["top"] = [[list(cfg), round(timed[cfg], 2)] for cfg in ranked]
    print("    top: " + ", ".join(f"{tuple(cfg)} {timed[cfg]:.2f}" for cfg in ranked), flush=True)
    return row


def step_totals(rows: list[dict]) -> list[dict]:
    out = []
    for fmt in dict.fromkeys(r["format"] for r in rows):
        for M in dict.fromkeys(r["M"] for r in rows if r["format"] == fmt):
            part = [r for r in rows if r["format"] == fmt and r["M"] == M]
            if {r["shape"] for r in part} != set(LAYER_SHAPES):
                continue
            total = {key: round(sum(r[key] for r in part) * NUM_LAYERS / 1e3, 3)
                     for key in ("default_us", "best_us", "linear_us", "bf16_us")}
            out.append({"format": fmt, "M": M, **{k.replace("_us", "_ms"): v for k, v in total.items()}})
            print(f"{fmt} M={M}: linear layers per step {total['default_us']:.3f} ms default, "
                  f"{total['best_us']:.3f} ms best, {total['linear_us']:.3f} ms through {fmt}_linear, "
                  f"bf16 {total['bf16_us']:.3f} ms")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,512", help="row counts M (comma-separated)")
    parser.add_argument("--formats", default="int4,fp8", help="int4 and/or fp8")
    parser.add_argument("--shapes", default=",".join(LAYER_SHAPES), help=f"of {', '.join(LLAMA2_7B)}")
    parser.add_argument("--no-sweep", action="store_true", help="time the defaults and the linear routes only")
    parser.add_argument("--json", help="write the rows and totals here")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda")
    sms = device_sms(device)
    rows = [sweep(fmt, int(M), name, sms, device, not args.no_sweep) for fmt in args.formats.split(",")
            for M in args.rows.split(",") for name in args.shapes.split(",")]
    result = {"device": torch.cuda.get_device_name(device), "rows": rows, "totals": step_totals(rows)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
