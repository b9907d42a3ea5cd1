"""Held-out loss of the demo model, defined so that anyone can recompute it.

Definition (the one recorded in ``README.md`` / ``training_log.json``):

1. ``token_ids`` = the tokenizer's encoding of the whole of ``heldout.txt`` (UTF-8), *with*
   the special tokens the tokenizer adds by default, i.e. ``[<s>] + tokens`` (one BOS at
   the very start, no EOS): ``tokenizer(text)["input_ids"]``.
2. Cut ``token_ids`` into consecutive non-overlapping windows of ``window`` (512) tokens:
   ``ids[0:512], ids[512:1024], ...``; the last window may be shorter (windows shorter
   than 2 tokens are skipped).  Every window is scored on its own, starting from an
   empty context (no KV carried across windows; position ids start at 0).
3. In a window of n tokens the model predicts tokens 1..n-1 from their prefixes; the
   loss is the natural-log cross-entropy of each such prediction.
4. The result is the mean over *all* predicted tokens of all windows (token-weighted),
   in nats per token.  ``exp(loss)`` is the perplexity.

The recorded number was computed with the saved bf16 checkpoint upcast to float32 and
float32 arithmetic; other dtypes / devices agree to about 1e-2.

Command line (from the repository root)::

    python weights/demo/evaluate.py [MODEL_DIR] [--window 512] [--dtype float32]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

WINDOW = 512


def mean_heldout_loss(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    token_ids: Sequence[int] | torch.Tensor,
    window: int = WINDOW,
) -> float:
    """Mean next-token cross-entropy (nats/token) over non-overlapping windows.

    ``logits_fn`` maps a 1-D LongTensor of n token ids (one window, positions 0..n-1)
    to an ``[n, vocab]`` tensor of logits (any float dtype, any device).
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    total = 0.0
    count = 0
    for start in range(0, ids.numel(), window):
        chunk = ids[start:start + window]
        if chunk.numel() < 2:
            continue
        logits = logits_fn(chunk)
        if logits.dim() == 3:  # tolerate [1, n, vocab]
            logits = logits[0]
        if logits.shape[0] != chunk.numel():
            raise ValueError(f"logits_fn returned {tuple(logits.shape)} for {chunk.numel()} tokens")
        targets = chunk[1:].to(logits.device)
        loss = F.cross_entropy(logits[:-1].float(), targets, reduction="sum")
        total += float(loss)
        count += targets.numel()
    if count == 0:
        raise ValueError("no tokens to score")
    return total / count


def hf_logits_fn(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """``logits_fn`` for a transformers causal LM."""
    device = next(model.parameters()).device

    @torch.no_grad()
    def fn(chunk: torch.Tensor) -> torch.Tensor:
        return model(input_ids=chunk[None].to(device), use_cache=False).logits[0]

    return fn


def heldout_token_ids(tokenizer, text: str) -> list[int]:
    """Step 1 of the definition, for a transformers tokenizer or a ``tokenizers.Tokenizer``."""
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer (post-processor adds <s>)
        return tokenizer.encode(text).ids
    return tokenizer(text)["input_ids"]


def build_parser() -> argparse.ArgumentParser:
    """The command line; its defaults recompute the number the demo model's card records."""
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_dir", nargs="?", default=here,
                   help="a transformers model directory, tokenizer included (default: this folder, the demo model)")
    p.add_argument("--text", default=None, help="the UTF-8 text to score (default: MODEL_DIR/heldout.txt)")
    p.add_argument("--window", type=int, default=WINDOW,
                   help="tokens per scoring window; windows do not overlap or share context (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the weights are loaded in; the card's number is float32's (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device to score on (default: cuda when there is one, else cpu)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    dtype = getattr(torch, a.dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=dtype)
    except TypeError:  # older transformers
        model = AutoModelForCausalLM.from_pretrained(a.model_dir, torch_dtype=dtype)
    model.to(a.device).eval()
    with open(a.text or os.path.join(a.model_dir, "heldout.txt"), encoding="utf-8") as f:
        text = f.read()
    ids = heldout_token_ids(tok, text)
    loss = mean_heldout_loss(hf_logits_fn(model), ids, a.window)
    print(json.dumps({"heldout_loss": round(loss, 4), "perplexity": round(math.exp(loss), 3),
                      "tokens": len(ids), "window": a.window, "dtype": a.dtype}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
