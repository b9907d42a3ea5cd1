import math

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from engine.ops import KernelOps
from engine.sampling.hashing import hash_uniform
from engine.sampling.sampler import RowSampling, Sampler
from engine.protocol.messages import SamplingParams


VOCAB = 64


@pytest.fixture(params=["torch", "triton"])
def sampler(request):
    return Sampler(KernelOps.create(request.param), torch.device("cpu"), vocab_size=VOCAB)


def row(seed=0, step=0, history=(), counts_in=None, **params):
    """A row state; with penalties, ``history`` goes into ``counts_in`` (the sampler's PenaltyCounts)."""
    state = RowSampling(SamplingParams(**params), seed=seed, step=step, num_tokens=len(history))
    if state.params.has_penalties:
        state.penalty_row = counts_in.acquire()
        counts_in.add(state.penalty_row, list(history))
    return state


def test_greedy_picks_argmax_and_reports_its_logprob(sampler):
    logits = torch.randn(3, 50)
    out = sampler(logits.clone(), [row(), row(), row(top_n_tokens=3)])
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-5)
    top = torch.log_softmax(logits[2], -1).topk(3)
    assert out.top_ids[2] == top.indices.tolist() and out.top_ids[0] == []
    assert torch.allclose(torch.tensor(out.top_logprobs[2]), top.values, atol=1e-5)


def test_plain_greedy_rows_take_the_given_picks_and_the_rest_take_the_processors(sampler):
    """``greedy`` (a decode graph's ``ops.greedy_pick``) is the sample when every row is plain greedy, with nothing
    launched after it; a batch with a row that asks for anything else (top-n, penalties, sampling, the watermark)
    goes through the processors, and its greedy rows get the same tokens and logprobs as the picks."""
    logits = torch.randn(3, VOCAB)
    picks = sampler.ops.greedy_pick(logits)
    assert torch.equal(picks[0], logits.argmax(-1))
    plain = sampler.launch(logits.clone(), [row(), row(temperature=0.5), row()], greedy=picks)
    assert plain.token_ids is picks[0] and plain.logprobs is picks[1] and plain.top_ids is None
    for other in (row(top_n_tokens=2), row(history=[1], counts_in=sampler.penalties, presence_penalty=0.5),
                  row(do_sample=True, seed=3), row(watermark=True)):
        mixed = sampler.launch(logits.clone(), [row(), row(temperature=0.5), other], greedy=picks)
        assert mixed.token_ids is not picks[0]
        assert torch.equal(mixed.token_ids[:2], picks[0][:2])
        torch.testing.assert_close(mixed.logprobs[:2], picks[1][:2], atol=1e-6, rtol=1e-6)


def test_repetition_penalty_matches_transformers(sampler):
    logits = torch.randn(1, VOCAB)
    history = [3, 5, 5, 9, 30]
    rows = [row(history=history, counts_in=sampler.penalties, repetition_penalty=1.7, top_n_tokens=VOCAB)]
    out = sampler(logits.clone(), rows)
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([history]), logits.clone())
    got = torch.full((VOCAB,), float("nan"))
    got[out.top_ids[0]] = torch.tensor(out.top_logprobs[0])
    assert torch.allclose(got, torch.log_softmax(expected[0], -1), atol=1e-5)


def test_frequency_and_presence_penalties(sampler):
    logits = torch.randn(1, VOCAB)
    history = [4, 4, 4, 7]
    rows = [row(history=history, counts_in=sampler.penalties, frequency_penalty=1.0, presence_penalty=0.5,
                top_n_tokens=VOCAB)]
    out = sampler(logits.clone(), rows)
    expected = logits[0].clone()
    expected[4] -= 1.0 * 3 / 4 + 0.5
    expected[7] -= 1.0 * 1 / 4 + 0.5
    got = torch.full((VOCAB,), float("nan"))
    got[out.top_ids[0]] = torch.tensor(out.top_logprobs[0])
    assert torch.allclose(got, torch.log_softmax(expected, -1), atol=1e-5)


def test_penalty_counts_follow_the_steps_on_the_device(sampler):
    """Over several steps, two penalised rows and one without: each step's penalised logits are
    those of an explicit host count of prompt + sampled tokens; a released row is reused zeroed."""
    torch.manual_seed(0)
    prompts = [[1, 2, 2, 3], [5, 5, 6], [7, 8]]
    params = [dict(repetition_penalty=1.5, frequency_penalty=0.5), dict(presence_penalty=0.7), dict()]
    rows = [row(history=p, counts_in=sampler.penalties, top_n_tokens=VOCAB, **kw) for p, kw in zip(prompts, params)]
    histories = [list(p) for p in prompts]
    for step in range(4):
        logits = torch.randn(3, VOCAB)
        out = sampler(logits.clone(), rows)
        for b, (state, kw) in enumerate(zip(rows, params)):
            expected = logits[b].clone()
            for token in set(histories[b]) if state.penalty_row >= 0 else ():
                count, value = histories[b].count(token), expected[token]
                value = value * kw.get("repetition_penalty", 1.0) if value < 0 else value / kw.get("repetition_penalty", 1.0)
                expected[token] = value - (kw.get("frequency_penalty", 0.0) / len(histories[b]) * count
                                           + kw.get("presence_penalty", 0.0))
            got = torch.full((VOCAB,), float("nan"))
            got[out.top_ids[b]] = torch.tensor(out.top_logprobs[b])
            assert torch.allclose(got, torch.log_softmax(expected, -1), atol=1e-5), (step, b)
            histories[b].append(out.token_ids[b])
            state.num_tokens += 1
    first = rows[0].penalty_row
    sampler.penalties.release(first)
    assert sampler.penalties.acquire() == first and not sampler.penalties.counts[first].any()


@pytest.mark.parametrize("params,warper", [
    (dict(temperature=0.7), TemperatureLogitsWarper(0.7)),
    (dict(top_k=5), TopKLogitsWarper(5)),
    (dict(top_p=0.8), TopPLogitsWarper(0.8)),
    (dict(typical_p=0.6), TypicalLogitsWarper(0.6)),
])
def test_warpers_keep_the_same_tokens_as_transformers(sampler, params, warper):
    logits = torch.randn(4, 64) * 3
    expected = warper(None, logits.clone())
    warped = sampler._warp(logits.clone(), [SamplingParams(do_sample=True, **params)] * 4)
    assert torch.equal(torch.isinf(expected), warped <= torch.finfo(torch.float32).min)
    kept = ~torch.isinf(expected)
    assert torch.allclose(warped[kept], expected[kept], atol=1e-5)


def test_seeded_sampling_reproduces_whatever_shares_the_batch(sampler):
    logits = torch.randn(1, 100)
    alone = sampler(logits.clone(), [row(seed=42, step=3, do_sample=True)]).token_ids[0]
    others = torch.randn(3, 100)
    mixed = sampler(torch.cat([others[:2], logits, others[2:]]),
                    [row(seed=1, do_sample=True), row(), row(seed=42, step=3, do_sample=True), row(seed=9, do_sample=True)])
    assert mixed.token_ids[2] == alone
    different = {sampler(logits.clone(), [row(seed=s, step=3, do_sample=True)]).token_ids[0] for s in range(30)}
    assert len(different) > 5


def test_exponential_race_draws_from_the_distribution(sampler):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None, :].repeat(4000, 1)
    rows = [row(seed=123, step=i, do_sample=True) for i in range(4000)]
    counts = torch.bincount(torch.tensor(sampler(logits, rows).token_ids), minlength=4).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03)


def test_hash_uniform_is_uniform_and_handles_64_bit_seeds():
    seeds = torch.tensor([0, 1, 2**62, -(2**63)], dtype=torch.int64)
    u = hash_uniform(seeds, torch.tensor([0, 5, 7, 9]), 20000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    assert not torch.equal(u[0], u[1])


def test_sampling_params_reject_out_of_range_values():
    for bad in [dict(temperature=0), dict(top_p=0), dict(top_k=-1), dict(repetition_penalty=0), dict(seed=2**64)]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert math.isfinite(SamplingParams().temperature)
