"""Token selection for one step: grammar, watermark, penalties, warpers, sampling, logprobs.

Order follows TGI: the grammar mask (disallowed tokens -> -inf) and the watermark bias
on the raw logits, then repetition, frequency and presence penalties; then, for sampled
rows, temperature, top-k, top-p and typical-p; the reported logprobs (and top-n tokens)
are ``log_softmax`` of the processed scores, i.e. of the constrained distribution.
(TGI applies the grammar after the penalties: the same scores, since -inf stays -inf.)

Sampling is reproducible and free of host syncs and per-row generator objects: the
token is ``argmax(p / E)`` with ``E ~ Exp(1)`` (the exponential race, equivalent to a
categorical draw), where each E comes from a counter-based hash of
(seed, generated-token index, vocab id). The same seed gives the same tokens whatever
else shares the batch, on any device.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.protocol.messages import SamplingParams
from engine.sampling.grammar import apply_bitmask
from engine.sampling.hashing import hash_uniform
from engine.sampling.watermark import WatermarkConfig, apply_watermark
from engine.transfer import start_to_host, to_device

log = logging.getLogger(__name__)


@dataclass
class RowSampling:
    """What the sampler needs for one row: its parameters and its token history."""
    params: SamplingParams
    seed: int
    step: int                                    # index of the token being generated
    penalty_row: int = -1                        # its row of the sampler's PenaltyCounts; -1: no penalties
    num_tokens: int = 0                          # prompt + generated tokens (TGI's frequency scaling)
    prev_token: int = 0                          # the token before the one being generated (watermark)
    grammar: object | None = None                # engine.sampling.grammar.GrammarMatcher when constrained


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class DeviceSample:
    """The sampler's choice for n rows, as tensors (on the device until copied)."""
    token_ids: torch.Tensor              # [n] int64
    logprobs: torch.Tensor               # [n] float32, of the chosen tokens
    top_ids: torch.Tensor | None         # [n, max top_n] int64, or None when no row asked
    top_logprobs: torch.Tensor | None
    top_n: list[int]                     # top_n_tokens of each row

    def start_copy(self) -> "DeviceSample":
        """Pinned host copies, started without waiting; read them after the step's event."""
        return DeviceSample(start_to_host(self.token_ids), start_to_host(self.logprobs),
                            start_to_host(self.top_ids), start_to_host(self.top_logprobs), self.top_n)

    def output(self) -> SampleOutput:
        """Python lists (waits for the device if the tensors are still there)."""
        top_ids, top_lp = [[] for _ in self.top_n], [[] for _ in self.top_n]
        if self.top_ids is not None:
            ids, values = self.top_ids.tolist(), self.top_logprobs.tolist()
            for i, n in enumerate(self.top_n):
                top_ids[i], top_lp[i] = ids[i][:n], values[i][:n]
        return SampleOutput(self.token_ids.tolist(), self.logprobs.tolist(), top_ids, top_lp)


class PenaltyCounts:
    """How often each token occurred in each penalised request, prompt and generated, on the device.

    ``counts`` [capacity, vocab] int32 is created at the first penalised request (servers
    whose requests never ask for penalties pay nothing) and doubles when its rows run out;
    a request holds one row (``acquire``) until it is released. Prompt tokens are added as
    they are prefilled (or taken from the prefix cache), sampled tokens right after each
    sampling, from the device tensor of chosen ids: no host sync, nothing re-sent per step.
    """

    def __init__(self, vocab_size: int | None, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(0, vocab_size or 0, dtype=torch.int32, device=device)
        self._free: list[int] = []

    def acquire(self) -> int:
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.counts[row].zero_()
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def add(self, row: int, token_ids: list[int]) -> None:
        ids = to_device(token_ids, torch.int64, self.device)
        self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def add_sampled(self, rows: list[int], token_ids: torch.Tensor) -> None:
        index = to_device(rows, torch.int64, self.device)
        self.counts.index_put_((index, token_ids), torch.ones_like(token_ids, dtype=torch.int32), accumulate=True)

    def _grow(self) -> None:
        if self.vocab_size is None:
            raise RuntimeError("penalties need the sampler's vocab_size")
        old = self.counts.shape[0]
        grown = torch.zeros(max(8, 2 * old), self.vocab_size, dtype=torch.int32, device=self.device)
        grown[:old] = self.counts
        self.counts = grown
        self._free.extend(reversed(range(old, grown.shape[0])))
        log.info("penalty counts: %d request rows (%.1f MiB)", grown.shape[0], grown.numel() * 4 / 2**20)


class Sampler:
    """``grammars`` (an ``engine.sampling.grammar.GrammarCompiler``) computes the masks of constrained
    rows; ``watermark`` (an ``engine.sampling.watermark.WatermarkConfig``) holds gamma and delta."""

    def __init__(self, ops, device: torch.device, grammars=None, watermark=None, vocab_size: int | None = None):
        self.ops = ops
        self.device = device
        self.grammars = grammars
        self.watermark = watermark or WatermarkConfig()
        self.penalties = PenaltyCounts(vocab_size, device)

    def __call__(self, logits: torch.Tensor, rows: list[RowSampling]) -> SampleOutput:
        return self.launch(logits, rows).output()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, rows: list[RowSampling],
               greedy: tuple[torch.Tensor, torch.Tensor] | None = None) -> DeviceSample:
        """Queue the sampling of one token per row; nothing here waits for the device. ``greedy``: each row's
        ``ops.greedy_pick`` of these logits, already computed (inside a decode graph): when every row is plain
        greedy (no processor touches its scores, no top-n) it is the sample, and nothing more is launched."""
        if greedy is not None and all(_plain_greedy(r) for r in rows):
            return DeviceSample(greedy[0], greedy[1], None, None, [0] * len(rows))
        scores = self._constrain(logits, rows)
        if any(r.penalty_row >= 0 for r in rows):
            self._apply_penalties(scores, rows)
        sampled = [i for i, r in enumerate(rows) if r.params.do_sample]
        if sampled:
            index = to_device(sampled, torch.int64, scores.device)
            scores[index] = self._warp(scores[index], [rows[i].params for i in sampled])
        logprobs = torch.log_softmax(scores, dim=-1)
        chosen = scores.argmax(dim=-1)
        if sampled:
            chosen[index] = self._draw(logprobs[index], [rows[i] for i in sampled])
        self._count_chosen(chosen, rows)
        return self._output(logprobs, chosen, rows)

    def _count_chosen(self, chosen: torch.Tensor, rows: list[RowSampling]) -> None:
        """The chosen tokens into the penalised rows' counts, on the device (next step's penalties)."""
        penalised = [i for i, r in enumerate(rows) if r.penalty_row >= 0]
        if penalised:
            index = to_device(penalised, torch.int64, chosen.device)
            self.penalties.add_sampled([rows[i].penalty_row for i in penalised], chosen[index])

    def _constrain(self, logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
        """float32 scores with the grammar masks and the watermark bias applied."""
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:    # CPU work before touching the logits: it overlaps the device's forward
            if self.grammars is None:
                raise RuntimeError("a row has a grammar but the sampler has no grammar compiler")
            bitmask = self.grammars.fill_bitmasks([rows[i].grammar for i in constrained],
                                                  pin=self.device.type == "cuda")
        scores = logits.float()
        if constrained:
            apply_bitmask(scores, constrained, bitmask)
        watermarked = [i for i, r in enumerate(rows) if r.params.watermark]
        if watermarked:
            apply_watermark(scores, watermarked, [rows[i].prev_token for i in watermarked], self.watermark)
        return scores

    def _apply_penalties(self, scores: torch.Tensor, rows: list[RowSampling]) -> None:
        # TGI's frequency penalty scales by each token's share of the sequence.
        freq = [r.params.frequency_penalty / max(r.num_tokens, 1) for r in rows]
        as_tensor = lambda v, dt: to_device(v, dt, self.device)  # noqa: E731
        self.ops.apply_penalties(
            scores, self.penalties.counts, as_tensor([r.penalty_row for r in rows], torch.int32),
            as_tensor([r.params.repetition_penalty for r in rows], torch.float32),
            as_tensor(freq, torch.float32),
            as_tensor([r.params.presence_penalty for r in rows], torch.float32),
        )

    def _warp(self, scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = to_device([p.temperature for p in params], torch.float32, scores.device)
        scores = scores / temps[:, None]
        neg_inf = torch.finfo(scores.dtype).min
        device = scores.device
        top_k = [i for i, p in enumerate(params) if p.top_k > 0]
        if top_k:
            ks = to_device([min(params[i].top_k, scores.shape[1]) for i in top_k], torch.int64, device)
            index = to_device(top_k, torch.int64, device)
            kth = scores[index].sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
            scores[index] = scores[index].masked_fill(scores[index] < kth, neg_inf)
        top_p = [i for i, p in enumerate(params) if p.top_p < 1.0]
        if top_p:
            index = to_device(top_p, torch.int64, device)
            masses = to_device([params[i].top_p for i in top_p], torch.float32, device)
            scores[index] = _top_p(scores[index], masses, neg_inf)
        typical = [i for i, p in enumerate(params) if p.typical_p < 1.0]
        if typical:
            index = to_device(typical, torch.int64, device)
            masses = to_device([params[i].typical_p for i in typical], torch.float32, device)
            scores[index] = _typical_p(scores[index], masses, neg_inf)
        return scores

    def _draw(self, logprobs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
        seeds = to_device([r.seed - 2**64 if r.seed >= 2**63 else r.seed for r in rows], torch.int64, logprobs.device)
        steps = to_device([r.step for r in rows], torch.int64, logprobs.device)
        exponential = -torch.log(hash_uniform(seeds, steps, logprobs.shape[1]))
        race = logprobs.double() - torch.log(exponential)   # log(p / E)
        return race.argmax(dim=-1)

    @staticmethod
    def _output(logprobs: torch.Tensor, chosen: torch.Tensor, rows: list[RowSampling]) -> DeviceSample:
        chosen_logprobs = logprobs.gather(1, chosen[:, None])[:, 0]
        top_n = [r.params.top_n_tokens for r in rows]
        values = indices = None
        if max(top_n):
            values, indices = logprobs.topk(min(max(top_n), logprobs.shape[1]), dim=-1)
        return DeviceSample(chosen, chosen_logprobs, indices, values, top_n)


def _plain_greedy(row: RowSampling) -> bool:
    """A row whose token is its logits' argmax and whose only output is that token's logprob."""
    params = row.params
    return (not params.do_sample and row.penalty_row < 0 and row.grammar is None and not params.watermark
            and params.top_n_tokens == 0)


def _top_p(scores: torch.Tensor, masses: torch.Tensor, fill: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper with a per-row mass (keeps at least one token)."""
    sorted_scores, sorted_idx = scores.sort(dim=-1, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - masses[:, None])
    remove[:, -1] = False
    return scores.masked_fill(remove.scatter(1, sorted_idx, remove), fill)


def _typical_p(scores: torch.Tensor, masses: torch.Tensor, fill: float) -> torch.Tensor:
    """transformers' TypicalLogitsWarper with a per-row mass (keeps at least one token)."""
    normalized = torch.log_softmax(scores, dim=-1)
    entropy = -(normalized * normalized.exp()).nansum(-1, keepdim=True)
    shifted = (-normalized - entropy).abs()
    sorted_shifted, sorted_idx = shifted.sort(dim=-1, descending=False)
    cumulative = scores.gather(-1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < masses[:, None]).sum(dim=1).clamp(max=scores.shape[1] - 1)
    remove = sorted_shifted > sorted_shifted.gather(1, last[:, None])
    remove[:, 0] = False
    return scores.masked_fill(remove.scatter(1, sorted_idx, remove), fill)
