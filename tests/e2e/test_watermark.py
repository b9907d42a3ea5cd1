"""`watermark: true` through the real launcher: --watermark-gamma / --watermark-delta reach the
shard that samples, and the detector finds the mark in what the HTTP API returns."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import requests

from engine.sampling.watermark import detect
from tests.grammar_cases import SCHEMAS, check_output

from .server import LaunchedServer

DEMO = Path(__file__).resolve().parents[2] / "weights" / "demo"
GAMMA, DELTA = 0.25, 4.0
PROMPTS = ["def ", "import os\n", "class Parser:\n    def __init__(self", "for i in range("]


@pytest.fixture(scope="module")
def server():
    srv = LaunchedServer(DEMO, "--max-total-tokens", "512", "--watermark-gamma", str(GAMMA),
                         "--watermark-delta", str(DELTA))
    try:
        yield srv.wait_healthy()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO)


def pooled_z(server, tokenizer, watermark: bool) -> tuple[float, float]:
    """(z-score, green fraction) over the sampled generations of every prompt, for the server's gamma."""
    green = scored = 0
    for seed, prompt in enumerate(PROMPTS):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 120, "do_sample": True, "seed": seed,
                                                 "details": True, "watermark": watermark}}
        response = requests.post(server.url + "/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        ids = [t["id"] for t in response.json()["details"]["tokens"]]
        score = detect(ids, len(tokenizer), GAMMA, context_token=tokenizer(prompt)["input_ids"][-1])
        green, scored = green + score.green, scored + score.scored
    return (green - GAMMA * scored) / math.sqrt(scored * GAMMA * (1 - GAMMA)), green / scored


def test_watermarked_generations_are_detected_and_plain_ones_are_not(server, tokenizer):
    (marked, fraction), (plain, _) = pooled_z(server, tokenizer, True), pooled_z(server, tokenizer, False)
    print(f"launched server, gamma {GAMMA} delta {DELTA}: z watermarked {marked:.2f} (green {fraction:.2f}), "
          f"plain {plain:.2f}")
    assert marked > 4 and plain < 2
    # The gamma-0.25 lists lie inside the default gamma-0.5 ones, half of whose tokens they hold: over 0.5
    # green is out of reach unless the server used --watermark-gamma 0.25.
    assert fraction > 0.6


def test_a_grammar_and_a_watermark_together_through_the_shard_processes(server):
    _, prompt, schema = SCHEMAS[13]
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 96, "do_sample": True, "seed": 1, "watermark": True,
                                             "details": True, "grammar": {"type": "json", "value": schema}}}
    response = requests.post(server.url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["details"]["finish_reason"] == "eos_token"
    check_output("json", schema, response.json()["generated_text"])
    bad = {"inputs": prompt, "parameters": {"grammar": {"type": "regex", "value": "(a"}}}
    assert requests.post(server.url + "/generate", json=bad, timeout=30).status_code == 422
    assert requests.get(server.url + "/health", timeout=5).status_code == 200
