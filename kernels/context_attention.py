"""A prompt chunk's attention to its long context through cuDNN's fused attention, beside the prefill kernel.

A chunk of a long prompt attends to every key before it (the context) and causally to its own. The first part is
most of the work at long context: 87% of a 32k-token prompt's attention and 96% of a 100k one's in 4,096-token
chunks. There every query sees every key, and cuDNN's attention (through torch) runs it faster than the prefill
kernel walks it. One H200, Llama-3.1-8B heads, bf16, 4,096 queries (``.diag``'s probes of stop 73):

| context keys | prefill kernel (its walk of them) | cuDNN, K/V gathered first (gather included) |
| --- | --- | --- |
| 4,096 | 0.557 ms (493 TFLOP/s) | 0.482 + 0.021 ms |
| 28,672 | 4.006 ms (480 TFLOP/s) | 2.847 + 0.077 ms |
| 98,304 | 15.586 ms (423 TFLOP/s) | 10.560 + 0.227 ms |

How a chunk's row takes it (``ContextAttention.plan``, then ``start``): a row with ``piece`` or more new tokens and
``bucket`` or more keys before them hands its first ``keys`` positions (the context rounded down to whole buckets)
to cuDNN. Their K/V are gathered through ``req_to_token`` into a contiguous workspace (any slots, one copy). Each
``piece`` rows of queries attend to them without a mask. That gives each query row its normalised output and
log-sum-exp. The prefill kernel then starts those rows from that state, as it does behind a shared prefix (``first``
= ``keys``), and walks the rest: the context's last keys short of a bucket and the chunk's own keys, causally.
A row's last new tokens short of a whole piece (its tail) take one more piece that ends at the row's last token,
overlapping the one before, unless they are at most half a piece (``tail_walks``): then they are a row of their own
in the prefill kernel (``ContextPlan.kernel_rows``), which walks their whole context from key 0, their programs
first. A 32,000-token prompt's last chunk (3,328 tokens: 3 pieces and 256) saves a piece a layer so: one H200, random
Llama-3.1-8B through HTTP, three prompts before and after in one run, TTFT 1.223-1.228 -> 1.202-1.213 s (stop 74).
A row of exactly ``bucket`` new tokens (every chunk of a long prompt but its last at the default step budget) takes
them in one call (``ContextAttention.calls``). Where it is the step's only such row, at token 0 (a long prompt alone),
the kernel starts from that call's output as it is; every other call's output is copied into the buffers. Against four
pieces (each copied), one H200, random Llama-3.1-8B through HTTP, the two alternating, two runs each (stop 75): a
32,000-token prompt's TTFT 1.173-1.180 -> 1.169-1.173 s, a 100,000-token one's 6.588 / 6.606 -> 6.583 / 6.585 s.

Tried and not kept (stop 74): a row of exactly ``bucket`` new tokens behind whole buckets also attending to its own
keys through cuDNN (the chunk against itself with cuDNN's causal mask, which torch aligns top-left), merged with its
context's result by a small Triton kernel, and no prefill kernel for the row. Alone, one H200, Llama-3.1-8B heads,
bf16, a 4,096-token diagonal took 0.275 ms in cuDNN (499 TFLOP/s) against the prefill kernel's 0.402 (342); in the
model, a 4,096-token chunk at 28,672 keys (``bench.profile_step``, one run) 203.8 -> 203.4 ms: the merge and the
copies ate the gain. Through HTTP the tail rows above and this together took a 32,000-token prompt's TTFT 1.219-1.224
-> 1.201-1.205 s, no more than the tail rows alone gained in another run (stop 74's note).

Tried and not kept (stop 75; one H200, Llama-3.1-8B heads, bf16, one layer of a 4,096-token chunk: the gather, the
cuDNN pieces and their copies, then the prefill kernel; CUDA events, ``.diag`` probes of one run): pieces whose
contexts grow by a piece each (bucket = piece = 1,024: piece j also attends to the chunk's first j pieces through
cuDNN, and the kernel walks only each piece's own keys, as four rows of 1,024). At 28,672 context keys 3.362 -> 3.342
ms, at 8,192 1.331 -> 1.296, at 0 (a first chunk) 0.433 -> 0.698, for four times the graph shapes: the kernel's short
rows took 0.258 ms against the one row's 0.462 for a quarter of its work (alone, launch included). q as the model
passes it (a view of the fused qkv projection's output) runs a piece at 28,672 keys as fast as a contiguous copy
(0.835 / 0.861 against 0.822 / 0.840 ms).

cuDNN builds a graph for every new shape: about 45 ms each on the H200 (the first about 0.5 s). So the shapes are
fixed, ``piece`` queries (and ``bucket`` queries, where a step holds that many tokens) by a multiple of ``bucket``
keys: ``max_keys / bucket`` graphs each, which ``warm`` builds at startup. No graph is built while requests wait.
1,024 queries a call run as fast as 4,096 (676 against 673 TFLOP/s at 28,672 keys).

The workspace (the largest context's K/V for one layer, a ``1 / layers`` share of one longest request's KV) and
the partial results (the step's tokens) are allocated once, before the KV cache is sized. The CPU runs the same
plan with a torch reference in place of cuDNN (``_attend_piece_ref``): that is how CI proves the merge.

In the model (one H200, random Llama-3.1-8B, ``bench.profile_step --batch-sizes 0 --prompt-chunk 4096
--chunk-context 28672 --table-dir``, PDL off): a layer's cuDNN pieces take 3.23 ms (807 us each, 13% slower than
alone), the prefill kernel 0.40 ms and the gather 0.07 ms; the step 201 ms. Through HTTP (``bench.long_prompt_bench``,
4eb6600 then this path in one run, two prompts each): one 32,000-token prompt's TTFT 1.313 / 1.296 -> 1.248 / 1.241 s,
one 100,000-token prompt's 7.638 / 7.665 -> 6.883 / 6.877 s; KV slots 844,991 -> 841,435 (the 480 MiB workspace of
``--max-input-tokens 120000``); 30 graph shapes built at startup in 1.2 s. A prompt prefilled beside decoding
streams gets chunks cut by the stall-free cost cap, mostly shorter than a piece: the prefill kernel walks them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import aligned_width

BUCKET = 4096   # keys a cuDNN call takes are a multiple of this (one graph per multiple)
PIECE = 1024    # queries a cuDNN call takes
LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class ContextRow:
    """One row of the step whose context goes to cuDNN: its first ``keys`` positions."""
    req_row: int    # its row of req_to_token
    q_start: int    # its first new token in the step
    q_len: int
    keys: int


@dataclass(frozen=True)
class ContextPlan:
    """The rows of a step whose contexts go to cuDNN, and the prefill kernel's rows to go on from there."""
    owner: "ContextAttention"
    rows: tuple[ContextRow, ...]
    kernel_rows: torch.Tensor   # [5, B'] int32: the prefill kernel's rows (req_to_token row, first new token, new
    #                             tokens, length, keys already attended), a row's tail (``tail_walks``) apart; each
    #                             of the five starts 16-byte aligned (``aligned_width``)
    max_walk: int               # the most keys the prefill kernel walks for a row (its split rule's length)

    def start(self, q: torch.Tensor, kv_layer: torch.Tensor, req_to_token: torch.Tensor,
              sm_scale: float) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        """(the prefill kernel's rows: req_row, q_start, q_len, seq_len, first, each [B']; partial outputs
        [T', Hq, D]; their log2-sum-exps [T', Hq]) of this layer: the kernel's start for the planned rows (the owner's
        buffers, T' >= T; or one call's outputs, ``ContextAttention.attend``)."""
        return tuple(self.kernel_rows.unbind(0)), *self.owner.attend(self.rows, q, kv_layer, req_to_token, sm_scale)


class ContextAttention:
    """The workspace, the partial-result buffers and the graph shapes of one model's context attention (one per
    worker; ``q_heads`` / ``kv_heads``: this shard's)."""

    def __init__(self, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_keys: int, max_tokens: int, bucket: int = BUCKET, piece: int = PIECE):
        if bucket < 1 or piece < 1 or q_heads % kv_heads:
            raise ValueError(f"bucket ({bucket}) and piece ({piece}) must be positive and q heads ({q_heads}) a "
                             f"multiple of kv heads ({kv_heads})")
        self.bucket, self.piece = bucket, piece
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.max_keys = max(0, max_keys) // bucket * bucket
        self.max_tokens = max_tokens
        self.cudnn = torch.device(device).type == "cuda"
        self.workspace = torch.empty((self.max_keys, 2 * kv_heads, head_dim), dtype=dtype, device=device)
        self.mid_out = torch.zeros((max_tokens, q_heads, head_dim), dtype=dtype, device=device)
        self.mid_lse = torch.zeros((max_tokens, q_heads), dtype=torch.float32, device=device)
        self.whole = bucket != piece and max_tokens >= bucket    # a row of a bucket's tokens takes one call (calls)

    @property
    def enabled(self) -> bool:
        return self.max_keys > 0

    def plan(self, req_rows: list[int], q_start: list[int], q_len: list[int], seq_len: list[int]) -> ContextPlan | None:
        """The step's rows (host lists) whose contexts go to cuDNN, or None when no row's does."""
        if max(q_len, default=0) < self.piece or sum(q_len) > self.max_tokens:
            return None     # no chunk of a piece (checked at C speed: 256 decode rows took 77 us in the loop below)
        rows, tails, kernel = [], [], []
        for row, start, n, total in zip(req_rows, q_start, q_len, seq_len):
            keys = min((total - n) // self.bucket * self.bucket, self.max_keys)
            if keys <= 0 or n < self.piece:
                kernel.append((row, start, n, total, 0))
                continue
            tail = n % self.piece if tail_walks(n % self.piece, self.piece) else 0
            rows.append(ContextRow(row, start, n - tail, keys))
            kernel.append((row, start, n - tail, total - tail, keys))
            if tail:
                tails.append((row, start + n - tail, tail, total, 0))
        if not rows:
            return None
        kernel = tails + kernel         # the tails' long walks start first (the kernel's grid runs rows in order)
        max_walk = max(total - first for _, _, _, total, first in kernel)
        width = aligned_width(len(kernel))        # each of the five arrays 16-byte aligned, as the step's are
        kernel_rows = torch.zeros((5, width), dtype=torch.int32, pin_memory=self.cudnn)
        kernel_rows[:, : len(kernel)] = torch.tensor(list(zip(*kernel)), dtype=torch.int32)
        device_rows = kernel_rows.to(self.workspace.device, non_blocking=True)[:, : len(kernel)]
        return ContextPlan(self, tuple(rows), device_rows, max_walk)

    def attend(self, rows: tuple[ContextRow, ...], q: torch.Tensor, kv_layer: torch.Tensor,
               req_to_token: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Each planned row's queries against its context's keys (one layer): normalised outputs and log2-sum-exps
        written at the rows' tokens of ``mid_out`` / ``mid_lse``, both returned whole; but a lone row at token 0 taken
        in one call returns that call's outputs in place of ``mid_out`` (its T tokens only: the kernel reads no other
        token's start)."""
        attend = _attend_piece if self.cudnn else _attend_piece_ref
        mid_out = self.mid_out
        for row in rows:
            keys = self.workspace[: row.keys]
            torch.index_select(kv_layer, 0, req_to_token[row.req_row, : row.keys], out=keys)
            for start, size in self.calls(row.q_len):
                tokens = slice(row.q_start + start, row.q_start + start + size)
                out, lse = attend(q[tokens], keys, self.kv_heads, sm_scale)
                if len(rows) == 1 and row.q_start == 0 and size == row.q_len:
                    mid_out = out       # the step's one call, at token 0: its output is the kernel's start as it is
                else:
                    self.mid_out[tokens] = out
                torch.mul(lse, LOG2E, out=self.mid_lse[tokens])
        return mid_out, self.mid_lse

    def calls(self, q_len: int) -> list[tuple[int, int]]:
        """(first query, queries) of each cuDNN call of a row of ``q_len`` (>= piece) new tokens: one call of them all
        when they are a whole bucket and the buffers hold one (``whole``), else its pieces (``piece_starts``)."""
        if q_len == self.bucket and self.whole:
            return [(0, q_len)]
        return [(start, self.piece) for start in piece_starts(q_len, self.piece)]

    def warm(self) -> int:
        """Build cuDNN's graph of every shape ``attend`` can use (one call each on the workspace): none is built
        while requests wait. Returns the number of shapes."""
        self.mid_out.zero_()
        self.workspace.zero_()
        shapes = 0
        for queries in (self.piece, self.bucket) if self.whole else (self.piece,):
            for keys in range(self.bucket, self.max_keys + 1, self.bucket):
                (_attend_piece if self.cudnn else _attend_piece_ref)(self.mid_out[:queries], self.workspace[:keys],
                                                                      self.kv_heads, 1.0)
                shapes += 1
        return shapes


def tail_walks(tail: int, piece: int) -> bool:
    """Whether a row's last ``tail`` new tokens short of a whole piece walk their context in the prefill kernel (as
    a row of their own from key 0) rather than in one more piece overlapping the one before: up to half a piece.
    Their programs walk the whole context side by side with the rest of the kernel; more of them than that would
    take longer than a piece."""
    return 0 < tail and 2 * tail <= piece


def piece_starts(q_len: int, piece: int) -> list[int]:
    """Where each ``piece`` of a row's ``q_len`` (>= piece) new tokens starts: whole pieces, then one that ends at
    the last token (overlapping the one before it unless ``piece`` divides ``q_len``)."""
    starts = list(range(0, q_len - piece + 1, piece))
    if starts[-1] + piece < q_len:
        starts.append(q_len - piece)
    return starts


def _attend_piece(q: torch.Tensor, keys: torch.Tensor, kv_heads: int,
                  sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, Hq, D] against every key of ``keys`` [S, 2*Hk, D] (K heads, then V heads), no mask, through cuDNN:
    (output [n, Hq, D], natural log-sum-exp [n, Hq]), both views."""
    k = keys[:, :kv_heads].permute(1, 0, 2).unsqueeze(0)
    v = keys[:, kv_heads:].permute(1, 0, 2).unsqueeze(0)
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(q.permute(1, 0, 2).unsqueeze(0), k, v, None, True,
                                                                 0.0, False, False, scale=sm_scale)
    return result[0][0].transpose(0, 1), result[1].reshape(q.shape[1], q.shape[0]).transpose(0, 1)


def _attend_piece_ref(q: torch.Tensor, keys: torch.Tensor, kv_heads: int,
                      sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``_attend_piece`` in float32 torch (any device): the CPU's stand-in for cuDNN."""
    group = q.shape[1] // kv_heads
    k = keys[:, :kv_heads].float().repeat_interleave(group, 1)
    v = keys[:, kv_heads:].float().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,shd->hns", q.float(), k) * sm_scale
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("hns,shd->nhd", torch.exp(scores - lse[..., None]), v)
    return out.to(q.dtype), lse.transpose(0, 1)
