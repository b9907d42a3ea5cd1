"""Every GEMM kernel a serving step can pick, run once at startup.

cuBLAS picks its kernel by the product's shape, and the first product of the process with a kernel it has
not run before blocks the host until the device's queue has drained. One H200, bf16, [M, 4096] x [4096,
4096] behind about 160 ms of queued GEMMs (``.diag/s55_mm_probe.py``, stop 55): M = 234, 115, 200, 777,
2,853, 2,500 and 3,333 each blocked the host 163-184 ms the first time; M = 234 again, and M = 201, 233,
1,000, 3,000 (kernels already run), 0.02-0.5 ms. After one product at each M from 1 to 1,024 no M up to 1,024
blocked. ``CUDA_MODULE_LOADING=EAGER`` did not change it: it is not the driver's lazy loading.

A server meets it where a step's row count is new, which is where the step is not replayed from a CUDA
graph: the last layer of an eager step runs only the rows it reads (``forward_batch.OutputRows``: one per
request of a burst), the logits of the sampled rows, and eager steps of more tokens than the piecewise graphs
hold. In issue 15's burst (256 requests behind a 3,000-token prefix, one H200) the launch of its steps of
2,700-4,096 tokens took 100-158 ms, 78-139 ms of it in the last layer, where such a product held the host
26-92 ms (torch.profiler) while the device idled behind it.

So the worker multiplies by each distinct weight (``engine.models.layers.gemm_weights``) once at every row
count a step can give it before it serves (``warm_row_counts``): every count up to ``EXACT_ROWS``, and beyond
it the multiples of ``ROW_GRANULE``, to which an eager step's tokens are padded (``padded_tokens``; the padding
is a row of its own, ``padding_row``). One H200, random Llama-2-7B, 4,096 tokens a step: 1,216 row counts of
five weight shapes in 9.4 s, and the server was ready 22.5 s after its start against 23.3 s without it (the
warm-up step and the graph captures had paid for most of those kernels' first products). The burst's time to
first token at the median, from its first request's arrival (server log, two servers each): first bursts
425 / 358 -> 332 / 374 ms, later bursts 601, 518, 559, 546 -> 430, 488, 494, 496 ms; the 512-request load
7,981 -> 8,351 output tokens/s (one run each, ``.diag/s55_call4.sh``).
"""
from __future__ import annotations

import logging
import time

import torch

from engine.protocol.messages import StepRow

log = logging.getLogger(__name__)

EXACT_ROWS = 1024       # every row count up to here is warmed (a step's rows read, its sampled rows' logits)
ROW_GRANULE = 16        # beyond it an eager step's tokens are padded to a multiple of this, each one warmed


def padded_tokens(tokens: int) -> int:
    """The token count an eager step of ``tokens`` runs with (its GEMMs' rows)."""
    if tokens <= EXACT_ROWS:
        return tokens
    return -(-tokens // ROW_GRANULE) * ROW_GRANULE


def warm_row_counts(max_rows: int) -> list[int]:
    """Every row count a GEMM meets in steps of at most ``max_rows`` tokens (``padded_tokens``), ascending."""
    exact = list(range(1, min(max_rows, EXACT_ROWS) + 1))
    return exact + list(range(EXACT_ROWS + ROW_GRANULE, padded_tokens(max_rows) + 1, ROW_GRANULE))


def padding_row(tokens: int, dummy_row: int, dummy_slot: int) -> StepRow:
    """The row an eager step's padding tokens form: the dummy request row, positions 0.., every token writing
    the dummy slot (``req_to_token``'s dummy row maps every position there); it reads and samples nothing."""
    return StepRow(request_id=-1, row=dummy_row, start_pos=0, input_ids=[0] * tokens, slots=[dummy_slot] * tokens,
                   sample=False)


@torch.inference_mode()
def warm_gemms(ops, weights: list, max_rows: int, dtype: torch.dtype, device: torch.device) -> None:
    """``ops.linear`` once with each weight at every row count of ``warm_row_counts(max_rows)`` (zeros). A weight
    whose product runs out of memory is warmed up to the rows that fit (a warning): a large vocabulary's logits
    at a large step budget need not fit beside the weights, and the warm-up must not fail the start."""
    counts = warm_row_counts(max_rows)
    start = time.perf_counter()
    for weight in weights:
        warmed = _warm_weight(ops, weight, counts, dtype, device)
        if warmed < counts[-1]:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log.warning("GEMMs with a weight of shape %s warmed up to %d rows only (out of memory): products of more "
                        "rows may stall the first step that needs each new kernel", tuple(weight.shape), warmed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("GEMMs run once at each of %d row counts (1 to %d) with %d weight shapes in %.1f s", len(counts),
             counts[-1], len(weights), time.perf_counter() - start)


def _warm_weight(ops, weight, counts: list[int], dtype: torch.dtype, device: torch.device) -> int:
    """The most rows ``weight``'s products ran with: ``counts[-1]`` unless one ran out of memory."""
    warmed = 0
    try:
        x = torch.zeros((counts[-1], weight.shape[1]), dtype=dtype, device=device)
        for rows in counts:
            ops.linear(x[:rows], weight)
            warmed = rows
    except torch.OutOfMemoryError:
        pass
    return warmed
