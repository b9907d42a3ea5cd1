"""Phi-3, StarCoder2 and Bloom through the launched server: greedy tokens equal transformers' (float32).

Phi-3 runs on two shards (gloo), so its fused qkv_proj / gate_up_proj are sliced per part
through the real launcher; StarCoder2 on one. Bloom on two shards (interleaved query_key_value
by whole heads, each shard's ALiBi slopes) and on one, with four ragged streamed prompts of which
two join while the first two decode: tokens and logprobs as transformers' for 32 tokens.
"""
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
import transformers

from tests.e2e.server import LaunchedServer, assert_server_greedy_equals, free_port
from tests.tiny_models import load_hf, save_tiny_server_model

PROMPTS = ["hello world", "def main(): return 0"]
NEW_TOKENS = 12
SHARD_ARGS = {"phi3": ["--num-shard", "2", "--master-port"], "starcoder2": []}


@pytest.mark.parametrize("family", ["phi3", "starcoder2"])
def test_server_answers_with_transformers_greedy_tokens(family, tmp_path):
    path = save_tiny_server_model(family, tmp_path / family)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    hf = load_hf(path)
    args = SHARD_ARGS[family] + ([str(free_port())] if SHARD_ARGS[family] else [])
    srv = LaunchedServer(path, *args, "--dtype", "float32", "--max-total-tokens", "128",
                         "--max-input-tokens", "64")
    try:
        srv.wait_healthy()
        assert_server_greedy_equals(srv.url, tokenizer, hf, PROMPTS, NEW_TOKENS, family)
    finally:
        assert srv.stop() == 0, srv.output()


BLOOM_PROMPTS = ["hello", "the quick brown fox jumps over the lazy dog. hello world, hello there!",
                 "def main(): return 0", "generation inference server tokens stream of text: 0123456789 " * 2]
BLOOM_TOKENS = 32
LOGPROB_TOL = 1e-3


def stream(url: str, prompt: str, started: threading.Event | None = None) -> list[tuple[int, float]]:
    """(id, logprob) of each streamed token; ``started`` is set once 3 tokens have arrived."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": BLOOM_TOKENS}}
    tokens = []
    with requests.post(url + "/generate_stream", json=body, stream=True, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith(b"data:"):
                token = json.loads(line[5:])["token"]
                tokens.append((token["id"], token["logprob"]))
                if started is not None and len(tokens) == 3:
                    started.set()
    return tokens


def transformers_greedy(hf, ids: list[int]) -> tuple[list[int], list[float]]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=BLOOM_TOKENS, do_sample=False, output_logits=True,
                      return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]


@pytest.mark.parametrize("shards", [2, 1])
def test_bloom_server_streams_transformers_tokens_to_requests_that_join_mid_way(shards, tmp_path):
    path = save_tiny_server_model("bloom", tmp_path / "bloom")
    tokenizer, hf = transformers.AutoTokenizer.from_pretrained(path), load_hf(path)
    ids = [tokenizer(p)["input_ids"] for p in BLOOM_PROMPTS]
    assert len({len(i) for i in ids}) == 4                                   # ragged
    shard_args = ["--num-shard", "2", "--master-port", str(free_port())] if shards == 2 else []
    srv = LaunchedServer(path, *shard_args, "--dtype", "float32", "--max-total-tokens", "128",
                         "--max-input-tokens", "64")
    try:
        srv.wait_healthy()
        started = threading.Event()
        with ThreadPoolExecutor(4) as pool:
            first = [pool.submit(stream, srv.url, BLOOM_PROMPTS[0], started),
                     pool.submit(stream, srv.url, BLOOM_PROMPTS[1])]
            assert started.wait(60), srv.output()
            late = [pool.submit(stream, srv.url, p) for p in BLOOM_PROMPTS[2:]]
            results = [f.result() for f in first + late]
        for prompt_ids, got in zip(ids, results):
            tokens, logprobs = transformers_greedy(hf, prompt_ids)
            got_ids = [t for t, _ in got]
            assert got_ids == tokens[: len(got_ids)] and (len(got_ids) == BLOOM_TOKENS or got_ids[-1] == 2)
            for (_, logprob), ref in zip(got, logprobs):
                assert logprob == pytest.approx(ref, abs=LOGPROB_TOL)
    finally:
        assert srv.stop() == 0, srv.output()
