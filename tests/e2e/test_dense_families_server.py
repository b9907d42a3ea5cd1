"""Phi-3 and StarCoder2 through the launched server: greedy tokens equal transformers' (float32).

Phi-3 runs on two shards (gloo), so its fused qkv_proj / gate_up_proj are sliced per part
through the real launcher; StarCoder2 on one.
"""
import pytest
import requests
import torch
import transformers

from tests.e2e.server import LaunchedServer, free_port
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
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
            body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
            details = requests.post(srv.url + "/generate", json=body, timeout=60).json()["details"]
            got = [t["id"] for t in details["tokens"]]
            assert got == expected.tolist()[: len(got)], (family, prompt)
            assert len(got) == NEW_TOKENS or details["finish_reason"] == "eos_token"
    finally:
        assert srv.stop() == 0, srv.output()
