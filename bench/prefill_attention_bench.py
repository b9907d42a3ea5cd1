"""Time the prefill attention at long context on the GPU and sweep its launch parameters
(Llama-3.1-8B heads by default).

    python -m bench.prefill_attention_bench [--heads 32 --kv-heads 8 --head-dim 128] \\
        [--seq-lens 4096,32768,100000] [--chunk 2048] [--sweep-lens 32768,100000] [--json out.json]

Two shapes per sequence length N, one request each, bf16, random K/V in contiguous slots
(``req_to_token`` = arange):
  whole  the prompt of N tokens prefilled at once (q_len = N)
  chunk  the last chunk of a chunked prefill: --chunk new tokens at the end of N keys
Each is timed (CUDA events, a warm-up call, the median of --reps) with ``prefill_attention``'s
default launch (``prefill_launch``, ``default_splits``). TFLOP/s count the causal FLOPs,
4 * heads * head_dim per visible (query, key) pair. torch's ``scaled_dot_product_attention`` on
the same shape is the reference point, and its output a check of the kernel's: K/V contiguous and
repeated to every q head, each fused backend (flash, cuDNN, memory-efficient) timed on its own and
the fastest reported; a whole prompt ``is_causal``, a chunk ``causal_lower_right`` (its queries are
the last of the keys). The engine runs a long prompt as chunks (``--max-batch-prefill-tokens``,
4,096 tokens by default), so the chunk rows are the comparison that counts. One H200 (torch 2.11,
2026-11-30, ``--seq-lens 8192,16384,32768 --chunk 4096 --sweep-lens ""``): 4,096 new tokens at the
end of 8k / 16k / 32k keys, this kernel 437 / 477 / 470 TFLOP/s, torch's fastest backend (flash)
302 / 322 / 351 (cuDNN's, timed alone in another run: 227 / 274 / 296); whole prompts of the same
lengths, this kernel 430 / 483 / 486, cuDNN's 591 / 632 / 629.

The sweep (BLOCK_M rows x BLOCK_N x warps x stages; a config that fails to compile or to
launch, e.g. out of shared memory, is skipped): every config on the whole prompt of the first
--sweep-lens length, the best --finalists of it (and the default) again at the other
--sweep-lens lengths, and every config on the chunk at the longest --seq-lens length (then
splits of its best). It prints the default's and the best few configs' TFLOP/s, checks each
shape's best output against the default's, and ends with the config best over every swept
shape (geometric mean of its time over the shape's best): the candidate for
``kernels.prefill_attention.CUDA_LAUNCHES``. A default run should take 2-3 minutes on one H100
(an estimate, most of it compiling the 36 configs). CUDA only; none of it runs in CI (the
kernel's tests do).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from kernels.prefill_attention import PrefillLaunch, default_splits, launch, prefill_launch

FUSED_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def make_inputs(q_len: int, seq_len: int, heads: int, kv_heads: int, head_dim: int) -> tuple:
    """``launch``'s leading arguments for one request: ``q_len`` new tokens at the end of ``seq_len`` keys."""
    device = torch.device("cuda")
    kv_layer = torch.randn(seq_len + 1, 2 * kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    table = torch.arange(seq_len, dtype=torch.int32, device=device).view(1, seq_len)
    q = torch.randn(q_len, heads, head_dim, dtype=torch.bfloat16, device=device)
    one = lambda v: torch.tensor([v], dtype=torch.int32, device=device)  # noqa: E731
    return q, kv_layer, table, one(0), one(0), one(q_len), one(seq_len), 1 / math.sqrt(head_dim), q_len


def causal_flops(q_len: int, seq_len: int, heads: int, head_dim: int) -> float:
    """4 * heads * head_dim per (query, key) pair it sees: the whole prefix, then its own chunk causally."""
    pairs = q_len * (seq_len - q_len) + q_len * (q_len + 1) / 2
    return 4 * heads * head_dim * pairs


def time_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls after a warm-up call (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def sweep_configs() -> list[PrefillLaunch]:
    """BLOCK_M 64/128 rows x BLOCK_N 32/64/128 x warps 4/8 x stages 2/3/4, less 64 rows over 8 warps
    (64 rows are one warpgroup's MMA; left out to keep a run near 2-3 minutes, most of it compiling), then
    the 128-row 8-warp ones again with each block's slots loaded a block ahead (``prefetch``; over 4 warps
    it ran at half speed in stop 45's probe)."""
    plain = [PrefillLaunch(*c) for c in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
             if not (c[0] == 64 and c[2] == 8)]
    return plain + [c._replace(prefetch=True) for c in plain if c.block_m == 128 and c.num_warps == 8]


def time_configs(inputs: tuple, configs, reps: int, splits: int = 1) -> dict:
    """{(config, splits): ms} of the configs that compile and run (the others are reported and skipped)."""
    results = {}
    for config in configs:
        try:
            results[config, splits] = time_ms(lambda: launch(*inputs, params=config, splits=splits), reps)
        except Exception as e:      # noqa: BLE001 (out of shared memory or registers: not a candidate)
            print(f"    {tuple(config)} splits {splits}: skipped ({type(e).__name__})", flush=True)
    return results


def sdpa_ms(inputs: tuple, kv_heads: int, reps: int, kernel_out: torch.Tensor) -> tuple[float, float, str]:
    """torch SDPA on the shape, each fused backend on its own: the fastest one's median ms, its max |difference|
    from the kernel's output and its name. A chunk (fewer queries than keys) is causal from the bottom right."""
    q, kv_layer, seq_len = inputs[0], inputs[1], int(inputs[6].item())
    q_len, group = q.shape[0], q.shape[1] // kv_heads
    qt = q.transpose(0, 1).contiguous().unsqueeze(0)                      # [1, Hq, N, D]
    k, v = (kv_layer[:seq_len, part].repeat_interleave(group, 1).transpose(0, 1).contiguous().unsqueeze(0)
            for part in (slice(0, kv_heads), slice(kv_heads, 2 * kv_heads)))
    causal = {"is_causal": True} if q_len == seq_len else {"attn_mask": causal_lower_right(q_len, seq_len)}
    timed, errors = [], []
    for backend in FUSED_SDPA:
        try:
            with sdpa_kernel(backend):
                run = lambda: F.scaled_dot_product_attention(qt, k, v, **causal)  # noqa: E731
                ms = time_ms(run, reps)
                diff = (run()[0].transpose(0, 1).float() - kernel_out.float()).abs().max().item()
            timed.append((ms, diff, backend.name.lower()))
        except RuntimeError as e:   # this backend does not take the shape
            errors.append(str(e).splitlines()[0][:80])
    if not timed:
        raise RuntimeError(errors[0])
    return min(timed)


def measure_shape(name: str, q_len: int, seq_len: int, args, configs, split_sweep: bool) -> dict:
    """The default launch and SDPA's fastest backend, then ``configs`` if any: one row of the report."""
    inputs = make_inputs(q_len, seq_len, args.heads, args.kv_heads, args.head_dim)
    flops = causal_flops(q_len, seq_len, args.heads, args.head_dim)
    params = prefill_launch(args.head_dim, inputs[0].device)
    splits = default_splits(1, args.heads, args.kv_heads, q_len, seq_len, params, inputs[0].device)
    reference = launch(*inputs, params=params, splits=splits)
    row = {"shape": name, "q_len": q_len, "seq_len": seq_len, "default": list(params), "default_splits": splits,
           "default_ms": time_ms(lambda: launch(*inputs, params=params, splits=splits), args.reps)}
    row["default_tflops"] = flops / row["default_ms"] / 1e9
    line = f"{name}: default {tuple(params)} splits {splits}: {row['default_ms']:.2f} ms " \
           f"({row['default_tflops']:.0f} TFLOP/s)"
    try:
        row["sdpa_ms"], row["sdpa_max_diff"], row["sdpa_backend"] = sdpa_ms(inputs, args.kv_heads, args.reps,
                                                                            reference)
        row["sdpa_tflops"] = flops / row["sdpa_ms"] / 1e9
        line += f"; SDPA ({row['sdpa_backend']}) {row['sdpa_ms']:.2f} ms ({row['sdpa_tflops']:.0f} TFLOP/s, " \
                f"max |diff| {row['sdpa_max_diff']:.1e})"
    except RuntimeError as e:   # no fused backend for this shape: no reference point
        line += f"; SDPA unavailable ({str(e).splitlines()[0][:80]})"
    print(line, flush=True)
    if configs:
        row.update(sweep_shape(inputs, flops, configs, args.reps, reference, split_sweep))
    return row


def sweep_shape(inputs: tuple, flops: float, configs, reps: int, reference: torch.Tensor, split_sweep: bool) -> dict:
    """The configs (then, for a chunk, splits 2..16 of the best one) on one shape; the best checked."""
    results = time_configs(inputs, configs, reps)
    if split_sweep and results:
        best = min(results, key=results.get)[0]
        for splits in (2, 4, 8, 16):
            results.update(time_configs(inputs, [best], reps, splits))
    ranked = sorted(results, key=results.get)
    best, best_splits = ranked[0]
    out = launch(*inputs, params=best, splits=best_splits)
    diff = (out.float() - reference.float()).abs().max().item()
    torch.testing.assert_close(out, reference, atol=2e-2, rtol=2e-2)
    for config, splits in ranked[:5]:
        ms = results[config, splits]
        print(f"    {tuple(config)} splits {splits}: {ms:.2f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
    print(f"    best vs default output: max |diff| {diff:.1e}", flush=True)
    return {"best_max_diff": diff,
            "sweep": [[list(c), s, results[c, s], flops / results[c, s] / 1e9] for c, s in ranked]}


def best_overall(rows: list[dict]) -> list[tuple[float, list]]:
    """Configs (one split) timed on every swept shape, by the geometric mean of time / the shape's best."""
    swept = [r for r in rows if "sweep" in r]
    scores = {}
    for r in swept:
        best = r["sweep"][0][2]
        for config, splits, ms, _ in r["sweep"]:
            if splits == 1:
                scores.setdefault(tuple(config), []).append(ms / best)
    common = [(math.exp(sum(map(math.log, s)) / len(s)), list(c)) for c, s in scores.items() if len(s) == len(swept)]
    return sorted(common)[:5]


def whole_prompt_rows(args, seq_lens: list[int], sweep_lens: list[int]) -> list[dict]:
    """The whole prompts: every config at the first sweep length (timed first), its finalists and the
    default at the other sweep lengths, the default alone at the rest."""
    lengths = sweep_lens[:1] + sorted((set(seq_lens) | set(sweep_lens)) - set(sweep_lens[:1]))
    rows, finalists = [], []
    for n in lengths:
        sweep = []
        if sweep_lens and n == sweep_lens[0]:
            sweep = sweep_configs()
        elif n in sweep_lens and finalists:
            sweep = list(dict.fromkeys(finalists + [prefill_launch(args.head_dim, torch.device("cuda"))]))
        rows.append(measure_shape(f"whole {n}", n, n, args, sweep, split_sweep=False))
        if sweep and not finalists:
            finalists = [PrefillLaunch(*c) for c, _, _, _ in rows[-1].get("sweep", [])][:args.finalists]
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.prefill_attention_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=32, help="q heads (Llama-3.1-8B: 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="kv heads (Llama-3.1-8B: 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension (Llama-3.1-8B: 128)")
    parser.add_argument("--seq-lens", default="4096,32768,100000", help="comma-separated sequence lengths")
    parser.add_argument("--chunk", type=int, default=2048, help="new tokens of the last chunk (0: no chunk shapes)")
    parser.add_argument("--sweep-lens", default="32768,100000",
                        help="whole-prompt lengths to sweep (the first with every config; empty: no sweep)")
    parser.add_argument("--finalists", type=int, default=8, help="configs re-timed at the later sweep lengths")
    parser.add_argument("--reps", type=int, default=5,
                        help="timed calls per measurement, after one warm-up call; the median is kept "
                             "(default: %(default)s)")
    parser.add_argument("--json", help="also write the results to this file")
    return parser


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("prefill_attention_bench needs a CUDA GPU")
    seq_lens = [int(n) for n in args.seq_lens.split(",") if n]
    sweep_lens = [int(n) for n in args.sweep_lens.split(",") if n]
    rows = whole_prompt_rows(args, seq_lens, sweep_lens)
    for n in seq_lens:
        if 0 < args.chunk < n:
            sweep = sweep_configs() if sweep_lens and n == max(seq_lens) else []
            rows.append(measure_shape(f"chunk {args.chunk}@{n}", args.chunk, n, args, sweep, split_sweep=True))
    overall = best_overall(rows)
    for score, config in overall:
        print(f"over every swept shape: {tuple(config)} at {score:.3f} x each shape's best", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "shapes": rows, "best_overall": overall}, indent=1))
    return rows


if __name__ == "__main__":
    main()
