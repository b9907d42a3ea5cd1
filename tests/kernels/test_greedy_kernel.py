import math

import pytest
import torch

from kernels.greedy import BLOCK, greedy_pick, greedy_pick_ref


def assert_picks_equal(logits, splits=None):
    tokens, logprobs = greedy_pick(logits, splits=splits)
    want_tokens, want_logprobs = greedy_pick_ref(logits)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs, atol=2e-6, rtol=2e-6, equal_nan=True)
    return tokens, logprobs


@pytest.mark.parametrize("rows,vocab,splits", [(1, 1, None), (3, 50, None), (2, BLOCK + 1, None), (2, 5000, 3),
                                               (5, 3 * BLOCK, 3), (1, 32003, 7)])
def test_greedy_pick_matches_argmax_and_log_softmax(device, rows, vocab, splits):
    logits = 4 * torch.randn(rows, vocab, device=device)
    assert_picks_equal(logits, splits)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_the_first_of_equal_maxima_wins_within_and_across_splits(device, splits):
    vocab = 3 * BLOCK
    logits = torch.randn(4, vocab, device=device)
    for row, columns in enumerate([(5, 9), (7, BLOCK + 3), (2 * BLOCK + 1, BLOCK), (vocab - 1, 0)]):
        logits[row, list(columns)] = 10.0
    tokens, _ = assert_picks_equal(logits, splits)
    assert tokens.tolist() == [5, 7, BLOCK, 0]


def test_masked_columns_and_extreme_rows(device):
    vocab = 2 * BLOCK + 10
    logits = torch.randn(4, vocab, device=device)
    logits[0, : vocab - 1] = float("-inf")                  # only the last column is finite
    logits[1] = float("-inf")                               # nothing finite: column 0, as torch
    logits[2, 100] = float("nan")                           # NaN wins, as in torch's argmax
    logits[3] = 0.0                                         # flat: the first column, logprob -log(V)
    tokens, logprobs = greedy_pick(logits, splits=2)
    assert tokens.tolist() == [vocab - 1, 0, 100, 0]
    assert logprobs[0].item() == 0.0
    assert math.isnan(logprobs[2].item())
    assert logprobs[3].item() == pytest.approx(-math.log(vocab), abs=1e-5)
    assert torch.equal(tokens, greedy_pick_ref(logits)[0])


def test_a_row_of_a_wider_tensor_is_read_by_its_stride(device):
    wide = torch.randn(6, 700, device=device)
    assert_picks_equal(wide[::2, :500], splits=None)


def test_no_rows_give_empty_results(device):
    tokens, logprobs = greedy_pick(torch.empty(0, 10, device=device))
    assert tokens.shape == (0,) and logprobs.shape == (0,)


def test_greedy_pick_rejects_bad_logits(device):
    with pytest.raises(ValueError, match="logits has dtype torch.float16"):
        greedy_pick(torch.randn(2, 8, device=device).half())
    with pytest.raises(ValueError, match="contiguous last dim"):
        greedy_pick(torch.randn(8, 2, device=device).t())
    with pytest.raises(ValueError, match="no columns"):
        greedy_pick(torch.empty(2, 0, device=device))
