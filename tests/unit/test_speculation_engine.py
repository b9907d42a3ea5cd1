"""Speculative decoding through the real engine: the worker's verify rows (prefill attention over
the drafts, every position's logits, exact acceptance) on tiny random checkpoints and the demo model.

Greedy outputs equal ``--speculate 0``'s token for token; sampled ones too, per seed (each position
draws with the seed and token index plain decoding would use), and their frequencies over many
seeds match (chi-square)."""
from __future__ import annotations

import inspect
import math
from dataclasses import replace
import textwrap
from pathlib import Path

import pytest
import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import FED_BACK, RowResult, SamplingParams, StepRow
from engine.router.drafter import NgramDrafter
from tests.tiny_models import save_tiny_model

DEMO = Path(__file__).resolve().parents[2] / "weights" / "demo"


def make_engine(model_dir, speculate: int, backend: str = "torch", eager_drafts: bool = True, **kw) -> Engine:
    """``eager_drafts``: draft at every decode row (no pause after misses, no step gate), so that random
    checkpoints, whose drafts mostly miss, still verify many."""
    values = dict(num_slots=600, max_requests=6, max_prefill_tokens=24)
    values.update(kw)
    engine = Engine(EngineConfig(model_dir=str(model_dir), device="cpu", kernel_backend=backend, speculate=speculate,
                                 **values))
    if eager_drafts:
        scheduler = engine.router.scheduler
        scheduler.config = replace(scheduler.config, max_draft_pause=0, verify_step_cost=0.0)
    return engine


def run(engine: Engine, arrivals: dict[int, list[GenerationRequest]]) -> dict[int, list[tuple]]:
    """Requests arriving at given steps; the allocator and prefix cache are checked after every step.
    Per request: (token, logprob to 1e-3, finish reason, top ids) of each event."""
    out: dict[int, list[tuple]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_work():
        for request in arrivals.get(step, []):
            engine.add_request(request)
            out[request.request_id] = []
        for e in engine.step():
            out[e.request_id].append((e.token_id, pytest.approx(e.logprob, abs=1e-3), e.finish_reason,
                                      tuple(e.top_ids)))
        engine.router.scheduler.check_integrity()
        step += 1
    assert engine.kv_usage()[0] == 0
    return out


def repeating_arrivals(params=SamplingParams(), stop=None) -> dict[int, list[GenerationRequest]]:
    """Ragged prompts that repeat themselves (drafts find matches), two late joiners, max_new_tokens
    of 1 and 2 (no room for drafts / for one), a stop token."""
    def request(rid, prompt, new):
        return GenerationRequest(rid, prompt, new, params, stop_token_ids=stop if rid == 2 else [])
    return {0: [request(0, [5, 9, 13, 17] * 4, 24), request(1, [30, 31], 1), request(2, [8, 6, 4] * 7 + [8], 20)],
            2: [request(3, list(range(40, 75)) + list(range(40, 50)), 2), request(4, [7, 7, 7, 7], 18)],
            9: [request(5, [11, 12, 13, 11, 12], 16)]}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {family: save_tiny_model(family, root / family) for family in ("llama", "qwen2_window")}


@pytest.mark.parametrize("family", ["llama", "qwen2_window"])
def test_greedy_tokens_equal_plain_decoding_on_tiny_checkpoints(tiny_models, family):
    plain = run(make_engine(tiny_models[family], 0), repeating_arrivals())
    stop = [plain[2][5][0]]          # request 2 stops at its sixth token (maybe inside accepted drafts)
    plain = run(make_engine(tiny_models[family], 0), repeating_arrivals(stop=stop))
    assert plain[2][-1][2] == "eos_token" and len(plain[2]) <= 6
    for speculate, eager in ((2, True), (4, True), (4, False)):
        engine = make_engine(tiny_models[family], speculate, eager_drafts=eager)
        assert run(engine, repeating_arrivals(stop=stop)) == plain
        stats = engine.router.scheduler.speculation
        assert stats.drafted_tokens > 0 and (stats.accepted_tokens > 0 or not eager)


def test_verify_rows_through_the_triton_kernels(tiny_models):
    """The verify rows' attention in the prefill kernel (interpreted on a CPU), beside plain rows, on a
    prompt where drafts hit (found with the torch references, which are quick)."""
    prompt = next(p for p in ([5, 6, 7, 8] * 4 + [5, 6, 7], [3, 4, 3, 4, 3], [9, 10, 11] * 4, [100, 101] * 6)
                  if _accepts_drafts(tiny_models["llama"], p))
    arrivals = {0: [GenerationRequest(0, prompt, 10, SamplingParams(), stop_token_ids=[]),
                    GenerationRequest(1, [3, 4], 6, SamplingParams(), stop_token_ids=[])]}
    plain = run(make_engine(tiny_models["llama"], 0, backend="triton"), arrivals)
    engine = make_engine(tiny_models["llama"], 3, backend="triton")
    out = run(engine, arrivals)
    assert [t[0] for t in out[0]] == [t[0] for t in plain[0]] and [t[0] for t in out[1]] == [t[0] for t in plain[1]]
    assert engine.router.scheduler.speculation.accepted_tokens > 0


class OracleDrafter(NgramDrafter):
    """Drafts the tokens plain decoding produced next, but one in ``wrong_every`` wrong: verify rows with
    accepted drafts and rejections mid-row whatever the model (penalties leave no repetition)."""

    def __init__(self, prompt_len: int, expected: list[int], wrong_every: int = 3):
        super().__init__()
        self.prompt_len, self.expected, self.wrong_every = prompt_len, expected, wrong_every

    def propose(self, max_drafts: int, ahead: int = 0) -> list[int]:
        done = len(self.tokens) - self.prompt_len + ahead      # ahead: tokens in flight (guessed right)
        drafts = self.expected[done : done + max_drafts]
        return [t if (done + i) % self.wrong_every else (t + 1) % 300 for i, t in enumerate(drafts)]


def with_oracle_drafts(engine: Engine, plain: dict[int, list[tuple]], wrong_every: int = 3) -> Engine:
    scheduler = engine.router.scheduler
    add = scheduler.add

    def add_with_oracle(request):
        add(request)
        if request.drafter is not None:
            expected = [event[0] for event in plain[request.request_id]]
            request.drafter = OracleDrafter(len(request.prompt_ids), expected, wrong_every)
            request.drafter.extend(request.prompt_ids)
    scheduler.add = add_with_oracle
    return engine


@pytest.mark.parametrize("params", [
    SamplingParams(top_n_tokens=2),
    SamplingParams(seed=3, do_sample=True, temperature=0.9, top_k=40, top_p=0.95),
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)])
def test_a_lone_request_waits_for_each_verify_result_and_gives_plain_decodings_tokens(tiny_models, params):
    """A lone request plans its next row only from its verify row's result (engine.router.scheduler): rows
    that keep every draft and rows that reject some; greedy, seeded and penalised tokens stay plain
    decoding's, no step carries a second row of the request behind its verify row, and the allocator is
    checked after every step."""
    arrivals = {0: [GenerationRequest(0, [5, 6, 7, 8, 9], 40, params, stop_token_ids=[])]}
    plain = run(make_engine(tiny_models["llama"], 0), arrivals)
    engine = with_oracle_drafts(make_engine(tiny_models["llama"], 4), plain, wrong_every=11)
    shards, calls = engine.router.shards, []
    submit, collect = shards.submit, shards.collect
    shards.submit = lambda step: (calls.append(row_kind(step.rows[0])), submit(step))[1]
    shards.collect = lambda timeout=None: (calls.append("collect"), collect(timeout))[1]
    assert run(engine, arrivals) == plain
    stats = engine.router.scheduler.speculation
    assert stats.drafted_tokens > stats.accepted_tokens > 10
    after_verify = {b for a, b in zip(calls, calls[1:]) if a == "verify"}
    assert after_verify == {"collect"} and calls.count("verify") > 5, calls


def row_kind(row) -> str:
    if row.input_ids[0] != FED_BACK:
        return "prompt"
    return "verify" if len(row.input_ids) > 1 else "plain"


def _accepts_drafts(model_dir, prompt: list[int]) -> bool:
    engine = make_engine(model_dir, 3)
    run(engine, {0: [GenerationRequest(0, prompt, 10, SamplingParams(), stop_token_ids=[])]})
    return engine.router.scheduler.speculation.accepted_tokens > 0


@pytest.fixture(scope="module")
def demo_tokens():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO)


def rename_prompt(tokenizer, function, new_name: str) -> list[int]:
    """A standard-library function's source, then the start of its copy under a new name."""
    source = inspect.getsource(function)
    renamed = source.replace(f"def {function.__name__}(", f"def {new_name}(", 1)
    text = f"{source}\n\n# The same function, renamed to {new_name}:\n{renamed.splitlines()[0]}\n"
    return tokenizer(text)["input_ids"]


@pytest.fixture(scope="module")
def demo_engines():
    engines = {n: make_engine(DEMO, n, num_slots=4096, max_requests=8, max_prefill_tokens=512) for n in (0, 4)}
    yield engines
    for engine in engines.values():
        engine.close()


def test_demo_model_greedy_rename_equals_plain_and_accepts_drafts(demo_engines, demo_tokens):
    prompts = [rename_prompt(demo_tokens, textwrap.dedent, "remove_common_indent"),
               rename_prompt(demo_tokens, textwrap.indent, "prefix_lines"),
               rename_prompt(demo_tokens, inspect.getsource, "source_of")]
    arrivals = {0: [GenerationRequest(i, p, 40, SamplingParams(top_n_tokens=2), stop_token_ids=None)
                    for i, p in enumerate(prompts[:2])],
                3: [GenerationRequest(2, prompts[2], 40, SamplingParams(), stop_token_ids=None)]}
    plain = run(demo_engines[0], arrivals)
    out = run(demo_engines[4], arrivals)
    assert out == plain
    stats = demo_engines[4].router.scheduler.speculation
    assert stats.accepted_tokens >= 0.1 * stats.drafted_tokens > 0


SAMPLED = dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, typical_p=0.98, top_n_tokens=3)


def test_demo_model_sampled_tokens_equal_plain_decoding_per_seed(demo_engines, demo_tokens):
    prompt = rename_prompt(demo_tokens, textwrap.dedent, "strip_margin")
    for extra in ({}, {"watermark": True}):
        arrivals = {0: [GenerationRequest(s, prompt, 16, SamplingParams(seed=s, **SAMPLED, **extra),
                                          stop_token_ids=[]) for s in range(4)]}
        assert run(demo_engines[4], arrivals) == run(demo_engines[0], arrivals)
    assert demo_engines[4].router.scheduler.speculation.accepted_tokens > 0


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, top_n_tokens=2),
    SamplingParams(seed=5, repetition_penalty=1.2, frequency_penalty=0.5, **SAMPLED)])
def test_penalties_count_the_accepted_drafts_only(tiny_models, params):
    """Penalised positions of a verify row see the drafts before them; the kept tokens (and only
    they) enter the request's counts: the tokens of --speculate 0, greedy and sampled."""
    arrivals = repeating_arrivals(params)
    plain = run(make_engine(tiny_models["llama"], 0), arrivals)
    engine = with_oracle_drafts(make_engine(tiny_models["llama"], 4), plain)
    assert run(engine, arrivals) == plain
    stats = engine.router.scheduler.speculation
    assert stats.drafted_tokens > stats.accepted_tokens > 20
    assert engine.worker.sampler.penalties.counts.shape[0] <= 16      # scratch rows were given back


def test_grammar_constrained_rows_verify_with_matchers_advanced_over_the_drafts(demo_tokens):
    """Constrained verify rows: each position's mask follows the drafts before it (copies of the
    matcher), drafts the grammar rejects end the row, the kept tokens advance the request's
    matcher: the tokens of --speculate 0, greedy and sampled, regex and JSON schema."""
    from engine.sampling.grammar import json_grammar_text

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    grammars = [("regex", r"[0-9]{2,6}( [a-z]+){1,4}\."), ("json", json_grammar_text(schema))]
    prompt = demo_tokens("person = ")["input_ids"]
    arrivals = {0: [GenerationRequest(i * 2 + sampled, prompt, 24, SamplingParams(
        grammar_type=kind, grammar=text, **(dict(SAMPLED, seed=11) if sampled else {})), stop_token_ids=None)
        for i, (kind, text) in enumerate(grammars) for sampled in (0, 1)]}
    plain = run(make_engine(DEMO, 0, num_slots=2048), arrivals)
    engine = with_oracle_drafts(make_engine(DEMO, 4, num_slots=2048), plain)
    assert run(engine, arrivals) == plain
    stats = engine.router.scheduler.speculation
    assert stats.drafted_tokens > stats.accepted_tokens > 10
    assert all(events[-1][2] == "eos_token" for events in plain.values())      # the grammars completed


def peaked_logits(worker, choices: list[int]) -> torch.Tensor:
    """[positions, vocab] logits whose top token at position j is ``choices[j]``."""
    logits = torch.zeros(len(choices), worker.sampler.penalties.counts.shape[1])
    logits[range(len(choices)), choices] = 10.0
    return logits


def verify_on_logits(worker, row, state, logits: torch.Tensor) -> RowResult:
    """A verify row sampled from ``logits`` (no forward pass: a draft no embedding holds can be fed): the row's
    result after the worker kept its tokens."""
    out = worker._sample_positions(logits, [row], [state]).start_copy().output()
    result = RowResult(row.request_id)
    worker._record_tokens([0], [row], out, [state], [result], worker.sampler.penalties)
    return result


def test_a_draft_outside_the_grammars_vocabulary_is_rejected_and_leaves_the_request_running(demo_tokens):
    """A draft id the grammar's tokenizer does not know (4101 of the demo's 4096) never reaches the request's
    live matcher (llguidance would put it into its error state and end the request with "the grammar failed"):
    the draft is rejected, the model's own token comes instead, the grammar goes on."""
    engine = make_engine(DEMO, 4, num_slots=256)
    worker = engine.worker
    worker.sampler.grammars.wait_loaded()
    one, two, three = demo_tokens.convert_tokens_to_ids(["1", "2", "3"])
    params = SamplingParams(grammar_type="regex", grammar=r"[0-9]{2,6}( [a-z]+){1,4}\.")
    row = StepRow(0, 0, 4, [FED_BACK, one, 4101, three], [4, 5, 6, 7], True, params=params)
    state = worker._new_row_state(row)
    result = verify_on_logits(worker, row, state, peaked_logits(worker, [one, two, three, three]))
    assert result.error is None and [result.token_id, *(r.token_id for r in result.following)] == [one, two]
    assert state.grammar.error is None and not state.grammar.only_eos
    row = replace(row, start_pos=6, input_ids=[FED_BACK, 4101], slots=[6, 7])     # the first draft unknown
    result = verify_on_logits(worker, row, state, peaked_logits(worker, [three, three]))
    assert result.error is None and result.token_id == three and result.following == []
    assert state.grammar.error is None
    engine.close()


def test_a_kept_draft_with_nan_scores_ends_the_row_after_the_tokens_before_it(tiny_models):
    """Position 1 of a verify row has NaN scores (its choice, token 0, is the second draft, so it is kept): the
    row gives the first token, then the NaN token's error (plain decoding's rows: one token, then the error)."""
    engine = make_engine(tiny_models["llama"], 4)
    worker = engine.worker
    row = StepRow(0, 0, 4, [FED_BACK, 7, 0, 9], [4, 5, 6, 7], True, params=SamplingParams())
    state = worker._new_row_state(row)
    logits = peaked_logits(worker, [7, 0, 9, 3])
    logits[1] = float("nan")                       # its greedy choice: token 0
    result = verify_on_logits(worker, row, state, logits)
    assert result.error is None and result.token_id == 7 and len(result.following) == 1
    assert result.following[0].token_id == 0 and "NaN" in result.following[0].error
    engine.close()


def test_demo_model_sampled_frequencies_match_plain_decoding(demo_engines, demo_tokens):
    """Different seeds for each side (not coupled): the frequencies of the first token, of the first
    two and of the first three agree (chi-square homogeneity tests, alpha 0.001 each)."""
    prompt = demo_tokens("x = [1, 2, 3]\ny = [1, 2, 3]\nz = [")["input_ids"]
    params = dict(do_sample=True, temperature=1.0)
    samples = []
    for speculate, seeds in ((0, range(0, 300)), (4, range(1000, 1300))):
        arrivals = {0: [GenerationRequest(s, prompt, 3, SamplingParams(seed=s, **params), stop_token_ids=[])
                        for s in seeds]}
        engine = make_engine(DEMO, speculate, num_slots=16384, max_requests=300, max_prefill_tokens=4096)
        out = run(engine, arrivals)
        samples.append([tuple(t[0] for t in out[s]) for s in seeds])
        if speculate:
            assert engine.router.scheduler.speculation.accepted_tokens > 0
        engine.close()
    for length in (1, 2, 3):
        plain, speculated = ([sample[:length] for sample in side] for side in samples)
        assert _chi_square_p(_histogram(plain), _histogram(speculated)) > 0.001


def _histogram(samples: list[tuple]) -> dict:
    hist: dict = {}
    for sample in samples:
        hist[sample] = hist.get(sample, 0) + 1
    return hist


def _chi_square_p(a: dict, b: dict) -> float:
    """p-value of the 2 x k homogeneity test over keys seen at least 10 times in all (the rest pooled)."""
    keys = sorted(set(a) | set(b), key=str)
    frequent = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= 10]
    rows = [[x.get(k, 0) for k in frequent] + [sum(x.get(k, 0) for k in keys if k not in frequent)] for x in (a, b)]
    columns = [i for i in range(len(rows[0])) if rows[0][i] + rows[1][i] > 0]
    total = [sum(r) for r in rows]
    statistic = 0.0
    for i in columns:
        column = rows[0][i] + rows[1][i]
        for r, n in zip(rows, total):
            expected = column * n / sum(total)
            statistic += (r[i] - expected) ** 2 / expected
    return _chi_square_survival(statistic, max(len(columns) - 1, 1))


def _chi_square_survival(x: float, dof: int) -> float:
    """P(X > x) for X ~ chi-square(dof): the regularized upper gamma Q(dof/2, x/2) by its series."""
    s, z = dof / 2, x / 2
    term = total = 1 / s
    k = 1
    while term > 1e-12 * total:
        term *= z / (s + k)
        total += term
        k += 1
    lower = math.exp(-z + s * math.log(z) - math.lgamma(s)) * total if z > 0 else 0.0
    return max(0.0, 1.0 - lower)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_verify_graphs_padded_layout_gives_the_eager_logits(tiny_models, backend):
    """The CUDA graphs' form of a verify step (``verify_layout``: rows padded to 1 + drafts tokens,
    a padding row, the prefill kernel) against the eager form, on the same KV: a plain decode row
    beside two verify rows."""
    import torch

    from engine.protocol.messages import FED_BACK, RowResult, Step, StepRow
    from engine.worker.cuda_graphs import PaddedVerifier
    from engine.worker.forward_batch import verify_batch, verify_layout

    engine = make_engine(tiny_models["llama"], 0, backend=backend)
    worker = engine.worker
    prompts = [[5, 9, 13, 17, 5, 9], [3, 4, 5], [7] * 11]
    slot = 0
    rows = []
    for i, p in enumerate(prompts):
        rows.append(StepRow(request_id=i, row=i, start_pos=0, input_ids=p, slots=list(range(slot, slot + len(p))),
                            sample=True, params=SamplingParams()))
        slot += len(p)
    worker.execute(Step(rows=rows))
    verify = []
    for i, (p, drafts) in enumerate(zip(prompts, ([13, 17, 2], [], [7, 7]))):
        verify.append(StepRow(request_id=i, row=i, start_pos=len(p), input_ids=[FED_BACK, *drafts],
                              slots=list(range(slot, slot + 1 + len(drafts))), sample=True))
        slot += 1 + len(drafts)
    _, eager, eager_hidden = worker._forward(Step(rows=verify), [RowResult(r.request_id) for r in verify])
    cache = worker.kv_cache
    layout = verify_layout(verify, rows=4, width=4, dummy_row=cache.max_requests, dummy_slot=cache.num_slots)
    assert layout.real == [0, 1, 2, 3, 4, 8, 9, 10] and layout.req_rows == [0, 1, 2, cache.max_requests]
    ids, positions, slots, token_rows = (torch.tensor(v) for v in (layout.input_ids, layout.positions, layout.slots,
                                                                    layout.token_rows))
    cache.write_table(token_rows, positions, slots)
    ids = torch.where(ids == FED_BACK, worker.last_tokens[token_rows], ids)
    batch = verify_batch(ids, positions, slots, torch.tensor(layout.req_rows), torch.tensor(layout.seq_len), 4)
    padded = worker.model.compute_logits(worker.model.forward(batch, cache))[torch.tensor(layout.real)]
    assert eager.shape == padded.shape == (8, eager.shape[1])
    torch.testing.assert_close(padded, eager, atol=1e-4, rtol=1e-4)
    verifier = PaddedVerifier(worker.model, worker.ops, cache, worker.last_tokens, max_requests=6, drafts=3,
                              use_graphs=False)
    assert verifier.buckets == [1, 2, 4, 6] and verifier.accepts(Step(rows=verify))
    logits, hidden, (tokens, logprobs) = verifier.run(Step(rows=verify), hidden_states=True)    # eager on a CPU
    torch.testing.assert_close(logits, eager, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden, eager_hidden, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens, logits.argmax(-1))                # the greedy picks of the real positions
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).max(-1).values, atol=1e-5, rtol=1e-5)
    assert verifier.run(Step(rows=verify)).hidden is None        # no draft heads: no gather of hidden states
    too_many = replace(verify[0], input_ids=[FED_BACK] + [1] * 4, slots=list(range(5)))
    assert not verifier.accepts(Step(rows=[too_many]))


def test_the_warm_up_runs_a_verify_step_after_its_prompts(tiny_models):
    """The GPU warm-up measures the largest step's activations; with --speculate that includes a verify
    row (logits at every position) after each warm-up prompt: the rows it builds run."""
    from dataclasses import replace as replace_config

    from engine.protocol.messages import FED_BACK, Step, StepRow

    worker = make_engine(tiny_models["llama"], 3).worker
    assert worker.config.speculate == 3
    prompts = [StepRow(request_id=-1 - i, row=i, start_pos=0, input_ids=[1] * n, slots=list(range(10 * i, 10 * i + n)),
                       sample=True, params=SamplingParams(repetition_penalty=1.1, top_n_tokens=5))
               for i, n in enumerate([10, 7])]
    verify = worker._warmup_verify_rows(prompts, next_slot=20)
    assert [(r.start_pos, r.input_ids, r.slots) for r in verify] == [
        (10, [FED_BACK, 1, 1, 1], [20, 21, 22, 23]), (7, [FED_BACK, 1, 1, 1], [24, 25, 26, 27])]
    worker.execute(Step(rows=prompts))
    result = worker.execute(Step(rows=verify))
    assert all(r.token_id is not None for r in result.rows)
    worker.execute(Step(rows=[], released=[r.request_id for r in prompts]))
    worker.config = replace_config(worker.config, speculate=0)
    assert worker._warmup_verify_rows(prompts, next_slot=20) == []


def test_two_shards_verify_like_one(tiny_models):
    """Tensor parallelism (gloo): rank 0 verifies and broadcasts every position's choice, each rank
    finds the kept token for ``last_tokens`` itself: the tokens of one shard without speculation."""
    from tests.e2e.server import free_port

    arrivals = {0: [GenerationRequest(0, [5, 6, 7, 8] * 4 + [5, 6], 20, SamplingParams(), stop_token_ids=[]),
                    GenerationRequest(1, [9, 10, 9, 10, 9], 12, SamplingParams(do_sample=True, seed=4),
                                      stop_token_ids=[])]}
    plain = run(make_engine(tiny_models["llama"], 0), arrivals)
    engine = with_oracle_drafts(make_engine(tiny_models["llama"], 3, num_shards=2, master_port=free_port()), plain)
    with engine:
        assert run(engine, arrivals) == plain
        assert engine.router.scheduler.speculation.accepted_tokens > 5
