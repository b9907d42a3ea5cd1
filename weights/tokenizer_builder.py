"""A synthetic byte-level BPE tokenizer for random checkpoints.

It has exactly ``config["vocab_size"]`` ids, with the special tokens where the real
model family keeps them:

| family (how it is recognised)          | special ids                                             | BOS added |
| -------------------------------------- | ------------------------------------------------------- | --------- |
| sentencepiece style (``bos_token_id`` < 256: Llama-2, Mistral) | ``<unk>``=0, ``<s>``=bos, ``</s>``=eos | yes |
| Llama-3 (``bos_token_id`` >= 256, not qwen2) | ``<|begin_of_text|>``=bos ... up to vocab_size - 1 (3.1 names when ``rope_scaling`` is llama3) | yes |
| Qwen (``model_type`` qwen2, qwen2_moe, qwen3, qwen3_moe) | ``<|endoftext|>``=eos, ``<|im_start|>``, ``<|im_end|>``, then ``<|reserved_N|>`` to vocab_size - 1 | no |

The other ids are regular tokens: the 256 byte-level symbols, then merges generated in
a fixed order (common English / Python pieces, then letter strings breadth first), so
the same config always gives the same tokenizer, in seconds even for 152064 ids.
"""
from __future__ import annotations

import itertools
import json
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# Pieces that real tokenizers learn early; each is added with all its prefixes.
_SEED_PIECES = (
    " the", " of", " and", " to", " in", " is", " that", " for", " it", " with", " as", " was", " on",
    " be", " at", " by", " this", " have", " from", " or", " an", " are", " not", " but", " you",
    " we", " they", " he", " she", " his", " her", " which", " one", " all", " were", " there",
    " their", " what", " so", " if", " about", " who", " would", " when", " will", " can", " more",
    " The", " In", " It", " This", " A", " I", " We", " He", " She", " They",
    "ing", "ed", "er", "es", "en", "tion", "ation", "ment", "ly", "al", "re", "th", "on", "an", "or",
    " def", " return", " self", " import", " from", " class", " None", " True", " False", " if",
    " else", " elif", " for", " while", " in", " print", " lambda", " yield", " with", " as",
    "self", "def", "import", "return", "__init__", "__", "()", "):", "(self", "self.", " =", " ==",
    " +", " -", " *", " /", " #", "  ", "    ", "        ", "\n", "\n\n", "\n    ", "\n        ",
    ", ", ". ", ".\n", ":\n", "0", "00", "000", "10", "20", "19", "20", " 1", " 2",
)
_START_CHARS = " " + string.ascii_lowercase + string.ascii_uppercase
_EXTEND_CHARS = string.ascii_lowercase


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table, the alphabet of the ByteLevel pre-tokenizer."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_SYMBOLS = bytes_to_unicode()


def _symbols(text: str) -> str:
    return "".join(_BYTE_SYMBOLS[b] for b in text.encode("utf-8"))


def _candidate_pieces():
    """Merged tokens in priority order, each one extending an earlier token by one symbol."""
    for piece in _SEED_PIECES:
        symbols = _symbols(piece)
        for end in range(2, len(symbols) + 1):
            yield symbols[:end]
    level = [_symbols(c) for c in _START_CHARS]
    while True:  # breadth first: every string of length n before any of length n + 1
        level = [prefix + c for prefix in level for c in _EXTEND_CHARS]
        yield from level


def _regular_vocab(count: int) -> tuple[list[str], list[tuple[str, str]]]:
    """``count`` regular tokens (256 byte symbols + merges) and the merges that make them."""
    if count < 256:
        raise ValueError(f"a byte-level tokenizer needs at least 256 regular ids, got {count}; "
                         f"use a vocab_size of at least 256 + the number of special tokens")
    tokens = [_BYTE_SYMBOLS[b] for b in range(256)]
    known = set(tokens)
    merges = []
    for piece in _candidate_pieces():
        if len(tokens) == count:
            break
        if piece in known:
            continue
        left, right = piece[:-1], piece[-1]
        if left not in known:  # cannot happen for prefix-closed candidates; kept as a guard
            continue
        tokens.append(piece)
        known.add(piece)
        merges.append((left, right))
    return tokens, merges


def _ids(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [int(value)]


def special_tokens_for(config: dict) -> dict:
    """The family's special tokens: ``{"specials": {id: text}, "bos", "eos", "unk", "add_bos", "style"}``."""
    vocab_size = int(config["vocab_size"])
    bos_ids, eos_ids = _ids(config.get("bos_token_id")), _ids(config.get("eos_token_id"))
    if str(config.get("model_type", "")).startswith("qwen"):  # qwen2, qwen2_moe, qwen3, qwen3_moe
        base = min(bos_ids + eos_ids)                         # Qwen3's eos is <|im_end|> = base + 2
        specials = {base: "<|endoftext|>", base + 1: "<|im_start|>", base + 2: "<|im_end|>"}
        specials.update({i: f"<|reserved_{i - base - 3}|>" for i in range(base + 3, vocab_size)})
        return dict(style="qwen2", specials=specials, bos=None, eos=specials[(eos_ids or [base])[0]], unk=None,
                    add_bos=False)
    bos = bos_ids[0] if bos_ids else 1
    if bos < 256:
        specials = {0: "<unk>", bos: "<s>"}
        for eos_id in eos_ids or [2]:
            specials.setdefault(eos_id, "</s>")
        return dict(style="sentencepiece", specials=specials, bos="<s>", eos=specials[(eos_ids or [2])[0]],
                    unk="<unk>", add_bos=True)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":  # Llama-3.1 names
        named = ["<|begin_of_text|>", "<|end_of_text|>", None, None, "<|finetune_right_pad_id|>", None,
                 "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    else:
        named = ["<|begin_of_text|>", "<|end_of_text|>", None, None, None, None,
                 "<|start_header_id|>", "<|end_header_id|>", None, "<|eot_id|>"]
    specials, reserved = {}, itertools.count()
    for i in range(bos, vocab_size):
        offset = i - bos
        text = named[offset] if offset < len(named) else None
        specials[i] = text or f"<|reserved_special_token_{next(reserved)}|>"
    eos = specials.get((eos_ids or [bos + 1])[0], "<|end_of_text|>")
    return dict(style="llama3", specials=specials, bos="<|begin_of_text|>", eos=eos, unk=None, add_bos=True)


_CHAT_TEMPLATES = {
    "sentencepiece": (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ '<<SYS>>\\n' + m['content'] + '\\n<</SYS>>\\n\\n' }}"
        "{% elif m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"),
    "llama3": (
        "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] "
        "+ '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    "qwen2": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
}


def build_tokenizer(config: dict) -> tuple[Tokenizer, dict]:
    """A ``tokenizers.Tokenizer`` with exactly ``config["vocab_size"]`` ids, and its special-token info."""
    vocab_size = int(config["vocab_size"])
    info = special_tokens_for(config)
    specials = info["specials"]
    bad = sorted(i for i in specials if not 0 <= i < vocab_size)
    if bad:
        raise ValueError(f"special token ids {bad} fall outside vocab_size {vocab_size}; "
                         f"expected bos/eos ids below vocab_size in the config")
    regular_ids = [i for i in range(vocab_size) if i not in specials]
    tokens, merges = _regular_vocab(len(regular_ids))
    vocab = dict(zip(tokens, regular_ids))
    vocab.update({text: i for i, text in specials.items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    byte_level = processors.ByteLevel(trim_offsets=False)
    if info["add_bos"]:
        bos, bos_id = info["bos"], vocab[info["bos"]]
        template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                                 special_tokens=[(bos, bos_id)])
        tokenizer.post_processor = processors.Sequence([byte_level, template])
    else:
        tokenizer.post_processor = byte_level
    tokenizer.add_special_tokens([AddedToken(specials[i], special=True, normalized=False)
                                  for i in sorted(specials)])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size, "vocab size mismatch"
    return tokenizer, info


def write_tokenizer(out_dir: str | Path, config: dict) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for ``config``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, info = build_tokenizer(config)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special_map = {key + "_token": info[key] for key in ("bos", "eos", "unk") if info[key]}
    if info["style"] == "qwen2":
        special_map["pad_token"] = info["eos"]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": info["add_bos"],
        "add_eos_token": False,
        "bos_token": info["bos"],
        "eos_token": info["eos"],
        **({"unk_token": info["unk"]} if info["unk"] else {}),
        **({"pad_token": special_map["pad_token"]} if "pad_token" in special_map else {}),
        "model_max_length": int(config.get("max_position_embeddings", 2048)),
        "clean_up_tokenization_spaces": False,
        "chat_template": _CHAT_TEMPLATES[info["style"]],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n")
    return out_dir
