"""The front end's encoder: concurrent texts go through encode_batch (with offsets) or
encode_batch_fast (ids only) on the worker threads and come back exactly as one encode each gives
them (ids, and byte offsets computed when asked, also after truncation); a text that fails fails
alone."""
import asyncio
from concurrent.futures import Future

import pytest
from transformers import AutoTokenizer

from tgi_compat.tokenization import TokenizerAdapter
from tests.tiny_models import save_tiny_tokenizer


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    adapter = TokenizerAdapter(tokenizer, workers=2)
    yield adapter
    adapter.close()


TEXTS = ["hello world", "é ü — snow ☃ and \U0001F600", "", "x" * 500, "def f(a, b):\n    return a + b"] * 20


def test_concurrent_encodes_equal_one_encode_each(adapter):
    """Every kind mixed in one burst: special tokens added or not, offsets or not."""
    def kind(i):
        return {"add_special_tokens": i % 3 != 0, "offsets": i % 2 == 0}

    async def all_at_once():
        return await asyncio.gather(*(adapter.encode(t, **kind(i)) for i, t in enumerate(TEXTS)))

    results = asyncio.run(all_at_once())
    for i, (text, got) in enumerate(zip(TEXTS, results)):
        expected = adapter.encode_sync(text, kind(i)["add_special_tokens"])
        assert got.ids == expected.ids, text
        if kind(i)["offsets"]:
            assert got.offsets == expected.offsets, text
        else:
            with pytest.raises(ValueError, match="offsets=True"):
                got.offsets


def test_one_text_alone_equals_encode(adapter):
    """A text that waits alone (no batch to join) gives the same ids, with or without offsets."""
    for offsets in (False, True):
        got = asyncio.run(adapter.encode(TEXTS[1], offsets=offsets))
        expected = adapter.encode_sync(TEXTS[1])
        assert got.ids == expected.ids
        if offsets:
            assert got.offsets == expected.offsets


@pytest.mark.parametrize("count", [1, 3, 7])
def test_truncated_offsets_are_the_last_tokens_offsets(adapter, count):
    """keep_last before the offsets are computed gives the offsets of the tokens kept."""
    full = adapter.encode_sync(TEXTS[1])
    kept = asyncio.run(adapter.encode(TEXTS[1], offsets=True)).keep_last(count)
    assert kept.ids == full.ids[-count:] and kept.offsets == full.offsets[-count:]
    twice = adapter.encode_sync(TEXTS[1]).keep_last(count + 1).keep_last(count)
    assert twice.ids == full.ids[-count:] and twice.offsets == full.offsets[-count:]


def test_a_text_that_cannot_be_encoded_fails_alone(adapter):
    async def mixed():
        return await asyncio.gather(adapter.encode("fine"), adapter.encode(None), adapter.encode("also fine"),
                                    return_exceptions=True)

    fine, failed, also = asyncio.run(mixed())
    assert isinstance(failed, Exception)
    assert fine.ids == adapter.encode_sync("fine").ids and also.ids == adapter.encode_sync("also fine").ids


def spy_on_batches(adapter, monkeypatch) -> list[list[str]]:
    """The texts of every batch call the backend gets from now on."""
    batched = []
    backend = adapter._backend
    for name in ("encode_batch", "encode_batch_fast"):
        real = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda texts, *a, real=real, **k: batched.append(list(texts))
                            or real(texts, *a, **k), raising=False)
    return batched


@pytest.mark.parametrize("offsets", [False, True])
def test_a_text_sent_several_times_in_one_batch_is_encoded_once(adapter, offsets, monkeypatch):
    """A chat stream's n choices send one prompt n times at once: the batch encodes each distinct text once and
    every request gets its own copy of the encoding (its own ids list), equal to one encode."""
    batched = spy_on_batches(adapter, monkeypatch)
    group = [(TEXTS[1], Future()), ("other", Future()), (TEXTS[1], Future()), (TEXTS[1], Future())]
    adapter._encoder._encode(group, True, offsets)
    assert batched == [[TEXTS[1], "other"]]
    got = [future.result() for _, future in group]
    expected = adapter.encode_sync(TEXTS[1])
    for encoding in (got[0], got[2], got[3]):
        assert encoding.ids == expected.ids
        if offsets:
            assert encoding.offsets == expected.offsets
    assert got[1].ids == adapter.encode_sync("other").ids
    assert len({id(got[0].ids), id(got[2].ids), id(got[3].ids)}) == 3


def test_one_text_sent_several_times_with_offsets_is_one_batch_call(adapter, monkeypatch):
    """Only a text alone in its batch goes to the tokenizer's single encode for its offsets; the same text sent
    three times (one distinct text) is still one batch call, not three encodes."""
    batched = spy_on_batches(adapter, monkeypatch)
    group = [(TEXTS[1], Future()) for _ in range(3)]
    adapter._encoder._encode(group, True, True)
    assert batched == [[TEXTS[1]]]
    expected = adapter.encode_sync(TEXTS[1])
    assert all(f.result().offsets == expected.offsets for _, f in group)
