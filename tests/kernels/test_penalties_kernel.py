import pytest
import torch

from kernels.penalties import apply_penalties, apply_penalties_ref


def penalty_inputs(entries_per_request, vocab, device):
    batch = len(entries_per_request)
    logits = 3 * torch.randn(batch, vocab, device=device)
    ids = [torch.randperm(vocab)[:n] for n in entries_per_request]  # unique tokens per request
    token_ids = torch.cat(ids).int().to(device)
    token_counts = torch.randint(1, 6, (token_ids.numel(),), dtype=torch.int32, device=device)
    starts = torch.tensor([0] + entries_per_request).cumsum(0).int().to(device)
    repetition = (0.5 + 1.5 * torch.rand(batch)).to(device)
    frequency = torch.randn(batch).to(device)
    presence = torch.randn(batch).to(device)
    return logits, token_ids, token_counts, starts, repetition, frequency, presence


@pytest.mark.parametrize("entries_per_request,vocab", [([1], 50), ([3, 0, 17, 300], 1000), ([5, 600], 32003)])
def test_apply_penalties_matches_reference(device, entries_per_request, vocab):
    logits, *rest = penalty_inputs(entries_per_request, vocab, device)
    expected = logits.clone()
    apply_penalties_ref(expected, *rest)
    before = logits.clone()
    apply_penalties(logits, *rest)
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=1e-6)
    token_ids, _, starts = rest[0], rest[1], rest[2]
    changed = torch.zeros_like(logits, dtype=torch.bool)
    for b in range(len(entries_per_request)):
        changed[b, token_ids[starts[b]:starts[b + 1]].long()] = True
    assert torch.equal(logits[~changed], before[~changed])
    assert (logits[changed] != before[changed]).all()


def test_apply_penalties_ref_formula(device):
    logits = torch.tensor([[2.0, -2.0, 1.0]], device=device)
    args = (torch.tensor([0, 1], dtype=torch.int32, device=device),
            torch.tensor([3, 1], dtype=torch.int32, device=device),
            torch.tensor([0, 2], dtype=torch.int32, device=device),
            torch.tensor([2.0], device=device), torch.tensor([0.5], device=device),
            torch.tensor([0.25], device=device))
    apply_penalties_ref(logits, *args)
    torch.testing.assert_close(logits, torch.tensor([[2.0 / 2 - 1.5 - 0.25, -2.0 * 2 - 0.5 - 0.25, 1.0]],
                                                    device=device))


def test_apply_penalties_rejects_bad_arguments(device):
    logits, token_ids, token_counts, starts, rep, freq, pres = penalty_inputs([2, 3], 40, device)
    with pytest.raises(ValueError, match="logits has dtype torch.float16"):
        apply_penalties(logits.half(), token_ids, token_counts, starts, rep, freq, pres)
    with pytest.raises(ValueError, match=r"b_token_start has shape \(2,\); expected \(3,\)"):
        apply_penalties(logits, token_ids, token_counts, starts[:2], rep, freq, pres)
    with pytest.raises(ValueError, match="token_ids has dtype torch.int64"):
        apply_penalties(logits, token_ids.long(), token_counts, starts, rep, freq, pres)
    with pytest.raises(ValueError, match=r"presence has shape \(1,\); expected \(2,\)"):
        apply_penalties(logits, token_ids, token_counts, starts, rep, freq, pres[:1])
