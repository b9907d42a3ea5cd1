"""Train lightserve's bundled demo model: a small Llama that completes Python code.

Corpus
    The ``.py`` files of the running interpreter's standard library
    (``sysconfig.get_paths()["stdlib"]``), so every machine has it and no download is
    needed.  Directories named test, tests, idlelib, lib2to3, site-packages,
    dist-packages and __pycache__ are skipped; files that are not valid UTF-8 are skipped.
    Files are sorted by relative POSIX path.  Split by a stable hash of the relative
    path: ``sha256(relpath) % 1000 < 20`` -> held-out (~2%), ``< 70`` -> validation
    (~5%, used only to pick the best checkpoint), the rest -> train.  The exact list
    depends on the Python version; training_log.json records it (version, counts).
Tokenizer
    Byte-level BPE (``tokenizers``), vocabulary 4096 including <unk>=0, <s>=1 (BOS),
    </s>=2 (EOS), <pad>=3, trained on the train split only.  Encoding adds <s>; decoding
    is byte-exact (ByteLevel decoder, no clean-up), so indentation round-trips.
Model
    transformers ``LlamaForCausalLM``, grouped-query attention (default: hidden 384,
    8 layers, 6 heads, 2 KV heads, MLP 1024, untied embeddings, RoPE theta 10000,
    ~15.7M parameters, ~31 MB in bf16).
Training
    Every file becomes ``<s> tokens </s>``; the files are concatenated and cut into
    packed sequences of 512 (+1) tokens, reshuffled (with a random phase) every epoch.
    AdamW (0.9, 0.95, wd 0.1), linear warmup then cosine decay to 10%, grad clip 1.0,
    bf16 autocast on CUDA with fp32 master weights, fixed seeds.  The number of steps is
    min(--max-steps, --epochs worth of steps, what fits in --max-minutes measured from
    the start of the script); it is fixed after a short timing of the first steps and
    recorded, so ``--max-steps N`` (with a large --max-minutes) repeats a run.  The
    validation loss is measured every --eval-every steps and the best state is kept.
Evaluation
    The saved bf16 checkpoint is reloaded and scored in float32 on ``heldout.txt``
    (held-out files, concatenated, <= 200 KB) with ``evaluate.mean_heldout_loss``:
    mean token cross-entropy over non-overlapping 512-token windows.

Usage (from the repository root)::

    python weights/demo/train.py --out /tmp/demo --max-minutes 5
    python weights/demo/train.py --smoke --out /tmp/demo_smoke      # CPU plumbing test
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass, field

T0 = time.time()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:  # imported as weights.demo.train
    from .evaluate import WINDOW, mean_heldout_loss, hf_logits_fn  # type: ignore
except ImportError:  # run as a script: load the sibling file explicitly (the name
    import importlib.util  # "evaluate" would otherwise collide with the HF package)

    _spec = importlib.util.spec_from_file_location(
        "_demo_evaluate", os.path.join(os.path.dirname(os.path.abspath(__file__)), "evaluate.py"))
    _ev = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_ev)
    WINDOW, mean_heldout_loss, hf_logits_fn = _ev.WINDOW, _ev.mean_heldout_loss, _ev.hf_logits_fn

EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages",
                 "__pycache__"}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0, 1, 2, 3
UNK, BOS, EOS, PAD = 0, 1, 2, 3
HELDOUT_PER_MILLE = 20
VAL_PER_MILLE = 50
HELDOUT_MAX_BYTES = 200_000
# Prompts end inside a line: byte-level BPE merges a newline with the next line's
# indentation, so a prompt ending in "\n" or " " is off-distribution at its last token.
SAMPLE_PROMPTS = ['def fibonacci(n):\n    """Return', "import os\nimport sys\n\n\ndef main():\n    args",
                  "class Stack:\n    def __init__(self):\n        self"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}### User:\n{{ message['content'] }}\n\n"
    "{% else %}### Assistant:\n{{ message['content'] }}{{ eos_token }}\n\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- corpus
def split_of(relpath: str) -> str:
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big") % 1000
    if h < HELDOUT_PER_MILLE:
        return "heldout"
    if h < HELDOUT_PER_MILLE + VAL_PER_MILLE:
        return "val"
    return "train"


class CorpusError(ValueError):
    """--stdlib names no directory, or one whose Python files leave a split empty."""


def load_corpus(stdlib: str) -> dict:
    """The directory's UTF-8 .py files by split (``split_of``); CorpusError where it is missing or a split empty."""
    if not os.path.isdir(stdlib):
        raise CorpusError(f"--stdlib {stdlib} is not a directory: give a directory of Python files (default: this "
                          f"interpreter's standard library)")
    paths = []
    for d, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(x for x in dirs if x not in EXCLUDED_DIRS)
        for f in files:
            if f.endswith(".py"):
                paths.append(os.path.relpath(os.path.join(d, f), stdlib).replace(os.sep, "/"))
    paths.sort()
    corpus = {"train": [], "val": [], "heldout": []}
    skipped = []
    for rel in paths:
        with open(os.path.join(stdlib, rel), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if not text.strip():
            continue
        corpus[split_of(rel)].append((rel, text))
    empty = [split for split in ("train", "val", "heldout") if not corpus[split]]
    if empty:
        raise CorpusError(f"--stdlib {stdlib}: none of its {len(paths)} .py files falls in the {' and '.join(empty)} "
                          f"split (a file's split comes from its path): give a directory with more Python files")
    corpus["skipped_non_utf8"] = skipped
    return corpus


# ------------------------------------------------------------------------ tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # Words keep ONE trailing space ("def ", "return "), unlike GPT-2's split that glues the
    # space to the next word: a prompt typed as "def " is then an ordinary token the model
    # has seen before every function name, not a lone space it has almost never seen.
    words = Regex(r"[A-Za-z_][A-Za-z_0-9]* ?|[0-9]+ ?|[^\sA-Za-z_0-9]+ ?|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(words, behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    return tok


def save_tokenizer(tok, out: str, model_max_length: int) -> None:
    tok.save(os.path.join(out, "tokenizer.json"))
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, s in enumerate(SPECIAL_TOKENS)}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "model_input_names": ["input_ids", "attention_mask"],
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "pad_token": "<pad>"}, f, indent=2)
        f.write("\n")


def encode_docs(tok, texts: list[str]) -> list[list[int]]:
    """Each document -> <s> tokens </s>."""
    encs = tok.encode_batch(texts, add_special_tokens=False)
    return [[BOS] + e.ids + [EOS] for e in encs]


# ---------------------------------------------------------------------------- model
def build_model(a, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=a.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        use_cache=True,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def patch_config_json(path: str) -> None:
    """Write both the transformers 4.x and 5.x spellings of rope theta / dtype."""
    with open(path) as f:
        cfg = json.load(f)
    rp = cfg.get("rope_parameters") or {}
    cfg.setdefault("rope_theta", float(rp.get("rope_theta", 10000.0)))
    cfg.setdefault("rope_scaling", None)
    dt = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    cfg["torch_dtype"] = dt
    cfg.setdefault("dtype", dt)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


# ------------------------------------------------------------------------- training
class Batches:
    """Packed sequences of seq_len+1 tokens; a fresh shuffle and phase every epoch."""

    def __init__(self, data: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        self.data, self.seq_len, self.bs = data, seq_len, batch_size
        self.g = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self.queue = torch.empty(0, dtype=torch.long)
        self.offsets = torch.arange(seq_len + 1, device=data.device)

    def steps_per_epoch(self) -> int:
        return max(1, (self.data.numel() - 1 - self.seq_len) // self.seq_len // self.bs)

    def _refill(self) -> None:
        L, S = self.data.numel(), self.seq_len
        phase = int(torch.randint(0, S, (1,), generator=self.g))
        starts = torch.arange(phase, L - S - 1 + 1, S)
        if starts.numel() < self.bs:
            starts = torch.arange(0, max(1, L - S - 1 + 1))
        starts = starts[torch.randperm(starts.numel(), generator=self.g)]
        self.queue = torch.cat([self.queue, starts])
        self.epoch += 1

    def next(self) -> torch.Tensor:
        while self.queue.numel() < self.bs:
            self._refill()
        starts, self.queue = self.queue[:self.bs], self.queue[self.bs:]
        return self.data[starts.to(self.data.device)[:, None] + self.offsets]


def lr_at(step: int, total: int, warmup: int, lr: float, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


@torch.no_grad()
def window_loss(model, data: torch.Tensor, seq_len: int, device, amp, max_windows: int = 256,
                batch: int = 32) -> float:
    """Mean token CE over non-overlapping windows of a token stream (training-time val)."""
    model.eval()
    n = min(max_windows, (data.numel() - 1) // seq_len)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        idx = torch.arange(i, min(n, i + batch), device=data.device)[:, None] * seq_len
        x = data[idx + torch.arange(seq_len + 1, device=data.device)].to(device)
        with amp():
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               x[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    model.train()
    return total / max(1, count)


def build_parser() -> argparse.ArgumentParser:
    """The command line; its defaults train the bundled model (``--smoke`` swaps in a tiny one)."""
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description="Train the lightserve demo model (see module doc).")
    p.add_argument("--out", default=here, help="output folder (default: weights/demo)")
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"],
                   help="the corpus: a directory of Python files, split by a hash of each file's path (default: this "
                        "interpreter's standard library, what the bundled model was trained on)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="wall-clock budget for the whole script (default 5 on CUDA, 30 on CPU)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="cap on optimizer steps (default: none, --epochs and --max-minutes decide; 20 with --smoke)")
    p.add_argument("--epochs", type=float, default=12.0,
                   help="cap on passes over the train split (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="vocabulary the BPE tokenizer is trained to, its 4 special tokens included; the model gets "
                        "the vocabulary the tokenizer reaches (default: %(default)s)")
    p.add_argument("--hidden-size", type=int, default=384, help="model width (default: %(default)s)")
    p.add_argument("--intermediate-size", type=int, default=1024, help="MLP width (default: %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default: %(default)s)")
    p.add_argument("--heads", type=int, default=6,
                   help="attention (query) heads, each --hidden-size / --heads wide (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=2,
                   help="key/value heads of grouped-query attention; must divide --heads (default: %(default)s)")
    p.add_argument("--max-position-embeddings", type=int, default=2048,
                   help="longest sequence in tokens the checkpoint declares: config.json's max_position_embeddings "
                        "and tokenizer_config.json's model_max_length (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=512,
                   help="tokens per packed training sequence, and per validation window (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per optimizer step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1.5e-3,
                   help="peak AdamW learning rate, reached after --warmup; cosine decay to a tenth of it by the last "
                        "step (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=100,
                   help="steps of linear warmup, at most a tenth of the planned steps (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay of the weight matrices (embeddings included); norm weights get none "
                        "(default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=100,
                   help="steps between validation losses (and one at the last step); the state with the best one is "
                        "saved (default: %(default)s)")
    p.add_argument("--log-every", type=int, default=50,
                   help="steps between log lines of the mean train loss since the previous line (default: "
                        "%(default)s)")
    p.add_argument("--seed", type=int, default=1234,
                   help="seed of the initial weights and the batch order (default: %(default)s)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (off by default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device to train on; cuda trains in bf16 autocast (default: cuda when there is one, "
                        "else cpu)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, 20 steps: a plumbing test that runs on a CPU in ~1-2 min (sets --hidden-size, "
                        "--intermediate-size, --layers, --heads, --kv-heads, --batch-size, --seq-len, --warmup, "
                        "--eval-every and --log-every itself)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    a = build_parser().parse_args(argv)
    if a.smoke:
        a.hidden_size, a.intermediate_size, a.layers, a.heads, a.kv_heads = 64, 128, 2, 4, 2
        a.batch_size, a.seq_len, a.warmup, a.eval_every, a.log_every = 8, 128, 5, 10, 5
        a.max_steps = a.max_steps or 20
    if a.max_minutes is None:
        a.max_minutes = 5.0 if a.device.startswith("cuda") else 30.0
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    deadline = T0 + a.max_minutes * 60 - 20  # leave ~20 s for the final eval and saving
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(a.seed)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    log(f"python {platform.python_version()} torch {torch.__version__} device {device}"
        f" -> {out}")

    data = prepare_data(a, out)
    heldout = write_heldout(data.corpus, data.tok, out)
    torch.manual_seed(a.seed)
    model = build_model(a, data.tok.get_vocab_size()).to(device)
    log(f"model: LlamaForCausalLM {num_params(model) / 1e6:.2f}M params (hidden {a.hidden_size}, "
        f"layers {a.layers}, heads {a.heads}/{a.kv_heads} kv, mlp {a.intermediate_size})")
    run = train(a, model, data, device, deadline)
    reloaded = save_checkpoint(model, out, device)
    heldout_loss = mean_heldout_loss(hf_logits_fn(reloaded), heldout.ids, WINDOW)
    log(f"held-out loss (heldout.txt, saved bf16 weights in fp32, {WINDOW}-token windows): "
        f"{heldout_loss:.4f} (ppl {math.exp(heldout_loss):.2f})")
    samples = greedy_samples(reloaded, data.tok, device)
    record = training_record(a, data, heldout, num_params(model), run, heldout_loss, samples, device, out)
    with open(os.path.join(out, "training_log.json"), "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(model_card(record))
    size = folder_bytes(out)
    log(f"wrote {sorted(os.listdir(out))} ({size / 1e6:.1f} MB) in {time.time() - T0:.0f}s total")
    if size > 40e6:
        log("WARNING: output folder exceeds 40 MB")
    return 0


@dataclass
class Data:
    corpus: dict
    tok: object                  # tokenizers.Tokenizer
    train_data: torch.Tensor     # all train tokens, concatenated
    val_data: torch.Tensor
    counts: dict                 # files per split
    nbytes: dict                 # bytes per split
    ntok: dict                   # tokens of train and val
    t_tok_train: float
    t_tok_encode: float


def prepare_data(a: argparse.Namespace, out: str) -> Data:
    """Read the corpus, train and save the tokenizer, encode the train and val splits."""
    t = time.time()
    corpus = load_corpus(a.stdlib)
    train_texts = [x for _, x in corpus["train"]]
    counts = {k: len(corpus[k]) for k in ("train", "val", "heldout")}
    nbytes = {k: sum(len(x.encode("utf-8")) for _, x in corpus[k]) for k in ("train", "val", "heldout")}
    log(f"corpus {a.stdlib}: files {counts}, bytes {nbytes}, "
        f"skipped non-UTF-8 {len(corpus['skipped_non_utf8'])} ({time.time() - t:.1f}s)")
    t = time.time()
    tok = train_tokenizer(train_texts, a.vocab_size)
    t_tok_train = time.time() - t
    save_tokenizer(tok, out, a.max_position_embeddings)
    t = time.time()
    train_docs = encode_docs(tok, train_texts)
    val_docs = encode_docs(tok, [x for _, x in corpus["val"]])
    t_tok_encode = time.time() - t
    train_data = torch.tensor([i for d in train_docs for i in d], dtype=torch.long)
    val_data = torch.tensor([i for d in val_docs for i in d], dtype=torch.long)
    ntok = {"train": train_data.numel(), "val": val_data.numel()}
    log(f"tokenizer: vocab {tok.get_vocab_size()}, trained in {t_tok_train:.1f}s; encoded "
        f"{ntok} tokens in {t_tok_encode:.1f}s ({nbytes['train'] / max(1, ntok['train']):.2f}"
        f" bytes/token)")
    return Data(corpus, tok, train_data, val_data, counts, nbytes, ntok, t_tok_train, t_tok_encode)


@dataclass
class Heldout:
    text: str
    ids: list[int]
    files: list[str]


def write_heldout(corpus: dict, tok, out: str) -> Heldout:
    """heldout.txt: held-out files in path order, while the total stays <= 200 KB."""
    parts, size, files = [], 0, []
    for rel, text in corpus["heldout"]:
        b = len(text.encode("utf-8")) + 1
        if size + b > HELDOUT_MAX_BYTES:
            continue
        parts.append(text if text.endswith("\n") else text + "\n")
        files.append(rel)
        size += b
    text = "\n".join(parts)
    with open(os.path.join(out, "heldout.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(text)
    ids = tok.encode(text).ids
    assert ids[0] == BOS
    rt = tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
    assert rt == text, "byte-level round trip failed"
    log(f"heldout.txt: {len(files)} files, {len(text.encode())} bytes, {len(ids)} tokens (round-trip exact)")
    return Heldout(text, ids, files)


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def autocast(device: torch.device):
    """bf16 autocast on CUDA (fp32 master weights); plain float32 on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@dataclass
class TrainRun:
    step: int = 0                       # steps taken
    total: int = 0                      # steps planned (after the timing)
    limited_by: str = ""                # epochs | max_steps | time
    steps_per_epoch: int = 0
    warmup: int = 0
    stopped_by_time: bool = False
    seconds: float = 0.0
    losses: list = field(default_factory=list)     # (step, mean train loss since the last log line)
    evals: list = field(default_factory=list)      # (step, val loss, last train loss)
    best: tuple = (float("inf"), -1, None)          # (val loss, step, state dict)

    @property
    def kept_train_loss(self) -> float | None:
        return next((e[2] for e in self.evals if e[0] == self.best[1]), None)


def make_optimizer(a: argparse.Namespace, model, device: torch.device):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if device.type == "cuda" else {}))


def train(a: argparse.Namespace, model, data: Data, device: torch.device, deadline: float) -> TrainRun:
    """The training loop; the best validation state is loaded back into ``model`` at the end."""
    train_data, val_data = data.train_data.to(device), data.val_data.to(device)
    opt = make_optimizer(a, model, device)
    fwd = torch.compile(model) if a.compile else model
    batches = Batches(train_data, a.seq_len, a.batch_size, a.seed)
    run = TrainRun(steps_per_epoch=batches.steps_per_epoch())
    epoch_steps = max(1, int(a.epochs * run.steps_per_epoch))
    run.total = min(epoch_steps, a.max_steps or epoch_steps)
    run.limited_by = "epochs" if run.total == epoch_steps else "max_steps"
    log(f"training: {run.steps_per_epoch} steps/epoch of {a.batch_size}x{a.seq_len} tokens; planned "
        f"{run.total} steps ({run.limited_by}); budget ends at {deadline - T0:.0f}s")
    model.train()
    t_train, timer = time.time(), StepTimer(enabled=not a.smoke and device.type == "cuda")
    loss_sum, loss_n, last_train = None, 0, None  # mean train loss since the last log line
    while run.step < run.total:
        if time.time() > deadline:
            run.stopped_by_time = True
            log(f"time budget reached at step {run.step}/{run.total}")
            break
        lr = lr_at(run.step, run.total, min(a.warmup, max(1, run.total // 10)), a.lr)
        loss = train_step(model, fwd, opt, batches.next(), lr, device)
        run.step += 1
        loss_sum = loss if loss_sum is None else loss_sum + loss
        loss_n += 1
        if run.step % a.log_every == 0 or run.step == run.total or run.step <= 2:
            last_train, loss_sum, loss_n = float(loss_sum) / loss_n, None, 0
            run.losses.append((run.step, round(last_train, 4)))
            el = time.time() - t_train
            log(f"step {run.step}/{run.total} loss {last_train:.4f} lr {lr:.2e} epoch "
                f"{run.step / run.steps_per_epoch:.2f} {run.step * a.batch_size * a.seq_len / el / 1e3:.0f}k tok/s")
        timer.fit_budget(run, deadline)
        if run.step % a.eval_every == 0 or run.step == run.total:
            evaluate_and_keep_best(model, val_data, a.seq_len, device, run, last_train)
    run.seconds = time.time() - t_train
    run.warmup = min(a.warmup, max(1, run.total // 10))
    if run.best[2] is not None and run.best[1] != run.step:
        log(f"restoring best validation state from step {run.best[1]} (val {run.best[0]:.4f})")
        model.load_state_dict(run.best[2])
    return run


def train_step(model, fwd, opt, x: torch.Tensor, lr: float, device: torch.device) -> torch.Tensor:
    """One optimizer step at learning rate ``lr``; returns the (detached) loss."""
    for g in opt.param_groups:
        g["lr"] = lr
    with autocast(device):
        logits = fwd(input_ids=x[:, :-1], use_cache=False).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


class StepTimer:
    """On CUDA, times steps 10-60 once and shortens the plan to what fits in the budget."""

    def __init__(self, enabled: bool):
        self.enabled, self.mark, self.done = enabled, None, False

    def fit_budget(self, run: TrainRun, deadline: float) -> None:
        if not self.enabled or self.done:
            return
        if run.step == 10:
            torch.cuda.synchronize()
            self.mark = time.time()
        elif run.step == 60 and self.mark is not None:
            torch.cuda.synchronize()
            per_step = (time.time() - self.mark) / 50 * (1 + 0.05)  # + eval overhead
            fit = 60 + int((deadline - time.time()) / per_step)
            if fit < run.total:
                run.total, run.limited_by = max(61, fit), "time"
            self.done = True
            log(f"timing: {per_step * 1e3:.1f} ms/step -> {run.total} steps ({run.limited_by})")


def evaluate_and_keep_best(model, val_data, seq_len: int, device, run: TrainRun, last_train) -> None:
    vl = window_loss(model, val_data, seq_len, device, lambda: autocast(device))
    run.evals.append((run.step, round(vl, 4), round(last_train, 4)))
    log(f"eval step {run.step}: val loss {vl:.4f}")
    if vl < run.best[0]:
        run.best = (vl, run.step, copy.deepcopy({k: v.detach().clone() for k, v in model.state_dict().items()}))


def save_checkpoint(model, out: str, device: torch.device):
    """Save the model in bf16 (one model.safetensors) with its generation config; return
    the saved checkpoint reloaded in float32 on ``device``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model.eval()
    model.to(torch.bfloat16)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    model.save_pretrained(out, safe_serialization=True)
    patch_config_json(os.path.join(out, "config.json"))
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, do_sample=False,
                     max_new_tokens=128).save_pretrained(out)
    for name in os.listdir(out):
        if name.startswith("model-") or name.endswith(".bin") or name == "model.safetensors.index.json":
            raise RuntimeError(f"unexpected checkpoint file {name}")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    except TypeError:
        reloaded = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    return reloaded.to(device).eval()


def greedy_samples(model, tok, device: torch.device) -> list[dict]:
    """Greedy completions of SAMPLE_PROMPTS, for the card."""
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids], device=device)
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48,
                                 do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
        samples.append({"prompt": prompt, "text": tok.decode(gen[0].tolist(), skip_special_tokens=True)})
        log("greedy sample:\n" + samples[-1]["text"])
    return samples


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if os.path.isfile(os.path.join(path, f)))


def training_record(a, data: Data, heldout: Heldout, n_params: int, run: TrainRun, heldout_loss: float,
                    samples: list[dict], device: torch.device, out: str) -> dict:
    """Everything the card says, machine-readable (training_log.json)."""
    import tokenizers
    from transformers import __version__ as tf_version

    return {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "args": vars(a),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": tf_version,
        "tokenizers": tokenizers.__version__,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "corpus": corpus_record(a.stdlib, data),
        "tokenizer": {"type": "byte-level BPE", "vocab_size": data.tok.get_vocab_size(),
                      "special_tokens": SPECIAL_TOKENS, "train_seconds": round(data.t_tok_train, 2),
                      "encode_seconds": round(data.t_tok_encode, 2)},
        "model": model_record(a, data, n_params),
        "training": run_record(a, run),
        "heldout": heldout_record(heldout, heldout_loss),
        "greedy_samples": samples,
        "reproduce": reproduce_command(sys.argv[1:], run.total),
        "folder_bytes": folder_bytes(out),
        "wall_seconds": round(time.time() - T0, 1),
    }


STDLIB_ROOT = "sysconfig.get_paths()['stdlib'] of Python "


def corpus_record(stdlib: str, data: Data) -> dict:
    """``root``: the interpreter's standard library in words, or the --stdlib directory given instead."""
    is_stdlib = os.path.realpath(stdlib) == os.path.realpath(sysconfig.get_paths()["stdlib"])
    return {
        "root": STDLIB_ROOT + platform.python_version() if is_stdlib else os.path.abspath(stdlib),
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "split": f"sha256(relpath) % 1000 < {HELDOUT_PER_MILLE}: heldout, "
                 f"< {HELDOUT_PER_MILLE + VAL_PER_MILLE}: val, else train",
        "files": data.counts,
        "bytes": data.nbytes,
        "tokens": data.ntok,
        "skipped_non_utf8": data.corpus["skipped_non_utf8"],
        "heldout_files": [r for r, _ in data.corpus["heldout"]],
        "val_files": [r for r, _ in data.corpus["val"]],
    }


def model_record(a, data: Data, n_params: int) -> dict:
    return {"architecture": "LlamaForCausalLM", "params": n_params,
            "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
            "layers": a.layers, "heads": a.heads, "kv_heads": a.kv_heads,
            "vocab_size": data.tok.get_vocab_size(),
            "max_position_embeddings": a.max_position_embeddings,
            "train_seq_len": a.seq_len}


def run_record(a, run: TrainRun) -> dict:
    return {"steps": run.step, "planned_steps": run.total, "steps_limited_by": run.limited_by,
            "stopped_by_time": run.stopped_by_time, "steps_per_epoch": run.steps_per_epoch,
            "epochs": round(run.step / run.steps_per_epoch, 2), "batch_size": a.batch_size,
            "tokens_seen": run.step * a.batch_size * a.seq_len, "lr": a.lr,
            "warmup": run.warmup,
            "train_seconds": round(run.seconds, 1),
            "final_train_loss": run.losses[-1][1] if run.losses else None,
            "train_loss_at_kept_step": run.kept_train_loss,
            "train_loss_curve": run.losses,
            "val_loss_curve": [(st, vl) for st, vl, _ in run.evals],
            "final_val_loss": run.evals[-1][1] if run.evals else None, "best_val_loss": round(run.best[0], 4),
            "kept_step": run.best[1] if run.best[2] is not None else run.step}


def heldout_record(heldout: Heldout, heldout_loss: float) -> dict:
    return {"file": "heldout.txt", "files": heldout.files,
            "bytes": len(heldout.text.encode("utf-8")), "tokens": len(heldout.ids),
            "window": WINDOW, "loss": round(heldout_loss, 4),
            "perplexity": round(math.exp(heldout_loss), 3),
            "definition": "mean next-token cross-entropy (nats) over all predicted "
                          "tokens of non-overlapping 512-token windows of "
                          "tokenizer(heldout.txt) (with the leading <s>), each window "
                          "scored independently; saved bf16 weights run in float32"}


def reproduce_command(argv: list[str], planned_steps: int) -> str:
    keep, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        if x in ("--out", "--max-minutes", "--max-steps"):
            skip = True
            continue
        if x.split("=")[0] in ("--out", "--max-minutes", "--max-steps"):
            continue
        keep.append(x)
    return " ".join(["python weights/demo/train.py"] + keep + [
        "--out weights/demo", f"--max-steps {planned_steps}", "--max-minutes 60"])


def model_card(r: dict) -> str:
    """The README of the trained folder, from its training record."""
    return "".join(section(r) for section in (card_intro, card_files, card_model, card_data, card_training,
                                              card_heldout, card_samples, card_reproduce, card_license))


def card_intro(r: dict) -> str:
    m = r["model"]
    return f"""---
license: other
license_name: psf-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [llama, code, python, demo]
---

# lightserve demo model: a tiny Llama for Python code

A {m['params'] / 1e6:.1f}M-parameter Llama-architecture model (grouped-query attention)
trained from scratch on the source code of the Python {r['python']} standard library.  It
is lightserve's bundled demo model: small enough to ship in the repository and to run on
a CPU, and it completes Python code.  It is a toy: expect plausible-looking stdlib-style
code, not correct programs, and nothing useful outside Python.
"""


def card_files(r: dict) -> str:
    h = r["heldout"]
    return f"""
## Files

| file | content |
| --- | --- |
| `config.json` | `LlamaForCausalLM` configuration |
| `model.safetensors` | weights, bfloat16 |
| `generation_config.json` | BOS/EOS/pad ids; greedy by default |
| `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json` | byte-level BPE tokenizer, chat template |
| `heldout.txt` | held-out text ({h['bytes']} bytes) on which the loss below is measured |
| `training_log.json` | everything below, machine-readable (incl. loss curves, file lists) |
| `train.py`, `evaluate.py` | the training script and the loss definition |
"""


def card_model(r: dict) -> str:
    m = r["model"]
    return f"""
## Model

| | |
| --- | --- |
| architecture | `LlamaForCausalLM`, RMSNorm, SwiGLU, RoPE (theta 10000) |
| hidden size / MLP | {m['hidden_size']} / {m['intermediate_size']} |
| layers | {m['layers']} |
| attention heads / KV heads | {m['heads']} / {m['kv_heads']} (grouped-query) |
| vocabulary | {m['vocab_size']} (byte-level BPE) |
| parameters | {m['params']:,} (untied input/output embeddings) |
| trained context | {m['train_seq_len']} tokens (`max_position_embeddings` {m['max_position_embeddings']}; quality degrades past {m['train_seq_len']}) |

Tokenizer: byte-level BPE, vocabulary {r['tokenizer']['vocab_size']}, trained on the training split;
special tokens `<unk>`=0, `<s>`=1 (BOS, added when encoding), `</s>`=2 (EOS), `<pad>`=3.
Decoding is byte-exact, so whitespace and indentation round-trip.  The chat template
renders `<s>### User:\\n...\\n\\n### Assistant:\\n`; the model was never trained on chat, it
simply continues with Python.
"""


def corpus_root(root: str) -> str:
    """The card's words for the corpus directory (``corpus_record``'s root)."""
    if root.startswith(STDLIB_ROOT):
        return f"`sysconfig.get_paths()[\"stdlib\"]` of Python {root[len(STDLIB_ROOT):]}"
    return f"`{root}`"


def card_data(r: dict) -> str:
    c, m = r["corpus"], r["model"]
    return f"""
## Training data

The `.py` files under {corpus_root(c['root'])}, sorted by
relative path, excluding the directories {', '.join(c['excluded_dirs'])} (and files that
are not UTF-8: {len(c['skipped_non_utf8'])}).  Split by a stable hash of the relative path:
{c['split']}.

| split | files | bytes | tokens |
| --- | --- | --- | --- |
| train | {c['files']['train']} | {c['bytes']['train']:,} | {c['tokens']['train']:,} |
| validation (checkpoint selection) | {c['files']['val']} | {c['bytes']['val']:,} | {c['tokens']['val']:,} |
| held-out | {c['files']['heldout']} | {c['bytes']['heldout']:,} | - |

Each file is encoded as `<s> tokens </s>`; the files are concatenated and cut into packed
{m['train_seq_len']}-token sequences, reshuffled every epoch.
"""


def card_training(r: dict) -> str:
    m, t = r["model"], r["training"]
    return f"""
## Training

AdamW (betas 0.9/0.95, weight decay 0.1), peak learning rate {t['lr']}, {t['warmup']} warmup
steps then cosine decay to 10%, gradient clipping 1.0, batch {t['batch_size']} x
{m['train_seq_len']} tokens, bf16 autocast with fp32 master weights, seed
{r['args']['seed']}.  {t['steps']} steps ({t['epochs']} epochs, {t['tokens_seen']:,} tokens) in
{t['train_seconds']} s on {r['device']} (whole script: {r['wall_seconds']} s); the step
count was limited by {t['steps_limited_by']}.  Training loss (mean of the last
{r['args']['log_every']} steps) {t['final_train_loss']} at the end; validation loss
{t['final_val_loss']} at the end, best {t['best_val_loss']} at step {t['kept_step']}, whose
weights are the ones saved (training loss then: {t['train_loss_at_kept_step']}).  Curves
are in `training_log.json`.

Software: Python {r['python']}, torch {r['torch']}, transformers {r['transformers']},
tokenizers {r['tokenizers']}.
"""


def card_heldout(r: dict) -> str:
    h = r["heldout"]
    return f"""
## Held-out loss

**{h['loss']} nats/token (perplexity {h['perplexity']})** on `heldout.txt`
({len(h['files'])} held-out files, concatenated in path order separated by a blank line,
{h['bytes']:,} bytes, {h['tokens']:,} tokens).

Definition (`evaluate.mean_heldout_loss`): encode the whole of `heldout.txt` with this
tokenizer (`tokenizer(text)["input_ids"]`, i.e. with the leading `<s>`); cut it into
consecutive non-overlapping windows of {h['window']} tokens (the last one shorter); score
each window independently from an empty context; average the natural-log cross-entropy of
every predicted token (tokens 1..n-1 of each window) over all windows.  Measured with the
saved bfloat16 weights upcast to float32.  Recompute it with

```bash
python weights/demo/evaluate.py weights/demo
```
"""


def card_samples(r: dict) -> str:
    samples = "\n\n".join(f"```python\n{s['text']}\n```" for s in r["greedy_samples"])
    return f"""
## Samples (greedy, 48 new tokens)

{samples}
"""


def card_reproduce(r: dict) -> str:
    return f"""
## Reproduce

```bash
{r['reproduce']}
```

(the run recorded here: `{r['command']}`.)  Fixed seeds make the data order and
initialisation identical; GPU kernels are not bitwise deterministic, and another Python
version has a slightly different standard library, so expect losses within a few
hundredths.
"""


def card_license(r: dict) -> str:
    return """
## License

The training data is the Python standard library, (c) Python Software Foundation, under
the PSF License Agreement (PSF-2.0); this model is a derivative of it and is provided for
demonstration and testing only, without any warranty.
"""


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CorpusError as e:     # a bad --stdlib: the message, no traceback
        sys.exit(f"error: {e}")
