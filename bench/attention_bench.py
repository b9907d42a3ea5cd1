"""Sweep the decode attention's launch parameters on the GPU (Llama-2-7B heads by default).

    python -m bench.attention_bench [--batch-sizes 1,8] [--seq-lens 128,384,1024,4096] [--json out.json]
    python -m bench.attention_bench --shared-prefix 3000 --batch-sizes 64,256 --seq-lens 3064
    python -m bench.attention_bench --verify-drafts 4 --batch-sizes 1,8,32 --seq-lens 512

With ``--shared-prefix P`` every request's first P positions map the same slots (requests behind
one cached prompt prefix): it times the decode attention without the shared-prefix kernel (every
request walks the prefix) and with it, for each of its launch parameters (tile rows, BLOCK_N,
warps, stages), and checks the best against the output without it.

For each (batch, sequence length) it times ``kernels.decode_attention.launch`` (split stage +
merge stage) for every combination of walk (the dot walk, and the rowwise walk where it applies: a
quantized cache without GQA), split count, BLOCK_N, warps and stages, as 32 back-to-back
calls (one per layer) replayed from a CUDA graph, so launch gaps count as they do in a decode
step. It prints the default's time and the best few, and checks the best against the default's
output. With ``--verify-drafts N`` it times instead the prefill attention of verify rows (1 + N new tokens a
request after its context, as ``--speculate N`` runs them) for every tile, BLOCK_N, warps and split count
(2 stages), against its default and a decode step's attention at the same context. CUDA only; no part of it runs in
CI (the kernel's tests do).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch
import triton

from kernels.decode_attention import (
    CUDA_LAUNCH,
    cuda_walk,
    decode_attention,
    default_num_splits,
    launch,
    rowwise_applies,
)
from kernels.prefill_attention import PrefillLaunch, prefill_attention, prefill_launch
from kernels.prefill_attention import default_splits as default_prefill_splits
from kernels.prefill_attention import launch as prefill_launch_kernels
from engine.worker.kv_cache import KV_CACHE_DTYPES
from kernels._kv_quant import quantize_ref
from kernels.skinny_gemm import device_sms
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


def time_us(fn, replays: int = 20, calls: int | None = None) -> float:
    """Microseconds per call of ``fn``, from a CUDA graph of ``calls`` (default LAYERS) calls."""
    calls = calls or LAYERS
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())     # the inputs are written on the current stream
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def quantize_cache(kv_layer: torch.Tensor, kv_dtype: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``kv_layer`` as the cache stores it with ``--kv-cache-dtype`` (None: unchanged): (data, kv_scales)."""
    if kv_dtype is None:
        return kv_layer, None
    dtype = KV_CACHE_DTYPES[kv_dtype]
    if dtype == torch.int8:
        return quantize_ref(kv_layer, dtype)
    scale = torch.ones((), dtype=torch.float32, device=kv_layer.device)
    return quantize_ref(kv_layer, dtype, scale)[0], torch.ones(2, dtype=torch.float32, device=kv_layer.device)


def sweep(batch: int, seq_len: int, args) -> dict:
    q, kv_layer, *rest = make_inputs(batch, seq_len, args.q_heads, args.kv_heads, args.head_dim, torch.bfloat16,
                                     "cuda")
    kv_layer, kv_scales = quantize_cache(kv_layer, args.kv_cache_dtype)
    inputs = (q, kv_layer, *rest)
    out = torch.empty_like(q)
    group = args.q_heads // args.kv_heads
    # decode_attention's walk and launch on CUDA (and its tail blocks)
    *default, tail_n, rowwise = cuda_walk(kv_layer, batch, group, None,
                                          default_num_splits(batch, args.kv_heads, out.device), device_sms(out.device))
    default = (rowwise, *default)
    reference = decode_attention(*inputs, kv_scales=kv_scales)
    walks = (False, True) if rowwise_applies(kv_layer, group, None) else (False,)
    results = {}                                  # (rowwise, splits, block_n, warps, stages) -> us, tails as long
    for params in itertools.product(walks, sorted({1, 2, 4, 8, 16, 32, default[1]}), (16, 32, 64, 128), (1, 2, 4),
                                    (1, 2)):
        try:
            results[params] = time_us(lambda: launch(*inputs, out, *params[1:], kv_scales=kv_scales,
                                                     rowwise=params[0]))
        except triton.runtime.errors.OutOfResources as e:      # e.g. too much shared memory for this tile
            print(f"  skipped {params}: {e}", flush=True)
    default_us = time_us(lambda: launch(*inputs, out, *default[1:], kv_scales=kv_scales, tail_n=tail_n,
                                        rowwise=rowwise))
    best = min(results, key=results.get)
    launch(*inputs, out, *best[1:], kv_scales=kv_scales, rowwise=best[0])

    def name(row, *params):
        return ("row " if row else "dot ") + "s{} n{} w{} st{}".format(*params)
    return {"batch": batch, "seq_len": seq_len, "default": name(*default) + f" tail {tail_n}",
            "default_us": round(default_us, 2),
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


def verify_inputs(batch: int, context: int, drafts: int, args):
    """Verify rows: each request holds ``context`` positions and brings 1 + ``drafts`` new tokens after them
    (``prefill_attention``'s arguments but the launch)."""
    width, dev = 1 + drafts, args.device
    length = context + width
    kv_layer = torch.randn(batch * length + 1, 2 * args.kv_heads, args.head_dim, dtype=torch.bfloat16, device=dev)
    table = torch.arange(batch * length, dtype=torch.int32, device=dev).view(batch, length)
    rows = torch.arange(batch, dtype=torch.int32, device=dev)
    q = torch.randn(batch * width, args.q_heads, args.head_dim, dtype=torch.bfloat16, device=dev)
    q_start = torch.arange(0, batch * width, width, dtype=torch.int32, device=dev)
    q_len = torch.full((batch,), width, dtype=torch.int32, device=dev)
    seq_len = torch.full((batch,), length, dtype=torch.int32, device=dev)
    return (q, kv_layer, table, rows, q_start, q_len, seq_len, 1 / math.sqrt(args.head_dim), width), length


def sweep_verify(batch: int, context: int, drafts: int, args) -> dict:
    """The prefill attention of verify rows (1 + ``drafts`` tokens a request after ``context`` positions): its
    default launch and splits against every (tile rows, BLOCK_N, warps, splits) at 2 stages, beside the decode
    attention of a plain decode step at the same context."""
    inputs, length = verify_inputs(batch, context, drafts, args)
    q, kv_layer = inputs[0], inputs[1]
    default_params = prefill_launch(args.head_dim, q.device, q.dtype, args.q_heads // args.kv_heads)
    default = (*default_params, default_prefill_splits(batch, args.q_heads, args.kv_heads, 1 + drafts, length,
                                                       default_params, q.device))
    reference = prefill_attention(*inputs, max_seq_len=length)
    results, outputs = {}, {}                     # (block_m, block_n, warps, stages, splits) -> us
    for combo in itertools.product((16, 32, 64), (32, 64, 128), (4, 8), (2,), (1, 2, 4, 8)):   # 36 kernels to compile
        if combo[0] < args.q_heads // args.kv_heads and combo[0] < 64:
            continue                              # fewer rows than a GQA group's heads: the tile splits heads
        try:
            results[combo] = time_us(lambda: prefill_launch_kernels(*inputs, PrefillLaunch(*combo[:4]), combo[4]))
        except Exception as e:  # noqa: BLE001  (a tile too large for shared memory)
            print(f"  {combo}: {type(e).__name__}", flush=True)
    results.setdefault(default, time_us(lambda: prefill_launch_kernels(*inputs, default_params, default[4])))
    best = min(results, key=results.get)
    out = prefill_launch_kernels(*inputs, PrefillLaunch(*best[:4]), best[4])
    decode = make_inputs(batch, context + 1, args.q_heads, args.kv_heads, args.head_dim, torch.bfloat16, args.device)
    name = "rows{} n{} w{} st{} s{}".format
    return {"batch": batch, "context": context, "drafts": drafts,
            "decode_step_us": round(time_us(lambda: decode_attention(*decode)), 2),
            "default": name(*default), "default_us": round(results[default], 2),
            "best": name(*best), "best_us": round(results[best], 2),
            "best_max_abs_diff": float((out.float() - reference.float()).abs().max()),
            "top5": [(name(*k), round(results[k], 2)) for k in sorted(results, key=results.get)[:5]]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated decode batch sizes")
    parser.add_argument("--seq-lens", default="128,384,1024,4096", help="comma-separated sequence lengths")
    parser.add_argument("--q-heads", type=int, default=32, help="query heads (Llama-2-7B: 32)")
    parser.add_argument("--kv-heads", type=int, default=32, help="KV heads (Llama-2-7B: 32)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="positions every request shares (times the shared-prefix kernel's launches)")
    parser.add_argument("--verify-drafts", type=int, default=0,
                        help="times the prefill attention of verify rows with this many drafts instead (--seq-lens: "
                             "the context before them), each launch and split count beside a decode step's attention")
    parser.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES),
                        help="the plain sweep over a quantized cache (the launcher's flag; default: bfloat16); "
                             "not with --shared-prefix or --verify-drafts")
    parser.add_argument("--json", help="also write the results to this file")
    parser.set_defaults(device="cuda")      # the sweeps' tensors (a CPU smoke of their code sets "cpu")
    return parser


def main(argv=None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kv_cache_dtype and (args.shared_prefix or args.verify_drafts):
        parser.error("--kv-cache-dtype applies to the plain decode sweep only; drop it or drop "
                     "--shared-prefix / --verify-drafts")
    if not torch.cuda.is_available():
        raise SystemExit("attention_bench needs a CUDA GPU")
    results = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for seq_len in (int(s) for s in args.seq_lens.split(",")):
            if args.verify_drafts:
                r = sweep_verify(batch, seq_len, args.verify_drafts, args)
                print(f"batch {batch:4d} context {seq_len:5d} verify rows of {1 + args.verify_drafts}: decode step "
                      f"{r['decode_step_us']:.2f} us; default {r['default']} {r['default_us']:.2f} us, "
                      f"best {r['best']} {r['best_us']:.2f} us (max |diff| {r['best_max_abs_diff']:.1e}); "
                      f"top5 {r['top5']}", flush=True)
            elif args.shared_prefix:
                r = sweep_shared(batch, seq_len, args.shared_prefix, args)
                print(f"batch {batch:4d} seq {seq_len:5d} shared {args.shared_prefix}: "
                      f"without {r['without_us']:.2f} us; "
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
