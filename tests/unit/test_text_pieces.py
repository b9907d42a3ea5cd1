"""A long text encoded in pieces gives exactly one encode's ids, for every tokenizer form the cutter accepts
(byte level: GPT-2's ByteLevel regex, Llama-3's and Qwen2's Split + ByteLevel, with and without NFC;
SentencePiece style: Metaspace or the Prepend/Replace normalizers over merges that stop at "▁"), and
tokenizers whose ids a cut could change are left whole."""
import asyncio
import random
from array import array

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tgi_compat.text_pieces import LLAMA3_SPLIT, QWEN2_SPLIT, PieceCache, PieceCutter, encode_ids
from tgi_compat.tokenization import TokenizerAdapter
from weights.tokenizer_builder import build_tokenizer

CONFIG = {"vocab_size": 2048, "bos_token_id": 1, "eos_token_id": 2}
# What the regexes treat differently: runs of spaces, newlines, digits, contractions, punctuation, non-ASCII
# letters, tabs, and the special tokens' text inside a prompt
FRAGMENTS = ["the", "cat", "It's", "we'll", "x", "Zebra", "éclair", "naïve", "日本", "123", "4567", "3.14", "!",
             "?!", "(a)", "def", "f():", "—", "\U0001F600", "<s>", "</s>", "  ", "   ", "\n", "\n\n", " \n", "\t",
             "\r\n", "a", "b"]


def random_text(rng: random.Random, words: int) -> str:
    parts = []
    for _ in range(words):
        parts.append(rng.choice(FRAGMENTS))
        parts.append(rng.choice([" ", " ", " ", "", "  ", "\n"]))
    return "".join(parts)


def byte_level_bpe(pre_tokenizer, normalizer=None, added: tuple[AddedToken, ...] = ()) -> Tokenizer:
    """The synthetic checkpoints' vocabulary and merges behind another pre-tokenizer (and normalizer)."""
    base, _ = build_tokenizer(CONFIG)
    model = base.model
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<s>", special=True, normalized=False), *added])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer


def sentencepiece_bpe(normalizer=None, pre_tokenizer=None, per_word: bool = True) -> Tokenizer:
    """A BPE over "▁"-joined words trained on the fragments (per word: its merges never cross a "▁"; else on
    whole texts, where they do), then given ``normalizer`` and ``pre_tokenizer``; ``<s>`` before each text."""
    rng = random.Random(1)
    corpus = [random_text(rng, 40) for _ in range(300)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    if per_word:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    else:
        tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>"],
                                                              initial_alphabet=["\u2581"], show_progress=False))
    tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, pre_tokenizer
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer


LEGACY = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])


def metaspace(scheme: str, split: bool):
    return pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=split)


def split_then_bytes(pattern: str):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


ACCEPTED = {
    "gpt2 byte level (synthetic checkpoint)": lambda: build_tokenizer(CONFIG)[0],
    "llama-3 split": lambda: byte_level_bpe(split_then_bytes(LLAMA3_SPLIT)),
    "qwen2 split + NFC": lambda: byte_level_bpe(split_then_bytes(QWEN2_SPLIT), normalizers.NFC()),
    "no special tokens around": lambda: build_tokenizer({**CONFIG, "model_type": "qwen2", "bos_token_id": 2000,
                                                         "eos_token_id": 2001})[0],
    "sentencepiece legacy prepend + replace (Llama-2)": lambda: sentencepiece_bpe(normalizer=LEGACY),
    "sentencepiece metaspace, first, one word (Mistral)": lambda: sentencepiece_bpe(
        pre_tokenizer=metaspace("first", False)),
    "sentencepiece metaspace, always, split": lambda: sentencepiece_bpe(pre_tokenizer=metaspace("always", True)),
    "sentencepiece metaspace, never": lambda: sentencepiece_bpe(pre_tokenizer=metaspace("never", False)),
    "sentencepiece replace only (Gemma)": lambda: sentencepiece_bpe(normalizer=normalizers.Replace(" ", "\u2581")),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
@pytest.mark.parametrize("special", [True, False])
def test_pieces_give_one_encodes_ids(name, special):
    """Texts cut every ~40 characters (hundreds of cuts each) and encoded in one batch call, beside short
    texts left whole: the same ids as one encode of each text."""
    tokenizer = ACCEPTED[name]()
    cutter = PieceCutter.for_tokenizer(tokenizer, piece_chars=40)
    assert cutter is not None
    rng = random.Random(7)
    texts = [random_text(rng, words) for words in (2000, 5, 3000, 1)]
    assert max(len(cutter.cut(t)) for t in texts) > 100
    got = encode_ids(tokenizer, cutter, texts, special)
    assert got == [tokenizer.encode(t, add_special_tokens=special).ids for t in texts]


class CountingBackend:
    """A tokenizer whose batch calls are recorded: the texts each call encoded."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def encode_batch_fast(self, texts, add_special_tokens):
        self.calls.append(list(texts))
        return self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("name", ["llama-3 split", "sentencepiece legacy prepend + replace (Llama-2)"])
def test_prompts_behind_one_prefix_encode_its_pieces_once(name):
    """A burst behind one long prefix: in one batch each distinct piece is encoded once, and a later batch behind
    the same prefix encodes only the pieces it does not share (its cuts fall where the first batch's did); every
    text still gets one encode's ids, also where the texts part inside a piece or right after a cut."""
    tokenizer = ACCEPTED[name]()
    cutter = PieceCutter.for_tokenizer(tokenizer, piece_chars=40)
    backend, cache = CountingBackend(tokenizer), PieceCache()
    rng = random.Random(11)
    prefix = random_text(rng, 400)
    shared = cutter.encoded(cutter.cut(prefix))[:-2]       # the prefix's pieces that no suffix can change
    assert len(shared) > 10
    first = [prefix + random_text(rng, 30) for _ in range(6)]
    assert encode_ids(backend, cutter, first, True, cache) == [tokenizer.encode(t).ids for t in first]
    encoded = backend.calls[0]
    assert len(encoded) == len(set(encoded)) < sum(len(cutter.cut(t)) for t in first) - 5 * len(shared)
    assert set(shared) <= set(encoded)
    at_a_cut = "".join(cutter.cut(prefix)[:10])
    later = [prefix + random_text(rng, 30) for _ in range(3)] + [at_a_cut + " zebra cat", at_a_cut]
    assert encode_ids(backend, cutter, later, False, cache) == [
        tokenizer.encode(t, add_special_tokens=False).ids for t in later]
    assert not set(shared) & set(backend.calls[1]) and cache.hits >= len(shared)


def test_the_piece_cache_drops_the_least_recently_used_pieces_past_its_characters():
    """Bounded by characters, not pieces: one long piece (a text with no place to cut) pushes out as many short ones
    as it needs, and one longer than the whole bound is not kept (nor does it push the others out); a piece put
    again counts as recently used."""
    cache = PieceCache(max_chars=4)
    cache.put({"a": array("i", [1]), "bb": array("i", [2])})
    assert list(cache.take(["a", "x"])) == ["a"] and (cache.hits, cache.misses) == (1, 1)
    cache.put({"cc": array("i", [3])})      # "bb" was used least recently
    assert list(cache.take(["a", "bb", "cc"])) == ["a", "cc"] and len(cache) == 2
    cache.put({"dddd": array("i", [4])})
    assert list(cache.take(["a", "cc", "dddd"])) == ["dddd"]
    cache.put({"eeeee": array("i", [5])})
    assert list(cache.take(["dddd", "eeeee"])) == ["dddd"] and len(cache) == 1
    cache = PieceCache(max_chars=4)
    cache.put({"a": array("i", [1]), "bb": array("i", [2])})
    cache.put({"a": array("i", [1])})         # encoded again (two threads missed it at once): now the newest
    cache.put({"cc": array("i", [3])})
    assert list(cache.take(["a", "bb", "cc"])) == ["a", "cc"]


def test_the_front_end_keeps_the_pieces_it_encoded():
    """The validation threads share one cache per tokenizer: a second prompt behind the same long prefix hits it."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=ACCEPTED["llama-3 split"](), bos_token="<s>")
    adapter = TokenizerAdapter(fast, workers=2)
    try:
        prefix = random_text(random.Random(5), 3 * adapter.cutter.piece_chars)
        for suffix in (" alpha beta", " gamma delta"):
            assert asyncio.run(adapter.encode(prefix + suffix)).ids == adapter.encode_sync(prefix + suffix).ids
        assert adapter.piece_cache.hits > 0 and len(adapter.piece_cache) > 2
    finally:
        adapter.close()


def test_a_sentencepiece_piece_keeping_its_space_would_change_the_ids():
    """Where the tokenizer puts "▁" before each text it encodes, a later piece must drop its leading space:
    kept, the ids differ (so the test above would catch a cutter that forgot it)."""
    tokenizer = ACCEPTED["sentencepiece legacy prepend + replace (Llama-2)"]()
    cutter = PieceCutter.for_tokenizer(tokenizer, piece_chars=40)
    assert cutter.drop_space
    text = random_text(random.Random(7), 2000)
    kept = [i for e in tokenizer.encode_batch_fast(cutter.cut(text), add_special_tokens=False) for i in e.ids]
    assert kept != tokenizer.encode(text, add_special_tokens=False).ids
    assert encode_ids(tokenizer, cutter, [text], False)[0] == tokenizer.encode(text, add_special_tokens=False).ids


def test_a_cut_anywhere_else_would_change_the_ids():
    """The cut rule is what makes it exact: cutting the same texts at every ~40th character instead changes
    the ids (so the test above would catch a looser rule)."""
    tokenizer = ACCEPTED["llama-3 split"]()
    text = random_text(random.Random(7), 2000)
    pieces = [text[i:i + 41] for i in range(0, len(text), 41)]
    loose = [i for e in tokenizer.encode_batch_fast(pieces, add_special_tokens=False) for i in e.ids]
    assert loose != tokenizer.encode(text, add_special_tokens=False).ids


def test_cuts_fall_at_a_space_between_two_ascii_letters():
    cutter = PieceCutter([1], [], piece_chars=10)
    text = "alpha beta gamma delta 12 34 éa bé epsilon zeta eta theta iota kappa"
    pieces = cutter.cut(text)
    assert "".join(pieces) == text and len(pieces) > 2
    for before, after in zip(pieces, pieces[1:]):
        assert before[-1].isascii() and before[-1].isalpha() and after[0] == " " and after[1].isalpha()
    assert cutter.cut("short text") == ["short text"]
    assert cutter.cut("1 2 3 4 " * 20) == ["1 2 3 4 " * 20]       # no place to cut: whole


def test_join_puts_the_special_ids_around_the_pieces():
    cutter = PieceCutter([7, 8], [9])
    assert cutter.join([[1, 2], [3]], special=True) == [7, 8, 1, 2, 3, 9]
    assert cutter.join([[1, 2], [3]], special=False) == [1, 2, 3]


REFUSED = {
    "metaspace over a vocabulary without its \u2581": lambda: byte_level_bpe(pre_tokenizers.Metaspace()),
    "sentencepiece merges across a \u2581": lambda: sentencepiece_bpe(normalizer=LEGACY, per_word=False),
    "byte level with a prefix space": lambda: byte_level_bpe(pre_tokenizers.ByteLevel(add_prefix_space=True)),
    "byte level without its regex alone": lambda: byte_level_bpe(pre_tokenizers.ByteLevel(use_regex=False)),
    "an unknown split regex": lambda: byte_level_bpe(split_then_bytes(r"\w+|\s+")),
    "a lowercasing normalizer": lambda: byte_level_bpe(split_then_bytes(LLAMA3_SPLIT), normalizers.Lowercase()),
    "an added token that strips spaces": lambda: byte_level_bpe(
        split_then_bytes(LLAMA3_SPLIT), added=(AddedToken("<mask>", lstrip=True, special=True),)),
    "an added token with a space": lambda: byte_level_bpe(
        split_then_bytes(LLAMA3_SPLIT), added=(AddedToken("a b", special=True),)),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_tokenizers_a_cut_could_change_are_left_whole(name):
    assert PieceCutter.for_tokenizer(REFUSED[name]()) is None


def test_the_front_end_encodes_a_long_prompt_in_pieces(monkeypatch):
    """A prompt of more than twice PIECE_CHARS goes to the batch call as pieces and comes back as one
    encode's ids; /tokenize (offsets) still encodes it whole."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=ACCEPTED["llama-3 split"](), bos_token="<s>")
    adapter = TokenizerAdapter(fast, workers=1)
    try:
        assert adapter.cutter is not None
        backend = adapter.tokenizer.backend_tokenizer
        text = random_text(random.Random(3), adapter.cutter.piece_chars)
        assert len(text) > 2 * adapter.cutter.piece_chars
        batches = []
        for name in ("encode_batch_fast", "encode_batch"):
            real = getattr(backend, name)
            monkeypatch.setattr(backend, name, lambda texts, *a, real=real, **k: batches.append(len(texts))
                                or real(texts, *a, **k), raising=False)
        got = asyncio.run(adapter.encode(text))
        assert batches[-1] > 1 and got.ids == adapter.encode_sync(text).ids
        with_offsets = asyncio.run(adapter.encode(text, offsets=True))
        assert with_offsets.ids == got.ids and with_offsets.offsets == adapter.encode_sync(text).offsets
    finally:
        adapter.close()
