"""MoE models (and Qwen3) beside transformers, bfloat16, and the batch-1 floor of the active bytes.

    python -m bench.moe_bench --model-dir /tmp/moe/mixtral-8x7b-8l [--model-dir ...] [--json out.json]

For each checkpoint: ``bench.engine_bench`` (batch-1 decode tokens/s, 128-token prompt and 256
new tokens; the 256-request throughput; both beside transformers in the same run), then the
batch-1 floor. A decode step must read every weight a token touches: the dense ones
(attention, norms, router, shared expert, dense layers, lm head) and, of each MoE layer, the
``top_k`` chosen experts out of ``num_experts``; the embedding reads one row. At the
device's measured copy bandwidth that gives the fastest batch-1 decode possible,

    floor tokens/s = bandwidth / active bytes

and the report gives ours as a fraction of it (the issue's target: >= 70%).

``--routing-ab``: then batch-1 decode again with the routing and the expert alignment done by
torch's ops (``moe_route_ref``, ``align_by_expert_torch``: about 30 launches per MoE layer) and by
the kernels (``moe_route``, ``fused_moe``'s one-program alignment: two), engines built in turn,
twice each: what those launches cost a decode step, before and after, in one run.
"""
from __future__ import annotations

import argparse
import gc
import json
import math

import torch

from engine.models import family_for, load_model_config

from . import engine_bench


def active_weight_bytes(config, element_bytes: int = 2) -> tuple[int, int]:
    """(active bytes, all weight bytes) of one batch-1 decode step of the model of ``config``
    (the family's config, ``engine.models.load_model_config``)."""
    shapes = family_for(config.architecture).checkpoint_shapes(config)
    experts_used = getattr(config, "top_k", 0) / max(getattr(config, "num_experts", 0), 1)
    active = total = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        total += n
        if ".experts." in name:
            active += n * experts_used
        elif name == "model.embed_tokens.weight":
            active += config.hidden_size + (0 if "lm_head.weight" in shapes else n)   # a row; tied: the lm head
        else:
            active += n
    return int(active * element_bytes), total * element_bytes


def copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes/s of a device-to-device copy (read + write), the best of 5."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = max(best, 2 * src.numel() / (start.elapsed_time(end) / 1e3))
    del src, dst
    torch.cuda.empty_cache()
    return best


def routing_ab(model_dir: str, rounds: int = 2, workload=None, kernel_backend: str | None = None
               ) -> dict[str, list[float]]:
    """Batch-1 decode tokens/s (engine_bench's workload unless ``workload``) with MoE routing by torch's
    ops and by the kernels, alternating, ``rounds`` engines each."""
    from contextlib import ExitStack
    from unittest import mock

    from engine.generation import Engine, EngineConfig
    from engine.ops import TritonOps
    from kernels import fused_moe, moe_route

    from .workloads import batch1

    def torch_route(self, logits, top_k, renormalize, round_dtype=None):
        return moe_route.moe_route_ref(logits, top_k, renormalize, round_dtype)

    rates = {"torch ops": [], "kernels": []}
    for _ in range(rounds):
        for name, runs in rates.items():
            with ExitStack() as patches:
                if name == "torch ops":
                    patches.enter_context(mock.patch.object(TritonOps, "moe_route", torch_route))
                    patches.enter_context(mock.patch.object(fused_moe, "ALIGN_MAX_PAIRS", 0))
                engine = Engine(EngineConfig(model_dir=model_dir, kernel_backend=kernel_backend))
                try:
                    timed = workload or batch1(engine.model_config.vocab_size)
                    runs.append(round(engine_bench.ours_decode_tokens_per_s(engine, timed), 1))
                finally:
                    engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    return rates


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", action="append", required=True, help="checkpoint directory (repeatable)")
    parser.add_argument("--requests", type=int, default=256, help="requests in the throughput workload")
    parser.add_argument("--no-peer", action="store_true", help="skip the transformers runs")
    parser.add_argument("--routing-ab", action="store_true", help="also batch-1 decode with the MoE routing and "
                        "expert alignment by torch's ops and by the kernels, in turn (module docstring)")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    bandwidth = copy_bandwidth()
    print(f"device copy bandwidth: {bandwidth / 1e9:.0f} GB/s")
    results = {}
    for model_dir in args.model_dir:
        print(f"\n=== {model_dir}")
        numbers = engine_bench.main(["--model-dir", model_dir, "--requests", str(args.requests)]
                                    + (["--no-peer"] if args.no_peer else []))
        active, total = active_weight_bytes(load_model_config(model_dir))
        floor = bandwidth / active
        numbers.update(active_bytes=active, weight_bytes=total, bandwidth=bandwidth, floor_decode=floor,
                       floor_fraction=numbers["ours_decode"] / floor)
        print(f"active weights {active / 1e9:.2f} GB of {total / 1e9:.2f} GB; batch-1 floor {floor:.1f} tokens/s; "
              f"ours {numbers['ours_decode']:.1f} = {100 * numbers['floor_fraction']:.0f}% of it (target >= 70%)")
        if args.routing_ab:
            numbers["routing_ab"] = rates = routing_ab(model_dir)
            for name, runs in rates.items():
                print(f"routing by {name}: batch-1 decode {runs} tokens/s = "
                      f"{', '.join(f'{100 * r / floor:.0f}%' for r in runs)} of the floor")
        results[model_dir] = numbers
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
