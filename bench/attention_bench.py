"""Sweep the decode attention's launch parameters on the GPU (Llama-2-7B heads by default).

    python -m bench.attention_bench [--batch-sizes 1,8] [--seq-lens 128,384,1024,4096] [--json out.json]
    python -m bench.attention_bench --shared-prefix 3000 --batch-sizes 64,256 --seq-lens 3064

With ``--shared-prefix P`` every request's first P positions map the same slots (requests behind
one cached prompt prefix): it times the decode attention without the shared-prefix kernel (every
request walks the prefix) and with it, for each of its launch parameters (tile rows, BLOCK_N,
warps, stages), and checks the best against the output without it.

For each (batch, sequence length) it times ``kernels.decode_attention.launch`` (split stage +
merge stage) for every combination of split count, BLOCK_N, warps and stages, as 32 back-to-back
calls (one per layer) replayed from a CUDA graph, so launch gaps count as they do in a decode
step. It prints the default's time and the best few, and checks the best against the default's
output. CUDA only; no part of it runs in CI (the kernel's tests do).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch

from kernels.decode_attention import (
    CUDA_LAUNCH,
    decode_attention,
    default_num_splits,
    launch,
)
from kernels.shared_prefix import SHARED_LAUNCH

LAYERS = 32


def make_inputs(batch: int, seq_len: int, q_heads: int, kv_heads: int, head_dim: int, dtype, device):
    """One request per row, each holding ``seq_len`` contiguous slots (as a fresh allocator hands out)."""
    slots = batch * seq_len + 1
    kv_layer = torch.randn(slots, 2 * kv_heads, head_dim, dtype=dtype, device=device)
    table = torch.arange(batch * seq_len, dtype=torch.int32, device=device).view(batch, seq_len)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    q = torch.randn(batch, q_heads, head_dim, dtype=dtype, device=device)
    return q, kv_layer, table, rows, lens, 1 / math.sqrt(head_dim)


def time_us(fn, replays: int = 20) -> float:
    """Microseconds per call of ``fn``, from a CUDA graph of LAYERS calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * LAYERS)


def sweep(batch: int, seq_len: int, args) -> dict:
    inputs = make_inputs(batch, seq_len, args.q_heads, args.kv_heads, args.head_dim, torch.bfloat16, "cuda")
    out = torch.empty_like(inputs[0])
    default_splits = default_num_splits(batch, args.kv_heads, out.device)
    reference = decode_attention(*inputs)
    results = {}                                  # (splits, block_n, warps, stages) -> us
    for params in itertools.product(sorted({1, 2, 4, 8, 16, 32, default_splits}), (16, 32, 64), (1, 2, 4), (1, 2)):
        results[params] = time_us(lambda: launch(*inputs, out, *params))
    default = (default_splits, *CUDA_LAUNCH)      # decode_attention's launch on CUDA
    best = min(results, key=results.get)
    launch(*inputs, out, *best)
    name = "s{} n{} w{} st{}".format
    return {"batch": batch, "seq_len": seq_len, "default": name(*default), "default_us": round(results[default], 2),
            "best": name(*best), "best_us": round(results[best], 2),
            "best_max_abs_diff": float((out.float() - reference.float()).abs().max()),
            "top5": [(name(*k), round(results[k], 2)) for k in sorted(results, key=results.get)[:5]]}


def sweep_shared(batch: int, seq_len: int, prefix: int, args) -> dict:
    """The decode attention of ``batch`` requests sharing their first ``prefix`` slots, without and with
    the shared-prefix kernel (each of its launch parameters)."""
    q, kv_layer, table, rows, lens, scale = make_inputs(batch, seq_len, args.q_heads, args.kv_heads,
                                                        args.head_dim, torch.bfloat16, "cuda")
    table[:, :prefix] = table[0, :prefix]
    shared = (torch.full((batch,), prefix, dtype=torch.int32, device="cuda"),
              torch.tensor([0, prefix], dtype=torch.int32, device="cuda"))
    inputs = (q, kv_layer, table, rows, lens, scale)
    out = torch.empty_like(q)
    splits = default_num_splits(batch, args.kv_heads, out.device)
    reference = decode_attention(*inputs)
    without = time_us(lambda: launch(*inputs, out, splits, *CUDA_LAUNCH))
    results = {}                                  # (tile rows, block_n, warps, stages) -> us
    for params in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3)):
        try:
            results[params] = time_us(lambda: launch(*inputs, out, splits, *CUDA_LAUNCH, shared=shared,
                                                     shared_launch=params))
        except Exception as e:  # noqa: BLE001  (a tile too large for shared memory)
            print(f"  {params}: {type(e).__name__}", flush=True)
    best = min(results, key=results.get)
    launch(*inputs, out, splits, *CUDA_LAUNCH, shared=shared, shared_launch=best)
    name = "rows{} n{} w{} st{}".format
    return {"batch": batch, "seq_len": seq_len, "shared_prefix": prefix, "without_us": round(without, 2),
            "default": name(*SHARED_LAUNCH), "default_us": round(results[SHARED_LAUNCH], 2),
            "best": name(*best), "best_us": round(results[best], 2),
            "best_max_abs_diff": float((out.float() - reference.float()).abs().max()),
            "top5": [(name(*k), round(results[k], 2)) for k in sorted(results, key=results.get)[:5]]}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated decode batch sizes")
    parser.add_argument("--seq-lens", default="128,384,1024,4096", help="comma-separated sequence lengths")
    parser.add_argument("--q-heads", type=int, default=32, help="query heads (Llama-2-7B: 32)")
    parser.add_argument("--kv-heads", type=int, default=32, help="KV heads (Llama-2-7B: 32)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="positions every request shares (times the shared-prefix kernel's launches)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_bench needs a CUDA GPU")
    results = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for seq_len in (int(s) for s in args.seq_lens.split(",")):
            if args.shared_prefix:
                r = sweep_shared(batch, seq_len, args.shared_prefix, args)
                print(f"batch {batch:4d} seq {seq_len:5d} shared {args.shared_prefix}: without {r['without_us']:.2f} us; "
                      f"with: default {r['default']} {r['default_us']:.2f} us, best {r['best']} {r['best_us']:.2f} us "
                      f"(max |diff| {r['best_max_abs_diff']:.1e}); top5 {r['top5']}", flush=True)
            else:
                r = sweep(batch, seq_len, args)
                print(f"batch {batch:4d} seq {seq_len:5d}: default {r['default']} {r['default_us']:.2f} us; "
                      f"best {r['best']} {r['best_us']:.2f} us (max |diff| {r['best_max_abs_diff']:.1e}); "
                      f"top5 {r['top5']}", flush=True)
            results.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
