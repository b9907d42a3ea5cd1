"""--speculate through the HTTP API: the demo model served with speculation answers /generate with
the tokens, logprobs and details of the server without it, and /metrics counts the drafts; a Medusa
--model-id serves its base model with the heads drafting."""
from __future__ import annotations

import inspect
import re
import textwrap

import requests
from transformers import AutoTokenizer

from tests.e2e.conftest import make_settings, serve
from tests.e2e.demo_server import DEMO, DEMO_MODEL_ID, demo_tokenizer, serve_demo
from tests.e2e.server import assert_server_greedy_equals, running
from tests.tiny_models import load_hf, save_medusa_heads, save_tiny_server_model


def _speculating_app():
    from engine.client import InProcessBackend
    from engine.generation import Engine, EngineConfig
    from tgi_compat import create_app

    engine = Engine(EngineConfig(model_dir=str(DEMO), device="cpu", kernel_backend="torch", num_slots=8192,
                                 max_requests=8, speculate=4))
    settings = make_settings(model_id=DEMO_MODEL_ID, max_input_tokens=1024, max_total_tokens=2048)
    return create_app(settings, demo_tokenizer(), InProcessBackend(engine))


def _generate(url: str, prompt: str, **parameters) -> dict:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 40, "details": True, **parameters}}
    response = requests.post(url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


LOGPROB_TOL = 1e-4      # verify rows' float32 sums run in another order than a decode row's


def _logprobs_apart(answer: dict) -> tuple[dict, list[float]]:
    """The answer with every token's and top token's logprob set to 0, and those logprobs in order (compared
    within ``LOGPROB_TOL``: rounded values compared for equality fail where one sits at a rounding boundary)."""
    tokens = answer["details"]["tokens"] + [t for tops in answer["details"].get("top_tokens") or [] for t in tops]
    logprobs = [token["logprob"] for token in tokens]
    for token in tokens:
        token["logprob"] = 0.0
    return answer, logprobs


def _same_answers(answers: list[tuple[dict, list[float]]], expected: list[tuple[dict, list[float]]]) -> bool:
    return [a for a, _ in answers] == [e for e, _ in expected] and all(
        len(a) == len(e) and all(abs(x - y) <= LOGPROB_TOL for x, y in zip(a, e))
        for (_, a), (_, e) in zip(answers, expected))


def _speculation_counters(url: str) -> tuple[float, ...]:
    """The server's drafted and accepted tokens so far, and `tgi_request_skipped_tokens`' sum and count (/metrics)."""
    metrics = requests.get(url + "/metrics", timeout=10).text
    names = ("tgi_speculation_drafted_tokens", "tgi_speculation_accepted_tokens",
             "tgi_request_skipped_tokens_sum", "tgi_request_skipped_tokens_count")
    return tuple(float(re.search(rf"^{name} (\S+)$", metrics, re.M).group(1)) for name in names)


def test_speculating_server_answers_like_the_plain_one_and_counts_drafts():
    source = inspect.getsource(textwrap.indent)
    prompt = f"{source}\n\n# The same function, renamed to add_prefix:\ndef add_prefix(text, prefix, predicate=None):\n"
    with serve_demo() as plain_url:
        text = _generate(plain_url, prompt)["generated_text"]
        cases = [dict(), dict(stop=[text[20:24]], top_n_tokens=2), dict(max_new_tokens=3),
                 dict(do_sample=True, seed=7, temperature=0.8, top_k=20),      # a stop inside the text
                 dict(top_n_tokens=5)]                                         # the whole copy: drafts accepted
        expected = [_logprobs_apart(_generate(plain_url, prompt, **case)) for case in cases]
    with serve(_speculating_app()) as url:
        answers = [_logprobs_apart(_generate(url, prompt, **case)) for case in cases[:-1]]
        before = _speculation_counters(url)
        answers.append(_logprobs_apart(_generate(url, prompt, **cases[-1])))
        copy_drafted, copy_accepted, copy_skipped, copy_generations = (
            after - was for after, was in zip(_speculation_counters(url), before))
        assert _same_answers(answers, expected)
        assert answers[1][0]["details"]["finish_reason"] == "stop_sequence"
        assert answers[2][0]["details"]["generated_tokens"] == 3
        metrics = requests.get(url + "/metrics", timeout=10).text
    # top_n_tokens under --speculate: the top tokens of every token, accepted drafts included
    details = answers[-1][0]["details"]
    assert copy_accepted > 0 and copy_drafted > 0
    # TGI's tgi_request_skipped_tokens: one observation per generation (a step's tokens of the request), of the
    # accepted drafts it appended besides the step's own token
    assert copy_skipped == copy_accepted and copy_generations + copy_skipped == 40
    assert len(details["top_tokens"]) == len(details["tokens"]) == details["generated_tokens"] == 40
    assert all(len(tops) == 5 and tops[0]["id"] == token["id"] for tops, token in zip(details["top_tokens"],
                                                                                      details["tokens"]))
    drafted = float(re.search(r"^tgi_speculation_drafted_tokens (\S+)$", metrics, re.M).group(1))
    accepted = float(re.search(r"^tgi_speculation_accepted_tokens (\S+)$", metrics, re.M).group(1))
    assert drafted >= accepted > 0
    assert "# TYPE tgi_request_skipped_tokens histogram" in metrics     # TGI's name (tgi_compat.metrics)
    assert "tgi_request_speculated_tokens" not in metrics


def test_a_medusa_model_id_serves_its_base_model_with_the_heads_drafting(tmp_path):
    """TGI's Medusa command line: --model-id names the heads, the launcher serves the base model their
    config names, with --speculate at the heads' count. Greedy answers equal transformers' on the base
    model, and the heads (fitted to one prompt's continuation) get drafts accepted."""
    base = save_tiny_server_model("llama", tmp_path / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    prompt = "hello world, hello there! def main(): return 0"
    heads = save_medusa_heads(tmp_path / "heads", base, num_heads=3, fit_prompts=(tokenizer(prompt)["input_ids"],),
                              new_tokens=16)
    with running(heads) as server:
        assert_server_greedy_equals(server.url, tokenizer, load_hf(base), [prompt, "the lazy dog"], 16, "medusa")
        drafted, accepted, skipped, _ = _speculation_counters(server.url)
        log = server.output()
    assert drafted >= accepted == skipped > 0
    assert "3 Medusa heads" in log
