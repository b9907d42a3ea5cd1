"""The prefix cache through ``engine.generation.Engine`` (float32, tiny checkpoint): the tokens
and logprobs with the cache equal those without it, at TP 1 and 2."""
import pytest

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import FED_BACK, SamplingParams
from tests.e2e.server import free_port
from tests.tiny_models import save_tiny_model

SHARED = list(range(3, 60))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(save_tiny_model("llama", tmp_path_factory.mktemp("ckpt") / "llama"))


def make_engine(path, caching, num_shards=1):
    return Engine(EngineConfig(model_dir=path, device="cpu", kernel_backend="torch", num_slots=600, max_requests=6,
                               max_prefill_tokens=48, prefix_caching=caching, num_shards=num_shards,
                               master_port=free_port()))


def outputs(events):
    return [(e.token_id, e.logprob) for e in events]


def assert_same(got, expected):
    """The same tokens; logprobs equal up to float32 summation order (the cached path sums
    attention over the prefix in another order)."""
    assert got.keys() == expected.keys()
    for key in expected:
        assert [t for t, _ in got[key]] == [t for t, _ in expected[key]], key
        assert [x for _, x in got[key]] == pytest.approx([x for _, x in expected[key]], abs=1e-4), key


def conversation(engine):
    """Shared-prefix batches, a multi-turn chat, a prefix that ends inside a cached run, an abort,
    penalties and prompt logprobs; returns everything generated."""
    out = {}
    batch = [GenerationRequest(i, SHARED + [100 + i] * (i + 1), 8, stop_token_ids=[]) for i in range(4)]
    out.update({k: outputs(v) for k, v in engine.generate(batch).items()})
    prompt = SHARED[:20] + [7, 7]
    for turn in range(3):                        # each turn: last prompt + its answer + more
        events = engine.generate([GenerationRequest(10 + turn, prompt, 6, stop_token_ids=[])])[10 + turn]
        out[10 + turn] = outputs(events)
        prompt = prompt + [e.token_id for e in events] + [200 + turn, 201]
    out[20] = outputs(engine.generate([GenerationRequest(20, SHARED[:33] + [250], 5, stop_token_ids=[])])[20])
    engine.add_request(GenerationRequest(30, SHARED + [9, 9, 9], 50, stop_token_ids=[]))
    for _ in range(5):
        engine.step()
    engine.abort(30)
    while engine.has_work():
        engine.step()
    penalised = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3)
    out[31] = outputs(engine.generate([GenerationRequest(31, SHARED + [9, 9, 9], 6, penalised,
                                                         stop_token_ids=[])])[31])
    details = engine.generate([GenerationRequest(32, SHARED + [9, 9], 3, SamplingParams(prompt_logprobs=True),
                                                 stop_token_ids=[])])[32]
    out[32] = outputs(details) + [(None, x) for x in details[0].prompt_logprobs[1:]]
    assert len(details[0].prompt_logprobs) == len(SHARED) + 2 and details[0].prompt_logprobs[0] is None
    assert engine.kv_usage()[0] == 0
    engine.router.scheduler.check_integrity()
    return out


@pytest.fixture(scope="module")
def uncached(tiny_llama):
    return conversation(make_engine(tiny_llama, caching=False))


def test_the_cache_changes_no_token_and_no_logprob(tiny_llama, uncached):
    engine = make_engine(tiny_llama, caching=True)
    assert_same(conversation(engine), uncached)
    stats = engine.router.scheduler.cache.stats
    assert stats.hit_tokens > 0.4 * stats.lookup_tokens


def test_two_shards_with_the_cache_equal_one_without(tiny_llama, uncached):
    with make_engine(tiny_llama, caching=True, num_shards=2) as engine:
        assert_same(conversation(engine), uncached)


def test_a_repeated_prompt_prefills_only_its_last_token(tiny_llama):
    engine = make_engine(tiny_llama, caching=True)
    shards, prefill = engine.router.shards, []
    submit = shards.submit

    def recording_submit(step):
        prefill.extend((r.request_id, len(r.input_ids)) for r in step.rows if r.input_ids[0] != FED_BACK)
        submit(step)

    shards.submit = recording_submit
    first = engine.generate([GenerationRequest(1, SHARED, 4, stop_token_ids=[])])[1]
    second = engine.generate([GenerationRequest(2, SHARED, 4, stop_token_ids=[])])[2]
    assert_same({0: outputs(second)}, {0: outputs(first)})
    assert prefill == [(1, 48), (1, len(SHARED) - 48), (2, 1)]
    status = engine.router.scheduler.prefix_cache_status()
    assert status["prefix_cache_hit_tokens"] == len(SHARED) - 1
    assert status["prefix_cache_lookup_tokens"] == 2 * len(SHARED)
    assert status["prefix_cache_tokens"] == len(SHARED) + 3     # the prompt and the fed-back answer


def test_cached_prefixes_map_into_the_table_once_per_distinct_prefix(tiny_llama):
    """A piece of ``Step.prefixes`` that several rows map is written by one broadcast copy, the others one by
    one: every row's first positions hold its own prefix slots (a shorter part of an entry, or an entry's
    base then its own slots), nothing past them is touched."""
    from engine.protocol.messages import NO_PREFIX, PrefixSlots, Step, StepRow

    worker = make_engine(tiny_llama, caching=True).worker
    table = worker.kv_cache.req_to_token
    table[:7].fill_(-1)
    prefixes = [PrefixSlots([40, 41, 42, 7, 9]), PrefixSlots([3, 4, 5]), PrefixSlots([60, 61], base=0, base_len=3)]
    step = Step(rows=[], prefixes=prefixes)
    uses = {0: (0, 5), 1: (1, 3), 2: (0, 5), 3: (NO_PREFIX, 0), 4: (2, 5), 5: (0, 2), 6: (2, 4)}  # row: (entry, length)
    step.rows = [StepRow(request_id=row, row=row, start_pos=length, input_ids=[1], slots=[100 + row], sample=False,
                         prefix=index) for row, (index, length) in uses.items()]
    worker._map_cached_prefixes(step)
    expected = {0: [40, 41, 42, 7, 9], 1: [3, 4, 5], 2: [40, 41, 42, 7, 9], 3: [], 4: [40, 41, 42, 60, 61],
                5: [40, 41], 6: [40, 41, 42, 60]}
    for row, slots in expected.items():
        k = len(slots)
        assert table[row, :k].tolist() == slots and (table[row, k:] == -1).all(), row
