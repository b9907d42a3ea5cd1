"""What a quantized KV cache costs in quality, on a real checkpoint through the engine.

For each ``--kv-cache-dtype`` (and the unquantized cache first):

- held-out loss: ``weights/demo/evaluate.py``'s definition (mean next-token cross-entropy over
  non-overlapping 512-token windows of ``heldout.txt``), from the engine's prompt logprobs: each
  window is prefilled through the cache, so every token attends to quantized keys and values;
- greedy tokens of prompts against the unquantized cache's: the first position where they differ,
  with the unquantized run's logprob gap between its top two tokens there (a near-tie when small).

    python -m bench.kv_quant_quality                       # the demo model on the CPU (torch references)
    python -m bench.kv_quant_quality --model-dir DIR --device cuda --dtype bfloat16

``--kernel-backend torch`` (the CPU default) runs the references, which store and read the same
values as the kernels (tests/kernels/test_kv_quant_kernel.py); the Triton interpreter is too slow
for the whole held-out text.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import SamplingParams

DEMO = Path(__file__).resolve().parents[1] / "weights" / "demo"
KV_DTYPES = (None, "int8", "fp8_e4m3fn", "fp8_e5m2")
WINDOW = 512
PROMPTS = ("def ", "import os\n", "class Parser:\n    def __init__(self", "for i in range(",
           "# Read a file and count the words\n", "def fibonacci(n):\n", "x = [", "return ")


@dataclass
class Divergence:
    prompt: int
    position: int | None          # first differing new token (None: all equal)
    gap: float | None = None      # the unquantized run's top-1 minus top-2 logprob there


@dataclass
class Quality:
    kv_cache_dtype: str
    heldout_loss: float
    greedy: list[list[int]] = field(default_factory=list)
    top2: list[list[tuple[float, float]]] = field(default_factory=list)


def new_engine(model_dir: str, device: str, dtype: str | None, backend: str | None, kv: str | None) -> Engine:
    return Engine(EngineConfig(model_dir=model_dir, device=device, dtype=dtype, kernel_backend=backend,
                               num_slots=16384, max_requests=16, max_prefill_tokens=4096, kv_cache_dtype=kv,
                               cuda_graphs=()))


def heldout_loss(engine: Engine, ids: list[int], window: int = WINDOW) -> float:
    windows = [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) >= 2]
    requests = [GenerationRequest(i, w, 1, SamplingParams(prompt_logprobs=True)) for i, w in enumerate(windows)]
    out = engine.generate(requests)
    logprobs = [lp for i in range(len(windows)) for lp in out[i][0].prompt_logprobs[1:]]
    return -sum(logprobs) / len(logprobs)


def greedy(engine: Engine, prompts: list[list[int]], new_tokens: int):
    """(tokens, (top-1, top-2) logprobs) of each prompt's greedy continuation."""
    requests = [GenerationRequest(i, p, new_tokens, SamplingParams(top_n_tokens=2), stop_token_ids=[])
                for i, p in enumerate(prompts)]
    out = engine.generate(requests)
    tokens = [[e.token_id for e in out[i]] for i in range(len(prompts))]
    top2 = [[tuple(e.top_logprobs[:2]) for e in out[i]] for i in range(len(prompts))]
    return tokens, top2


def measure(model_dir: str, device: str, dtype: str | None, backend: str | None, kv: str | None,
            ids: list[int], prompts: list[list[int]], new_tokens: int) -> Quality:
    engine = new_engine(model_dir, device, dtype, backend, kv)
    try:
        tokens, top2 = greedy(engine, prompts, new_tokens)
        return Quality(kv or "unquantized", heldout_loss(engine, ids), tokens, top2)
    finally:
        engine.close()


def divergences(reference: Quality, other: Quality) -> list[Divergence]:
    found = []
    for i, (want, got) in enumerate(zip(reference.greedy, other.greedy)):
        position = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
        gap = None if position is None else reference.top2[i][position][0] - reference.top2[i][position][1]
        found.append(Divergence(i, position, gap))
    return found


def build_parser() -> argparse.ArgumentParser:
    """The command line; its defaults measure the demo model on the CPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(DEMO),
                        help="checkpoint directory with a tokenizer (default: the demo model, %(default)s)")
    parser.add_argument("--heldout", default=str(DEMO / "heldout.txt"),
                        help=f"text file whose held-out loss is measured, in non-overlapping {WINDOW}-token windows "
                             "(default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device the engine runs on (default: %(default)s)")
    parser.add_argument("--dtype", default=None,
                        help="float16 | bfloat16 | float32 (default: the device's: float32 on a CPU, the "
                             "checkpoint's half precision on a GPU)")
    parser.add_argument("--kernel-backend", default=None,
                        help="triton | torch: the engine's kernels (default: torch on the CPU, triton on CUDA)")
    parser.add_argument("--new-tokens", type=int, default=32,
                        help=f"greedy tokens of each of the {len(PROMPTS)} prompts, compared with the unquantized "
                             "cache's (default: %(default)s)")
    parser.add_argument("--kv-dtypes", default=",".join(k for k in KV_DTYPES if k),
                        help="comma-separated quantized KV dtypes, each measured after the unquantized cache "
                             "(default: %(default)s)")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    import transformers

    backend = args.kernel_backend or ("torch" if args.device == "cpu" else None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    ids = tokenizer(Path(args.heldout).read_text())["input_ids"]
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    runs = [measure(args.model_dir, args.device, args.dtype, backend, kv, ids, prompts, args.new_tokens)
            for kv in (None, *args.kv_dtypes.split(","))]
    reference, report = runs[0], []
    print(f"held-out loss, {reference.kv_cache_dtype} cache: {reference.heldout_loss:.4f} nats/token")
    for run in runs[1:]:
        found = divergences(reference, run)
        delta = run.heldout_loss - reference.heldout_loss
        print(f"{run.kv_cache_dtype}: held-out loss {run.heldout_loss:.4f} ({delta:+.4f}); greedy "
              f"{sum(d.position is None for d in found)}/{len(found)} prompts equal over {args.new_tokens} tokens")
        for d in found:
            if d.position is not None:
                print(f"  prompt {d.prompt} ({PROMPTS[d.prompt]!r}): first differs at new token {d.position}, "
                      f"unquantized top-2 logprob gap {d.gap:.4f}")
        report.append({"kv_cache_dtype": run.kv_cache_dtype, "heldout_loss": run.heldout_loss, "delta": delta,
                       "divergences": [vars(d) for d in found]})
    if args.json:
        Path(args.json).write_text(json.dumps({"reference_loss": reference.heldout_loss, "runs": report}, indent=1))


if __name__ == "__main__":
    main()
