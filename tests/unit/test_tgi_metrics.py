"""Prometheus exposition of TGI's metric names, owned by each app."""
from __future__ import annotations

import re

from tgi_compat.metrics import Histogram, ServerMetrics, duration_buckets, linear_buckets

TGI_NAMES = ["tgi_request_count", "tgi_request_success", "tgi_request_failure", "tgi_request_duration",
             "tgi_request_validation_duration", "tgi_request_queue_duration", "tgi_request_inference_duration",
             "tgi_request_mean_time_per_token_duration", "tgi_request_input_length", "tgi_request_generated_tokens",
             "tgi_request_max_new_tokens", "tgi_queue_size", "tgi_batch_current_size", "tgi_batch_current_max_tokens",
             "tgi_batch_max_total_tokens", "tgi_kv_cache_usage", "tgi_num_shards"]


def test_every_tgi_metric_is_exposed_with_a_type():
    text = ServerMetrics(100, 200, num_shards=2).render()
    for name in TGI_NAMES:
        assert re.search(rf"^# TYPE {name} (counter|gauge|histogram)$", text, re.M), name
    assert "tgi_num_shards 2\n" in text


def test_counters_with_labels():
    metrics = ServerMetrics(100, 200, 1)
    metrics.request_count.inc()
    metrics.request_count.inc()
    metrics.request_failure.inc(err="validation")
    metrics.request_failure.inc(err="overloaded")
    metrics.request_failure.inc(err="validation")
    text = metrics.render()
    assert "tgi_request_count 2\n" in text
    assert 'tgi_request_failure{err="validation"} 2\n' in text
    assert 'tgi_request_failure{err="overloaded"} 1\n' in text


def test_histogram_buckets_are_cumulative():
    histogram = Histogram("h", "help", [1, 2, 5])
    for value in (0.5, 1, 1.5, 7):
        histogram.observe(value)
    lines = histogram.render()
    assert lines[2:] == ['h_bucket{le="1"} 2', 'h_bucket{le="2"} 3', 'h_bucket{le="5"} 3',
                         'h_bucket{le="+Inf"} 4', "h_sum 10", "h_count 4"]


def test_tgi_bucket_layouts():
    seconds = duration_buckets()
    assert len(seconds) == 35 and seconds[0] == 0.00015 and abs(seconds[1] / seconds[0] - 1.5) < 1e-12
    assert linear_buckets(1000) == [10.0 * (i + 1) for i in range(100)]


def test_gauges_come_from_backend_stats():
    metrics = ServerMetrics(100, 200, 1)
    metrics.update_from_stats({"queue_size": 3, "batch_size": 2, "kv_used": 256, "kv_capacity": 1024}, None)
    text = metrics.render()
    for line in ("tgi_queue_size 3", "tgi_batch_current_size 2", "tgi_batch_current_max_tokens 256",
                 "tgi_batch_max_total_tokens 1024", "tgi_kv_cache_usage 0.25"):
        assert line + "\n" in text


def test_each_app_has_its_own_registry():
    first, second = ServerMetrics(10, 20, 1), ServerMetrics(10, 20, 1)
    first.request_success.inc()
    assert "tgi_request_success 1\n" in first.render()
    assert "tgi_request_success 0\n" in second.render()
