"""Request features with a prefix-cache hit give what they give without the cache (engine API, float32, tiny
checkpoint with a tokenizer): seeded sampling, penalties, grammars, the watermark, prompt logprobs and a best_of
fan-out of one prompt.

Every case runs the same two requests on an engine without the cache and on one with it: a greedy warm-up that
fills the cache, then the measured request(s), whose prompt is either the warm-up's prompt again ("same": only its
last token is prefilled) or the warm-up's prompt, its answer and one more token ("extended": the cached part holds
generated tokens, whose KV decode rows wrote). The cached run must really take the prefix from the cache: each
measured request's first prompt row starts at the cached length (``Prefills``) and the cache's hit counter grows
by as much. Tokens must be equal, logprobs equal up to float32 summation order (``assert_same``).
"""
from __future__ import annotations

import json
import random
import re
from itertools import count

import jsonschema
import pytest
import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.ops import TritonOps
from engine.protocol.messages import FED_BACK, NO_PREFIX, SamplingParams
from engine.sampling.grammar import json_grammar_text
from tests.tiny_models import save_tiny_server_model
from tgi_compat.fan_out import choice_request
from tgi_compat.schema import GenerateParameters, GenerateRequest

PREFIX_LEN = 70          # > max_prefill_tokens: the uncached prompt is prefilled in two chunks
NEW = 8
KINDS = ("same", "extended")
_ids = count(1)
_tags = count(300)       # each case's prompt starts with its own token: no case hits another's prompt


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These tensors are tiny: a second torch thread only spins, and on a machine whose cores other work shares
    the spinning made each case 50-100x slower (3-5 s instead of 0.05 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_server_model("llama", tmp_path_factory.mktemp("features") / "llama"))


class Prefills:
    """Records every prompt row the router submits: per request, the position its first prompt row starts at
    (the tokens it took from the prefix cache), whether that row maps a cached prefix, and the longest shared
    prefix (cascade attention) any of its rows carried."""

    def __init__(self, engine: Engine):
        self.start: dict[int, int] = {}
        self.mapped: dict[int, bool] = {}
        self.shared: dict[int, int] = {}
        shards = engine.router.shards
        submit = shards.submit

        def recording_submit(step):
            for r in step.rows:
                self.shared[r.request_id] = max(self.shared.get(r.request_id, 0), r.shared_prefix_len)
                if r.input_ids[0] != FED_BACK and r.request_id not in self.start:
                    self.start[r.request_id] = r.start_pos
                    self.mapped[r.request_id] = r.prefix != NO_PREFIX
            submit(step)

        shards.submit = recording_submit


def make_engine(path: str, caching: bool, backend: str = "torch") -> Engine:
    engine = Engine(EngineConfig(model_dir=path, device="cpu", kernel_backend=backend, num_slots=2400,
                                 max_requests=8, max_prefill_tokens=48, prefix_caching=caching))
    engine.prefills = Prefills(engine)
    return engine


@pytest.fixture(scope="module")
def engines(model_dir):
    """{caching: engine}, shared by the module's cases (each case's prompts start with a token of its own)."""
    return {False: make_engine(model_dir, caching=False), True: make_engine(model_dir, caching=True)}


def fresh_prefix() -> list[int]:
    tag = next(_tags)
    return [tag] + random.Random(tag).choices(range(3, 300), k=PREFIX_LEN - 1)


def generate(engine: Engine, requests: list[GenerationRequest]) -> dict[int, list]:
    events = engine.generate(requests)
    for request_events in events.values():
        assert request_events and all(e.error is None for e in request_events), request_events
    return events


def run_case(engine: Engine, prefix: list[int], kind: str, params: list[SamplingParams], stop=(), new=NEW) -> dict:
    """The warm-up (greedy, ``prefix``), then one measured request per ``params``, all of the same prompt (see
    the module docstring), submitted together. Returns the warm-up's tokens, the measured prompt, the measured
    requests' events in ``params`` order, and for the cached engine what they took from the cache."""
    scheduler = engine.router.scheduler
    warm_up = GenerationRequest(next(_ids), prefix, new, stop_token_ids=[])
    answer = [e.token_id for e in generate(engine, [warm_up])[warm_up.request_id]]
    prompt = prefix if kind == "same" else prefix + answer + [299]
    cached = len(prefix) - 1 if kind == "same" else len(prefix) + len(answer) - 1   # the last answer token has no KV
    requests = [GenerationRequest(next(_ids), prompt, new, p, stop_token_ids=None if stop is None else list(stop))
                for p in params]
    hits = scheduler.cache.stats.hit_tokens if scheduler.cache is not None else 0
    available = scheduler.cache.match(prompt[:-1]).length if scheduler.cache is not None else 0
    events = generate(engine, requests)
    out = {"answer": answer, "prompt": prompt, "cached": cached, "available": available,
           "events": [events[r.request_id] for r in requests],
           "start": [engine.prefills.start[r.request_id] for r in requests],
           "mapped": [engine.prefills.mapped[r.request_id] for r in requests],
           "shared": [engine.prefills.shared[r.request_id] for r in requests]}
    if scheduler.cache is not None:
        out["hits"] = scheduler.cache.stats.hit_tokens - hits
    assert engine.kv_usage()[0] == 0
    scheduler.check_integrity()
    return out


def both(engines, kind: str, params: list[SamplingParams], stop=(), new=NEW) -> tuple[dict, dict]:
    """The case without and with the cache, on the same prompts; the warm-ups' answers are equal."""
    prefix = fresh_prefix()
    cold = run_case(engines[False], prefix, kind, params, stop, new)
    warm = run_case(engines[True], prefix, kind, params, stop, new)
    assert warm["answer"] == cold["answer"] and warm["prompt"] == cold["prompt"]
    return cold, warm


def assert_hit(warm: dict, requests: int) -> None:
    """Every measured request took the cached prefix: its first prompt row starts there and maps it."""
    assert warm["start"] == [warm["cached"]] * requests
    assert all(warm["mapped"])
    assert warm["hits"] == requests * warm["cached"]


def assert_same(got: list, expected: list) -> None:
    """Per request: the same tokens, finish reasons, seeds and top-n ids; logprobs (and top-n logprobs) equal up
    to float32 summation order (the cached path sums attention over the prefix in another order)."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert [x.token_id for x in g] == [x.token_id for x in e]
        assert [(x.finish_reason, x.seed, x.top_ids) for x in g] == [(x.finish_reason, x.seed, x.top_ids) for x in e]
        assert [x.logprob for x in g] == pytest.approx([x.logprob for x in e], abs=1e-4)
        for gx, ex in zip(g, e):
            assert gx.top_logprobs == pytest.approx(ex.top_logprobs, abs=1e-4)


SAMPLED = {
    "temperature": SamplingParams(do_sample=True, temperature=1.5, seed=7),
    "top-k-top-p": SamplingParams(do_sample=True, temperature=0.9, top_k=12, top_p=0.9, seed=2**63 + 5),
    "typical-top-n": SamplingParams(do_sample=True, temperature=1.2, typical_p=0.8, top_n_tokens=3, seed=11),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", SAMPLED)
def test_seeded_sampling_with_a_cache_hit_equals_sampling_without_the_cache(engines, name, kind):
    cold, warm = both(engines, kind, [SAMPLED[name]])
    assert_hit(warm, 1)
    assert_same(warm["events"], cold["events"])
    greedy = GenerationRequest(next(_ids), cold["prompt"], NEW, stop_token_ids=[])
    plain = generate(engines[False], [greedy])[greedy.request_id]
    assert [e.token_id for e in plain] != [e.token_id for e in cold["events"][0]]     # it really sampled


PENALTIES = {
    "repetition": SamplingParams(repetition_penalty=1.8),
    "frequency": SamplingParams(frequency_penalty=1.5),
    "presence": SamplingParams(presence_penalty=1.0),
    "all-sampled": SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4,
                                  do_sample=True, seed=3, top_n_tokens=2),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", PENALTIES)
def test_penalties_count_the_cached_prompt_tokens_as_if_prefilled(engines, name, kind):
    """The worker gets a hit's cached token ids (``StepRow.prefix_ids``) into its penalty counts, and their
    number into the frequency penalty's sequence length: logprobs, which are of the penalised scores, show
    any difference in either."""
    cold, warm = both(engines, kind, [PENALTIES[name]])
    assert_hit(warm, 1)
    assert_same(warm["events"], cold["events"])


REGEX = r"[0-9]{2,4}( [a-z]{1,4}){1,2}\."
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 3},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}
GRAMMARS = {
    "regex": SamplingParams(grammar_type="regex", grammar=REGEX),
    "regex-sampled": SamplingParams(grammar_type="regex", grammar=REGEX, do_sample=True,
                                    seed=5),
    "json": SamplingParams(grammar_type="json", grammar=json_grammar_text(SCHEMA)),
    "json-sampled": SamplingParams(grammar_type="json", grammar=json_grammar_text(SCHEMA), do_sample=True, seed=9,
                                   top_n_tokens=2),
}


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", GRAMMARS)
def test_grammar_constrained_generation_with_a_cache_hit_equals_it_without_the_cache(engines, tokenizer, name, kind):
    """Runs to the model's EOS, which the grammar allows once complete: the text matches the regex, or is JSON
    that the schema accepts."""
    cold, warm = both(engines, kind, [GRAMMARS[name]], stop=None, new=40)
    assert_hit(warm, 1)
    assert_same(warm["events"], cold["events"])
    events = cold["events"][0]
    assert events[-1].finish_reason == "eos_token"
    text = tokenizer.decode([e.token_id for e in events], skip_special_tokens=True)
    if name.startswith("json"):
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert re.fullmatch(REGEX, text), text


WATERMARKED = {
    "greedy": SamplingParams(watermark=True, top_n_tokens=3),
    "sampled": SamplingParams(watermark=True, do_sample=True, seed=21),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", WATERMARKED)
def test_the_watermark_with_a_cache_hit_equals_it_without_the_cache(engines, name, kind):
    """The green list of the first new token follows the last prompt token, which a hit never takes from the
    cache; the bias shows in the logprobs (of the biased scores), compared against an unwatermarked run."""
    cold, warm = both(engines, kind, [WATERMARKED[name]])
    assert_hit(warm, 1)
    assert_same(warm["events"], cold["events"])
    params = WATERMARKED[name]
    plain = SamplingParams(do_sample=params.do_sample, seed=params.seed, top_n_tokens=params.top_n_tokens)
    request = GenerationRequest(next(_ids), cold["prompt"], NEW, plain, stop_token_ids=[])
    unmarked = generate(engines[False], [request])[request.request_id]
    assert [e.logprob for e in unmarked] != pytest.approx([e.logprob for e in cold["events"][0]], abs=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_logprobs_of_a_cached_prompt_equal_the_uncached_ones(engines, kind):
    """A request for prompt logprobs whose prompt's prefix the cache holds gets every prompt token's logprob,
    equal to the uncached run's: by design it takes nothing from the cache (each position's logprob needs that
    position's logits, which cached KV does not give), while a plain request of the same prompt beside it in the
    same step does take the cached prefix. All generate what they generate without the cache."""
    logprobs = SamplingParams(prompt_logprobs=True)
    plain = SamplingParams()
    cold, warm = both(engines, kind, [logprobs, plain, SamplingParams(prompt_logprobs=True, top_n_tokens=2)])
    assert warm["available"] == warm["cached"]                  # the cache held the prefix for all three
    assert warm["start"] == [0, warm["cached"], 0] and warm["mapped"] == [False, True, False]
    assert warm["hits"] == warm["cached"]
    assert_same(warm["events"], cold["events"])
    for events in (cold["events"], warm["events"]):
        for i in (0, 2):
            assert len(events[i][0].prompt_logprobs) == len(cold["prompt"]) and events[i][0].prompt_logprobs[0] is None
        assert events[1][0].prompt_logprobs is None
    for i in (0, 2):
        got, expected = warm["events"][i][0].prompt_logprobs, cold["events"][i][0].prompt_logprobs
        assert got[0] is None and got[1:] == pytest.approx(expected[1:], abs=1e-4)
    # ... and the logprob request's own prompt enters the cache: a later plain request of it hits
    engine = engines[True]
    again = GenerationRequest(next(_ids), cold["prompt"] + [298], NEW, stop_token_ids=[])
    hits = engine.router.scheduler.cache.stats.hit_tokens
    events = generate(engine, [again])[again.request_id]
    assert engine.router.scheduler.cache.stats.hit_tokens - hits == len(cold["prompt"])
    assert engine.prefills.start[again.request_id] == len(cold["prompt"])
    expected = generate(engines[False], [GenerationRequest(next(_ids), again.prompt_ids, NEW, stop_token_ids=[])])
    assert_same([events], list(expected.values()))


def best_of_params(n: int, seed: int) -> list[SamplingParams]:
    """The sub-requests' parameters of a best_of / n request (``tgi_compat.fan_out.choice_request``'s seeds)."""
    request = GenerateRequest(inputs="", parameters=GenerateParameters(do_sample=True, temperature=1.3, seed=seed))
    seeds = [choice_request(request, k).parameters.seed for k in range(n)]
    assert len(set(seeds)) == n
    return [SamplingParams(do_sample=True, temperature=1.3, seed=s, top_n_tokens=2) for s in seeds]


@pytest.mark.parametrize("kind", KINDS)
def test_best_of_sequences_sharing_a_cached_prompt_equal_them_without_the_cache(engines, kind):
    """n sampled sequences of one prompt, submitted together, each with its own seed: every one takes the
    cached prefix and gives its uncached tokens; they are not copies of one another."""
    cold, warm = both(engines, kind, best_of_params(4, 2**64 - 2))      # the seeds wrap around 2**64
    assert_hit(warm, 4)
    assert_same(warm["events"], cold["events"])
    assert len({tuple(e.token_id for e in events) for events in cold["events"]}) > 1


def test_best_of_sequences_arriving_together_take_the_first_ones_prefill(engines):
    """A best_of fan-out as the front end sends it: n requests of one long prompt at once, no warm-up. With the
    cache the first prefills the prompt and the others wait for it (``DEFER_MIN_TOKENS``), then take it from the
    cache: every sequence still gives its uncached tokens and logprobs."""
    prompt = fresh_prefix() + random.Random(0).choices(range(3, 300), k=160)
    params = best_of_params(4, 99)
    out = {}
    for caching, engine in engines.items():
        requests = [GenerationRequest(next(_ids), prompt, NEW, p, stop_token_ids=[]) for p in params]
        cache = engine.router.scheduler.cache
        hits = cache.stats.hit_tokens if cache is not None else 0
        events = generate(engine, requests)
        out[caching] = [events[r.request_id] for r in requests]
        starts = sorted(engine.prefills.start[r.request_id] for r in requests)
        if caching:        # the first prefilled it all, the others took at least most of it from the cache
            assert starts[0] == 0 and min(starts[1:]) > len(prompt) // 2
            assert cache.stats.hit_tokens - hits == sum(starts)
        else:
            assert starts == [0] * 4
        engine.router.scheduler.check_integrity()
    assert_same(out[True], out[False])
    assert len({tuple(e.token_id for e in events) for events in out[False]}) > 1


def with_triton_decode_attention(engine: Engine) -> Engine:
    """The engine's decode attention through the Triton kernel (interpreted on the CPU; every other op stays
    torch's: all of them interpreted cost a minute); counts the calls that attend to a shared prefix once."""
    ops = engine.worker.ops
    engine.shared_prefix_calls = 0

    def decode_attention(q, kv, req_to_token, req_rows, seq_len, sm_scale, shared=None, mods=None):
        engine.shared_prefix_calls += shared is not None
        return TritonOps.decode_attention(ops, q, kv, req_to_token, req_rows, seq_len, sm_scale, shared, mods)

    ops.decode_attention = decode_attention
    return engine


def test_best_of_through_the_shared_prefix_kernel_equals_it_without_the_cache(engines, model_dir):
    """Eight sequences behind one cached prompt of 70 tokens decode as a shared-prefix group (cascade attention:
    the Triton decode kernel attends to the prefix once for all eight): each sequence still gives the tokens and
    logprobs of the uncached engine (torch's reference attention over every row's whole context)."""
    cascade = with_triton_decode_attention(make_engine(model_dir, caching=True))
    cold, warm = both({False: engines[False], True: cascade}, "same", best_of_params(8, 1234), new=4)
    assert_hit(warm, 8)
    assert min(warm["shared"]) >= 64 and max(cold["shared"]) == 0     # the group's prefix, and none uncached
    assert cascade.shared_prefix_calls > 0
    assert_same(warm["events"], cold["events"])
