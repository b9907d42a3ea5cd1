"""Steps with prompt tokens on CUDA: every layer's work but its attention replayed from CUDA graphs.

A step that is not a plain decode step (stall-free batching's mixed steps: decode rows beside a prompt
chunk; short prompts) ran eagerly. A Llama-3.1-8B forward issues about 160 Triton launches and 130 GEMMs:
21-25 ms of host time for a mixed step of a 704-token chunk on the H100 host, about as long as the device's
work (stop 44, ``bench.profile_step --prompt-chunk 704``, launch_ms), and longer than it for smaller chunks.
Through these graphs the same steps took 6.5-9.7 ms to launch; a stream decoding beside a 16k-token prompt
in 256-token chunks got steps of 15.0 ms at the median (40 ms at most) against 16.0 (88) eagerly, in process.

Here a step's tokens are padded to a bucket (``PIECEWISE_BUCKETS``, token counts). Each bucket's forward
is captured once as ``layers + 1`` graphs, split where each layer's prefill attention runs: its grid and
split count follow the step's rows and lengths, which a graph cannot hold, so it runs eagerly between two
replays, reading the q that the graph before it left and writing a static buffer that the graph after it
reads (``ops.prefill_attention(..., out=)``). A split is made by the batch's ``attention`` hook
(``ForwardBatch.attention``), so every family's forward splits without knowing it.

Inputs: one pinned host buffer ``[INPUT_ROWS, tokens]`` and one copy:

    inputs[0]  input ids (FED_BACK: the row's last sampled token, replaced inside the graph; padding 0)
    inputs[1]  positions (padding 0)
    inputs[2]  KV slots (padding: the dummy slot)
    inputs[3]  request row of each token (padding: the dummy row)
    inputs[4]  each token's row's sequence length (padding 1; rotary scaling reads it)

and the rows' ``[req_rows, q_start, q_len, seq_len]`` int32 in a second copy for the attention. Padding
tokens write only the dummy slot and attend to nothing (the attention sees the step's own tokens); their
rows of the activations are computed and never read. With graphs off the same padded forward runs
eagerly, its attention inline, so eager and graph steps compute the same numbers (as the decoder's).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.protocol.messages import FED_BACK, Step
from engine.transfer import to_device
from engine.worker.forward_batch import (ForwardBatch, RaggedInputs, context_plan, ragged_inputs, rope_lengths,
                                        shared_prefix_tensors)
from kernels.context_attention import ContextAttention, ContextPlan
from kernels.prefill_attention import aligned_width

log = logging.getLogger(__name__)

INPUT_ROWS = 5
# Step sizes in tokens: padding costs at most one bucket's step of work (64 tokens up to 1,024: about 1.8 ms on
# Llama-3.1-8B at 28 us a token), against the 21-25 ms of host time an eager step took. A stall-free step is a
# cost-capped chunk plus the decode rows; bigger steps (a burst's prompts, no decode rows) keep the device busy
# for longer than their launches take and run eagerly. All buckets: 1.8 s of capture and 570 MiB on the H100.
PIECEWISE_BUCKETS = (16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896,
                     960, 1024, 1152, 1280, 1408, 1536, 1792, 2048)


class RowInputs(NamedTuple):
    """A step's per-row attention inputs (device int32 [B] each) and their host maxima."""
    req_rows: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    seq_len: torch.Tensor
    max_q_len: int
    max_seq_len: int
    shared: tuple[torch.Tensor, torch.Tensor] | None
    tokens: int                   # the step's own tokens (the rest of the bucket is padding)
    context: ContextPlan | None = None   # the rows whose long contexts go to cuDNN first


def row_inputs(x: RaggedInputs, shared, device: torch.device, context: ContextPlan | None = None) -> RowInputs:
    """The attention's per-row inputs in one copy, each starting 16-byte aligned: Triton compiles a kernel per
    pointer alignment class, and rows packed back to back (a row count not a multiple of 4) compiled the
    prefill attention anew mid-serving: 4.2 s on the H100 (stop 44)."""
    rows = len(x.req_rows)
    width = aligned_width(rows)
    padding = [0] * (width - rows)
    values = to_device(x.req_rows + padding + x.q_start + padding + x.q_len + padding + x.seq_len + padding,
                       torch.int32, device).view(4, width)[:, :rows]
    return RowInputs(values[0], values[1], values[2], values[3], max(x.q_len), max(x.seq_len), shared,
                     len(x.input_ids), context)


class Site(NamedTuple):
    """One layer's attention as a capture met it: its q (in the graph's memory) and what else it reads."""
    q: torch.Tensor
    kv: object                    # KVLayer
    req_to_token: torch.Tensor
    sm_scale: float
    mods: object                  # ScoreMods | None


@dataclass
class Pieces:
    """A bucket's captured graphs (one more than its attention sites) and its final hidden states."""
    graphs: list
    sites: list[Site]
    hidden: torch.Tensor


class PiecewiseGraphs:
    def __init__(self, model, ops, kv_cache, last_tokens: torch.Tensor, max_tokens: int, use_graphs: bool,
                 context: ContextAttention | None = None):
        self.model, self.ops, self.kv_cache, self.last_tokens = model, ops, kv_cache, last_tokens
        self.context = context            # long contexts' cuDNN path (``kernels.context_attention``), if any
        limit = min(max_tokens, PIECEWISE_BUCKETS[-1])
        self.buckets = sorted({b for b in PIECEWISE_BUCKETS if b <= limit} | {limit})
        size = self.buckets[-1]
        device = kv_cache.req_to_token.device
        on_gpu = device.type == "cuda"        # on a CPU it runs eagerly (tests)
        self.hosts = [torch.empty((INPUT_ROWS, size), dtype=torch.int64, pin_memory=on_gpu) for _ in range(2)]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()] if on_gpu else None   # each host buffer's copy ran
        self.turn = 0
        self.inputs = torch.zeros((INPUT_ROWS, size), dtype=torch.int64, device=device)
        self.placeholder = torch.zeros(1, dtype=torch.int32, device=device)   # ForwardBatch's unread row fields
        # the attention's output and input buffers, by (heads, head dim, dtype): outside the graphs' memory
        self.outs: dict[tuple, torch.Tensor] = {}
        self.qs: dict[tuple, torch.Tensor] = {}
        self.final: torch.Tensor | None = None
        self.graphs: dict[int, Pieces] = {}
        if use_graphs:
            self._capture_all()

    def accepts(self, step: Step) -> bool:
        return sum(len(r.input_ids) for r in step.rows) <= self.buckets[-1]

    def run(self, step: Step, meanwhile: Callable[[], None] | None = None) -> torch.Tensor:
        """The step's final hidden states [its tokens, hidden] (a view of a static buffer, valid until the
        next step's forward). ``meanwhile``: called after each layer's attention is queued."""
        x = ragged_inputs(step.rows)
        count = len(x.input_ids)
        size = next(b for b in self.buckets if b >= count)
        self.turn ^= 1
        host = self.hosts[self.turn]
        if self.copied is not None:
            self.copied[self.turn].synchronize()            # long done: two steps ago
        host[:, :count] = torch.tensor([x.input_ids, x.positions, x.slots, x.token_rows, rope_lengths(step.rows)])
        self._pad(host, count, size)
        self.inputs[:, :size].copy_(host[:, :size], non_blocking=True)
        if self.copied is not None:
            self.copied[self.turn].record()
        self.kv_cache.write_table(self.inputs[3, :count], self.inputs[1, :count], self.inputs[2, :count])
        inputs = row_inputs(x, shared_prefix_tensors(step.rows, self.inputs.device), self.inputs.device,
                            context_plan(self.context, x))
        pieces = self.graphs.get(size)
        if pieces is None:
            return self._forward(size, _Inline(self, inputs, meanwhile))[:count]
        calls = {}
        for graph, site in zip(pieces.graphs, pieces.sites):
            graph.replay()
            self._attend(site, inputs, calls)
            if meanwhile is not None:
                meanwhile()
        pieces.graphs[-1].replay()
        return pieces.hidden[:count]

    def _pad(self, host: torch.Tensor, start: int, size: int) -> None:
        pad = host[:, start:size]
        pad[0], pad[1], pad[4] = 0, 0, 1
        pad[2] = self.kv_cache.num_slots      # the dummy slot
        pad[3] = self.kv_cache.max_requests   # the dummy row

    def _forward(self, size: int, attention) -> torch.Tensor:
        """The padded forward of ``size`` tokens, each layer's attention through ``attention``."""
        x = self.inputs
        rows = x[3, :size]
        input_ids = torch.where(x[0, :size] == FED_BACK, self.last_tokens[rows], x[0, :size])
        p = self.placeholder
        batch = ForwardBatch(input_ids=input_ids, positions=x[1, :size], out_slots=x[2, :size], req_rows=p,
                             q_start=p, q_len=p, seq_len=p, max_q_len=1, is_decode=False,
                             token_seq_len=x[4, :size], attention=attention)
        return self.model.forward(batch, self.kv_cache)

    def out(self, q: torch.Tensor) -> torch.Tensor:
        """The attention's output buffer for q's heads (the largest bucket's tokens; zeros at first, so padding
        rows hold finite values)."""
        return self._buffer(self.outs, q)

    def staged_q(self, q: torch.Tensor) -> torch.Tensor:
        """The buffer a captured piece leaves q in for the attention: q's shape, contiguous."""
        return self._buffer(self.qs, q)[: q.shape[0]]

    def _final(self, hidden: torch.Tensor) -> torch.Tensor:
        """The buffer the last piece leaves the final hidden states in (``run``'s result)."""
        if self.final is None:
            self.final = torch.empty((self.buckets[-1], hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
        return self.final[: hidden.shape[0]]

    def _buffer(self, buffers: dict, q: torch.Tensor) -> torch.Tensor:
        key = (q.shape[1], q.shape[2], q.dtype)
        if key not in buffers:
            buffers[key] = torch.zeros((self.buckets[-1], *key[:2]), dtype=q.dtype, device=q.device)
        return buffers[key]

    def _attend(self, site: Site, rows: RowInputs, calls: dict) -> torch.Tensor:
        """One layer's attention over the step's own tokens, into the output buffer (returned whole). The step's
        rows are checked and the launch planned once for every layer alike (``ops.prefill_attention_call``;
        ``calls``: the step's, by what a layer's call depends on)."""
        out, n = self.out(site.q), rows.tokens
        key = (site.q.shape, site.q.stride(), site.q.dtype, id(site.req_to_token), site.sm_scale,
               _mods_key(site.mods), site.kv.data.shape, site.kv.data.dtype)
        call = calls.get(key)
        if call is None:
            call = calls[key] = self.ops.prefill_attention_call(
                site.q[:n], site.kv, site.req_to_token, rows.req_rows, rows.q_start, rows.q_len, rows.seq_len,
                site.sm_scale, rows.max_q_len, shared=rows.shared, max_seq_len=rows.max_seq_len, mods=site.mods,
                out=out[:n], context=rows.context)
        call(site.q[:n], site.kv)
        return out

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start, free = time.perf_counter(), torch.cuda.mem_get_info()[0]
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        for size in reversed(self.buckets):             # the largest first: the others reuse its memory
            self._pad(self.inputs, 0, size)
            self._final(self._forward(size, _Skip(self)))   # compile, warm up, allocate the buffers (no attention)
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                split = _Split(self, pool)
                try:
                    hidden = self._forward(size, split)
                    final = self._final(hidden)
                    final.copy_(hidden)        # a buffer outside the graphs' memory: buckets share it
                finally:
                    split.close()
            self.graphs[size] = Pieces(split.pieces, split.sites, final)
        torch.cuda.synchronize()
        pieces = len(self.graphs[self.buckets[-1]].graphs)
        log.info("captured piecewise CUDA graphs (%d pieces each, split at the attention) for steps of %s tokens in "
                 "%.1f s (%.0f MiB)", pieces, self.buckets, time.perf_counter() - start,
                 (free - torch.cuda.mem_get_info()[0]) / 2**20)


def _mods_key(mods) -> tuple | None:
    """A layer's score modifications as a key (layers build their own ``ScoreMods``, equal or not)."""
    return None if mods is None else (mods.window, mods.softcap, id(mods.alibi_slopes))


class _Hook:
    """A ``ForwardBatch.attention``: called as ``ops.prefill_attention`` is, on the padded step's q; the per-row
    arguments are the batch's placeholders (unread). ``site`` gives the layer's attention output."""

    def __init__(self, graphs: PiecewiseGraphs):
        self.graphs = graphs

    def __call__(self, q, kv, req_to_token, req_rows, q_start, q_len, seq_len, sm_scale, max_q_len, shared=None,
                 max_seq_len=None, mods=None, context=None) -> torch.Tensor:
        return self.site(Site(q, kv, req_to_token, sm_scale, mods))[: q.shape[0]]

    def site(self, site: Site) -> torch.Tensor:
        raise NotImplementedError


class _Inline(_Hook):
    """Graphs off: each layer's attention runs at once on the step's own rows."""

    def __init__(self, graphs: PiecewiseGraphs, rows: RowInputs, meanwhile: Callable[[], None] | None = None):
        super().__init__(graphs)
        self.rows, self.meanwhile = rows, meanwhile
        self.calls: dict = {}

    def site(self, site: Site) -> torch.Tensor:
        out = self.graphs._attend(site, self.rows, self.calls)
        if self.meanwhile is not None:
            self.meanwhile()
        return out


class _Skip(_Hook):
    """The warm-up before a capture: the output buffer as it is (the attention kernels were compiled at startup)."""

    def site(self, site: Site) -> torch.Tensor:
        self.graphs.staged_q(site.q)       # the capture's buffers, allocated here, outside its memory
        return self.graphs.out(site.q)


class _Split(_Hook):
    """A capture split at each layer's attention: the graph being captured ends there, the site is kept, and
    the next graph begins; the buffer the eager attention will write stands for its output."""

    def __init__(self, graphs: PiecewiseGraphs, pool):
        super().__init__(graphs)
        self.pool = pool
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.sites: list[Site] = []
        self.current: torch.cuda.CUDAGraph | None = None
        self._begin()

    def _begin(self) -> None:
        self.current = torch.cuda.CUDAGraph()
        self.current.capture_begin(pool=self.pool)

    def _end(self) -> None:
        graph, self.current = self.current, None
        graph.capture_end()
        self.pieces.append(graph)

    def site(self, site: Site) -> torch.Tensor:
        # q into a buffer outside the graphs' memory (one copy in the graph): a site holding q itself would
        # keep its layer's qkv block from reuse, every layer of every bucket (8.5 GB on Llama-3.1-8B)
        q = self.graphs.staged_q(site.q)
        q.copy_(site.q)
        out = self.graphs.out(site.q)      # allocated by the warm-up, outside the graphs' memory too
        self._end()
        self.sites.append(site._replace(q=q))
        self._begin()
        return out

    def close(self) -> None:
        """End the last graph (also after a failed capture, which must not stay open)."""
        if self.current is not None:
            self._end()
