"""Prometheus text exposition of TGI's `tgi_*` metrics, without a client library.

One ``ServerMetrics`` per app (no process-global registry). Names, kinds and buckets
follow TGI (server.rs `start()`, docs/source/reference/metrics.md); gauges that
describe the engine are read from ``backend.stats()`` at scrape time. Extra:
`tgi_kv_cache_usage` (0..1, TGI issue #3275) and `tgi_num_shards`.
"""
from __future__ import annotations

import bisect
import math
import threading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Labels = tuple[tuple[str, str], ...]


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _labels(labels: Labels, extra: tuple[str, str] | None = None) -> str:
    pairs = list(labels) + ([extra] if extra else [])
    if not pairs:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in pairs)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(pairs, escaped)) + "}"


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str):
        self.name, self.help_text = name, help_text
        self._values: dict[Labels, float] = {}
        self._lock = threading.Lock()

    def _header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items()) or [((), 0.0)]
        return self._header() + [f"{self.name}{_labels(k)} {_number(v)}" for k, v in items]


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Gauge(_Metric):
    kind = "gauge"

    def set(self, value: float) -> None:
        with self._lock:
            self._values[()] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: list[float]):
        super().__init__(name, help_text)
        self.buckets = sorted(buckets)
        self._counts = [0] * (len(self.buckets) + 1)   # last: above every bucket
        self._sum = 0.0

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    def render(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines, cumulative = self._header(), 0
        for bound, count in zip(self.buckets + [math.inf], counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines += [f"{self.name}_sum {_number(total)}", f"{self.name}_count {cumulative}"]
        return lines


def duration_buckets() -> list[float]:
    """35 geometric buckets from 0.00015 s, x1.5 each (TGI)."""
    return [0.00015 * 1.5**i for i in range(35)]


def linear_buckets(maximum: int, count: int = 100) -> list[float]:
    return [maximum / count * (i + 1) for i in range(count)]


class ServerMetrics:
    """The metrics of one app; the request handlers record, ``render`` exposes."""

    def __init__(self, max_input_tokens: int, max_total_tokens: int, num_shards: int):
        seconds, c, g = duration_buckets(), Counter, Gauge
        self.request_count = c("tgi_request_count", "Generation requests received")
        self.request_success = c("tgi_request_success", "Generation requests that succeeded")
        self.request_failure = c("tgi_request_failure", "Generation requests that failed, by error kind")
        self.request_duration = Histogram("tgi_request_duration", "End-to-end request time (s)", seconds)
        self.validation_duration = Histogram(
            "tgi_request_validation_duration", "Validation and tokenization time (s)", seconds)
        self.queue_duration = Histogram(
            "tgi_request_queue_duration", "Submission to first token, prefill included (s)", seconds)
        self.inference_duration = Histogram(
            "tgi_request_inference_duration", "First token to last token (s)", seconds)
        self.time_per_token = Histogram(
            "tgi_request_mean_time_per_token_duration", "Mean time between generated tokens (s)", seconds)
        self.input_length = Histogram(
            "tgi_request_input_length", "Prompt tokens", linear_buckets(max_input_tokens))
        self.generated_tokens = Histogram(
            "tgi_request_generated_tokens", "Generated tokens", linear_buckets(max_total_tokens))
        self.max_new_tokens = Histogram(
            "tgi_request_max_new_tokens", "Requested max_new_tokens", linear_buckets(max_total_tokens))
        self.queue_size = g("tgi_queue_size", "Requests waiting for admission")
        self.batch_size = g("tgi_batch_current_size", "Requests in the running batch")
        self.batch_tokens = g("tgi_batch_current_max_tokens", "KV tokens held by the running batch")
        self.batch_max_tokens = g("tgi_batch_max_total_tokens", "KV token capacity")
        self.kv_usage = g("tgi_kv_cache_usage", "Fraction of KV cache slots in use (0..1)")
        self.num_shards = g("tgi_num_shards", "Tensor-parallel shards")
        self.num_shards.set(num_shards)

    def update_from_stats(self, stats: dict, fallback_capacity: int | None) -> None:
        capacity = stats.get("max_batch_total_tokens") or stats.get("kv_capacity") or fallback_capacity or 0
        used = stats.get("kv_used", 0)
        self.queue_size.set(stats.get("queue_size", 0))
        self.batch_size.set(stats.get("batch_size", 0))
        self.batch_tokens.set(used)
        self.batch_max_tokens.set(capacity)
        slots = stats.get("kv_capacity") or capacity
        self.kv_usage.set(used / slots if slots else 0.0)
        if stats.get("num_shards"):
            self.num_shards.set(stats["num_shards"])

    def render(self) -> str:
        lines: list[str] = []
        for metric in vars(self).values():
            if isinstance(metric, _Metric):
                lines += metric.render()
        return "\n".join(lines) + "\n"
