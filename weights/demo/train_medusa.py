"""Train Medusa draft heads for the demo model: lightserve's bundled ``weights/demo/medusa``.

Heads
    TGI's "v2" Medusa layout: head k (0-based) is --layers residual blocks,
    ``x = x + silu(x @ W.T + b)`` from ``x = h``, read by the demo model's own LM head (frozen),
    so the file holds ``heads x layers x (384 x 384 + 384)`` parameters. ``W`` and ``b`` start
    at zero: every head starts as the model's next-token head.
Targets (greedy self-distillation)
    For the final hidden state (after the last norm) at position t of a training window,
    head k learns the demo model's own greedy choice at position t + 1 + k, teacher-forced
    on the corpus: the token greedy decoding produces at t + 2 + k where the model's earlier
    choices follow the text. (The corpus's own tokens would teach the heads the text, not
    what the verifying model will choose.)
Data
    The train split of ``train.py``'s standard-library corpus (same split rule, the running
    interpreter's stdlib), each file ``<s> tokens </s>``, concatenated and cut into windows of
    512 tokens; ``--windows`` of them drawn with a fixed seed. The held-out split's windows
    score the heads.
Training
    AdamW (lr --lr, cosine to 10%, weight decay 0), batches of --batch positions, the summed
    cross-entropy of the heads, for --steps steps (or until --max-minutes).
Score
    On the held-out windows, per head the share of positions where it names its target, and
    the expected drafts accepted per verify row with n drafts: the sum over k <= n of the
    share of positions where heads 1..k are all right (a verify row keeps drafts while they
    are right).

Usage (from the repository root)::

    python weights/demo/train_medusa.py --out weights/demo/medusa
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))     # the repository root

from weights.demo.train import BOS, EOS, CorpusError, load_corpus  # noqa: E402

WINDOW = 512


def build_parser() -> argparse.ArgumentParser:
    """The command line; its defaults trained the bundled heads (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for config.json, medusa_lm_head.safetensors, the log")
    p.add_argument("--model", default=HERE, help="the demo model's directory (default: weights/demo)")
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"],
                   help="the corpus: a directory of Python files, split as train.py splits them (default: this "
                        "interpreter's standard library, what the bundled heads were trained on)")
    p.add_argument("--heads", type=int, default=4,
                   help="draft heads; head k (from 1) guesses the token k places after the model's own next token "
                        "(default: %(default)s)")
    p.add_argument("--layers", type=int, default=1, help="residual blocks per head (default: %(default)s)")
    p.add_argument("--windows", type=int, default=400,
                   help="training windows of 512 tokens, drawn from the train split (default: %(default)s)")
    p.add_argument("--heldout-windows", type=int, default=48,
                   help="windows of 512 tokens from the held-out split that score the heads (default: %(default)s)")
    p.add_argument("--steps", type=int, default=1500,
                   help="optimizer steps, unless --max-minutes ends training first (default: %(default)s)")
    p.add_argument("--batch", type=int, default=512, help="positions per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=2e-3,
                   help="AdamW learning rate at the first step, cosine decay to a tenth of it over --steps (default: "
                        "%(default)s)")
    p.add_argument("--max-minutes", type=float, default=20.0,
                   help="wall-clock budget of the training loop, not counting the model's distillation pass "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the windows drawn and of the batch order (default: %(default)s)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def windows_of(tokenizer, texts: list[str], count: int, seed: int) -> torch.Tensor:
    """``count`` windows of WINDOW tokens (fewer if the text is short), drawn with ``seed``."""
    ids = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend([BOS, *encoding.ids, EOS])
    starts = list(range(0, len(ids) - WINDOW, WINDOW))
    random.Random(seed).shuffle(starts)
    return torch.tensor([ids[s : s + WINDOW] for s in sorted(starts[:count])])


@torch.no_grad()
def distill(model, windows: torch.Tensor, heads: int, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states [N, hidden], targets [N, heads]): at each position t < WINDOW - 1 - heads of every
    window, the final hidden state and the model's greedy choices at t + 1 .. t + heads."""
    states, targets = [], []
    last = WINDOW - 1 - heads
    for i in range(0, len(windows), batch):
        out = model(windows[i : i + batch], output_hidden_states=True)
        greedy = out.logits.argmax(dim=-1)                          # [b, WINDOW]: the choice for position + 1
        states.append(out.hidden_states[-1][:, :last].reshape(-1, out.hidden_states[-1].shape[-1]))
        targets.append(torch.stack([greedy[:, 1 + k : last + 1 + k] for k in range(heads)], dim=-1).reshape(-1, heads))
    return torch.cat(states), torch.cat(targets)


class Heads(torch.nn.Module):
    def __init__(self, heads: int, layers: int, hidden: int, lm_head: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(layers, heads, hidden, hidden))
        self.bias = torch.nn.Parameter(torch.zeros(layers, heads, hidden))
        self.register_buffer("lm_head", lm_head)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[heads, N, vocab] logits."""
        x = h[None].expand(self.weight.shape[1], -1, -1)
        for weight, bias in zip(self.weight, self.bias):
            x = x + F.silu(torch.einsum("knd,kod->kno", x, weight) + bias[:, None])
        return x @ self.lm_head.T


def loss_of(heads: Heads, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = heads(h)
    return sum(F.cross_entropy(logits[k], targets[:, k]) for k in range(logits.shape[0]))


@torch.no_grad()
def score(heads: Heads, h: torch.Tensor, targets: torch.Tensor) -> dict:
    right = torch.cat([(heads(h[i : i + 4096]).argmax(-1).T == targets[i : i + 4096]) for i in range(0, len(h), 4096)])
    all_right = right.cumprod(dim=1).float().mean(dim=0)             # heads 1..k all right
    return {"head_accuracy": [round(v, 4) for v in right.float().mean(dim=0).tolist()],
            "expected_accepted_drafts": [round(v, 3) for v in all_right.cumsum(0).tolist()]}


def train(heads: Heads, h: torch.Tensor, targets: torch.Tensor, a: argparse.Namespace) -> dict:
    opt = torch.optim.AdamW(heads.parameters(), lr=a.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(a.seed)
    deadline, started, losses = time.time() + 60 * a.max_minutes, time.time(), []
    step = 0
    for step in range(a.steps):
        if time.time() > deadline:
            break
        for group in opt.param_groups:
            group["lr"] = a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / a.steps)))
        index = torch.randint(0, len(h), (a.batch,), generator=generator)
        loss = loss_of(heads, h[index], targets[index])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0:
            log(f"step {step}: loss {sum(losses[-100:]) / len(losses[-100:]):.3f}")
    return {"steps": step + 1, "seconds": round(time.time() - started, 1),
            "loss_first_100": round(sum(losses[:100]) / len(losses[:100]), 4),
            "loss_last_100": round(sum(losses[-100:]) / len(losses[-100:]), 4)}


def save(heads: Heads, a: argparse.Namespace, record: dict) -> None:
    from safetensors.torch import save_file

    os.makedirs(a.out, exist_ok=True)
    tensors = {}
    layers, count = heads.weight.shape[:2]
    for j in range(layers):
        for k in range(count):
            tensors[f"{k}.{j}.linear.weight"] = heads.weight[j, k].detach().to(torch.bfloat16).contiguous()
            tensors[f"{k}.{j}.linear.bias"] = heads.bias[j, k].detach().to(torch.bfloat16).contiguous()
    save_file(tensors, os.path.join(a.out, "medusa_lm_head.safetensors"))
    base = os.path.relpath(os.path.abspath(a.model), os.path.abspath(a.out))
    config = {"medusa_num_heads": count, "medusa_num_layers": layers, "base_model_name_or_path": base}
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(a.out, "training_log.json"), "w") as f:
        json.dump(record, f, indent=2)


def main(argv=None) -> int:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    a = parse_args(argv)
    torch.manual_seed(a.seed)
    corpus = load_corpus(a.stdlib)      # first: a bad --stdlib is refused before the model loads
    tokenizer = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    data = {split: windows_of(tokenizer, [text for _, text in corpus[split]], count, a.seed)
            for split, count in (("train", a.windows), ("heldout", a.heldout_windows))}
    log(f"distilling {len(data['train'])} training and {len(data['heldout'])} held-out windows")
    train_h, train_t = distill(model, data["train"], a.heads)
    held_h, held_t = distill(model, data["heldout"], a.heads)
    heads = Heads(a.heads, a.layers, train_h.shape[1], model.lm_head.weight.detach().float())
    before = score(heads, held_h, held_t)
    log(f"before training (every head = the next-token head): {before}")
    run = train(heads, train_h, train_t, a)
    after = score(heads, held_h, held_t)
    log(f"after training: {after}")
    record = {"python": sys.version.split()[0], "torch": torch.__version__, "args": vars(a),
              "train_positions": len(train_h), "heldout_positions": len(held_h), "run": run,
              "heldout_before": before, "heldout_after": after}
    save(heads, a, record)
    log(f"saved to {a.out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CorpusError as e:     # a bad --stdlib: the message, no traceback
        sys.exit(f"error: {e}")
