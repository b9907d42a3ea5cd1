"""A shard worker: the model, its KV buffers and the sampler; runs one Step at a time.

The worker keeps no request bookkeeping beyond what sampling needs (parameters, seed,
token counts for penalties); the router owns slots and rows and tells it everything.

On CUDA a step runs one of three ways: plain decode steps through the decoder's CUDA graphs
(``cuda_graphs.PaddedDecoder``), verify steps through the verifier's, and any other step of up to
``piecewise.PIECEWISE_BUCKETS[-1]`` tokens (prompt chunks, with or without decode rows) through the
piecewise graphs, which run every layer's work from graphs but its attention
(``piecewise.PiecewiseGraphs``). Larger steps, and every step on a CPU, run the ragged forward eagerly,
its last layer's attention and MLP only for the tokens the step reads (``forward_batch.OutputRows``).

Verify rows (``[FED_BACK, d1 .. dn]``, speculation) run as short prompt chunks through the
prefill attention (causal among their own tokens), eagerly or through the verify CUDA graphs.
Their logits at every position are sampled as n + 1 rows whose states assume the drafts before
them were accepted (token index, token count, previous token, penalty counts with the drafts in
scratch rows): position j chooses what decoding one token at a time would choose after ``d1 .. dj``,
with the same seeded draw. Draft ``d(j+1)`` is accepted while it equals that choice; the row
returns the accepted drafts plus the first choice that differs (or the bonus token after the
last draft). Greedy rows thus give exactly the tokens of ``--speculate 0``, and sampled rows the
very tokens of the same seed: the draft is accepted with probability p(d), and a rejection
draws from p without d, renormalised (rejection sampling with a point-mass draft).

With Medusa heads (``WorkerConfig.draft_heads``, ``engine.models.medusa``) every sampled row's
result also carries the heads' drafts for the positions after its last kept token: the heads read
the final hidden state at the position whose logits chose that token (a verify row's
``_last_kept``), on every rank (their out projections are split like the model's head), replayed
from CUDA graphs of their own on a GPU (``cuda_graphs.HeadGraphs``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.models import build_model, load_model_config
from engine.models.config import ModelConfig
from engine.models.layers import attention_blocks, gemm_weights
from engine.models.medusa import DraftHeads, read_medusa_config
from engine.models.parallel import TensorParallel
from engine.models.rope import plain_rope_length
from engine.ops import KernelOps, default_backend
from engine.protocol.messages import (FED_BACK, NO_PREFIX, PrefixSlots, RowResult, SamplingParams, Step, StepResult,
                                      StepRow)
from engine.sampling.grammar import GrammarCompiler, GrammarMatcher
from engine.sampling.sampler import RowSampling, Sampler
from engine.sampling.watermark import WatermarkConfig
from engine.transfer import start_to_host, to_device
from engine.worker.cuda_graphs import HeadGraphs, PaddedDecoder, PaddedVerifier
from engine.worker.forward_batch import (SHARED_PREFIX_MIN_ROWS, ForwardBatch, context_plan, output_rows,
                                        ragged_inputs, read_tokens, rope_lengths, shared_prefix_tensors)
from engine.worker.gemm_warmup import padded_tokens, padding_row, warm_gemms
from engine.worker.kv_cache import KVCache, kv_cache_dtype, read_kv_scales
from engine.worker.piecewise import PiecewiseGraphs
from kernels.context_attention import BUCKET as CONTEXT_BUCKET
from kernels.context_attention import PIECE as CONTEXT_PIECE
from kernels.context_attention import ContextAttention
from kernels.prefill_attention import MIN_SPLIT_KEYS
from weights.checkpoint import open_checkpoint

log = logging.getLogger(__name__)

class LaunchedStep:
    """A step whose device work is queued; ``result()`` waits for it (once) and returns its rows."""

    def __init__(self, finish, event=None):
        self._finish = finish
        self._event = event
        self._result: StepResult | None = None

    @classmethod
    def done(cls, result: StepResult) -> "LaunchedStep":
        step = cls(None)
        step._result = result
        return step

    def ready(self) -> bool:
        """Whether ``result()`` would return without waiting for the device."""
        return self._result is not None or self._event is None or self._event.query()

    def result(self) -> StepResult:
        if self._result is None:
            self._result = self._finish()
        return self._result


@dataclass(frozen=True)
class WorkerConfig:
    model_dir: str
    dtype: torch.dtype
    device: torch.device
    kernel_backend: str
    max_requests: int
    max_seq_len: int
    num_slots: int | None = None          # None: size from free device memory
    memory_fraction: float = 0.9          # of the memory free after weights and warm-up (CUDA)
    warmup_tokens: int = 4096             # the largest step (prefill budget) the warm-up runs
    cuda_graphs: tuple[int, ...] | None = None   # decode batch sizes to capture; () = eager (CUDA only)
    watermark_gamma: float = 0.5          # TGI's --watermark-gamma / --watermark-delta
    watermark_delta: float = 2.0
    kv_cache_dtype: str | None = None     # --kv-cache-dtype: int8 | fp8_e4m3fn | fp8_e5m2; None: ``dtype``
    speculate: int = 0                    # --speculate: drafts per verify row (the warm-up runs such a step)
    draft_heads: str | None = None        # a directory of Medusa heads (engine.models.medusa): the first
                                          # ``speculate`` heads draft after every sampled row
    # (bucket, piece) of the prompt chunks' long contexts through cuDNN (``kernels.context_attention``) where it
    # applies (``context_attention_applies``); None: the prefill kernel walks every key
    context_attention: tuple[int, int] | None = (CONTEXT_BUCKET, CONTEXT_PIECE)


def resolve_dtype(requested: str | None, config: ModelConfig, device: torch.device) -> torch.dtype:
    """--dtype if given; else the checkpoint's half precision on a GPU, float32 on a CPU."""
    if requested:
        names = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
        if requested not in names:
            raise ValueError(f"--dtype {requested!r} is not supported; use float16, bfloat16 or float32")
        return names[requested]
    if device.type == "cpu":
        return torch.float32
    if config.checkpoint_dtype in (torch.float16, torch.bfloat16):
        return config.checkpoint_dtype
    return torch.bfloat16


class ModelWorker:
    def __init__(self, config: WorkerConfig, model_config: ModelConfig | None = None,
                 tp: TensorParallel = TensorParallel()):
        self.config = config
        self.model_config = model_config or load_model_config(config.model_dir)
        self.device = config.device
        self.tp = tp
        self.ops = KernelOps.create(config.kernel_backend or default_backend(config.device))
        if self.device.type == "cuda":
            # Blocks an earlier worker of this process freed go back to the device first: weights placed
            # inside a freed KV cache's cached segment pin all of it, and the KV cache sized from the
            # device's free memory then got a tenth of the card (spec_bench verify after demo: 492 free).
            torch.cuda.empty_cache()
        self.model = build_model(self.model_config, self.ops, config.dtype, config.device, config.max_seq_len, tp)
        self.rope_by_length = plain_rope_length(self.model_config) is not None    # ForwardBatch.token_seq_len
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, config.dtype)
        with open_checkpoint(config.model_dir) as checkpoint:
            self.model.load_weights(checkpoint)
            fp8 = self.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            self.kv_tensor_scales = read_kv_scales(checkpoint, self.model_config.num_layers) if fp8 else None
        self.draft_heads = self._load_draft_heads()
        self.sampler = self._new_sampler()
        self._sampling: dict[int, RowSampling] = {}
        self.kv_cache: KVCache | None = None
        self.decoder: PaddedDecoder | None = None      # the warm-up below runs eagerly
        self.verifier: PaddedVerifier | None = None    # verify steps' graphs (--speculate)
        self.head_graphs: HeadGraphs | None = None     # the Medusa heads' graphs
        self.piecewise: PiecewiseGraphs | None = None  # steps with prompt tokens, but their attention, in graphs
        self._unfinished: LaunchedStep | None = None   # launched; its tokens not yet in the row states
        # The newest token sampled for each request row (and the dummy row): decode inputs.
        self.last_tokens = torch.zeros(config.max_requests + 1, dtype=torch.int64, device=config.device)
        if self.device.type == "cuda":    # before the KV cache takes the memory (a vocabulary's logits at 4k rows)
            warm_gemms(self.ops, gemm_weights(self.model, self.draft_heads), warmup_shape(config)[0], config.dtype,
                       self.device)
        self.context_attention = self._new_context_attention()     # its buffers before the KV cache's
        num_slots = self._size_slots()
        self.kv_cache = self._new_cache(num_slots)
        if self.device.type == "cuda" and self.ops.backend == "triton":
            self._compile_attention_variants()
        if self.device.type == "cuda":
            graphs = config.cuda_graphs
            # The torch references index with host integers, which a graph capture cannot hold.
            capture = (graphs is None or len(graphs) > 0) and self.ops.backend == "triton"
            self.decoder = PaddedDecoder(self.model, self.ops, self.kv_cache, self.last_tokens, config.max_requests,
                                         graphs or None, use_graphs=capture)
            if config.speculate:
                self.verifier = PaddedVerifier(self.model, self.ops, self.kv_cache, self.last_tokens,
                                               config.max_requests,
                                               config.speculate, use_graphs=capture)
            self.piecewise = self._piecewise_graphs(capture)
            if self.draft_heads is not None:
                self.head_graphs = HeadGraphs(self.draft_heads, self.ops, self.model_config.hidden_size,
                                              config.dtype, self.device, self.decoder.buckets, use_graphs=capture)
        if self.sampler.grammars is not None:
            self.sampler.grammars.wait_loaded()    # loaded beside the weights: ready before the first request

    def _new_context_attention(self) -> ContextAttention | None:
        """The long contexts' cuDNN path with its buffers and every graph shape built, where it applies (else None;
        a cuDNN that refuses the shapes: one warning, and the prefill kernel walks every key)."""
        if not context_attention_applies(self.config, self.kv_dtype, self.model, self.ops.backend):
            return None
        bucket, piece = self.config.context_attention
        budget = warmup_shape(self.config)[0]
        if budget < piece:     # no step holds a chunk of a piece's tokens
            return None
        block = attention_blocks(self.model)[0]          # this shard's heads
        context = ContextAttention(block.num_heads, block.num_kv_heads, block.head_dim, self.config.dtype,
                                   self.device, self.config.max_seq_len - piece, padded_tokens(budget), bucket, piece)
        if not context.enabled:
            return None
        start = time.perf_counter()
        try:
            shapes = context.warm()
        except (RuntimeError, AttributeError, TypeError) as e:     # refused; or a torch without that private op
            log.warning("long prompt contexts: cuDNN's attention refused them (%s); the prefill kernel walks every "
                        "key", str(e).splitlines()[0])
            return None
        log.info("long prompt contexts: cuDNN's attention for chunks of %d+ tokens behind %d+ keys (%d graph shapes "
                 "built in %.1f s; workspace %.0f MiB)", piece, bucket, shapes, time.perf_counter() - start,
                 context.workspace.nbytes / 2**20)
        return context

    def _piecewise_graphs(self, capture: bool) -> PiecewiseGraphs | None:
        """Steps of up to the prefill budget's tokens (at most ``PIECEWISE_BUCKETS[-1]``) padded and replayed
        from graphs, but for their attention. If the memory the KV cache left cannot hold the captures, such
        steps run eagerly, as before (one warning)."""
        try:
            return PiecewiseGraphs(self.model, self.ops, self.kv_cache, self.last_tokens, warmup_shape(self.config)[0],
                                   use_graphs=capture, context=self.context_attention)
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            log.warning("piecewise CUDA graphs not captured (%s): steps with prompt tokens run eagerly; a lower "
                        "--cuda-memory-fraction leaves them room", str(e).splitlines()[0])
            return None

    def _load_draft_heads(self) -> DraftHeads | None:
        cfg = self.config
        if cfg.draft_heads is None:
            return None
        medusa = read_medusa_config(cfg.draft_heads)
        heads = DraftHeads.load(medusa, self.model_config, self.model, cfg.speculate, cfg.dtype, cfg.device, self.tp)
        log.info("Medusa heads: the first %d of %d from %s (%d residual blocks each, %s) draft after every sampled row",
                 heads.count, medusa.num_heads, medusa.directory, medusa.num_layers,
                 "the model's own head" if heads.outs is None else "their own out projections")
        return heads

    def _new_sampler(self) -> Sampler:
        """Rank 0 samples: it alone holds the grammar engine (its tokenizer loads on first use)."""
        c = self.model_config
        grammars = GrammarCompiler(self.config.model_dir, c.vocab_size, c.eos_token_ids) if self.tp.rank == 0 else None
        watermark = WatermarkConfig(self.config.watermark_gamma, self.config.watermark_delta)
        return Sampler(self.ops, self.config.device, grammars, watermark, vocab_size=c.vocab_size)

    def _new_cache(self, num_slots: int) -> KVCache:
        c, cfg = self.model_config, self.config
        return KVCache(c.num_layers, num_slots, self.model.num_kv_heads, c.head_dim, cfg.max_requests,
                       cfg.max_seq_len, cfg.dtype, cfg.device, self.kv_dtype, self.kv_tensor_scales)

    @property
    def num_slots(self) -> int:
        return self.kv_cache.num_slots

    def _size_slots(self) -> int:
        """KV capacity: as configured; on CUDA what the memory left after a max-size warm-up holds."""
        if self.config.num_slots:
            return self.config.num_slots
        if self.device.type != "cuda":
            return max(self.config.max_seq_len, 16384)
        c = self.model_config
        per_slot = KVCache.bytes_per_slot(c.num_layers, self.model.num_kv_heads, c.head_dim, self.kv_dtype)
        activations = self._warmup_peak_bytes()
        free, _ = torch.cuda.mem_get_info(self.device)
        slots = int(free * self.config.memory_fraction - activations) // per_slot
        if slots < self.config.max_seq_len:
            raise MemoryError(f"after the weights only {slots} KV slots fit on {self.device}; one request of "
                              f"{self.config.max_seq_len} tokens needs more: lower --max-total-tokens or add shards")
        log.info("KV cache: %d slots of %s (%d bytes each, scales included; %.1f GiB); warm-up activations %.2f GiB",
                 slots, str(self.kv_dtype).removeprefix("torch."), per_slot, slots * per_slot / 2**30,
                 activations / 2**30)
        return slots

    def _warmup_peak_bytes(self) -> int:
        """Run the largest step once on a scratch cache; return its peak activation memory."""
        cfg = self.config
        tokens, num_rows = warmup_shape(cfg)
        per_row = [tokens // num_rows + (1 if i < tokens % num_rows else 0) for i in range(num_rows)]
        params = SamplingParams(do_sample=True, top_k=50, top_p=0.9, repetition_penalty=1.1, top_n_tokens=5)
        rows, next_slot = [], 0
        for i, n in enumerate(per_row):
            rows.append(StepRow(request_id=-1 - i, row=i, start_pos=0, input_ids=[1] * n,
                                slots=list(range(next_slot, next_slot + n)), sample=True, params=params))
            next_slot += n
        verify = self._warmup_verify_rows(rows, next_slot)
        self.kv_cache = self._new_cache(tokens + sum(len(r.input_ids) for r in verify))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self.execute(Step(rows=rows, released=[]))
        if verify:
            self.execute(Step(rows=verify, released=[]))
        self.execute(Step(rows=[], released=[r.request_id for r in rows]))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.kv_cache = None
        torch.cuda.empty_cache()
        return peak

    def _warmup_verify_rows(self, rows: list[StepRow], next_slot: int) -> list[StepRow]:
        """With --speculate, a verify row after each warm-up prompt (logits and sampling at every
        position: the most a decode step samples)."""
        verify, drafts = [], self.config.speculate
        for r in rows:
            n = len(r.input_ids)
            if drafts and n + 1 + drafts <= self.config.max_seq_len:
                verify.append(StepRow(request_id=r.request_id, row=r.row, start_pos=n,
                                      input_ids=[FED_BACK] + [1] * drafts,
                                      slots=list(range(next_slot, next_slot + 1 + drafts)), sample=True))
                next_slot += 1 + drafts
        return verify

    def _compile_attention_variants(self) -> None:
        """Run once each prefill-attention variant that serving reaches beyond the warm-up's plain prompts
        (prompt chunks behind a shared prefix; keys split over a long context; both), so that Triton
        compiles them at startup: compiled mid-serving, under a burst's tokenization load, each cost
        seconds of every waiting request's time to first token."""
        long_len = min(2 * MIN_SPLIT_KEYS, self.config.max_seq_len - 16, self.num_slots - 64)
        if self.config.max_requests > SHARED_PREFIX_MIN_ROWS:
            self._warm_shared_prefix(16)
            if long_len >= 2 * MIN_SPLIT_KEYS:
                self._warm_shared_prefix(long_len)
        if long_len >= 2 * MIN_SPLIT_KEYS:
            self._warm_shared_prefix(long_len, members=1)
        if self.context_attention is not None:
            self._warm_context()

    def _warm_context(self) -> None:
        """A prompt chunk of one piece's tokens, then one of up to four pieces, each behind one bucket of keys: the
        prefill kernel's variants that start from cuDNN's partial results (``kernels.context_attention``; the short
        chunk may split its keys) run once."""
        bucket, piece = self.context_attention.bucket, self.context_attention.piece
        budget = warmup_shape(self.config)[0]
        for n in sorted({piece, min(4 * piece, budget)}):
            if bucket + n > min(self.config.max_seq_len, self.num_slots):
                continue
            starts = [*range(0, bucket, budget), bucket]
            for start, end in zip(starts, [*starts[1:], bucket + n]):
                self.execute(Step(rows=[StepRow(request_id=-1, row=0, start_pos=start, input_ids=[1] * (end - start),
                                                slots=list(range(start, end)), sample=end == bucket + n,
                                                params=SamplingParams() if start == 0 else None)]))
            self.execute(Step(rows=[], released=[-1]))

    def _warm_shared_prefix(self, prefix_len: int, members: int = SHARED_PREFIX_MIN_ROWS) -> None:
        """A prompt of ``prefix_len`` tokens, then ``members`` requests that reuse its slots (as the prefix
        cache maps them) with a 4-token chunk each: one cascade group from ``SHARED_PREFIX_MIN_ROWS`` rows."""
        params = SamplingParams()
        owner = StepRow(request_id=-1, row=0, start_pos=0, input_ids=[1] * prefix_len, slots=list(range(prefix_len)),
                        sample=True, params=params)
        self.execute(Step(rows=[owner]))
        shared = prefix_len if members >= SHARED_PREFIX_MIN_ROWS else 0
        rows = [StepRow(request_id=-2 - i, row=1 + i, start_pos=prefix_len, input_ids=[1] * 4,
                        slots=list(range(prefix_len + 4 * i, prefix_len + 4 * i + 4)), sample=True, params=params,
                        prefix=0, shared_prefix_len=shared) for i in range(members)]
        self.execute(Step(rows=rows, prefixes=[PrefixSlots(list(range(prefix_len)))]))
        self.execute(Step(rows=[], released=[r.request_id for r in [owner, *rows]]))

    # ---- one step ------------------------------------------------------------------

    def execute(self, step: Step) -> StepResult:
        """Run one step to the end (``launch`` + ``result``)."""
        return self.launch(step).result()

    @torch.inference_mode()
    def launch(self, step: Step, meanwhile: Callable[[], None] | None = None) -> "LaunchedStep":
        """Queue the step's device work and return without waiting for it.

        The previous step's tokens reach the host here, after this step's forward is
        queued and before its sampling (which needs them for penalties, grammars and
        seeds): the device runs the forward meanwhile. Decode rows read their input
        token from ``last_tokens``, written on the device by the previous sampling.
        ``meanwhile``: called between the pieces of a forward through the piecewise graphs
        (after each layer's attention), whose launch can take longer than the previous step
        runs: the caller may take that step's result there (``engine.worker.process``).
        """
        for request_id in step.released:
            state = self._sampling.pop(request_id, None)
            if state is not None and state.penalty_row >= 0:
                self.sampler.penalties.release(state.penalty_row)
        if not step.rows:
            return LaunchedStep.done(StepResult([]))
        results = [RowResult(r.request_id) for r in step.rows]
        self._map_cached_prefixes(step)            # before either path's forward reads the table
        picks = None
        if self.decoder is not None and self.decoder.accepts(step):
            sampled, logits, hidden, picks = self._decode_with_graphs(step, self.decoder)
        elif self.verifier is not None and self.verifier.accepts(step):
            sampled, logits, hidden, picks = self._decode_with_graphs(step, self.verifier)
        else:
            sampled, logits, hidden = self._forward(step, results, meanwhile)
        self._finish_previous()
        self._track_rows(step)
        if not sampled:
            return LaunchedStep.done(StepResult(results))
        return self._launch_sampling(step, sampled, logits, hidden, results, picks)

    def _finish_previous(self) -> None:
        if self._unfinished is not None:
            self._unfinished.result()
            self._unfinished = None

    def _track_rows(self, step: Step) -> None:
        """New rows get their sampling state; prompt tokens count for penalties (sampled ones when sampled)."""
        for r in step.rows:
            state = self._sampling.get(r.request_id)
            if state is None:
                state = self._sampling[r.request_id] = self._new_row_state(r)
            if r.input_ids[0] == FED_BACK:
                continue
            state.prev_token = r.input_ids[-1]
            state.num_tokens += len(r.input_ids) + (r.start_pos if r.prefix != NO_PREFIX else 0)
            if state.penalty_row >= 0:                               # a cached prefix counts as prefilled
                self.sampler.penalties.add(state.penalty_row, (r.prefix_ids or []) + r.input_ids)

    def _new_row_state(self, row: StepRow) -> RowSampling:
        state = RowSampling(params=row.params, seed=row.seed, step=0)
        if row.params.has_penalties and self.tp.rank == 0:      # rank 0 samples
            state.penalty_row = self.sampler.penalties.acquire()
        grammars = self.sampler.grammars
        if row.params.grammar_type and grammars is not None:
            state.grammar = grammars.matcher(row.params.grammar_type, row.params.grammar)
        return state

    def _forward(self, step: Step, results: list[RowResult], meanwhile: Callable[[], None] | None = None,
                 eager: bool = False):
        """The forward of a step the decode and verify graphs do not take (through the piecewise graphs where
        they take it, else eagerly; ``eager``: always eagerly, e.g. for a profiler to see each kernel): (indices
        of the sampled rows, their logits, the final hidden states at the same positions)."""
        sampled = [i for i, r in enumerate(step.rows) if r.sample]
        read = [logit_positions(r) if r.sample else 0 for r in step.rows]     # each row's last tokens read
        narrowed = False
        if not eager and self.piecewise is not None and self.piecewise.accepts(step):
            hidden = self.piecewise.run(step, meanwhile)
        else:
            batch = self._forward_batch(step, read)
            hidden, narrowed = self.model.forward(batch, self.kv_cache), batch.output is not None
        offsets, offset = [], 0
        for r in step.rows:
            offsets.append(offset)
            offset += len(r.input_ids)
        self._prompt_logprobs(step, hidden, offsets, results)      # narrowed: no row reads its prompt's
        if not sampled:
            return sampled, None, None
        if not narrowed:
            positions = read_tokens(offsets, [len(r.input_ids) for r in step.rows], read)
            hidden = hidden[to_device(positions, torch.int64, self.device)]
        return sampled, self.model.compute_logits(hidden), hidden     # a collective: every rank computes

    def _forward_batch(self, step: Step, read: list[int] | None = None) -> ForwardBatch:
        """The step's ``ForwardBatch``; ``read``: how many of each row's last tokens the step reads (their final
        hidden states), which narrows the last layer to them (``OutputRows``) unless every token is read or a
        row asks for its prompt's logprobs (those read every position). Past ``gemm_warmup.EXACT_ROWS`` tokens
        a row of padding tokens follows the step's (``gemm_warmup.padded_tokens``): the final hidden states
        then have more rows than the step has tokens, the step's own first."""
        rows, dev = step.rows, self.device
        tokens = sum(len(r.input_ids) for r in rows)
        narrow = narrowed_reads(rows, read, tokens)
        padding = padded_tokens(tokens) - tokens
        if 0 < padding <= self.config.max_seq_len and max(len(r.input_ids) for r in rows) > 1:   # not a decode step
            rows = [*rows, padding_row(padding, self.config.max_requests, self.kv_cache.num_slots)]
            narrow = None if narrow is None else [*narrow, 0]
        x = ragged_inputs(rows)
        positions_t = to_device(x.positions, torch.int64, dev)
        slots_t = to_device(x.slots, torch.int64, dev)
        token_rows_t = to_device(x.token_rows, torch.int64, dev)
        self.kv_cache.write_table(token_rows_t, positions_t, slots_t)
        ids_t = to_device(x.input_ids, torch.int64, dev)
        if FED_BACK in x.input_ids:
            ids_t = torch.where(ids_t == FED_BACK, self.last_tokens[token_rows_t], ids_t)
        batch = ForwardBatch(
            input_ids=ids_t, positions=positions_t, out_slots=slots_t,
            req_rows=to_device(x.req_rows, torch.int32, dev), q_start=to_device(x.q_start, torch.int32, dev),
            q_len=to_device(x.q_len, torch.int32, dev), seq_len=to_device(x.seq_len, torch.int32, dev),
            max_q_len=max(x.q_len), is_decode=max(x.q_len) == 1, shared_prefix=shared_prefix_tensors(rows, dev),
            max_seq_len=max(x.seq_len), context=context_plan(self.context_attention, x),
            token_seq_len=to_device(rope_lengths(rows), torch.int64, dev) if self.rope_by_length else None,
        )
        if narrow is None:
            return batch
        return replace(batch, output=output_rows(batch, x.q_start, x.q_len, narrow))

    def _decode_with_graphs(self, step: Step, graphs):
        """Decode rows through the CUDA graphs (``graphs``: the decoder, or the verifier when rows
        carry drafts): (the rows that sample, their logits: every token's of a verify row, the hidden
        states there when draft heads read them, else None, and the greedy picks there). A row may be a
        one-token prompt chunk (a prompt the prefix cache held but for its last token)."""
        heads = self.draft_heads is not None
        outputs = graphs.run(step, hidden_states=heads)
        sampled = [i for i, r in enumerate(step.rows) if r.sample]
        if len(sampled) < len(step.rows):
            offsets, positions = [0], []
            for r in step.rows:
                offsets.append(offsets[-1] + len(r.input_ids))
            for i in sampled:
                positions.extend(range(offsets[i], offsets[i + 1]))
            outputs = outputs.rows(to_device(positions, torch.int64, self.device), heads)
        return sampled, outputs.logits, outputs.hidden, outputs.picks

    def _map_cached_prefixes(self, step: Step) -> None:
        """req_to_token[row, 0:k] = the cached prefix slots a request's first row brings (prefix cache).

        A piece of ``Step.prefixes`` that several rows map (a burst behind one long system prompt) is
        written by one broadcast copy of its slots: one host list of k slots instead of rows x k (a step
        of 106 requests behind a 3,000-token prefix built three 318k-element lists). The pieces of one
        row each go in one flat write."""
        pieces: dict[tuple[int, int, int], list[int]] = {}
        for r in step.rows:
            if r.prefix != NO_PREFIX:
                for piece in step.prefix_segments(r.prefix, r.start_pos):
                    pieces.setdefault(piece, []).append(r.row)
        if not pieces:
            return
        dev = self.device
        table_rows, positions, slots = [], [], []
        for (entry, start, end), rows in pieces.items():
            piece = step.prefixes[entry].slots[: end - start]
            if len(rows) == 1:
                table_rows.extend(rows * len(piece))
                positions.extend(range(start, end))
                slots.extend(piece)
                continue
            self.kv_cache.write_table(to_device(rows, torch.int64, dev)[:, None],
                                      torch.arange(start, end, device=dev)[None, :],
                                      to_device(piece, torch.int64, dev)[None, :])
        if table_rows:
            self.kv_cache.write_table(to_device(table_rows, torch.int64, dev), to_device(positions, torch.int64, dev),
                                      to_device(slots, torch.int64, dev))

    def _launch_sampling(self, step: Step, sampled: list[int], logits, hidden,
                         results: list[RowResult], picks=None) -> "LaunchedStep":
        """Rank 0 samples and broadcasts the tokens; every rank feeds them back into ``last_tokens``.
        ``picks``: the graphs' greedy choice at every logit position (the sampler takes it for plain greedy rows).
        With draft heads, every rank runs them on the hidden state where each row's last kept token was
        chosen (``draft_heads``)."""
        rows = [step.rows[i] for i in sampled]
        states = [self._sampling[r.request_id] for r in rows] if self.tp.rank == 0 else []
        sample, tokens = self._sample_tokens(logits, rows, states, picks)
        if self.tp.world_size > 1:
            torch.distributed.broadcast(tokens, src=0)
        kept_at = None if logits.shape[0] == len(rows) else self._last_kept(rows, tokens)
        kept = tokens if kept_at is None else tokens[kept_at]
        self.last_tokens.index_copy_(0, to_device([r.row for r in rows], torch.int64, self.device), kept)
        drafts = self._draft_heads(hidden, kept_at)
        if sample is None:
            return LaunchedStep.done(StepResult(results))      # only rank 0 replies
        host, drafts_host = sample.start_copy(), start_to_host(drafts)
        event = torch.cuda.Event() if self.device.type == "cuda" else None
        if event is not None:
            event.record()

        def finish() -> StepResult:
            if event is not None:
                event.synchronize()
            self._record_tokens(sampled, rows, host.output(), states, results, self.sampler.penalties)
            if drafts_host is not None:
                for i, row_drafts in zip(sampled, drafts_host.tolist()):
                    results[i].drafts = row_drafts
            return StepResult(results)

        self._unfinished = LaunchedStep(finish, event)
        return self._unfinished

    def _sample_tokens(self, logits: torch.Tensor, rows: list[StepRow], states: list[RowSampling], picks=None):
        """(the sample, the token at every logit position of ``rows``) on rank 0; (None, a buffer for the
        broadcast) on the other ranks."""
        if self.tp.rank != 0:
            return None, torch.empty(logits.shape[0], dtype=torch.int64, device=self.device)
        sample = self._sample_positions(logits, rows, states, picks)
        return sample, sample.token_ids

    def _draft_heads(self, hidden: torch.Tensor, kept_at: torch.Tensor | None) -> torch.Tensor | None:
        """[rows, heads] drafts for the positions after each sampled row's last kept token: the heads read
        the hidden state whose logits chose that token (``kept_at``: its logit position; None: one per row)."""
        if self.draft_heads is None:
            return None
        if self.head_graphs is not None:
            return self.head_graphs.run(hidden, kept_at)
        return self.draft_heads(self.ops, hidden if kept_at is None else hidden[kept_at])

    def _last_kept(self, rows: list[StepRow], tokens: torch.Tensor) -> torch.Tensor:
        """Per row, the index in ``tokens`` of the last token it keeps (the first choice that differs
        from its draft, or the bonus token), on the device: no host sync."""
        drafts, segments = [], []
        for i, r in enumerate(rows):
            width = logit_positions(r)
            drafts.extend(r.input_ids[1:width] + [FED_BACK])      # the last position has no draft
            segments.extend([i] * width)
        dev = tokens.device
        positions = torch.arange(tokens.shape[0], device=dev)
        differs = torch.where(tokens != to_device(drafts, torch.int64, dev), positions, tokens.shape[0])
        first = torch.full((len(rows),), tokens.shape[0], dtype=torch.int64, device=dev)
        return first.scatter_reduce_(0, to_device(segments, torch.int64, dev), differs, "amin")

    def _sample_positions(self, logits: torch.Tensor, rows: list[StepRow], states: list[RowSampling], picks=None):
        """The sampler over every logit position (``verify_states``). A verify row's penalised
        positions count the drafts before them in scratch rows of the penalty counts, freed here
        (the stream runs their reads before any later reuse); its constrained positions take copies
        of the grammar matcher advanced over the drafts before them (``draft_matchers``)."""
        expanded = verify_states(rows, states)
        scratch = []
        if len(expanded) > len(states):
            penalties = self.sampler.penalties
            position = 0
            for row, state in zip(rows, states):
                width = logit_positions(row)
                if state.penalty_row >= 0:
                    for j in range(1, width):
                        expanded[position + j].penalty_row = scratch_row = penalties.acquire()
                        penalties.counts[scratch_row].copy_(penalties.counts[state.penalty_row])
                        penalties.add(scratch_row, row.input_ids[1 : j + 1])
                        scratch.append(scratch_row)
                if state.grammar is not None and width > 1:
                    matchers = draft_matchers(state.grammar, row.input_ids[1:], self.sampler.grammars.vocab_size)
                    for j, matcher in enumerate(matchers, start=1):
                        expanded[position + j].grammar = matcher
                position += width
        sample = self.sampler.launch(logits, expanded, greedy=picks)
        for scratch_row in scratch:
            self.sampler.penalties.release(scratch_row)
        return sample

    @staticmethod
    def _record_tokens(sampled: list[int], rows: list[StepRow], out, states: list[RowSampling],
                       results: list[RowResult], penalties) -> None:
        """The kept tokens into the results and into each row's state (seed step, grammar; the
        sampler counted the first for penalties on the device already, a verify row's others are
        added here). A verify row keeps its choices while they equal its drafts, and the first that
        differs. A kept token that fails (NaN scores, the grammar) is the row's last: the request ends
        with its error after the tokens before it, as plain decoding's rows would have given them."""
        position = 0
        for j, i in enumerate(sampled):
            width = logit_positions(rows[j])
            kept = accepted_length(rows[j].input_ids[1:width], out.token_ids[position : position + width]) + 1
            kept_results = [RowResult(rows[j].request_id) for _ in range(kept - 1)]
            for n, (res, p) in enumerate(zip([results[i], *kept_results], range(position, position + kept))):
                res.token_id, res.logprob = out.token_ids[p], out.logprobs[p]
                res.top_ids, res.top_logprobs = out.top_ids[p], out.top_logprobs[p]
                _advance(states[j], res)
                if res.error is not None:
                    del kept_results[n:]     # keeps the failed one (n - 1) unless it is the row's own (n = 0)
                    break
            if kept_results and states[j].penalty_row >= 0:
                with torch.inference_mode():        # runs when the step is collected, outside ``launch``
                    penalties.add(states[j].penalty_row, [res.token_id for res in kept_results])
            results[i].following = kept_results
            position += width

    def _prompt_logprobs(self, step: Step, hidden, offsets: list[int], results: list[RowResult]) -> None:
        """Each prompt position's logprob of the token after it, the logits formed ``warmup_shape``'s rows at a
        time: the warm-up measured the memory of that many rows of float32 logits, and a whole chunk's at once
        (4,096 positions: 2.1 GB at Llama 3's vocabulary, 4.2 GB at Gemma's, and log_softmax's copy beside them)
        could pass what the KV cache left and end the shard."""
        rows = warmup_shape(self.config)[1]
        for i, r in enumerate(step.rows):
            if not r.logprob_targets:
                if r.logprob_targets is not None:
                    results[i].prompt_logprobs = []
                continue
            picked = torch.tensor(r.logprob_targets, device=self.device)[:, None]
            parts = []
            for start in range(0, len(r.logprob_targets), rows):
                end = min(start + rows, len(r.logprob_targets))
                logits = self.model.compute_logits(hidden[offsets[i] + start : offsets[i] + end])  # every rank (TP)
                if self.tp.rank == 0:
                    parts.append(torch.log_softmax(logits, dim=-1).gather(1, picked[start:end])[:, 0])
            if self.tp.rank == 0:
                results[i].prompt_logprobs = torch.cat(parts).tolist()     # one wait for the device, not one a slice


def context_attention_applies(config: WorkerConfig, kv_dtype: torch.dtype, model, backend: str) -> bool:
    """Whether prompt chunks' long contexts can go to cuDNN (``kernels.context_attention``): asked for, the Triton
    kernels, a KV cache in the model's dtype, a layer without score modifications (a window, soft-cap or ALiBi) and,
    on CUDA, float16 / bfloat16 with a head dim cuDNN takes (a multiple of 8 up to 128). The CPU (the Triton
    interpreter) runs the plan with a torch stand-in for cuDNN."""
    if config.context_attention is None or backend != "triton" or kv_dtype != config.dtype:
        return False
    blocks = attention_blocks(model)
    if not any(b.mods is None or not b.mods.any for b in blocks):
        return False
    if config.device.type != "cuda":
        return True
    return config.dtype in (torch.float16, torch.bfloat16) and all(
        b.head_dim % 8 == 0 and b.head_dim <= 128 for b in blocks)


def warmup_shape(config: WorkerConfig) -> tuple[int, int]:
    """(tokens, rows) of the warm-up's largest step: the prefill budget spread over as many request rows as
    fit, each sampled (so it also measures ``rows`` rows of logits)."""
    tokens = min(config.warmup_tokens, config.max_requests * config.max_seq_len)
    return tokens, min(config.max_requests, tokens)


def narrowed_reads(rows: list[StepRow], read: list[int] | None, tokens: int) -> list[int] | None:
    """How many of each row's last tokens the last layer runs (``OutputRows``), or None: all of them (every one
    of the step's ``tokens`` is read, or a row asks for its prompt's logprobs, which read every position). A step
    that reads nothing (a prompt chunk that samples nothing) runs its last token (no empty GEMMs)."""
    if read is None or any(r.logprob_targets for r in rows) or sum(read) == tokens:
        return None
    return read if any(read) else [0] * (len(read) - 1) + [1]


def logit_positions(row: StepRow) -> int:
    """Positions of a sampled row whose logits choose tokens: every one of a verify row, else the last."""
    return len(row.input_ids) if row.input_ids[0] == FED_BACK else 1


def verify_states(rows: list[StepRow], states: list[RowSampling]) -> list[RowSampling]:
    """One sampling state per logit position: a verify row's position j samples as if its drafts
    before j were accepted (token index, token count, previous token for the watermark; the caller
    gives penalised and constrained positions their own counts and matchers)."""
    if all(len(r.input_ids) == 1 or r.input_ids[0] != FED_BACK for r in rows):
        return states
    expanded = []
    for row, state in zip(rows, states):
        expanded.append(state)
        if row.input_ids[0] != FED_BACK:
            continue
        s = state      # every field, by the constructor: dataclasses.replace cost ~4 us a state (128 at batch 32)
        expanded.extend(RowSampling(s.params, s.seed, s.step + j, s.penalty_row, s.num_tokens + j, d, s.grammar)
                        for j, d in enumerate(row.input_ids[1:], start=1))
    return expanded


def draft_matchers(grammar: GrammarMatcher, drafts: list[int], vocab_size: int) -> list[GrammarMatcher]:
    """Per draft d_j, a copy of the request's matcher advanced over d_1 .. d_j, so position j's mask
    is the one plain decoding would use after them; the request's own matcher is untouched (the
    kept tokens advance it). Past the first draft the grammar rejects, copies stop advancing: the
    choice before it obeys a mask without it, so no later position is kept. A draft id outside the
    grammar's vocabulary (the ``vocab_size`` ids its tokenizer was built with) counts as rejected:
    llguidance would put the matcher that checks it into its error state."""
    if grammar.only_eos:
        return [grammar] * len(drafts)
    known = next((j for j, d in enumerate(drafts) if not 0 <= d < vocab_size), len(drafts))
    advanced = grammar.raw.deep_copy()
    valid = advanced.validate_tokens(drafts[:known])
    matchers = []
    for j, draft in enumerate(drafts):
        if j < valid:
            advanced.consume_token(draft)
        matchers.append(GrammarMatcher(advanced if j == len(drafts) - 1 else advanced.deep_copy(), grammar.eos_ids))
    return matchers


def accepted_length(drafts: list[int], choices: list[int]) -> int:
    """How many drafts equal the choices made at the positions before them (a prefix)."""
    count = 0
    while count < len(drafts) and drafts[count] == choices[count]:
        count += 1
    return count


def _advance(state: RowSampling, res: RowResult) -> None:
    """A kept token into its row's state (and grammar, whose failure ends the request). A NaN logprob ends the
    request too: its scores were not numbers, so the token is an arbitrary one."""
    state.step += 1
    state.prev_token = res.token_id
    state.num_tokens += 1
    if res.logprob != res.logprob:
        res.error = (f"Request failed during generation: the token scores were NaN at new token {state.step}: the "
                     "model's logits overflowed (in float16? serve the model with --dtype bfloat16 or float32), or "
                     "a temperature this close to 0 made them infinite (use a larger one, or greedy decoding)")
        return
    if state.grammar is not None:
        state.grammar.advance(res.token_id)
        if state.grammar.error is not None:
            res.error = f"Request failed during generation: the grammar failed: {state.grammar.error}"
