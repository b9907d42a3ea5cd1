"""Decode linear layers on one GPU: cuBLAS ``F.linear`` against the Triton skinny GEMM's configs.

    python -m bench.gemm_bench [--rows 1,2,4,8] [--shapes qkv,o_proj,...,5120x2048] [--json FILE]

A shape is one of Llama-2-7B's projections by name or any ``NxK`` (another model's layers).

For each Llama-2-7B projection (N, K) and each row count M it times

  cublas    ``F.linear(x, w)``, x [M, K], w [N, K]
  triton    ``kernels.skinny_gemm.skinny_gemm`` for ~40-60 configs: a coarse stage (FMA and dot
            paths x BLOCK_N x BLOCK_K x num_warps at 3 stages, the default split), then the
            --top best of it with num_stages 1-4 and SPLIT_K 1, 2, 4, 8; plus ``_config``'s default (the
            device's ``TUNED`` config where it has one: what the engine runs)

Each timing is a CUDA graph of back-to-back launches replayed a few times between CUDA events
(median, per launch). The launches cycle through copies of the weight that together exceed
four times the L2 cache, so every launch reads its weight from HBM as in a real decode step.
TB/s counts the weight bytes only. The best config's output is checked against cuBLAS (bf16
tolerance) and run twice (bit-equal). Last it prints a table and the per-step totals
``(qkv + o_proj + gate_up + down) * 32 + lm_head`` in ms, and --json writes everything with the
best config per (M, N, K).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from kernels.skinny_gemm import (
    FMA_ACC_BUDGET,
    MAX_ROWS,
    SkinnyConfig,
    _config,
    default_split_k,
    device_name,
    device_sms,
    precompile_skinny_gemm,
    skinny_gemm,
    split_layout,
)

LLAMA2_7B = {"qkv": (12288, 4096), "o_proj": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
             "lm_head": (32000, 4096)}
LAYER_SHAPES = ("qkv", "o_proj", "gate_up", "down")


def shape_of(name: str) -> tuple[int, int]:
    """(N, K) of a Llama-2-7B projection's name or of ``NxK``; ValueError for anything else."""
    if name in LLAMA2_7B:
        return LLAMA2_7B[name]
    n, sep, k = name.partition("x")
    if sep and n.isdigit() and k.isdigit() and int(n) > 0 and int(k) > 0:
        return int(n), int(k)
    raise ValueError(f"unknown shape {name!r}: use one of {', '.join(LLAMA2_7B)} or NxK (e.g. 5120x2048)")
NUM_LAYERS = 32
SMEM_BUDGET = 200 * 1024   # bytes of pipeline buffers a dot config may ask for (H100: 227 KiB a block)
GRAPH_TARGET_US = 1500.0   # aim each graph replay at about this long
REPLAYS = 5


# ---------------------------------------------------------------- candidates

def _key(cfg: SkinnyConfig, K: int) -> tuple:
    """Configs that launch the same kernels share a key (split_k as launched)."""
    return cfg._replace(split_k=split_layout(K, cfg)[0])


def _dot_smem(cfg: SkinnyConfig, elt: int) -> int:
    return cfg.num_stages * (cfg.block_n + 16) * cfg.block_k * elt


def _fma_acc_regs(M: int, cfg: SkinnyConfig) -> int:
    return triton.next_power_of_2(M) * cfg.block_n * cfg.block_k // (32 * cfg.num_warps)


def _fits(M: int, K: int, cfg: SkinnyConfig, elt: int) -> bool:
    if cfg.block_k > max(128, triton.next_power_of_2(K)):
        return False
    if cfg.use_dot:
        return _dot_smem(cfg, elt) <= SMEM_BUDGET
    return _fma_acc_regs(M, cfg) <= FMA_ACC_BUDGET and cfg.block_n * cfg.block_k >= 2048


def coarse_candidates(M: int, N: int, K: int, sms: int, elt: int) -> list[SkinnyConfig]:
    """FMA (BLOCK_N 8-32) and dot (16-64) x BLOCK_K 128-512 x 4/8 warps, 3 stages, default split."""
    out = []
    for use_dot, block_ns in ((False, (8, 16, 32)), (True, (16, 32, 64))):
        for block_n in block_ns:
            for block_k in (128, 256, 512):
                for warps in (4, 8):
                    split = default_split_k(N, K, block_n, block_k, sms)
                    cfg = SkinnyConfig(block_n, block_k, split, warps, 3, use_dot)
                    if _fits(M, K, cfg, elt):
                        out.append(cfg)
    return out


def refine_candidates(M: int, K: int, seeds: list[SkinnyConfig], elt: int) -> list[SkinnyConfig]:
    """Each seed with the other num_stages and SPLIT_K values (at least 2 K tiles a split)."""
    out = []
    for seed in seeds:
        for stages in ((1, 2, 3, 4) if not seed.use_dot else (2, 3, 4)):
            out.append(seed._replace(num_stages=stages))
        for split in (1, 2, 4, 8):
            if triton.cdiv(K, seed.block_k) >= 2 * split:
                out.append(seed._replace(split_k=split))
    return [cfg for cfg in out if _fits(M, K, cfg, elt)]


# ---------------------------------------------------------------- timing

def rotating_weights(N: int, K: int, dtype, device) -> list[torch.Tensor]:
    """Enough copies of a [N, K] weight to exceed 4x the L2 cache together (at least 2)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20) or 50 * 2**20
    nbytes = N * K * torch.tensor([], dtype=dtype).element_size()
    copies = max(2, math.ceil(4 * l2 / nbytes))
    return [(0.02 * torch.randn(N, K, device=device)).to(dtype) for _ in range(copies)]


def time_per_launch(launch, weights: list[torch.Tensor], est_us: float) -> float:
    """Median microseconds per launch of ``launch(w)`` in a CUDA graph cycling through ``weights``."""
    launches = max(len(weights), min(400, math.ceil(GRAPH_TARGET_US / max(est_us, 1.0))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, allocate workspaces, surface errors before capture
        for w in weights:
            launch(w)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            launch(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    del graph
    return statistics.median(times)


def tbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e12


class ShapeBench:
    """One (M, N, K): cuBLAS and the Triton candidates on the same rotating weights."""

    def __init__(self, M: int, N: int, K: int, weights: list[torch.Tensor], compile_threads: int = 0):
        self.M, self.N, self.K = M, N, K
        self.compile_threads = compile_threads
        self.weights = weights
        self.x = torch.randn(M, K, device=weights[0].device).to(weights[0].dtype)
        self.wbytes = weights[0].numel() * weights[0].element_size()
        self.est_us = self.wbytes / 2.5e6  # at 2.5 TB/s
        self.timings: dict[tuple, float] = {}
        self.failures: dict[tuple, str] = {}

    def precompile(self, cfgs: list[SkinnyConfig]) -> None:
        """Compile the configs' kernels on threads (Triton's AsyncCompileMode); errors surface when timed."""
        async_mode = getattr(triton, "AsyncCompileMode", None)
        if self.compile_threads <= 1 or async_mode is None:
            return
        try:
            with ThreadPoolExecutor(self.compile_threads) as pool, async_mode(pool, ignore_errors=True):
                for cfg in cfgs:
                    precompile_skinny_gemm(self.x, self.weights[0], config=cfg)
        except Exception as exc:  # noqa: BLE001 (the timed launches compile what is missing)
            print(f"parallel compile failed ({type(exc).__name__}: {exc}); compiling one by one", flush=True)
            self.compile_threads = 0

    def cublas_us(self) -> float:
        return time_per_launch(lambda w: F.linear(self.x, w), self.weights, self.est_us)

    def triton_us(self, cfg: SkinnyConfig) -> float:
        key = _key(cfg, self.K)
        if key not in self.timings and key not in self.failures:
            try:
                self.timings[key] = time_per_launch(lambda w: skinny_gemm(self.x, w, config=key), self.weights,
                                                    self.est_us)
            except Exception as exc:  # noqa: BLE001 (out of shared memory, a compile error: skip the config)
                torch.cuda.synchronize()
                self.failures[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        return self.timings.get(key, math.inf)

    def sweep(self, top: int, default: SkinnyConfig) -> SkinnyConfig:
        elt = self.weights[0].element_size()
        sms = device_sms(self.x.device)
        coarse = coarse_candidates(self.M, self.N, self.K, sms, elt) + [default]
        self.precompile(coarse)
        for cfg in coarse:
            self.triton_us(cfg)
        seeds = sorted(self.timings, key=self.timings.get)[:top]
        refine = refine_candidates(self.M, self.K, seeds, elt)
        self.precompile(refine)
        for cfg in refine:
            self.triton_us(cfg)
        if not self.timings:
            raise RuntimeError(f"every config failed for M={self.M} N={self.N} K={self.K}: {self.failures}")
        return min(self.timings, key=self.timings.get)

    def check(self, cfg: SkinnyConfig) -> dict:
        w = self.weights[0]
        out = skinny_gemm(self.x, w, config=cfg)
        again = skinny_gemm(self.x, w, config=cfg)
        ref = F.linear(self.x, w)
        exact = F.linear(self.x.double(), w.double())
        diff = (out.float() - ref.float()).abs()
        ok = bool((diff <= 1e-2 + 1.6e-2 * ref.float().abs()).all())
        return {"max_abs_diff_vs_cublas": diff.max().item(),
                "max_abs_diff_vs_fp64": (out.double() - exact).abs().max().item(),
                "cublas_max_abs_diff_vs_fp64": (ref.double() - exact).abs().max().item(),
                "within_bf16_tolerance": ok, "bit_reproducible": bool(torch.equal(out, again))}


# ---------------------------------------------------------------- reporting

def _cfg_str(cfg) -> str:
    if cfg is None:
        return "-"
    path = "dot" if cfg.use_dot else "fma"
    return f"{path} n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"


def bench_shape(M: int, name: str, weights: list[torch.Tensor], top: int, compile_threads: int) -> dict:
    N, K = shape_of(name)
    bench = ShapeBench(M, N, K, weights, compile_threads)
    started = time.perf_counter()
    cublas = bench.cublas_us()
    default = _key(_config(M, N, K, device_sms(weights[0].device), device_name(weights[0].device)), K)
    best = bench.sweep(top, default)
    row = {
        "M": M, "name": name, "N": N, "K": K, "weight_bytes": bench.wbytes,
        "cublas_us": cublas, "cublas_tbps": tbps(bench.wbytes, cublas),
        "best_config": list(best), "best_us": bench.timings[best], "best_tbps": tbps(bench.wbytes, bench.timings[best]),
        "speedup": cublas / bench.timings[best],
        "default_config": list(default), "default_us": bench.timings.get(default, math.inf),
        "candidates": len(bench.timings), "failed": {_cfg_str(k): v for k, v in bench.failures.items()},
        "all_us": {_cfg_str(k): round(v, 3) for k, v in sorted(bench.timings.items(), key=lambda kv: kv[1])},
        **bench.check(best),
        "sweep_s": time.perf_counter() - started,
    }
    print(f"M={M:<2d} {name:8s} cuBLAS {cublas:8.2f} us {row['cublas_tbps']:5.2f} TB/s | "
          f"best {_cfg_str(best):28s} {row['best_us']:8.2f} us {row['best_tbps']:5.2f} TB/s x{row['speedup']:.3f} | "
          f"default {row['default_us']:8.2f} us | {row['candidates']} cfgs {len(bench.failures)} failed "
          f"{row['sweep_s']:.1f}s", flush=True)
    return row


def _step_ms(by_name: dict, us_of) -> float:
    layer = sum(us_of(by_name[n]) for n in LAYER_SHAPES)
    return (layer * NUM_LAYERS + us_of(by_name["lm_head"])) / 1e3


def step_totals(rows: list[dict]) -> dict:
    """Per M: (qkv + o_proj + gate_up + down) * 32 + lm_head, in ms, for each column."""
    totals = {}
    for M in sorted({r["M"] for r in rows}):
        by_name = {r["name"]: r for r in rows if r["M"] == M}
        if not all(n in by_name for n in LAYER_SHAPES + ("lm_head",)):
            continue
        totals[M] = {"cublas_ms": _step_ms(by_name, lambda r: r["cublas_us"]),
                     "triton_best_ms": _step_ms(by_name, lambda r: r["best_us"]),
                     "triton_default_ms": _step_ms(by_name, lambda r: r["default_us"]),
                     "best_of_both_ms": _step_ms(by_name, lambda r: min(r["cublas_us"], r["best_us"]))}
    return totals


def print_table(rows: list[dict], totals: dict) -> None:
    print(f"\n{'M':>2} {'layer':8} {'N':>6} {'K':>6} {'cuBLAS us':>10} {'TB/s':>5} {'best Triton config':28} "
          f"{'us':>8} {'TB/s':>5} {'speedup':>7} {'default us':>10} {'maxdiff':>8} {'ok':>3}")
    for r in rows:
        ok = "yes" if r["within_bf16_tolerance"] and r["bit_reproducible"] else "NO"
        print(f"{r['M']:2d} {r['name']:8} {r['N']:6d} {r['K']:6d} {r['cublas_us']:10.2f} {r['cublas_tbps']:5.2f} "
              f"{_cfg_str(SkinnyConfig(*r['best_config'])):28} {r['best_us']:8.2f} {r['best_tbps']:5.2f} "
              f"{r['speedup']:7.3f} {r['default_us']:10.2f} {r['max_abs_diff_vs_cublas']:8.1e} {ok:>3}")
    if totals:
        print(f"\nper decode step, (qkv + o_proj + gate_up + down) x {NUM_LAYERS} + lm_head, ms:")
        print(f"{'M':>2} {'cuBLAS':>8} {'Triton best':>12} {'Triton default':>15} {'best of both':>13} {'speedup':>8}")
        for M, t in totals.items():
            print(f"{M:2d} {t['cublas_ms']:8.3f} {t['triton_best_ms']:12.3f} {t['triton_default_ms']:15.3f} "
                  f"{t['best_of_both_ms']:13.3f} {t['cublas_ms'] / t['triton_best_ms']:8.3f}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8",
                        help=f"comma-separated M values (1..{MAX_ROWS}) (default: %(default)s)")
    parser.add_argument("--shapes", default=",".join(LLAMA2_7B),
                        help="comma-separated Llama-2-7B projections (" + ",".join(LLAMA2_7B) + ") or NxK shapes")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                        help="dtype of the weights and the inputs (default: %(default)s)")
    parser.add_argument("--top", type=int, default=4,
                        help="coarse-stage configs refined in the second stage (default: %(default)s)")
    parser.add_argument("--compile-threads", type=int, default=min(16, os.cpu_count() or 1),
                        help="threads compiling the sweep's kernels ahead of timing (0: compile when first timed)")
    parser.add_argument("--json", help="also write the results to this file")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.gemm_bench needs a CUDA device")
    rows_list = [int(s) for s in args.rows.split(",")]
    if any(not 1 <= m <= MAX_ROWS for m in rows_list):
        raise SystemExit(f"--rows must be in 1..{MAX_ROWS}, got {args.rows}")
    names = args.shapes.split(",")
    try:
        shapes = {name: shape_of(name) for name in names}
    except ValueError as e:
        raise SystemExit(str(e)) from None
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(device)
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {getattr(props, 'L2_cache_size', 0) / 2**20:.0f} MiB; "
          f"torch {torch.__version__}, triton {triton.__version__}, {args.dtype}", flush=True)
    started = time.perf_counter()
    rows = []
    for name in names:
        weights = rotating_weights(*shapes[name], dtype, device)
        for M in rows_list:
            rows.append(bench_shape(M, name, weights, args.top, args.compile_threads))
        del weights
        torch.cuda.empty_cache()
    rows.sort(key=lambda r: (r["M"], names.index(r["name"])))
    totals = step_totals(rows)
    print_table(rows, totals)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    result = {
        "device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "dtype": args.dtype, "results": rows,
        "step_ms": {str(m): t for m, t in totals.items()},
        "best_configs": {f"{r['M']},{r['N']},{r['K']}": r["best_config"] for r in rows},
        "config_fields": list(SkinnyConfig._fields),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
