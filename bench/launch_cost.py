"""What the small launches of a decode step cost: the step's device time with some of them skipped.

    python -m bench.launch_cost --model-dir /tmp/moe/qwen3-30b-a3b-16l \
        [--variants base,norms,rotary,merge,route,reduce,all,base] [--batch-size 1] [--context 128] [--json out.json]

A variant skips the launches ``SKIPS`` names (``all``: every one of them) and measures the step as
``bench.profile_step`` does; its gpu_ms below ``base``'s bounds what fusing those launches into the kernels
beside them could save at best: a fusion adds its work to the kernel it moves into, and that kernel can get
slower (more registers, fewer programs resident per SM) by more than the launch cost. The skipped kernels'
outputs are missing, so the tokens are garbage: this measures time only. Each variant runs in its own process
(the skips must be in place before the model's CUDA graphs are captured); ``base`` first and last shows the
run's drift.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from bench import positive_int

SKIPS = {
    "norms": "RMSNorm / LayerNorm launches, their residual adds with them (the norm returns its input)",
    "rotary": "the rotary + KV store launch (Qwen3's q/k norms inside it)",
    "merge": "the decode attention's split merge",
    "route": "MoE routing (every token takes experts 0..k-1 at equal weights)",
    "reduce": "the split-K reduce of the skinny, 4-bit and FP8 GEMMs (their outputs stay unwritten)",
}
VARIANTS = ("base", *SKIPS, "all")


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _fixed_routing():
    """A ``moe_route`` that launches nothing: every token's experts 0..k-1 at equal weights, made once per shape and
    device and then returned as they are (made anew on each call, their fills took longer than the routing: on one
    H200 this variant's Qwen3-30B-A3B step was 0.021 ms slower than base)."""
    made = {}

    def route(self, logits, top_k: int, renormalize: bool, round_dtype=None):
        key = (logits.shape[0], top_k, logits.device)
        if key not in made:
            ids = torch.arange(top_k, device=logits.device, dtype=torch.int32).repeat(logits.shape[0], 1)
            made[key] = (torch.full((logits.shape[0], top_k), 1.0 / top_k, device=logits.device), ids)
        return made[key]
    return route


def apply_skips(names: set[str]) -> list[tuple[object, str, object]]:
    """Patch the ops of both backends (and the merge kernel) so that the launches ``names`` are skipped; returns
    what was replaced, as (owner, attribute, original), for ``restore``."""
    from engine.ops import TorchOps, TritonOps
    from kernels import decode_attention, skinny_gemm

    unknown = names - set(SKIPS)
    if unknown:
        raise ValueError(f"unknown launches to skip: {sorted(unknown)}; choose from {', '.join(SKIPS)}")
    patches = []
    route = _fixed_routing()
    for ops in (TritonOps, TorchOps):
        if "norms" in names:
            patches += [(ops, "rmsnorm", lambda self, x, weight, eps: x),
                        (ops, "add_rmsnorm", lambda self, x, residual, weight, eps: x),
                        (ops, "layernorm", lambda self, x, weight, bias, eps: x),
                        (ops, "add_layernorm", lambda self, x, residual, weight, bias, eps: x)]
        if "rotary" in names:
            patches.append((ops, "rotary_store_kv", lambda self, *args, **kwargs: None))
        if "route" in names:
            patches.append((ops, "moe_route", route))
    if "merge" in names:
        patches.append((decode_attention, "_decode_merge_kernel", _NoLaunch()))
    if "reduce" in names:
        patches.append((skinny_gemm, "_split_k_reduce_kernel", _NoLaunch()))
    replaced = []
    for owner, name, value in patches:
        replaced.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)
    return replaced


def restore(replaced: list[tuple[object, str, object]]) -> None:
    for owner, name, original in reversed(replaced):
        setattr(owner, name, original)


def skips_of(variant: str) -> set[str]:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return set(SKIPS) if variant == "all" else set() if variant == "base" else {variant}


def measure(variant: str, profile_args: list[str]) -> dict:
    """One variant in this process: the skips, then ``bench.profile_step`` (one batch size)."""
    from bench import profile_step

    apply_skips(skips_of(variant))
    result = profile_step.main(profile_args)[0]
    return {"variant": variant, "gpu_ms": result["gpu_ms"], "piped_ms": result["piped_ms"]}


def run_variant(variant: str, profile_args: list[str]) -> dict:
    """One variant in a process of its own; its result is the last line it prints."""
    done = subprocess.run([sys.executable, "-m", "bench.launch_cost", "--one", variant, "--", *profile_args],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(results: list[dict]) -> list[dict]:
    """Each variant's ms below the mean of the ``base`` runs."""
    bases = [r["gpu_ms"] for r in results if r["variant"] == "base"]
    base = sum(bases) / len(bases) if bases else None
    print(f"\n{'variant':10} {'gpu ms':>8} {'piped ms':>9} {'saved ms':>9}  skipped")
    for r in results:
        r["saved_ms"] = round(base - r["gpu_ms"], 3) if base is not None else None
        saved = f"{r['saved_ms']:9.3f}" if base is not None else f"{'':9}"
        skipped = ", ".join(sorted(skips_of(r["variant"]))) or "nothing"
        print(f"{r['variant']:10} {r['gpu_ms']:8.3f} {r['piped_ms']:9.3f} {saved}  {skipped}")
    return results


def _variants(text: str) -> list[str]:
    variants = text.split(",")
    for variant in variants:
        try:
            skips_of(variant)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return variants


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="checkpoint directory")
    parser.add_argument("--variants", type=_variants, default="base,norms,rotary,merge,route,reduce,all,base",
                        help=f"comma-separated, in order, from: {', '.join(VARIANTS)}")
    parser.add_argument("--batch-size", type=positive_int, default=1, help="decode rows a step")
    parser.add_argument("--context", type=positive_int, default=128, help="tokens each request holds before decoding")
    parser.add_argument("--repeats", type=positive_int, default=50, help="timed repetitions per measurement")
    parser.add_argument("--json", help="also write the numbers to this file")
    return parser


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:
        print(json.dumps(measure(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])))
        return []
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (Path(args.model_dir) / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir} has no config.json: give a checkpoint directory")
    variants = args.variants
    profile_args = ["--model-dir", args.model_dir, "--batch-sizes", str(args.batch_size),
                    "--context", str(args.context), "--repeats", str(args.repeats)]
    results = report([run_variant(v, profile_args) for v in variants])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
