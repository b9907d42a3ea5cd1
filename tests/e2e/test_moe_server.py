"""`launcher.py` serving each MoE family and Qwen3 (tiny checkpoints, CPU): greedy tokens over
HTTP equal transformers'."""
import pytest
import requests
import torch
import transformers

from tests.e2e.server import LaunchedServer
from tests.tiny_models import load_hf, save_tiny_server_model

PROMPT = "the quick brown fox jumps"
NEW_TOKENS = 8


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3", "qwen3_moe"])
def test_server_greedy_tokens_equal_transformers(family, tmp_path):
    path = save_tiny_server_model(family, tmp_path / family)
    ids = transformers.AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]
    out = load_hf(path).generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = out[0, len(ids):].tolist()
    srv = LaunchedServer(path, "--max-total-tokens", "256", "--max-input-tokens", "128")
    try:
        srv.wait_healthy()
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
        details = requests.post(srv.url + "/generate", json=body, timeout=60).json()["details"]
        got = [t["id"] for t in details["tokens"]]
        assert got == expected[: len(got)] and (len(got) == NEW_TOKENS or details["finish_reason"] == "eos_token")
    finally:
        assert srv.stop() == 0, srv.output()
