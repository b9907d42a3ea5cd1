"""Constrained decoding in the engine: masks, the sampler, and real models under 30 grammars."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.sampling.grammar import GrammarCompiler, apply_bitmask, close_objects, grammar_error, json_grammar_text, unpack_bitmask
from engine.protocol.codec import decode, encode
from engine.ops import KernelOps
from engine.sampling.sampler import RowSampling, Sampler
from engine.protocol.messages import SamplingParams
from engine.protocol.messages import Step, StepRow
from tests.grammar_cases import cases, check_output
from tests.tiny_models import save_tiny_server_model

DEMO = Path(__file__).resolve().parents[2] / "weights" / "demo"
DEMO_VOCAB, DEMO_EOS = 4096, 2
CASES = cases()
YES_NO = ("regex", "(yes|no)")


@pytest.fixture(scope="module")
def demo_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def demo_grammars():
    return GrammarCompiler(str(DEMO), DEMO_VOCAB, (DEMO_EOS,))


@pytest.fixture(scope="module")
def demo_engine():
    return Engine(EngineConfig(model_dir=str(DEMO), device="cpu", kernel_backend="torch", num_slots=16384,
                               max_requests=32, max_prefill_tokens=2048))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_server_model("llama", tmp_path_factory.mktemp("tiny-grammar"))


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir):
    return Engine(EngineConfig(model_dir=str(tiny_dir), device="cpu", kernel_backend="torch", num_slots=8192,
                               max_requests=32))


def grammar_params(kind: str, text: str, **params) -> SamplingParams:
    return SamplingParams(grammar_type=kind, grammar=text, **params)


# ---- masks ---------------------------------------------------------------------------

@pytest.mark.parametrize("vocab_size", [1, 31, 32, 77, 4096])
def test_unpack_bitmask_gives_each_bit(vocab_size):
    words = (vocab_size + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32)
    expected = [[bool((int(bitmask[r, v // 32]) >> (v % 32)) & 1) for v in range(vocab_size)] for r in range(3)]
    assert unpack_bitmask(bitmask, vocab_size).tolist() == expected


def test_apply_bitmask_sets_only_the_disallowed_tokens_of_the_masked_rows_to_minus_inf():
    scores = torch.randn(3, 40)
    before = scores.clone()
    bitmask = torch.tensor([[0b1010, 0]], dtype=torch.int32)       # tokens 1 and 3
    apply_bitmask(scores, [1], bitmask)
    assert torch.equal(scores[0], before[0]) and torch.equal(scores[2], before[2])
    assert scores[1, 1] == before[1, 1] and scores[1, 3] == before[1, 3]
    assert torch.isinf(scores[1]).sum() == 38


def test_close_objects_forbids_unlisted_keys_at_every_level_and_keeps_explicit_choices():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},   # a property named so
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "list": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}}},
        "$defs": {"d": {"type": "object", "properties": {"z": {}}}},
        "anyOf": [{"type": "object", "properties": {"w": {}}}]}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]["properties"]["x"]
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema                    # the input is left alone


def test_grammar_error_names_the_problem():
    assert grammar_error("regex", r"[a-z]{2}\d") is None
    assert grammar_error("json", json_grammar_text(CASES[0][4])) is None
    assert "unclosed group" in grammar_error("regex", "a(b")
    assert "strin" in grammar_error("json", json_grammar_text({"properties": {"a": {"type": "strin"}}}))
    assert "not valid JSON" in grammar_error("json", "{")


def test_matcher_allows_eos_once_the_grammar_accepts_and_only_eos_once_it_is_complete(demo_grammars,
                                                                                      demo_tokenizer):
    matcher = demo_grammars.matcher("regex", r"ab(cd)?")
    allowed = lambda: set(unpack_bitmask(demo_grammars.fill_bitmasks([matcher]), DEMO_VOCAB)[0]  # noqa: E731
                          .nonzero().flatten().tolist())
    assert DEMO_EOS not in allowed()
    for token in demo_tokenizer.encode("ab", add_special_tokens=False):
        matcher.advance(token)
    assert DEMO_EOS in allowed() and len(allowed()) > 1              # may end, or go on with "cd"
    for token in demo_tokenizer.encode("cd", add_special_tokens=False):
        matcher.advance(token)
    assert allowed() == {DEMO_EOS} and matcher.only_eos              # complete: nothing but the end


def test_ipc_carries_the_grammar_and_watermark_to_the_worker():
    params = grammar_params("json", json_grammar_text(CASES[1][4]), watermark=True, do_sample=True, seed=3)
    step = Step(rows=[StepRow(request_id=5, row=0, start_pos=0, input_ids=[1, 2], slots=[0, 1], sample=True,
                              params=params)])
    assert decode(encode(step)).rows[0].params == params


# ---- the sampler ---------------------------------------------------------------------

def test_sampler_masks_constrained_rows_and_reports_the_constrained_distribution(demo_grammars, demo_tokenizer):
    sampler = Sampler(KernelOps.create("torch"), torch.device("cpu"), demo_grammars)
    logits = torch.randn(2, DEMO_VOCAB)
    constrained = RowSampling(SamplingParams(top_n_tokens=8), seed=0, step=0, grammar=demo_grammars.matcher(*YES_NO))
    free = RowSampling(SamplingParams(top_n_tokens=5), seed=0, step=0)
    out = sampler(logits.clone(), [constrained, free])
    fresh = demo_grammars.fill_bitmasks([demo_grammars.matcher(*YES_NO)])
    allowed = set(unpack_bitmask(fresh, DEMO_VOCAB)[0].nonzero().flatten().tolist())
    assert 0 < len(allowed) < 8 and all("yes".startswith(demo_tokenizer.decode([t])) or
                                        "no".startswith(demo_tokenizer.decode([t])) for t in allowed)
    assert out.token_ids[0] == max(allowed, key=lambda t: logits[0, t])
    finite = [(t, lp) for t, lp in zip(out.top_ids[0], out.top_logprobs[0]) if lp > float("-inf")]
    assert {t for t, _ in finite} == allowed                       # fewer than 8 tokens are allowed at all
    assert abs(torch.tensor([lp for _, lp in finite]).logsumexp(0).item()) < 1e-4   # they hold all the mass
    assert out.token_ids[1] == logits[1].argmax().item()          # the other row is untouched
    assert out.top_ids[1] == logits[1].topk(5).indices.tolist()


# ---- real models ---------------------------------------------------------------------

def run_cases(engine, tokenizer, max_new_tokens: int, **params):
    requests = [GenerationRequest(i, tokenizer(prompt)["input_ids"], max_new_tokens,
                                  grammar_params(kind, text, **params))
                for i, (_, prompt, kind, text, _) in enumerate(CASES)]
    out = engine.generate(requests)
    assert engine.kv_usage()[0] == 0
    engine.allocator.check_integrity()
    ids = [[e.token_id for e in out[i]] for i in range(len(CASES))]
    return ids, [out[i][-1].finish_reason for i in range(len(CASES))]


def check_cases(tokenizer, grammars, ids, reasons) -> int:
    """Every finished output is valid; every cut one is a prefix the grammar accepts
    (the grammar engine consumed all its tokens without error). Returns #finished."""
    for (name, _, kind, text, expected), tokens, reason in zip(CASES, ids, reasons):
        if reason == "length":
            matcher = grammars.matcher(kind, text)
            for token in tokens:
                matcher.advance(token)
            assert matcher.error is None, (name, tokenizer.decode(tokens))
            if matcher.only_eos:      # cut just when it was complete: the EOS did not fit
                check_output(kind, expected, tokenizer.decode(tokens, skip_special_tokens=True))
        else:
            assert reason == "eos_token" and tokens[-1] in grammars.eos_ids, name
            check_output(kind, expected, tokenizer.decode(tokens, skip_special_tokens=True))
    return sum(r != "length" for r in reasons)


def test_demo_model_outputs_are_valid_and_at_least_90_percent_finish_in_256_tokens(demo_engine, demo_tokenizer,
                                                                                   demo_grammars):
    ids, reasons = run_cases(demo_engine, demo_tokenizer, 256)
    finished = check_cases(demo_tokenizer, demo_grammars, ids, reasons)
    print(f"demo model: {finished}/{len(CASES)} grammar outputs finished within 256 tokens")
    assert finished >= 0.9 * len(CASES)


def test_random_tiny_model_outputs_are_valid_or_accepted_prefixes(tiny_engine, tiny_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    grammars = GrammarCompiler(str(tiny_dir), 384, (2,))
    ids, reasons = run_cases(tiny_engine, tokenizer, 48)
    check_cases(tokenizer, grammars, ids, reasons)
    regexes = [r for (_, _, kind, _, _), r in zip(CASES, reasons) if kind == "regex"]
    assert regexes == ["eos_token"] * 10       # bounded patterns: once complete, only EOS is allowed


def test_sampled_grammar_requests_with_seed_and_penalties_are_valid_and_reproducible(demo_engine, demo_tokenizer,
                                                                                    demo_grammars):
    params = {"do_sample": True, "seed": 7, "temperature": 0.9, "top_k": 50, "top_p": 0.95,
              "repetition_penalty": 1.2, "frequency_penalty": 0.3}
    first, reasons = run_cases(demo_engine, demo_tokenizer, 128, **params)
    check_cases(demo_tokenizer, demo_grammars, first, reasons)
    again, _ = run_cases(demo_engine, demo_tokenizer, 128, **params)
    assert again == first


def test_mixed_batch_leaves_unconstrained_greedy_tokens_unchanged(demo_engine, demo_tokenizer):
    prompts = ["def ", "import os\n", "class Parser:\n    def __init__(self"]
    plain = [GenerationRequest(i, demo_tokenizer(p)["input_ids"], 24, stop_token_ids=[]) for i, p in enumerate(prompts)]
    alone = demo_engine.generate(plain)
    constrained = [GenerationRequest(100 + i, demo_tokenizer(prompt)["input_ids"], 24, grammar_params(kind, text))
                   for i, (_, prompt, kind, text, _) in enumerate(CASES[:6] + CASES[20:23])]
    mixed = demo_engine.generate(constrained[:5] + plain + constrained[5:])
    for r in plain:
        assert [e.token_id for e in mixed[r.request_id]] == [e.token_id for e in alone[r.request_id]]


def test_a_grammar_that_fails_in_the_worker_ends_its_request_with_an_error_and_leaks_nothing(demo_engine, demo_tokenizer):
    bad = GenerationRequest(1, demo_tokenizer("x = ")["input_ids"], 16, grammar_params("regex", "a(b"))
    good = GenerationRequest(2, demo_tokenizer("def ")["input_ids"], 8, stop_token_ids=[])
    out = demo_engine.generate([bad, good])
    (failed,) = out[1]
    assert failed.error.startswith("Request failed during generation: the grammar failed") and failed.token_id == -1
    assert len(out[2]) == 8
    assert demo_engine.kv_usage()[0] == 0
    demo_engine.allocator.check_integrity()


def test_a_grammar_compiles_once_per_text_and_each_request_gets_its_own_state(demo_grammars, demo_tokenizer):
    key = ("json", json_grammar_text({"type": "object", "properties": {"k": {"type": "boolean"}}}))
    first = demo_grammars.matcher(*key)
    template = demo_grammars._compiled[key]
    second = demo_grammars.matcher(*key)
    assert demo_grammars._compiled[key] is template
    for token in demo_tokenizer.encode('{"k": ', add_special_tokens=False):
        first.advance(token)
    masks = unpack_bitmask(demo_grammars.fill_bitmasks([first, second]), DEMO_VOCAB)
    assert first.error is None and not torch.equal(masks[0], masks[1])
    for row, matcher in enumerate((first, second)):           # the batch call fills each row as one call would
        assert torch.equal(masks[row], unpack_bitmask(demo_grammars.fill_bitmasks([matcher]), DEMO_VOCAB)[0])


def test_a_model_without_a_tokenizer_cannot_take_down_the_worker(tmp_path):
    grammars = GrammarCompiler(str(tmp_path), 64, (2,))            # an empty folder: nothing to load
    matcher = grammars.matcher(*YES_NO)
    assert matcher.only_eos and matcher.error
    allowed = unpack_bitmask(grammars.fill_bitmasks([matcher]), 64)[0]
    assert allowed.nonzero().flatten().tolist() == [2]
