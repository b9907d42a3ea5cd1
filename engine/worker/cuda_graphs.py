"""Decode steps on CUDA: padded to a bucket size and replayed from captured CUDA graphs.

A decode step has one new token per request. Its inputs travel in one pinned host
buffer and one copy:

    inputs[0]  input ids      inputs[3]  request rows (padding: the dummy row)
    inputs[1]  positions      inputs[4]  sequence lengths (padding: 1)
    inputs[2]  KV slots (padding: the dummy slot)
    inputs[5]  shared prefix length of each row (0: none; padding 0)
    inputs[6]  [0] a shared-prefix member's row, [1] the shared prefix length (0 0: no group)

Buckets of at least ``SHARED_PREFIX_MIN_ROWS`` capture the shared-prefix (cascade) kernel;
it does nothing in a step without a group.

An input id of ``FED_BACK`` is replaced, inside the graph, by ``last_tokens[row]`` (the
token the previous step sampled for the row, still on the device). Two host buffers take
turns, so filling step N+1's never overwrites step N's before its copy has run.

Verify steps (speculation: rows ``[FED_BACK, drafts..]``, beside plain decode rows) have their
own graphs (``PaddedVerifier``): every row padded to ``1 + drafts`` tokens
(``forward_batch.verify_layout``), attended by the prefill kernel (causal within each row).

Medusa draft heads run from graphs of their own (``HeadGraphs``), over the hidden states where each
row's last kept token was chosen.

Padding rows read and write only the dummy slot, so they never touch a request's KV.
Each bucket's forward, logits, final hidden states (draft heads read them) and greedy picks
(``GraphOutputs``) are captured once; ``run`` copies the inputs, writes the new table entries and
replays. With graphs off the same padded forward runs eagerly, so eager and graph decoding compute
exactly the same numbers.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from engine.protocol.messages import FED_BACK, Step
from engine.transfer import to_device
from engine.worker.forward_batch import (SHARED_PREFIX_MIN_ROWS, ForwardBatch, shared_prefix_inputs, verify_batch,
                                        verify_layout)

log = logging.getLogger(__name__)

INPUT_ROWS = 7
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
VERIFY_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)     # verify graphs: larger batches run eagerly
# Medusa heads' graphs up to this many rows; more run eagerly: a graph's pool keeps its heads' logits
# ([heads x rows, vocab] float32) for good, 1 GB at 512 rows of 4 heads over Llama-3's vocabulary
HEAD_GRAPH_ROWS = 64


class PaddedDecoder:
    def __init__(self, model, ops, kv_cache, last_tokens: torch.Tensor, max_requests: int,
                 buckets: tuple[int, ...] | None, use_graphs: bool):
        self.model, self.ops = model, ops
        self.kv_cache = kv_cache
        self.last_tokens = last_tokens
        chosen = sorted({b for b in (buckets or DEFAULT_BUCKETS) if b <= max_requests} | {max_requests})
        self.buckets = chosen
        device = kv_cache.req_to_token.device
        size = max(self.buckets[-1], 2)       # row 6 holds two values (the shared-prefix source), whatever the batch
        on_gpu = device.type == "cuda"        # on a CPU it runs eagerly (bench.spec_bench host)
        self.hosts = [torch.empty((INPUT_ROWS, size), dtype=torch.int64, pin_memory=on_gpu) for _ in range(2)]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()] if on_gpu else None   # each host buffer's copy ran
        self.turn = 0
        self.inputs = torch.empty((INPUT_ROWS, size), dtype=torch.int64, device=device)
        self.q_start = torch.arange(size, dtype=torch.int32, device=device)
        self.q_len = torch.ones(size, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        if use_graphs:
            self._capture_all()

    def accepts(self, step: Step) -> bool:
        return len(step.rows) <= self.buckets[-1] and all(
            len(r.input_ids) == 1 and r.logprob_targets is None for r in step.rows)

    def run(self, step: Step, hidden_states: bool = False) -> GraphOutputs:
        """A decode step's float32 logits [len(step.rows), vocab], with ``hidden_states`` the final hidden states
        (else None), and the rows' greedy picks."""
        count = len(step.rows)
        size = next(b for b in self.buckets if b >= count)
        self.turn ^= 1
        if self.copied is not None:
            self.copied[self.turn].synchronize()            # long done: two steps ago
        self._fill(step.rows, size)
        self.inputs.copy_(self.host, non_blocking=True)     # one contiguous pinned copy (a few KB)
        if self.copied is not None:
            self.copied[self.turn].record()
        self.kv_cache.write_table(self.inputs[3, :count], self.inputs[1, :count], self.inputs[2, :count])
        if size in self.graphs:
            graph, outputs = self.graphs[size]
            graph.replay()
        else:
            outputs = self._forward(size)
        return outputs.rows(slice(0, count), hidden_states)

    @property
    def host(self) -> torch.Tensor:
        return self.hosts[self.turn]

    def _fill(self, rows, size: int) -> None:
        host, count = self.host, len(rows)
        host[0, :count] = torch.tensor([r.input_ids[0] for r in rows])
        host[1, :count] = torch.tensor([r.start_pos for r in rows])
        host[2, :count] = torch.tensor([r.slots[0] for r in rows])
        host[3, :count] = torch.tensor([r.row for r in rows])
        host[4, :count] = host[1, :count] + 1
        lengths, source = shared_prefix_inputs(rows)
        host[5, :count] = torch.tensor(lengths)
        host[6, :2] = torch.tensor(source)
        self._pad(count, size)

    def _pad(self, start: int, size: int) -> None:
        pad = self.host[:, start:size]
        pad[0], pad[1], pad[4], pad[5] = 0, 0, 1, 0
        pad[2] = self.kv_cache.num_slots      # the dummy slot
        pad[3] = self.kv_cache.max_requests   # the dummy row
        if start == 0:
            self.host[6, :2] = 0

    def _forward(self, size: int) -> torch.Tensor:
        x = self.inputs
        rows = x[3, :size]
        input_ids = torch.where(x[0, :size] == FED_BACK, self.last_tokens[rows], x[0, :size])
        batch = ForwardBatch(
            input_ids=input_ids, positions=x[1, :size], out_slots=x[2, :size],
            req_rows=rows.to(torch.int32), q_start=self.q_start[:size], q_len=self.q_len[:size],
            seq_len=x[4, :size].to(torch.int32), max_q_len=1, is_decode=True,
            shared_prefix=(x[5, :size].to(torch.int32), x[6, :2].to(torch.int32))
            if size >= SHARED_PREFIX_MIN_ROWS else None,
        )
        return forward_outputs(self.model, self.ops, batch, self.kv_cache)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self.graphs = capture_graphs(self.buckets, self._dummy_inputs, self._forward)
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _dummy_inputs(self, size: int) -> None:
        self._pad(0, size)
        self.inputs[:, :size].copy_(self.host[:, :size])


class PaddedVerifier:
    """Verify steps on CUDA: ``rows`` rows of ``width`` tokens (``verify_layout``), replayed from
    graphs captured per row bucket. Inputs travel as one pinned host buffer [5, tokens] (ids,
    positions, slots, token rows; row 4 holds the rows' request rows then their sequence lengths)."""

    def __init__(self, model, ops, kv_cache, last_tokens: torch.Tensor, max_requests: int, drafts: int,
                 use_graphs: bool):
        self.model, self.ops, self.kv_cache, self.last_tokens = model, ops, kv_cache, last_tokens
        self.width = 1 + drafts
        self.buckets = sorted({b for b in VERIFY_BUCKETS if b <= max_requests} | {min(max_requests, 64)})
        size = self.buckets[-1] * self.width
        device = kv_cache.req_to_token.device
        on_gpu = device.type == "cuda"        # on a CPU it runs eagerly (tests)
        self.host = torch.empty((5, size), dtype=torch.int64, pin_memory=on_gpu)
        self.copied = torch.cuda.Event() if on_gpu else None
        self.inputs = torch.empty((5, size), dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        if use_graphs:
            self._capture_all()

    def accepts(self, step: Step) -> bool:
        """Decode and verify rows (and one-token prompt chunks) that fit a bucket and the table."""
        limit = self.kv_cache.max_seq_len
        return len(step.rows) <= self.buckets[-1] and all(
            (len(r.input_ids) == 1 or r.input_ids[0] == FED_BACK) and len(r.input_ids) <= self.width
            and r.logprob_targets is None and r.start_pos + self.width <= limit for r in step.rows)

    def run(self, step: Step, hidden_states: bool = False) -> GraphOutputs:
        """float32 logits [the step's tokens, vocab], row after row, with ``hidden_states`` the final hidden
        states there (None without: their gather past the padding costs a copy), and the greedy picks."""
        rows = next(b for b in self.buckets if b >= len(step.rows))
        layout = verify_layout(step.rows, rows, self.width, self.kv_cache.max_requests, self.kv_cache.num_slots)
        tokens = rows * self.width
        if self.copied is not None:
            self.copied.synchronize()                       # the previous step's copy has run
        host = self.host                  # one tensor built from the lists (each build costs ~4 us + its length)
        host[:4, :tokens] = torch.tensor([layout.input_ids, layout.positions, layout.slots, layout.token_rows])
        host[4, : 2 * rows] = torch.tensor(layout.req_rows + layout.seq_len)
        self.inputs[:, :tokens].copy_(host[:, :tokens], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.kv_cache.write_table(self.inputs[3, :tokens], self.inputs[1, :tokens], self.inputs[2, :tokens])
        if rows in self.graphs:
            graph, outputs = self.graphs[rows]
            graph.replay()
        else:
            outputs = self._forward(rows)
        real = layout.real
        if real[-1] == len(real) - 1:     # no padding before the last real token: a view, no index copy
            return outputs.rows(slice(0, len(real)), hidden_states)
        return outputs.rows(to_device(real, torch.int64, outputs.logits.device), hidden_states)

    def _forward(self, rows: int) -> torch.Tensor:
        x, tokens = self.inputs, rows * self.width
        token_rows = x[3, :tokens]
        input_ids = torch.where(x[0, :tokens] == FED_BACK, self.last_tokens[token_rows], x[0, :tokens])
        batch = verify_batch(input_ids, x[1, :tokens], x[2, :tokens], x[4, :rows], x[4, rows : 2 * rows], self.width)
        return forward_outputs(self.model, self.ops, batch, self.kv_cache)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self.graphs = capture_graphs(self.buckets, self._dummy_inputs, self._forward)
        log.info("captured verify CUDA graphs (%d tokens per row) for batch sizes %s", self.width, self.buckets)

    def _dummy_inputs(self, rows: int) -> None:
        layout = verify_layout([], rows, self.width, self.kv_cache.max_requests, self.kv_cache.num_slots)
        tokens = rows * self.width
        for i, values in enumerate((layout.input_ids, layout.positions, layout.slots, layout.token_rows)):
            self.inputs[i, :tokens] = torch.tensor(values)
        self.inputs[4, :rows], self.inputs[4, rows : 2 * rows] = (torch.tensor(layout.req_rows),
                                                                  torch.tensor(layout.seq_len))


class GraphOutputs(NamedTuple):
    """A padded forward's outputs: float32 logits [tokens, vocab], the final hidden states [tokens, hidden]
    (``None`` once selected without them), and ``picks``: each token's greedy choice as
    ``(token ids [tokens] int64, logprobs [tokens] float32)`` (``ops.greedy_pick``), computed inside the graph
    so that a step of plain greedy rows needs no sampling launch after it (the sampler's ``greedy``)."""
    logits: torch.Tensor
    hidden: torch.Tensor | None
    picks: tuple[torch.Tensor, torch.Tensor]

    def rows(self, index, hidden_states: bool) -> "GraphOutputs":
        """The outputs at ``index`` (a slice: views; a tensor: copies), hidden states only if asked for."""
        return GraphOutputs(self.logits[index], self.hidden[index] if hidden_states else None,
                            (self.picks[0][index], self.picks[1][index]))


def forward_outputs(model, ops, batch: ForwardBatch, kv_cache) -> GraphOutputs:
    hidden = model.forward(batch, kv_cache)
    logits = model.compute_logits(hidden)
    return GraphOutputs(logits, hidden, ops.greedy_pick(logits))


def capture_graphs(buckets: list[int], dummy_inputs, forward) -> dict[int, tuple[torch.cuda.CUDAGraph, tuple]]:
    """One CUDA graph of ``forward(size)`` per bucket, with its outputs (e.g. ``GraphOutputs``): the largest
    first (the smaller graphs reuse its memory pool), each run once outside the capture on
    ``dummy_inputs(size)`` (compile, warm up)."""
    graphs, pool = {}, None
    for size in reversed(buckets):
        dummy_inputs(size)
        forward(size)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = forward(size)
        pool = graph.pool()
        graphs[size] = (graph, outputs)
    torch.cuda.synchronize()
    return graphs


class HeadGraphs:
    """Medusa draft heads (``engine.models.medusa.DraftHeads``) on CUDA, replayed from one graph per row
    bucket over a static buffer of hidden states: ``run`` gathers the rows' hidden states into it (one
    kernel) and replays. Eagerly the heads cost ~10 launches each (blocks, activations, residual adds,
    the head, argmax): on a small model at batch 1 that host work cost more than the step itself.
    Rows past the largest bucket (``HEAD_GRAPH_ROWS``), and every row where graphs are off, run eagerly."""

    def __init__(self, heads, ops, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 buckets: list[int], use_graphs: bool):
        self.heads, self.ops = heads, ops
        self.buckets = [b for b in buckets if b <= HEAD_GRAPH_ROWS]
        self.hidden = torch.zeros((max(self.buckets, default=0), hidden_size), dtype=dtype, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if use_graphs and self.buckets:
            with torch.inference_mode():
                self.graphs = capture_graphs(self.buckets, lambda size: None, self._forward)
            log.info("captured Medusa head CUDA graphs for batch sizes %s", self.buckets)

    def _forward(self, size: int) -> torch.Tensor:
        return self.heads(self.ops, self.hidden[:size])

    def run(self, hidden: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, heads] drafts from ``hidden`` [tokens, hidden] at the positions ``index`` (None: every row)."""
        rows = hidden.shape[0] if index is None else index.shape[0]
        size = next((b for b in self.buckets if b >= rows), None)
        if size not in self.graphs:
            return self.heads(self.ops, hidden if index is None else hidden[index])
        if index is None:
            self.hidden[:rows].copy_(hidden)
        else:
            torch.index_select(hidden, 0, index, out=self.hidden[:rows])
        graph, drafts = self.graphs[size]
        graph.replay()
        return drafts[:rows]
