"""TGI's `tgi_*` Prometheus metrics, kept in one ``prometheus_client`` registry per app.

Names, kinds, labels and buckets follow TGI (server.rs `start()`, backends/v3,
docs/source/reference/metrics.md). Two things differ from prometheus_client's defaults,
both so that TGI's dashboards and alerts keep working:

- counters keep TGI's names: `tgi_request_count`, not prometheus_client's `tgi_request_count_total`;
- there are no `*_created` series (TGI's exporter has none).

Gauges that describe the engine are set from ``backend.stats()`` at scrape time; TGI's
per-step batch metrics (`tgi_batch_*`, label `method="prefill"|"decode"`) are observed as
the router reports its steps (``observe_steps``). A step is "prefill" when it carries
prompt tokens (chunked prefill mixes them with decode rows, as TGI v3's chunking does);
`tgi_batch_concat{reason="chunking"}` counts the steps in which new requests joined a
running batch. Durations: concat = scheduling (admission and the step's rows), forward =
the shards' time, decode = sampled tokens to token events, filter = freeing finished
requests, inference = all of a step.

Extra: `tgi_kv_cache_usage` (0..1, TGI issue #3275), `tgi_kv_cache_used_slots` /
`tgi_kv_cache_total_slots`, `tgi_num_shards`, and the prefix cache's
`tgi_prefix_cache_tokens` (slots it holds), `tgi_prefix_cache_lookup_tokens` and
`tgi_prefix_cache_hit_tokens` (prompt tokens of admitted requests, and of those the ones
taken from the cache: their rates' ratio is the hit rate) and `tgi_prefix_cache_evicted_tokens`;
with `--speculate`, `tgi_speculation_drafted_tokens` and `tgi_speculation_accepted_tokens` (draft
tokens verified, and of those accepted and appended: their ratio is the acceptance rate); and the front end's
tokenizer piece cache
(``tgi_compat.text_pieces.PieceCache``): `tgi_tokenizer_piece_cache_hits` / `_misses` (pieces of long
prompts found in it / encoded) and `tgi_tokenizer_piece_cache_chars` (characters it holds).

With several front-end processes (``tgi_compat.frontend_group``) the metrics are prometheus_client's
file-backed multiprocess values: a scrape sums every process's counters and histograms, the engine
gauges show the latest router status (``mostrecent``), and only the first front end receives the
router's step numbers. The router's own totals (prefix cache, speculation) are read from its status at
each scrape (``_RouterTotals``), never added up per process; each front end's tokenizer has a piece cache
of its own, whose counts and characters are added up.

TGI's speculation metric is `tgi_request_skipped_tokens`: one observation per generation (a request's tokens
from one step; TGI's router records ``len(tokens) - 1``, the accepted drafts appended besides the step's own
token, 0 for a plain row or a prompt's first token). Its buckets here are 0 .. ``--speculate``, as TGI's
server.rs once set them (the current one leaves them out, so its exporter renders a summary: the same `_sum`
and `_count`). It is a router total as well: the status's numbers of results by accepted drafts
(``speculation_skipped_tokens``, ``Scheduler.speculation_status``) become its cumulative buckets.
"""
from __future__ import annotations

import re

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def duration_buckets() -> list[float]:
    """35 geometric buckets from 0.00015 s, x1.5 each (TGI)."""
    return [0.00015 * 1.5**i for i in range(35)]


def linear_buckets(maximum: int, count: int = 100) -> list[float]:
    """``count`` equal buckets up to ``maximum`` (TGI's token-count histograms)."""
    return [maximum / count * (i + 1) for i in range(count)]


class _WithoutCreated(Collector):
    """The registry's families without their `*_created` samples."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [s for s in family.samples if s.name != family.name + "_created"]
            yield kept


ROUTER_TOTALS = [   # (metric, the router status key of its total, help)
    ("prefix_cache_lookup_tokens", "prefix_cache_lookup_tokens", "Prompt tokens of admitted requests"),
    ("prefix_cache_hit_tokens", "prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache"),
    ("prefix_cache_evicted_tokens", "prefix_cache_evicted_tokens", "Cached tokens evicted to make room"),
    ("speculation_drafted_tokens", "speculation_drafted_tokens", "Draft tokens verified (--speculate)"),
    ("speculation_accepted_tokens", "speculation_accepted_tokens", "Draft tokens accepted and appended (--speculate)"),
]
SKIPPED_TOKENS_KEY = "speculation_skipped_tokens"    # [k]: generations that appended k accepted drafts


class _RouterTotals(Collector):
    """The router's counters and its `tgi_request_skipped_tokens`, as its latest status gives them (totals since
    it started)."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.skipped_tokens: tuple[int, ...] = ()

    def collect(self):
        for name, key, help_text in ROUTER_TOTALS:
            family = CounterMetricFamily(f"tgi_{name}", help_text)
            family.add_metric([], self.totals.get(key, 0))
            yield family
        yield skipped_tokens_histogram(self.skipped_tokens)


def skipped_tokens_histogram(counts: tuple[int, ...]) -> HistogramMetricFamily:
    """TGI's `tgi_request_skipped_tokens` from the numbers of generations that skipped 0, 1, .. tokens."""
    buckets, seen = [], 0
    for skipped, count in enumerate(counts):
        seen += count
        buckets.append((str(float(skipped)), seen))
    return HistogramMetricFamily("tgi_request_skipped_tokens", "Accepted draft tokens per generation (speculation)",
                                 buckets=[*buckets, ("+Inf", seen)],
                                 sum_value=sum(skipped * count for skipped, count in enumerate(counts)))


class PieceCacheMetrics:
    """The ``observer`` of a front end's ``PieceCache``: counted as the validation threads look pieces up, so with
    several front ends each one's file holds its own cache's numbers and a scrape adds them up."""

    def __init__(self, r: CollectorRegistry):
        self.hits = Counter("tgi_tokenizer_piece_cache_hits",
                            "Pieces of long prompts found in the tokenizer's piece cache (not encoded again)",
                            registry=r)
        self.misses = Counter("tgi_tokenizer_piece_cache_misses",
                              "Pieces of long prompts not in the tokenizer's piece cache (encoded)", registry=r)
        self.chars = Gauge("tgi_tokenizer_piece_cache_chars", "Characters of the pieces the tokenizer's caches hold",
                           registry=r, multiprocess_mode="livesum")      # one cache per front end: their sum

    def looked_up(self, hits: int, misses: int) -> None:
        self.hits.inc(hits)
        self.misses.inc(misses)

    def holds(self, chars: int) -> None:
        self.chars.set(chars)


class ServerMetrics:
    """The metrics of one app: the request handlers record, ``render`` exposes. ``multiprocess_dir``: the
    front ends' shared directory (``frontend_group.use_shared_metrics`` made the values file-backed)."""

    def __init__(self, max_input_tokens: int, max_total_tokens: int, num_shards: int,
                 multiprocess_dir: str | None = None):
        self.registry = r = CollectorRegistry(auto_describe=True)
        seconds = duration_buckets()
        self.request_count = Counter("tgi_request_count", "Generation requests received", registry=r)
        self.request_success = Counter("tgi_request_success", "Generation requests that succeeded", registry=r)
        self.request_failure = Counter("tgi_request_failure", "Generation requests that failed, by error kind",
                                       ["err"], registry=r)

        def histogram(name: str, help_text: str, buckets: list[float]) -> Histogram:
            return Histogram(name, help_text, buckets=buckets, registry=r)

        self.request_duration = histogram("tgi_request_duration", "End-to-end request time (s)", seconds)
        self.validation_duration = histogram(
            "tgi_request_validation_duration", "Validation and tokenization time (s)", seconds)
        self.queue_duration = histogram(
            "tgi_request_queue_duration", "Submission to first token, prefill included (s)", seconds)
        self.inference_duration = histogram(
            "tgi_request_inference_duration", "First token to last token (s)", seconds)
        self.time_per_token = histogram(
            "tgi_request_mean_time_per_token_duration", "Mean time between generated tokens (s)", seconds)
        self.input_length = histogram("tgi_request_input_length", "Prompt tokens", linear_buckets(max_input_tokens))
        self.generated_tokens = histogram(
            "tgi_request_generated_tokens", "Generated tokens", linear_buckets(max_total_tokens))
        self.max_new_tokens = histogram(
            "tgi_request_max_new_tokens", "Requested max_new_tokens", linear_buckets(max_total_tokens))
        def gauge(name: str, help_text: str) -> Gauge:   # every front end sets the same router status
            return Gauge(name, help_text, registry=r, multiprocess_mode="mostrecent")

        self.queue_size = gauge("tgi_queue_size", "Requests waiting for admission")
        self.batch_size = gauge("tgi_batch_current_size", "Requests in the running batch")
        self.batch_tokens = gauge("tgi_batch_current_max_tokens", "KV tokens held by the running batch")
        self.batch_max_tokens = gauge("tgi_batch_max_total_tokens", "KV token capacity")
        self.kv_usage = gauge("tgi_kv_cache_usage", "Fraction of KV cache slots in use (0..1)")
        self.kv_used_slots = gauge("tgi_kv_cache_used_slots", "KV cache slots (tokens) in use")
        self.kv_total_slots = gauge("tgi_kv_cache_total_slots", "KV cache slots (tokens) in all")
        self.num_shards = gauge("tgi_num_shards", "Tensor-parallel shards")
        self.num_shards.set(num_shards)
        self._batch_metrics(r, seconds)
        self.prefix_cache_tokens = gauge("tgi_prefix_cache_tokens", "KV slots the prefix cache holds")
        self.piece_cache = PieceCacheMetrics(r)
        self._router_totals = _RouterTotals()
        r.register(self._router_totals)
        self._own = _WithoutCreated(r)
        self._view = _WithoutCreated(self._exposed(r, multiprocess_dir))
        counters = sorted(f.name for f in self._own.collect() if f.type == "counter")
        self._counter_total = re.compile(rf"^((?:# (?:HELP|TYPE) )?(?:{'|'.join(counters)}))_total\b", re.M)

    def _batch_metrics(self, r: CollectorRegistry, seconds: list[float]) -> None:
        def by_method(kind, name: str, help_text: str, **extra):
            return kind(name, help_text, ["method"], registry=r, **extra)

        self.batch_count = by_method(Counter, "tgi_batch_inference_count", "Steps run")
        self.batch_success = by_method(Counter, "tgi_batch_inference_success", "Steps that succeeded")
        self.batch_failure = by_method(Counter, "tgi_batch_inference_failure", "Steps that failed")
        self.batch_durations = {
            phase: by_method(Histogram, f"tgi_batch_{phase}_duration", help_text, buckets=seconds)
            for phase, help_text in [
                ("inference", "A whole step: scheduling to token events (s)"),
                ("forward", "The shards' time for a step (s)"),
                ("decode", "Turning a step's sampled tokens into token events (s)"),
                ("filter", "Freeing the requests that finished in a step (s)"),
                ("concat", "Scheduling a step: admission and its rows (s)"),
            ]}
        self.batch_next_size = Histogram("tgi_batch_next_size", "Rows (requests) in a step",
                                         buckets=[float(i) for i in range(1, 1025)], registry=r)
        self.batch_concat = Counter("tgi_batch_concat", "Steps in which requests joined a running batch",
                                    ["reason"], registry=r)

    def _exposed(self, r: CollectorRegistry, multiprocess_dir: str | None) -> CollectorRegistry:
        """What a scrape reads: this registry, or every front end's files and the router's totals."""
        if multiprocess_dir is None:
            return r
        exposed = CollectorRegistry(auto_describe=True)
        MultiProcessCollector(exposed, path=multiprocess_dir)
        exposed.register(self._router_totals)
        return exposed

    def observe_steps(self, steps: list) -> None:
        """Record the router's ``StepStats`` (called on the backend's reader thread)."""
        for step in steps:
            self.batch_count.labels(method=step.method).inc()
            if not step.ok:
                self.batch_failure.labels(method=step.method).inc()
                continue
            self.batch_success.labels(method=step.method).inc()
            for phase, histogram in self.batch_durations.items():
                histogram.labels(method=step.method).observe(getattr(step, f"{phase}_s"))
            self.batch_next_size.observe(step.size)
            if step.joined:
                self.batch_concat.labels(reason="chunking").inc()

    def update_from_stats(self, stats: dict, fallback_capacity: int | None) -> None:
        """Set the engine gauges from a backend's ``stats()`` (queue, batch and KV numbers)."""
        capacity = stats.get("max_batch_total_tokens") or stats.get("kv_capacity") or fallback_capacity or 0
        used = stats.get("kv_used", 0)
        slots = stats.get("kv_capacity") or capacity
        self.queue_size.set(stats.get("queue_size", 0))
        self.batch_size.set(stats.get("batch_size", 0))
        self.batch_tokens.set(used)
        self.batch_max_tokens.set(capacity)
        self.kv_used_slots.set(used)
        self.kv_total_slots.set(slots)
        self.kv_usage.set(used / slots if slots else 0.0)
        if stats.get("num_shards"):
            self.num_shards.set(stats["num_shards"])
        self.prefix_cache_tokens.set(stats.get("prefix_cache_tokens", 0))
        self._router_totals.totals = {key: stats.get(key, 0) for _, key, _ in ROUTER_TOTALS}
        self._router_totals.skipped_tokens = tuple(stats.get(SKIPPED_TOKENS_KEY, ()))

    def names(self) -> set[str]:
        """Every metric family this app exports (TGI's names)."""
        return {family.name for family in self._own.collect()}

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4), counters under TGI's names."""
        return self._counter_total.sub(r"\1", generate_latest(self._view).decode())
