import pytest
import torch

from kernels.penalties import apply_penalties, apply_penalties_ref


def penalty_inputs(entries_per_request, vocab, device, pool_size=None):
    """Rows with ``n`` distinct seen tokens each (``None``: a row without penalties), their counts
    in a shuffled pool."""
    batch = len(entries_per_request)
    pool_size = pool_size or batch + 2
    logits = 3 * torch.randn(batch, vocab, device=device)
    counts = torch.zeros(pool_size, vocab, dtype=torch.int32, device=device)
    slots = torch.randperm(pool_size)[:batch]
    pool_rows = torch.full((batch,), -1, dtype=torch.int32)
    for b, n in enumerate(entries_per_request):
        if n is None:
            continue
        pool_rows[b] = slots[b]
        ids = torch.randperm(vocab)[:n]
        counts[slots[b], ids.to(device)] = torch.randint(1, 6, (n,), dtype=torch.int32, device=device)
    repetition = (0.5 + 1.5 * torch.rand(batch)).to(device)
    frequency = torch.randn(batch).to(device)
    presence = torch.randn(batch).to(device)
    return logits, counts, pool_rows.to(device), repetition, frequency, presence


@pytest.mark.parametrize("entries_per_request,vocab", [([1], 50), ([3, None, 0, 17, 300], 1000),
                                                       ([5, 600, None], 32003)])
def test_apply_penalties_matches_reference(device, entries_per_request, vocab):
    logits, *rest = penalty_inputs(entries_per_request, vocab, device)
    expected = logits.clone()
    apply_penalties_ref(expected, *rest)
    before = logits.clone()
    apply_penalties(logits, *rest)
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=1e-6)
    counts, pool_rows = rest[0], rest[1]
    changed = torch.zeros_like(logits, dtype=torch.bool)
    for b in range(len(entries_per_request)):
        if pool_rows[b] >= 0:
            changed[b] = counts[pool_rows[b].long()] > 0
    assert torch.equal(logits[~changed], before[~changed])
    assert (logits[changed] != before[changed]).all()


def test_apply_penalties_ref_formula(device):
    logits = torch.tensor([[2.0, -2.0, 1.0], [5.0, 5.0, 5.0]], device=device)
    counts = torch.tensor([[0, 0, 0], [3, 1, 0]], dtype=torch.int32, device=device)
    args = (counts, torch.tensor([1, -1], dtype=torch.int32, device=device),
            torch.tensor([2.0, 3.0], device=device), torch.tensor([0.5, 1.0], device=device),
            torch.tensor([0.25, 1.0], device=device))
    apply_penalties_ref(logits, *args)
    torch.testing.assert_close(logits, torch.tensor([[2.0 / 2 - 1.5 - 0.25, -2.0 * 2 - 0.5 - 0.25, 1.0],
                                                     [5.0, 5.0, 5.0]], device=device))


def test_apply_penalties_rejects_bad_arguments(device):
    logits, counts, pool_rows, rep, freq, pres = penalty_inputs([2, 3], 40, device)
    with pytest.raises(ValueError, match="logits has dtype torch.float16"):
        apply_penalties(logits.half(), counts, pool_rows, rep, freq, pres)
    with pytest.raises(ValueError, match="counts must have one column per vocabulary id"):
        apply_penalties(logits, counts[:, :39], pool_rows, rep, freq, pres)
    with pytest.raises(ValueError, match="pool_rows has dtype torch.int64"):
        apply_penalties(logits, counts, pool_rows.long(), rep, freq, pres)
    with pytest.raises(ValueError, match=r"presence has shape \(1,\); expected \(2,\)"):
        apply_penalties(logits, counts, pool_rows, rep, freq, pres[:1])
