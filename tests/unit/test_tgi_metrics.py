"""TGI's metric names, kinds and labels through prometheus_client, one registry per app."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.protocol.messages import StepStats
from tgi_compat.metrics import ServerMetrics, duration_buckets, linear_buckets

TGI_KINDS = {
    "tgi_request_count": "counter", "tgi_request_success": "counter", "tgi_request_failure": "counter",
    "tgi_request_duration": "histogram", "tgi_request_validation_duration": "histogram",
    "tgi_request_queue_duration": "histogram", "tgi_request_inference_duration": "histogram",
    "tgi_request_mean_time_per_token_duration": "histogram", "tgi_request_input_length": "histogram",
    "tgi_request_generated_tokens": "histogram", "tgi_request_max_new_tokens": "histogram",
    "tgi_queue_size": "gauge", "tgi_batch_current_size": "gauge", "tgi_batch_current_max_tokens": "gauge",
    "tgi_batch_max_total_tokens": "gauge",
    "tgi_batch_inference_count": "counter", "tgi_batch_inference_success": "counter",
    "tgi_batch_inference_failure": "counter", "tgi_batch_inference_duration": "histogram",
    "tgi_batch_forward_duration": "histogram", "tgi_batch_decode_duration": "histogram",
    "tgi_batch_filter_duration": "histogram", "tgi_batch_concat_duration": "histogram",
    "tgi_batch_next_size": "histogram", "tgi_batch_concat": "counter", "tgi_request_skipped_tokens": "histogram",
    # ours
    "tgi_kv_cache_usage": "gauge", "tgi_kv_cache_used_slots": "gauge", "tgi_kv_cache_total_slots": "gauge",
    "tgi_num_shards": "gauge", "tgi_prefix_cache_tokens": "gauge", "tgi_prefix_cache_lookup_tokens": "counter",
    "tgi_prefix_cache_hit_tokens": "counter", "tgi_prefix_cache_evicted_tokens": "counter",
    "tgi_speculation_drafted_tokens": "counter", "tgi_speculation_accepted_tokens": "counter",
    "tgi_tokenizer_piece_cache_hits": "counter", "tgi_tokenizer_piece_cache_misses": "counter",
    "tgi_tokenizer_piece_cache_chars": "gauge",
}


def families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample_lines(text: str) -> set[str]:
    return {line for line in text.splitlines() if not line.startswith("#")}


def test_every_tgi_metric_parses_with_its_kind():
    parsed = families(ServerMetrics(100, 200, num_shards=2).render())
    assert {name: parsed[name].type for name in TGI_KINDS} == TGI_KINDS
    assert parsed["tgi_num_shards"].samples[0].value == 2


def test_counters_keep_tgi_names_and_labels():
    metrics = ServerMetrics(100, 200, 1)
    metrics.request_count.inc(2)
    for err in ("validation", "overloaded", "validation"):
        metrics.request_failure.labels(err=err).inc()
    text = metrics.render()
    lines = sample_lines(text)
    assert "# TYPE tgi_request_count counter" in text.splitlines()
    assert "tgi_request_count 2.0" in lines
    assert {'tgi_request_failure{err="validation"} 2.0', 'tgi_request_failure{err="overloaded"} 1.0'} <= lines
    assert "_total" not in text.replace("max_total_tokens", "").replace("total_slots", "")
    assert "_created" not in text


def test_histograms_use_tgi_buckets():
    metrics = ServerMetrics(100, 200, 1)
    for value in (0.0001, 0.0002, 10.0):
        metrics.request_duration.observe(value)
    parsed = families(metrics.render())["tgi_request_duration"]
    buckets = {s.labels["le"]: s.value for s in parsed.samples if s.name.endswith("_bucket")}
    assert len(buckets) == 36 and buckets["0.00015"] == 1 and buckets["+Inf"] == 3
    assert {s.name: s.value for s in parsed.samples}["tgi_request_duration_count"] == 3
    input_buckets = [s for s in families(metrics.render())["tgi_request_input_length"].samples
                     if s.name.endswith("_bucket")]
    assert input_buckets[0].labels["le"] == "1.0" and input_buckets[-2].labels["le"] == "100.0"


def test_tgi_bucket_layouts():
    seconds = duration_buckets()
    assert len(seconds) == 35 and seconds[0] == 0.00015 and abs(seconds[1] / seconds[0] - 1.5) < 1e-12
    assert linear_buckets(1000) == [10.0 * (i + 1) for i in range(100)]


def test_gauges_come_from_backend_stats():
    metrics = ServerMetrics(100, 200, 1)
    metrics.update_from_stats({"queue_size": 3, "batch_size": 2, "kv_used": 256, "kv_capacity": 1024}, None)
    lines = sample_lines(metrics.render())
    for line in ("tgi_queue_size 3.0", "tgi_batch_current_size 2.0", "tgi_batch_current_max_tokens 256.0",
                 "tgi_batch_max_total_tokens 1024.0", "tgi_kv_cache_usage 0.25", "tgi_kv_cache_used_slots 256.0",
                 "tgi_kv_cache_total_slots 1024.0"):
        assert line in lines


def test_each_app_has_its_own_registry():
    first, second = ServerMetrics(10, 20, 1), ServerMetrics(10, 20, 1)
    first.request_success.inc()
    assert "tgi_request_success 1.0" in sample_lines(first.render())
    assert "tgi_request_success 0.0" in sample_lines(second.render())


def test_names_lists_the_exported_families():
    metrics = ServerMetrics(10, 20, 1)
    assert metrics.names() == set(families(metrics.render())) == set(TGI_KINDS)


def step(method: str, size: int, joined: bool = False, ok: bool = True) -> StepStats:
    return StepStats(method=method, size=size, joined=joined, concat_s=0.001, forward_s=0.02, decode_s=0.0005,
                     filter_s=0.0001, inference_s=0.0216, ok=ok)


def test_steps_feed_the_batch_metrics_by_method():
    metrics = ServerMetrics(100, 200, 1)
    metrics.observe_steps([step("prefill", 3), step("decode", 3), step("decode", 4, joined=True),
                           step("decode", 4, ok=False)])
    parsed = families(metrics.render())
    lines = sample_lines(metrics.render())
    assert {'tgi_batch_inference_count{method="prefill"} 1.0', 'tgi_batch_inference_count{method="decode"} 3.0',
            'tgi_batch_inference_success{method="decode"} 2.0', 'tgi_batch_inference_failure{method="decode"} 1.0',
            'tgi_batch_concat{reason="chunking"} 1.0'} <= lines
    forward = {(s.name, s.labels.get("method"), s.labels.get("le")): s.value for s in parsed["tgi_batch_forward_duration"].samples}
    assert forward[("tgi_batch_forward_duration_count", "decode", None)] == 2
    assert forward[("tgi_batch_forward_duration_sum", "prefill", None)] == 0.02
    sizes = {s.labels.get("le"): s.value for s in parsed["tgi_batch_next_size"].samples if s.name.endswith("_bucket")}
    assert len(sizes) == 1025 and sizes["2.0"] == 0 and sizes["3.0"] == 2 and sizes["1024.0"] == 3


def test_prefix_cache_counters_follow_the_routers_totals():
    metrics = ServerMetrics(100, 200, 1)
    for hits in (10, 30, 30):
        metrics.update_from_stats({"prefix_cache_tokens": 50, "prefix_cache_lookup_tokens": 100,
                                   "prefix_cache_hit_tokens": hits, "prefix_cache_evicted_tokens": 0}, 1024)
    lines = sample_lines(metrics.render())
    assert {"tgi_prefix_cache_tokens 50.0", "tgi_prefix_cache_hit_tokens 30.0",
            "tgi_prefix_cache_lookup_tokens 100.0", "tgi_prefix_cache_evicted_tokens 0.0"} <= lines


def test_speculation_counters_follow_the_routers_totals():
    metrics = ServerMetrics(100, 200, 1)
    for drafted, accepted in ((8, 3), (20, 11), (20, 11)):
        metrics.update_from_stats({"speculation_drafted_tokens": drafted, "speculation_accepted_tokens": accepted},
                                  1024)
    lines = sample_lines(metrics.render())
    assert {"tgi_speculation_drafted_tokens 20.0", "tgi_speculation_accepted_tokens 11.0"} <= lines
    assert not any(line.startswith("tgi_request_speculated_tokens") for line in lines)     # not a TGI name


def test_skipped_tokens_is_tgis_histogram_of_accepted_drafts_per_generation():
    """TGI's `tgi_request_skipped_tokens`: one observation per generation (tokens - 1), buckets 0 .. --speculate,
    from the router's numbers of generations by accepted drafts (cumulative, so a scrape reads the latest)."""
    metrics = ServerMetrics(100, 200, 1)
    assert families(metrics.render())["tgi_request_skipped_tokens"].type == "histogram"
    for counts in ((3, 0, 1), (7, 2, 0, 1, 4)):          # --speculate 4: 7 plain generations, 2 with 1 draft ..
        metrics.update_from_stats({"speculation_skipped_tokens": counts}, 1024)
    samples = families(metrics.render())["tgi_request_skipped_tokens"].samples
    buckets = {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket")}
    assert buckets == {"0.0": 7, "1.0": 9, "2.0": 9, "3.0": 10, "4.0": 14, "+Inf": 14}
    totals = {s.name: s.value for s in samples if not s.name.endswith("_bucket")}
    assert totals == {"tgi_request_skipped_tokens_count": 14, "tgi_request_skipped_tokens_sum": 21}
