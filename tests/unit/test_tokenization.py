"""The front end's encoder: concurrent texts go through encode_batch on the worker threads and come
back exactly as one encode each gives them (ids, and byte offsets computed when asked); a text
that fails fails alone."""
import asyncio

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
    async def all_at_once():
        return await asyncio.gather(*(adapter.encode(t, add_special_tokens=i % 3 != 0) for i, t in enumerate(TEXTS)))

    results = asyncio.run(all_at_once())
    for i, (text, got) in enumerate(zip(TEXTS, results)):
        expected = adapter.encode_sync(text, i % 3 != 0)
        assert got.ids == expected.ids and got.offsets == expected.offsets, text


def test_a_text_that_cannot_be_encoded_fails_alone(adapter):
    async def mixed():
        return await asyncio.gather(adapter.encode("fine"), adapter.encode(None), adapter.encode("also fine"),
                                    return_exceptions=True)

    fine, failed, also = asyncio.run(mixed())
    assert isinstance(failed, Exception)
    assert fine.ids == adapter.encode_sync("fine").ids and also.ids == adapter.encode_sync("also fine").ids
