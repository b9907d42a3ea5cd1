"""The `text-generation` 0.7.0 Python client parses every response and raises its
error classes (it talks to the `POST /` compat route)."""
from __future__ import annotations

import asyncio
import threading

import pytest
import requests
from text_generation import AsyncClient, Client
from text_generation.errors import OverloadedError, ValidationError
from text_generation.types import FinishReason

from .conftest import spanning_stop


def test_generate_with_every_detail(server_url):
    response = Client(server_url, timeout=60).generate(
        "hello world", max_new_tokens=5, decoder_input_details=True, top_n_tokens=2)
    details = response.details
    assert details.generated_tokens == len(details.tokens) == len(details.top_tokens)
    assert details.prefill[0].logprob is None and details.prefill[0].text == "<s>"
    assert all(len(top) == 2 for top in details.top_tokens)
    assert details.finish_reason in (FinishReason.Length, FinishReason.EndOfSequenceToken)
    assert details.seed is None and details.best_of_sequences is None


def test_best_of_and_seed(server_url):
    client = Client(server_url, timeout=60)
    best = client.generate("hello", max_new_tokens=4, best_of=2, do_sample=True)
    assert len(best.details.best_of_sequences) == 1 and best.details.seed is not None
    seeded = [client.generate("hello", max_new_tokens=4, do_sample=True, seed=7) for _ in range(2)]
    assert seeded[0] == seeded[1] and seeded[0].details.seed == 7


def test_stop_sequence_finish_reason(server_url):
    client = Client(server_url, timeout=60)
    full = client.generate("hello world", max_new_tokens=16)
    stop, count = spanning_stop([t.text for t in full.details.tokens])
    stopped = client.generate("hello world", max_new_tokens=16, stop_sequences=[stop])
    assert stopped.details.finish_reason == FinishReason.StopSequence
    assert stopped.details.generated_tokens == count


def test_generate_stream(server_url):
    client = Client(server_url, timeout=60)
    events = list(client.generate_stream("hello world", max_new_tokens=5, top_n_tokens=1))
    assert [e.generated_text for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1].details.generated_tokens == len(events)
    plain = client.generate("hello world", max_new_tokens=5)
    assert events[-1].generated_text == plain.generated_text
    assert [e.token for e in events] == plain.details.tokens


@pytest.mark.parametrize("stream", [False, True])
def test_validation_errors_raise_validation_error(server_url, stream):
    client = Client(server_url, timeout=60)
    with pytest.raises(ValidationError, match=r"`top_n_tokens` must be >= 0 and <= 5. Given: 9"):
        if stream:
            list(client.generate_stream("hello", top_n_tokens=9))
        else:
            client.generate("hello", top_n_tokens=9)


def test_overloaded_raises_overloaded_error(gated_app):
    with gated_app(max_concurrent_requests=1) as (url, gated):
        holder = threading.Thread(target=lambda: requests.post(url + "/generate", json={"inputs": "a"}, timeout=60))
        holder.start()
        gated.wait_for_waiting(1)
        client = Client(url, timeout=30)
        with pytest.raises(OverloadedError, match="Model is overloaded"):
            client.generate("hello", max_new_tokens=2)
        with pytest.raises(OverloadedError):
            list(client.generate_stream("hello", max_new_tokens=2))
        gated.gate.set()
        holder.join(30)


def test_async_client(server_url):
    async def main():
        client = AsyncClient(server_url, timeout=60)
        response = await client.generate("hello", max_new_tokens=4, decoder_input_details=True, top_n_tokens=2)
        events = [e async for e in client.generate_stream("hello", max_new_tokens=4)]
        with pytest.raises(ValidationError):
            await client.generate("hello", max_new_tokens=4, top_n_tokens=9)
        with pytest.raises(ValidationError):
            _ = [e async for e in client.generate_stream("hello", top_n_tokens=9)]
        return response, events
    response, events = asyncio.run(main())
    assert response.details.generated_tokens == len(events) <= 4
    assert events[-1].generated_text == response.generated_text
    # The same tokens; logprobs to float32 rounding: the stream's prompt comes from the prefix
    # cache (the first request, with decoder_input_details, prefilled it whole).
    assert [e.token.id for e in events] == [t.id for t in response.details.tokens]
    assert [e.token.logprob for e in events] == pytest.approx([t.logprob for t in response.details.tokens], abs=1e-5)


def test_huggingface_hub_inference_client(server_url):
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import ValidationError as HubValidationError

    client = InferenceClient(base_url=server_url, timeout=60)
    output = client.text_generation("hello", max_new_tokens=4, details=True, decoder_input_details=True,
                                    top_n_tokens=2, return_full_text=False)
    assert output.details.generated_tokens == len(output.details.tokens) <= 4
    assert output.details.prefill[0].logprob is None
    pieces = list(client.text_generation("hello", max_new_tokens=4, stream=True, details=True))
    assert pieces[-1].details.generated_tokens == len(pieces)
    with pytest.raises(HubValidationError, match="`top_n_tokens` must be >= 0 and <= 5"):
        list(client.text_generation("hello", top_n_tokens=9, stream=True))
