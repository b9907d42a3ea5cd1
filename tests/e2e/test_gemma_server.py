"""Gemma and Gemma 2 through the launched server: greedy tokens and logprobs equal transformers'."""
import pytest
import requests
import torch
import transformers

from tests.e2e.server import LaunchedServer
from tests.tiny_models import load_hf, save_tiny_server_model

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog. hello there", "0123"]
NEW_TOKENS = 16


@pytest.mark.parametrize("family", ["gemma", "gemma2"])
def test_server_answers_like_transformers(family, tmp_path):
    """gemma2's window (6) is shorter than the prompts plus generation, so the kernels' window matters."""
    path = save_tiny_server_model(family, tmp_path / family)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    hf = load_hf(path)
    srv = LaunchedServer(path, "--max-total-tokens", "256", "--max-input-tokens", "128")
    try:
        srv.wait_healthy()
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
            expected = out.sequences[0, ids.shape[1]:].tolist()
            body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True,
                                                     "decoder_input_details": False}}
            details = requests.post(srv.url + "/generate", json=body, timeout=60).json()["details"]
            got = [t["id"] for t in details["tokens"]]
            assert got == expected[: len(got)] and (len(got) == NEW_TOKENS or details["finish_reason"] == "eos_token")
            for token, logits in zip(details["tokens"], out.logits):
                assert token["logprob"] == pytest.approx(torch.log_softmax(logits[0], -1)[token["id"]].item(),
                                                         abs=1e-3)
    finally:
        assert srv.stop() == 0, srv.output()
