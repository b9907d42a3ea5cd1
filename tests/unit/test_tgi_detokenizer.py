"""Incremental detokenization: multi-byte characters split across byte-level tokens,
special tokens, and the context that keeps SentencePiece's word-initial spaces."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.tiny_models import save_tiny_tokenizer
from tgi_compat.detokenizer import IncrementalDetokenizer, decode_continuation
from tgi_compat.tokenization import TokenizerAdapter

EOS_ID = 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = save_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    adapter = TokenizerAdapter(AutoTokenizer.from_pretrained(path), workers=1)
    yield adapter
    adapter.close()


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_sync(text).ids[1:]      # without the <s> the tokenizer adds


def stream(tokenizer, prompt: str, ids: list[int]) -> tuple[list[str], IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode_sync(prompt).ids)
    return [detokenizer.push(i) for i in ids], detokenizer


@pytest.mark.parametrize("text", ["café au lait", "smile 🙂 ok", "日本語のテキスト", "mixed é🙂日 end", "🙂🙂"])
def test_multibyte_characters_split_across_tokens_come_out_whole(tokenizer, text):
    ids = ids_of(tokenizer, text)
    assert len(ids) > len(text.split()), "the characters must really be split into byte tokens"
    pieces, detokenizer = stream(tokenizer, "hello", ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces                               # some bytes were held back until the character completed
    assert detokenizer.generated_text() == text


def test_a_character_is_emitted_with_the_token_that_completes_it(tokenizer):
    ids = ids_of(tokenizer, "🙂")
    assert len(ids) == 4                              # four UTF-8 bytes, four tokens
    pieces, _ = stream(tokenizer, "hello", ids)
    assert pieces == ["", "", "", "🙂"]


def test_an_incomplete_character_at_the_end_is_held_back(tokenizer):
    pieces, detokenizer = stream(tokenizer, "hello", ids_of(tokenizer, "é")[:1])
    assert pieces == [""]
    assert detokenizer.generated_text() == "\ufffd"   # as TGI: the final decode shows the broken byte


def test_special_tokens_keep_their_text_per_token_but_not_in_generated_text(tokenizer):
    ids = ids_of(tokenizer, " world") + [EOS_ID]
    pieces, detokenizer = stream(tokenizer, "hello", ids)
    assert pieces[-1] == "</s>"
    assert tokenizer.is_special(EOS_ID) and not tokenizer.is_special(ids[0])
    assert detokenizer.generated_text() == " world"


def test_leading_space_after_the_prompt_is_kept(tokenizer):
    pieces, detokenizer = stream(tokenizer, "hello", ids_of(tokenizer, " world"))
    assert "".join(pieces) == " world" and detokenizer.generated_text() == " world"


def test_sentencepiece_style_tokenizer_keeps_word_initial_spaces():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁again": 3}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    assert sp.decode([2]) == "world"                  # decoded alone the space is lost

    class Adapter:
        def decode(self, ids, skip_special_tokens):
            return sp.decode(ids, skip_special_tokens=skip_special_tokens)

    detokenizer = IncrementalDetokenizer(Adapter(), [1])
    assert [detokenizer.push(2), detokenizer.push(3)] == [" world", " again"]
    assert detokenizer.generated_text() == " world again"
    assert decode_continuation(Adapter(), [1], [2]) == " world"


def test_tokenize_offsets_are_utf8_byte_offsets(tokenizer):
    text = "é hello"
    encoding = tokenizer.encode_sync(text)
    raw = text.encode()
    assert encoding.offsets[0] == (0, 0)              # <s>
    hello = [raw[a:b].decode() for a, b in encoding.offsets[1:]][-1]
    assert hello.strip() in ("hello", "llo", "o")      # some piece of the last word, found by byte offsets
    assert encoding.offsets[-1][1] == len(raw)
