r"""A long prompt tokenized in pieces, in parallel, with exactly the ids of one encode.

One text is one encode on one thread. ``encode_batch_fast`` runs a batch's texts side by side in Rust,
so a long text cut into pieces is encoded on every core at once. One H200 host (16 cores), a random
Llama-3.1-8B's tokenizer, the server's validation time of one prompt in the same run, whole -> in pieces:
32,000 tokens 54-73 -> 11-14 ms, 100,000 tokens 166-213 -> 26-34 ms (its TTFT 7.72-7.76 -> 7.38-7.40 s
through HTTP, with ``engine.worker.forward_batch.OutputRows``). A SentencePiece-style BPE (Llama-2's
normalizers, the whole text one word) is slower whole and gains more, on the same host's 16 cores: 16,000
tokens 31-40 -> 10-16 ms, 50,000 tokens 157-191 -> 13-17 ms (five runs each, through this encoder).

The cut must not change a single id. Every cut falls at a space between two ASCII letters ("a b"), and
``PieceCutter.for_tokenizer`` accepts only the two kinds of tokenizer for which such a cut is exact:

- byte-level BPE (GPT-2, Llama-3, Qwen2): the pre-tokenizer is GPT-2's ByteLevel regex (``use_regex``) or a
  ``Split`` by one of ``SPLIT_PATTERNS`` followed by ByteLevel without its regex, no prefix space; no
  normalizer, or NFC (a space is a normalization boundary). No regex match crosses such a space (the
  letters' match ends before it, the space starts the next one, `` ?\p{L}+``), so the model sees the same
  words whole or cut. A piece keeps its leading space.
- SentencePiece-style BPE (Llama-2, Mistral, Gemma): spaces become "▁" (``Metaspace``, or the normalizers
  ``Replace(" ", "▁")`` with or without ``Prepend("▁")``) and the text is one word, so the cut is exact when
  no merge joins a symbol ending in another character to one starting with "▁" (checked over the merges):
  the merges on either side of the cut never meet. Where the tokenizer puts "▁" before a text it encodes
  (``Prepend``, or Metaspace's prepend scheme), a piece after the first is encoded without its leading
  space, which that "▁" stands for.

For both: no added token holds a space or strips the spaces next to it (an added token is matched first),
and the post-processor adds fixed ids around the text (``TemplateProcessing``'s ``<s> $A``, or nothing),
found by encoding a probe with and without them. Other tokenizers (WordPiece, Unigram, other regexes)
encode every text whole.
"""
from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict

# A text of at least twice this many characters is cut into pieces of about this many (each piece is
# one task of the batch call's thread pool; ~4 characters a token). Small enough that prompts which share
# a system prompt or a conversation share their first pieces (``PieceCache``): 16,384 before, and on a
# 2-core CPU a 32,000-token text encoded in 28-31 ms in pieces of either size.
PIECE_CHARS = 2_048
# Characters of the pieces a ``PieceCache`` keeps (with their ids, about 2 bytes a character: some 16 MB). A bound
# on characters, not pieces: a text with no place to cut ends in one piece as long as the rest of it.
CACHED_CHARS = 8_000_000
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
    """Where a tokenizer's long texts may be cut, the ids its post-processor puts around a text, and whether a
    piece after the first is encoded without its leading space (``drop_space``: the tokenizer's own "▁")."""

    def __init__(self, before: list[int], after: list[int], piece_chars: int = PIECE_CHARS, drop_space: bool = False):
        self.before, self.after, self.piece_chars, self.drop_space = before, after, piece_chars, drop_space

    @classmethod
    def for_tokenizer(cls, backend, piece_chars: int = PIECE_CHARS) -> "PieceCutter | None":
        """The cutter for a ``tokenizers.Tokenizer``, or None where a cut could change its ids (the
        module's docstring)."""
        spec = json.loads(backend.to_str())
        form = _byte_level_form(spec) or _sentencepiece_form(spec)
        if form is None or not all(_added_token_is_whole(t) for t in spec.get("added_tokens") or ()):
            return None
        around = _special_ids_around(backend)
        return None if around is None else cls(*around, piece_chars=piece_chars, drop_space=form == DROP_SPACE)

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

    def encoded(self, pieces: list[str]) -> list[str]:
        """The texts to encode for ``cut``'s pieces (without special tokens)."""
        if not self.drop_space:
            return pieces
        return pieces[:1] + [piece[1:] for piece in pieces[1:]]

    def join(self, pieces_ids: list[list[int]], special: bool) -> list[int]:
        """One text's ids from its pieces' (encoded without special tokens)."""
        ids = list(self.before) if special else []
        for piece in pieces_ids:
            ids.extend(piece)
        if special:
            ids.extend(self.after)
        return ids


class PieceCache:
    """The ids of recently encoded pieces, by the text encoded: without special tokens a piece's ids depend on its
    text alone, and cut where ``PieceCutter.cut`` cuts (the first cut searched from ``piece_chars`` on, each next
    one from the last), texts that begin alike are cut alike up to where they differ. A burst of prompts behind
    one system prompt encodes its pieces once. Pieces of at most ``max_chars`` characters in all, the least recently
    used dropped first; the validation threads share it. ``observer`` (the front end's /metrics,
    ``tgi_compat.metrics.PieceCacheMetrics``) hears of each lookup, ``looked_up(hits, misses)``, and of the characters
    held after each put, ``holds(chars)``, under the cache's lock (so the last number it hears is the latest)."""

    def __init__(self, max_chars: int = CACHED_CHARS):
        self.max_chars = max_chars
        self.observer = None
        self.hits = self.misses = 0
        self._ids: OrderedDict[str, array] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def take(self, texts: list[str]) -> dict[str, array]:
        """The cached ids of those of ``texts`` (distinct) that are cached, each marked recently used."""
        found = {}
        with self._lock:
            for text in texts:
                ids = self._ids.get(text)
                if ids is not None:
                    self._ids.move_to_end(text)
                    found[text] = ids
            self.hits += len(found)
            self.misses += len(texts) - len(found)
            if self.observer is not None:
                self.observer.looked_up(len(found), len(texts) - len(found))
        return found

    def put(self, encoded: dict[str, array]) -> None:
        with self._lock:
            for text, ids in encoded.items():
                if len(text) > self.max_chars:
                    continue            # not kept: it would push out every other piece, then itself
                if text in self._ids:
                    self._ids.move_to_end(text)
                else:
                    self._chars += len(text)
                self._ids[text] = ids
            while self._chars > self.max_chars:
                self._chars -= len(self._ids.popitem(last=False)[0])
            if self.observer is not None:
                self.observer.holds(self._chars)


def encode_ids(backend, cutter: PieceCutter | None, texts: list[str], special: bool,
               cache: PieceCache | None = None) -> list[list[int]]:
    """Each text's ids from one ``encode_batch_fast`` call, long texts cut by ``cutter`` (None: whole) and each
    distinct piece encoded once, none that ``cache`` holds (the pieces encoded go into it)."""
    pieces = [cutter.encoded(cutter.cut(text)) if cutter is not None else [text] for text in texts]
    if all(len(p) == 1 for p in pieces):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=special)]
    distinct = list(dict.fromkeys(piece for p in pieces for piece in p))
    known = cache.take(distinct) if cache is not None else {}
    missing = [piece for piece in distinct if piece not in known]
    if missing:
        encodings = backend.encode_batch_fast(missing, add_special_tokens=False)
        fresh = {piece: array("i", e.ids) for piece, e in zip(missing, encodings)}
        if cache is not None:
            cache.put(fresh)
        known.update(fresh)
    return [cutter.join([known[piece] for piece in p], special) for p in pieces]


KEEP_SPACE, DROP_SPACE = "keep", "drop"
META = "\u2581"      # SentencePiece's "▁"


def _byte_level_form(spec: dict) -> str | None:
    """KEEP_SPACE for a byte-level BPE whose regex never crosses a space between letters (no normalizer or
    NFC; GPT-2's ByteLevel regex, or a known Split regex then ByteLevel without its regex; no prefix space)."""
    normalizer, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    if not (normalizer is None or normalizer.get("type") == "NFC") or pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        return KEEP_SPACE if pre.get("use_regex", True) and not pre.get("add_prefix_space", False) else None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    known = (split.get("type") == "Split" and (split.get("pattern") or {}).get("Regex") in SPLIT_PATTERNS
             and split.get("behavior") == "Isolated" and not split.get("invert", False)
             and byte_level.get("type") == "ByteLevel" and not byte_level.get("use_regex", True)
             and not byte_level.get("add_prefix_space", False))
    return KEEP_SPACE if known else None


def _sentencepiece_form(spec: dict) -> str | None:
    """For a SentencePiece-style BPE (spaces become META, by Metaspace or by the normalizers) whose merges never
    join across a META: DROP_SPACE where the tokenizer puts META before each text it encodes, else KEEP_SPACE."""
    model = spec.get("model") or {}
    if (model.get("type") != "BPE" or model.get("dropout") or META not in (model.get("vocab") or {})
            or not _merges_stop_at_meta(model.get("merges") or ())):      # (an unknown META could fuse with a letter)
        return None
    normalizer, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    steps = normalizer.get("normalizers") if normalizer is not None and normalizer.get("type") == "Sequence" else [
        normalizer] if normalizer is not None else []
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": META}
    if pre is None and steps == [{"type": "Prepend", "prepend": META}, replace]:
        return DROP_SPACE
    if pre is None and steps == [replace]:
        return KEEP_SPACE
    if not steps and pre is not None and pre.get("type") == "Metaspace" and pre.get("replacement") == META:
        scheme = pre.get("prepend_scheme") or ("always" if pre.get("add_prefix_space", True) else "never")
        return {"always": DROP_SPACE, "first": DROP_SPACE, "never": KEEP_SPACE}.get(scheme)
    return None


def _merges_stop_at_meta(merges) -> bool:
    """No merge joins a symbol ending in another character to one starting with META (merges are pairs, or
    "a b" strings in older files)."""
    for merge in merges:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        if right.startswith(META) and not left.endswith(META):
            return False
    return True


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
