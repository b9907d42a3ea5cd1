"""Incremental detokenization of one request (TGI/vLLM prefix-offset/read-offset method).

Each new token's text is ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``:
decoding a small window with a little context keeps word-initial spaces right
(SentencePiece) and is O(window) per token. While the window's text ends in U+FFFD
(a UTF-8 character split across byte-level tokens) nothing is emitted and the offsets
stay put; the next token that completes the character emits it whole.
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5          # prompt tokens kept as decoding context (TGI: len(input) - 5)


class IncrementalDetokenizer:
    """Token texts with special tokens kept (``Token.text``); the concatenation of all
    emitted texts is the decoded output except a trailing incomplete character."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self._tokenizer = tokenizer
        self._context = list(prompt_ids[-CONTEXT_TOKENS:])
        self._ids = list(self._context)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    @property
    def generated_ids(self) -> list[int]:
        return self._ids[len(self._context):]

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while held back)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=False)
        new_text = decode(self._ids[self._prefix_offset:], skip_special_tokens=False)
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text[len(prefix_text):]
        return ""

    def generated_text(self) -> str:
        """All generated tokens decoded without special tokens (TGI's `generated_text`)."""
        return decode_continuation(self._tokenizer, self._context[-1:], self.generated_ids)


def decode_continuation(tokenizer, context: list[int], ids: list[int]) -> str:
    """Text of ``ids`` as it reads after ``context`` (keeps a leading space SentencePiece drops)."""
    prefix = tokenizer.decode(context, skip_special_tokens=True)
    full = tokenizer.decode(context + ids, skip_special_tokens=True)
    if full.startswith(prefix) and not prefix.endswith(REPLACEMENT_CHAR):
        return full[len(prefix):]
    return tokenizer.decode(ids, skip_special_tokens=True)
