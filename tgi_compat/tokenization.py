"""The tokenizer as the front end uses it: encode off the event loop, decode, special ids.

Wraps a Hugging Face fast tokenizer (``transformers.AutoTokenizer.from_pretrained``)
and calls its Rust backend directly: ``encode`` never changes the tokenizer's
truncation/padding state, so it is safe from several worker threads at once.

Encoding runs on ``--validation-workers`` threads. Each takes every text waiting (up to
``MAX_BATCH``) into one batch call, which runs in Rust in parallel and without the GIL;
one ``encode`` per text holds the GIL, so a burst of long prompts (256 requests of 3,000
tokens) would take turns with the event loop. A prompt needs only its ids: those go
through ``encode_batch_fast``, which skips the character offsets (half the work of a
long prompt); /tokenize asks for offsets and gets ``encode_batch``. A long prompt is cut into
pieces that the batch call encodes side by side, where the tokenizer allows it exactly
(``tgi_compat.text_pieces``), and the pieces it encoded lately are not encoded again
(``PieceCache``: prompts behind one system prompt, a conversation's earlier turns).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future

from .text_pieces import PieceCache, PieceCutter, encode_ids

log = logging.getLogger(__name__)

MAX_BATCH = 16     # texts per batch call: every text of a batch waits for its slowest (fewer wait longer)
# A text this long is encoded without the GIL even alone with offsets (/tokenize of a long text:
# 1.9 MB take seconds, which the event loop should not wait for).
LONG_TEXT = 10_000


class Encoding:
    """A text's token ids, and each token's byte offsets into its UTF-8 form (computed on first
    use: only /tokenize needs them, and for a long prompt they cost more than the encoding).
    An encoding made without offsets (``raw`` None: ``encode(..., offsets=False)``) has none."""

    def __init__(self, ids: list[int], offsets: list[tuple[int, int]] | None = None, text: str = "",
                 raw=None, first: int = 0):
        self.ids = ids
        self._offsets = offsets
        # the input, the tokenizers.Encoding and the index in it of ids[0], until offsets are asked
        self._text, self._raw, self._first = text, raw, first

    @property
    def offsets(self) -> list[tuple[int, int]]:
        if self._offsets is None:
            if self._raw is None:
                raise ValueError("this encoding was made without offsets: encode it with offsets=True")
            self._offsets = _byte_offsets(self._text, self._raw.offsets[self._first:])
            self._text, self._raw = "", None
        return self._offsets

    def copy(self) -> "Encoding":
        """The same encoding with lists of its own (requests that sent the same text each get one)."""
        return Encoding(list(self.ids), None if self._offsets is None else list(self._offsets), text=self._text,
                        raw=self._raw, first=self._first)

    def keep_last(self, count: int | None) -> "Encoding":
        """TGI's `truncate`: keep the last ``count`` tokens (their offsets stay uncomputed)."""
        if count is None or count >= len(self.ids):
            return self
        if self._offsets is not None:
            return Encoding(self.ids[-count:], self._offsets[-count:])
        return Encoding(self.ids[-count:], text=self._text, raw=self._raw,
                        first=self._first + len(self.ids) - count)


class TokenizerAdapter:
    def __init__(self, tokenizer, workers: int):
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if self._backend is None:
            raise TypeError(f"a fast (Rust) tokenizer is required, got {type(tokenizer).__name__}")
        self.special_ids = frozenset(int(i) for i in tokenizer.all_special_ids)
        # The most characters one token stands for (its vocabulary string; a byte-level token's
        # string has one character per byte): a text needs at least len(text) / this many tokens.
        self.longest_token_chars = max((len(token) for token in tokenizer.get_vocab()), default=1) or 1
        # encode_batch pads and truncates if the tokenizer.json asks for it; encode alone does not
        batchable = self._backend.padding is None and self._backend.truncation is None
        self.cutter = PieceCutter.for_tokenizer(self._backend) if batchable else None   # None: texts whole
        self.piece_cache = PieceCache() if self.cutter is not None else None
        self._encoder = _BatchingEncoder(self, workers, batchable)

    def close(self) -> None:
        self._encoder.close()

    async def encode(self, text: str, add_special_tokens: bool = True, offsets: bool = False) -> Encoding:
        """Tokenize on the validation worker threads; ``add_special_tokens=False`` for text
        that already holds them (a rendered chat template); ``offsets``: the encoding can
        give each token's byte offsets (/tokenize), else it has the ids only."""
        return await asyncio.wrap_future(self.submit(text, add_special_tokens, offsets))

    def submit(self, text: str, add_special_tokens: bool = True, offsets: bool = False) -> Future:
        """``encode`` started now, awaited later (``asyncio.wrap_future``); cancel what is not needed."""
        return self._encoder.submit(text, add_special_tokens, offsets)

    def encode_sync(self, text: str, add_special_tokens: bool = True) -> Encoding:
        """On the calling thread, with offsets (tests, tools)."""
        encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        return Encoding(encoding.ids, text=text, raw=encoding)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """A token decoded alone, special tokens kept (top tokens, prefill tokens)."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids


class TemplatedTokenizer:
    """The same tokenizer for prompts rendered by a chat template: those already hold the
    special tokens, so ``encode`` adds none (TGI: `add_special_tokens: false` on chat)."""

    def __init__(self, adapter: TokenizerAdapter):
        self.adapter = adapter

    def __getattr__(self, name: str):
        return getattr(self.adapter, name)

    async def encode(self, text: str, offsets: bool = False) -> Encoding:
        return await self.adapter.encode(text, add_special_tokens=False, offsets=offsets)

    def submit(self, text: str, offsets: bool = False) -> Future:
        return self.adapter.submit(text, add_special_tokens=False, offsets=offsets)

    def encode_sync(self, text: str) -> Encoding:
        return self.adapter.encode_sync(text, add_special_tokens=False)


def _byte_offsets(text: str, char_offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character offsets (what `tokenizers` reports to Python) -> UTF-8 byte offsets."""
    if text.isascii():
        return [(int(a), int(b)) for a, b in char_offsets]
    byte_at = [0] * (len(text) + 1)
    for i, ch in enumerate(text):
        byte_at[i + 1] = byte_at[i] + len(ch.encode("utf-8"))
    return [(byte_at[a], byte_at[b]) for a, b in char_offsets]


class _BatchingEncoder:
    """``workers`` threads; each takes the texts waiting (up to MAX_BATCH) into one batch call per kind
    (special tokens added or not, offsets or not)."""

    def __init__(self, adapter: TokenizerAdapter, workers: int, batchable: bool):
        self._adapter, self._batchable = adapter, batchable
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"tgi-tokenizer-{i}", daemon=True)
                         for i in range(max(1, workers))]
        for thread in self._threads:
            thread.start()

    def submit(self, text: str, add_special_tokens: bool, offsets: bool) -> Future:
        future: Future = Future()
        self._pending.put((text, (add_special_tokens, offsets), future))
        return future

    def close(self) -> None:
        for _ in self._threads:
            self._pending.put(None)

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            for kind in dict.fromkeys(kind for _, kind, _ in batch):
                self._encode([(text, future) for text, k, future in batch if k == kind], *kind)

    def _take(self) -> list | None:
        """The next item and every one waiting behind it (None: closed)."""
        item = self._pending.get()
        if item is None:
            return None
        batch = [item]
        while len(batch) < MAX_BATCH:
            try:
                item = self._pending.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._pending.put(None)        # this thread's stop comes after the batch
                break
            batch.append(item)
        return [b for b in batch if b[2].set_running_or_notify_cancel()]      # drop cancelled requests

    def _encode(self, group: list[tuple[str, Future]], special: bool, offsets: bool) -> None:
        """One batch call without the GIL (even for one text, unless it is short and needs offsets), each distinct
        text encoded once (a chat stream's n choices send one prompt n times; a copy for each repeat);
        one by one where the tokenizer cannot batch or the batch failed."""
        texts = list(dict.fromkeys(text for text, _ in group))
        if self._batchable and (len(group) > 1 or not offsets or len(texts[0]) >= LONG_TEXT):
            try:
                encodings = dict(zip(texts, self._encode_batch(texts, special, offsets)))
            except Exception:  # noqa: BLE001  (one text's failure must not fail the others: one by one below)
                log.debug("batch encoding failed; encoding one by one", exc_info=True)
            else:
                delivered = set()
                for text, future in group:
                    future.set_result(encodings[text] if text not in delivered else encodings[text].copy())
                    delivered.add(text)
                return
        for text, future in group:
            try:
                future.set_result(self._adapter.encode_sync(text, special))
            except Exception as e:  # noqa: BLE001  (delivered to the request that sent the text)
                future.set_exception(e)

    def _encode_batch(self, texts: list[str], special: bool, offsets: bool) -> list[Encoding]:
        backend = self._adapter._backend
        if not offsets:
            return [Encoding(ids) for ids in encode_ids(backend, self._adapter.cutter, texts, special,
                                                        self._adapter.piece_cache)]
        encodings = backend.encode_batch(texts, add_special_tokens=special)
        return [Encoding(e.ids, text=text, raw=e) for text, e in zip(texts, encodings)]
