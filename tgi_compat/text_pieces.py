"""A long prompt tokenized in pieces, in parallel, with exactly the ids of one encode.

One text is one encode on one thread. ``encode_batch_fast`` runs a batch's texts side by side in Rust,
so a long text cut into pieces is encoded on every core at once. One H200 host (16 cores), a random
Llama-3.1-8B's tokenizer, the server's validation time of one prompt in the same run, whole -> in pieces:
32,000 tokens 54-73 -> 11-14 ms, 100,000 tokens 166-213 -> 26-34 ms (its TTFT 7.72-7.76 -> 7.38-7.40 s
through HTTP, with ``engine.worker.forward_batch.OutputRows``).

The cut must not change a single id. It is exact where the tokenizer's pre-tokenizer splits the text
with a regex whose matches never cross a space between two ASCII letters ("a b": the letters' match
ends before the space; the space starts the next match, `` ?\\p{L}+``), so the model (BPE) sees the
same words whole or cut there. ``PieceCutter.for_tokenizer`` accepts only tokenizers built that way:

- no normalizer, or NFC (a space is a normalization boundary: nothing composes across it);
- the pre-tokenizer is GPT-2's ByteLevel regex (``use_regex``), or a ``Split`` by one of
  ``SPLIT_PATTERNS`` (Llama-3's, Qwen2's) followed by ByteLevel without its regex; no prefix space;
- no added token holds a space or strips the spaces next to it (an added token is matched first);
- the post-processor adds fixed ids around the text (``TemplateProcessing``'s ``<s> $A``, or nothing),
  found by encoding a probe with and without them.

Other tokenizers (SentencePiece's Metaspace, whose whole text is one word) encode every text whole.
"""
from __future__ import annotations

import json
import re

# A text of at least twice this many characters is cut into pieces of about this many (each piece is
# one task of the batch call's thread pool; ~4 characters a token)
PIECE_CHARS = 16_384
# How far past a piece's nominal end the cut may move to find a space between two ASCII letters
CUT_SEARCH_CHARS = 4_096
_CUT = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PATTERNS = (LLAMA3_SPLIT, QWEN2_SPLIT)
_PROBE = "a b"


class PieceCutter:
    """Where a tokenizer's long texts may be cut, and the ids its post-processor puts around a text."""

    def __init__(self, before: list[int], after: list[int], piece_chars: int = PIECE_CHARS):
        self.before, self.after, self.piece_chars = before, after, piece_chars

    @classmethod
    def for_tokenizer(cls, backend, piece_chars: int = PIECE_CHARS) -> "PieceCutter | None":
        """The cutter for a ``tokenizers.Tokenizer``, or None where a cut could change its ids (the
        module's docstring)."""
        spec = json.loads(backend.to_str())
        if not (_normalizer_keeps_spaces(spec.get("normalizer")) and _splits_at_spaces(spec.get("pre_tokenizer"))
                and all(_added_token_is_whole(t) for t in spec.get("added_tokens") or ())):
            return None
        around = _special_ids_around(backend)
        return None if around is None else cls(*around, piece_chars=piece_chars)

    def cut(self, text: str) -> list[str]:
        """``text`` in pieces of about ``piece_chars`` characters, each cut at a space between two ASCII
        letters (the text itself when it is short or has no such space near a piece's end)."""
        if len(text) < 2 * self.piece_chars:
            return [text]
        pieces, start = [], 0
        while len(text) - start >= 2 * self.piece_chars:
            target = start + self.piece_chars
            found = _CUT.search(text, target, target + CUT_SEARCH_CHARS)
            if found is None:
                break
            pieces.append(text[start:found.start()])
            start = found.start()
        pieces.append(text[start:])
        return pieces

    def join(self, pieces_ids: list[list[int]], special: bool) -> list[int]:
        """One text's ids from its pieces' (encoded without special tokens)."""
        ids = list(self.before) if special else []
        for piece in pieces_ids:
            ids.extend(piece)
        if special:
            ids.extend(self.after)
        return ids


def encode_ids(backend, cutter: PieceCutter | None, texts: list[str], special: bool) -> list[list[int]]:
    """Each text's ids from one ``encode_batch_fast`` call, long texts cut by ``cutter`` (None: whole)."""
    pieces = [cutter.cut(text) if cutter is not None else [text] for text in texts]
    if all(len(p) == 1 for p in pieces):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=special)]
    encodings = iter(backend.encode_batch_fast([piece for p in pieces for piece in p], add_special_tokens=False))
    return [cutter.join([next(encodings).ids for _ in p], special) for p in pieces]


def _normalizer_keeps_spaces(spec: dict | None) -> bool:
    return spec is None or spec.get("type") == "NFC"


def _splits_at_spaces(spec: dict | None) -> bool:
    """GPT-2's ByteLevel regex, or a known Split regex then ByteLevel without its regex; no prefix space."""
    if spec is None:
        return False
    if spec.get("type") == "ByteLevel":
        return spec.get("use_regex", True) and not spec.get("add_prefix_space", False)
    steps = spec.get("pretokenizers") if spec.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return False
    split, byte_level = steps
    return (split.get("type") == "Split" and (split.get("pattern") or {}).get("Regex") in SPLIT_PATTERNS
            and split.get("behavior") == "Isolated" and not split.get("invert", False)
            and byte_level.get("type") == "ByteLevel" and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space", False))


def _added_token_is_whole(spec: dict) -> bool:
    """An added token that no cut at a space can split, and that takes no space beside it."""
    return (" " not in spec.get("content", "") and not spec.get("lstrip") and not spec.get("rstrip")
            and not spec.get("single_word"))


def _special_ids_around(backend) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor adds before and after a text, or None if it does more than that."""
    bare = backend.encode(_PROBE, add_special_tokens=False).ids
    full = backend.encode(_PROBE, add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    return None
