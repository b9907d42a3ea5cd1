"""Medusa draft heads (TGI's speculation with heads beside the model): loading and checking the heads'
file, the worker's drafts from the hidden state where each row's last kept token was chosen, the
router's ``HeadDrafter``, and greedy / seeded outputs equal to plain decoding through the engine,
at one and two shards. Heads fitted to a prompt's greedy continuation draft it exactly."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from engine.assembly import EngineConfig, plan_engine
from engine.generation import GenerationRequest
from engine.models.medusa import DraftHeads, read_medusa_config, reference_drafts
from engine.protocol.messages import FED_BACK, SamplingParams, Step, StepRow
from engine.router.drafter import HeadDrafter
from engine.worker.cuda_graphs import HeadGraphs
from tests.tiny_models import load_hf, save_medusa_heads, save_tiny_model
from tests.unit.test_speculation_engine import make_engine, run

FITTED_PROMPT = [5, 9, 13, 17, 21, 25]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    base = save_tiny_model("llama", root / "llama")
    return {
        "base": base,
        # own out projections, fitted to FITTED_PROMPT's greedy continuation (every draft of it right)
        "fitted": save_medusa_heads(root / "fitted", base, num_heads=3, fit_prompts=(FITTED_PROMPT,), new_tokens=24),
        # TGI's "v2" files: two residual blocks, the model's own head
        "shared": save_medusa_heads(root / "shared", base, num_heads=4, num_layers=2, own_out=False, seed=1),
    }


def test_head_drafter_proposes_the_heads_tokens_past_the_known_ones():
    drafter = HeadDrafter()
    drafter.extend([1, 2, 3])
    assert drafter.propose(3) == [] and drafter.foresee() is None          # no result yet
    drafter.receive([7, 8, 9])                                             # for positions 3, 4, 5
    assert drafter.propose(3) == [7, 8, 9] and drafter.propose(2) == [7, 8] and drafter.foresee() == 7
    assert drafter.propose(3, ahead=1) == [8, 9]         # behind a row in flight: 7 stands for its token
    drafter.extend([7], score=True)                      # a token the drafts foresaw
    assert drafter.streak == 1 and drafter.propose(3) == [8, 9]
    drafter.extend([4], score=True)                      # one they did not: nothing more to propose
    assert drafter.streak == 0 and drafter.propose(3) == [] and drafter.foresee() is None
    drafter.extend([1, 2])                               # quoting itself ("1 2" occurred before): n-gram lookup's
    drafter.receive([5, 6, 7])
    assert drafter.propose(3) == [3, 7, 4] and drafter.foresee() == 3 and drafter.head_drafts(3) == [5, 6, 7]


@pytest.mark.parametrize("heads", ["fitted", "shared"])
def test_draft_heads_equal_the_torch_reference(models, heads):
    worker = make_engine(models["base"], 2, draft_heads=str(models[heads])).worker
    hidden = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    drafts = worker.draft_heads(worker.ops, hidden)
    expected = reference_drafts(models[heads], hidden, load_hf(models["base"]).lm_head.weight, count=2)
    assert drafts.shape == (7, 2) and torch.equal(drafts, expected)


def test_head_graphs_draft_from_the_indexed_rows(models):
    """``HeadGraphs`` (the heads' CUDA graphs; eager here, as past the largest bucket): rows picked by
    ``index`` or every row, each drafted from its own hidden state."""
    worker = make_engine(models["base"], 2, draft_heads=str(models["shared"])).worker
    graphs = HeadGraphs(worker.draft_heads, worker.ops, 64, torch.float32, torch.device("cpu"), [1, 2, 4, 512],
                        use_graphs=False)
    assert graphs.buckets == [1, 2, 4]          # past HEAD_GRAPH_ROWS rows the heads run eagerly
    hidden = torch.randn(7, 64, generator=torch.Generator().manual_seed(5))
    index = torch.tensor([6, 0, 3])
    expected = reference_drafts(models["shared"], hidden, load_hf(models["base"]).lm_head.weight, count=2)
    assert torch.equal(graphs.run(hidden, index), expected[index]) and torch.equal(graphs.run(hidden), expected)


def test_the_worker_drafts_where_each_rows_last_kept_token_was_chosen(models):
    """A prompt row's drafts come from its last position; a verify row's from the position whose logits
    chose its last kept token (the first draft right, the second wrong: the second position)."""
    hf = load_hf(models["base"])
    worker = make_engine(models["base"], 3, draft_heads=str(models["shared"])).worker
    prompt = [5, 9, 13, 17, 21, 25]
    greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)[0].tolist()
    first = worker.execute(Step(rows=[StepRow(request_id=0, row=0, start_pos=0, input_ids=prompt,
                                              slots=list(range(6)), sample=True, params=SamplingParams())])).rows[0]
    wrong = (greedy[8] + 1) % 384
    verify = StepRow(request_id=0, row=0, start_pos=6, input_ids=[FED_BACK, greedy[7], wrong, 3],
                     slots=list(range(6, 10)), sample=True)
    second = worker.execute(Step(rows=[verify])).rows[0]
    assert [first.token_id, second.token_id, *(r.token_id for r in second.following)] == greedy[6:9]
    with torch.no_grad():
        hidden = hf(torch.tensor([greedy[:8]]), output_hidden_states=True).hidden_states[-1][0]
    expected = reference_drafts(models["shared"], hidden[[5, 7]], hf.lm_head.weight, count=3).tolist()
    assert [first.drafts, second.drafts] == expected and second.following[-1].drafts is None


def arrivals(params=SamplingParams(), stop=None):
    """The fitted prompt, a prompt the heads know nothing of (with a stop token), a late joiner whose
    max_new_tokens leaves no room for drafts."""
    return {0: [GenerationRequest(0, FITTED_PROMPT, 24, params, stop_token_ids=[]),
                GenerationRequest(1, [8, 6, 4, 100, 200], 16, params, stop_token_ids=stop or [])],
            3: [GenerationRequest(2, [7, 7, 7], 1, params, stop_token_ids=[])]}


@pytest.mark.parametrize("heads,speculate", [("fitted", 3), ("fitted", 2), ("shared", 4)])
def test_medusa_greedy_tokens_equal_plain_decoding(models, heads, speculate):
    plain = run(make_engine(models["base"], 0), arrivals())
    stop = [plain[1][6][0]]
    plain = run(make_engine(models["base"], 0), arrivals(stop=stop))
    engine = make_engine(models["base"], speculate, draft_heads=str(models[heads]))
    assert run(engine, arrivals(stop=stop)) == plain
    stats = engine.router.scheduler.speculation
    assert stats.drafted_tokens > 0
    if heads == "fitted":        # alone, the fitted prompt has its drafts accepted
        lone = make_engine(models["base"], speculate, draft_heads=str(models[heads]))
        assert run(lone, {0: arrivals()[0][:1]}) == {0: plain[0]}
        stats = lone.router.scheduler.speculation
        # all but at most one: with 2 drafts a row, one drafts the 23rd token from the 22nd's hidden state, which
        # the fitted heads get wrong (13 of 14 accepted; 16 of 16 with 3 drafts a row)
        assert stats.accepted_tokens >= max(stats.drafted_tokens - 1, 8), stats


def test_medusa_seeded_sampling_equals_plain_decoding(models):
    params = SamplingParams(do_sample=True, seed=11, temperature=0.7, top_k=5, repetition_penalty=1.2)
    plain = run(make_engine(models["base"], 0), arrivals(params))
    assert run(make_engine(models["base"], 3, draft_heads=str(models["fitted"])), arrivals(params)) == plain


def test_two_shards_draft_like_one(models):
    """Tensor parallelism (gloo): the out projections are split by vocabulary rows and their logits gathered,
    so every rank runs the heads; the tokens are those of one shard without speculation."""
    from tests.e2e.server import free_port

    plain = run(make_engine(models["base"], 0), arrivals())
    for heads in ("fitted", "shared"):
        engine = make_engine(models["base"], 3, draft_heads=str(models[heads]), num_shards=2, master_port=free_port())
        with engine:
            assert run(engine, arrivals()) == plain
            assert engine.router.scheduler.speculation.accepted_tokens >= (8 if heads == "fitted" else 0)


def _plan(model_dir, **kw):
    return plan_engine(EngineConfig(model_dir=str(model_dir), device="cpu", **kw))


def test_the_plan_takes_the_heads_and_refuses_what_cannot_work(models, tmp_path):
    plan = _plan(models["base"], speculate=2, draft_heads=str(models["fitted"]))
    assert plan.worker.draft_heads == str(models["fitted"]) and plan.scheduler.draft_heads
    with pytest.raises(ValueError, match="holds Medusa heads, not a model"):
        _plan(models["fitted"], speculate=2)
    with pytest.raises(ValueError, match="--speculate 4 with the 3 Medusa heads.*use 1 to 3"):
        _plan(models["base"], speculate=4, draft_heads=str(models["fitted"]))
    with pytest.raises(ValueError, match="--speculate 0 with the 3 Medusa heads"):
        _plan(models["base"], speculate=0, draft_heads=str(models["fitted"]))
    other = save_tiny_model("llama", tmp_path / "wide", hidden_size=96)
    wide = save_medusa_heads(tmp_path / "wide-heads", other, num_heads=2)
    with pytest.raises(ValueError, match="do not fit the model.*hidden size 64"):
        _plan(models["base"], speculate=2, draft_heads=str(wide))


@pytest.mark.parametrize("change,message", [
    (lambda d: (d / "medusa_lm_head.safetensors").unlink(), "medusa_lm_head.safetensors is missing"),
    (lambda d: (d / "medusa_lm_head.safetensors").rename(d / "medusa_lm_head.pt"), "pickle"),
    (lambda d: _edit_config(d, medusa_num_heads="4"), "medusa_num_heads is '4'"),
    (lambda d: _edit_config(d, medusa_num_layers=-1), "medusa_num_layers is -1"),
    (lambda d: (d / "config.json").write_text("{not json"), "is not valid JSON"),
])
def test_broken_heads_are_refused_with_what_to_do(models, tmp_path, change, message):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(models["fitted"], broken)
    change(broken)
    with pytest.raises(ValueError, match=message):
        _plan(models["base"], speculate=2, draft_heads=str(broken))


def _edit_config(directory, **values):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def test_heads_the_engine_is_not_given_are_named_in_a_warning(models, tmp_path, caplog):
    """A model directory with a heads file beside its weights serves the model (the heads file is not
    read as a weight shard); the warning says the heads are not loaded and how drafts come instead."""
    import shutil

    model = tmp_path / "with-heads"
    shutil.copytree(models["base"], model)
    shutil.copy(models["fitted"] / "medusa_lm_head.safetensors", model)
    with caplog.at_level(logging.WARNING, logger="engine.assembly"):
        plan = _plan(model, speculate=2)
    assert plan.scheduler.speculate == 2 and not plan.scheduler.draft_heads
    assert "does not load" in caplog.text and "medusa_lm_head" in caplog.text
    assert run(make_engine(model, 0), {0: [GenerationRequest(0, [5, 6], 3, SamplingParams())]})[0]


def test_the_launcher_serves_the_base_model_of_a_medusa_model_id(models, tmp_path):
    """TGI's way: --model-id names the heads; their config's base_model_name_or_path is served, --speculate
    defaults to the heads' count, and --speculate 0 leaves them out."""
    import shutil

    from tgi_compat.launch_config import parse_args
    from tgi_compat.launch_plan import plan_server
    from tests.tiny_models import save_tiny_tokenizer

    base = tmp_path / "base"
    shutil.copytree(models["base"], base)
    save_tiny_tokenizer(base)
    heads = save_medusa_heads(tmp_path / "heads", base, num_heads=3)
    environ = {"HF_HUB_OFFLINE": "1"}
    plan = plan_server(parse_args(["--model-id", str(heads)], environ))
    assert (plan.engine.config.model_dir, plan.engine.worker.draft_heads) == (str(base.resolve()), str(heads.resolve()))
    assert plan.engine.scheduler.speculate == 3 and plan.engine.scheduler.draft_heads
    assert plan.frontend.model_dir == str(base.resolve())              # the base model's tokenizer
    two = plan_server(parse_args(["--model-id", str(heads), "--speculate", "2"], environ)).engine
    assert two.scheduler.speculate == 2
    off = plan_server(parse_args(["--model-id", str(heads), "--speculate", "0"], environ)).engine
    assert off.scheduler.speculate == 0 and off.worker.draft_heads is None
    with pytest.raises(ValueError, match="--speculate 5 with the 3 Medusa heads"):
        plan_server(parse_args(["--model-id", str(heads), "--speculate", "5"], environ))
    _edit_config(heads, base_model_name_or_path=None)
    with pytest.raises(ValueError, match="names no base_model_name_or_path"):
        plan_server(parse_args(["--model-id", str(heads)], environ))
    assert read_medusa_config(heads).num_heads == 3
    demo = Path(__file__).resolve().parents[2] / "weights" / "demo"     # its heads name it as ".."
    plan = plan_server(parse_args(["--model-id", str(demo / "medusa")], environ)).engine
    assert plan.config.model_dir == str(demo) and plan.scheduler.speculate == 4 and plan.scheduler.draft_heads
