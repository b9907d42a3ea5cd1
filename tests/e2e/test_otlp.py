"""--otlp-endpoint: each request's trace reaches an OpenTelemetry collector over OTLP/gRPC (a
stub collector on localhost built from opentelemetry-proto's service definition)."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
import requests
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)

from tgi_compat.launch_config import LaunchError, parse_args

from .conftest import make_settings, serve
from .server import LaunchedServer


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it is sent, with its resource's service.name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, count: int, timeout: float = 20.0) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.spans) >= count:
                    return list(self.spans)
            time.sleep(0.05)
        raise AssertionError(f"the collector got {len(self.spans)} spans, expected {count}")


@pytest.fixture
def collector():
    sink = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, f"http://127.0.0.1:{port}"
    server.stop(0)


def attributes(span) -> dict:
    return {a.key: (a.value.string_value or a.value.int_value) for a in span.attributes}


def test_each_request_is_a_trace_with_its_phases(collector, hf_tokenizer, engine_backend, monkeypatch):
    sink, endpoint = collector
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")        # export within 0.1 s (default 5 s)
    settings = make_settings(otlp_endpoint=endpoint, otlp_service_name="lightserve-test")
    from tgi_compat import create_app

    with serve(create_app(settings, hf_tokenizer, engine_backend)) as url:
        requests.post(url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}}, timeout=30)
        requests.post(url + "/generate_stream", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                      timeout=30)
        requests.post(url + "/generate", json={"inputs": "hello", "parameters": {"top_k": 0}}, timeout=30)
        spans = sink.wait_for(4 + 4 + 2)
    assert {service for service, _ in spans} == {"lightserve-test"}
    roots = {span.name: span for _, span in spans if not span.parent_span_id and span.name != "generate"
             or (span.name == "generate" and attributes(span).get("finish_reason"))}
    children = [span for _, span in spans if span.parent_span_id]
    for name in ("generate", "generate_stream"):
        root = roots[name]
        phases = {span.name: span for span in children if span.parent_span_id == root.span_id}
        assert set(phases) == {"validation", "queue", "inference"}, name
        assert all(p.trace_id == root.trace_id for p in phases.values())
        assert root.start_time_unix_nano <= phases["validation"].start_time_unix_nano
        assert phases["validation"].end_time_unix_nano <= phases["queue"].end_time_unix_nano
        assert phases["inference"].end_time_unix_nano <= root.end_time_unix_nano
        assert attributes(root)["finish_reason"] == "length" and attributes(root)["input_length"] > 0
    failed = [span for _, span in spans if span.name == "generate" and attributes(span).get("error_type")]
    assert len(failed) == 1 and failed[0].status.code == 2          # STATUS_CODE_ERROR: the validation error


def test_the_flag_is_checked_before_anything_starts(capsys):
    config = parse_args(["--model-id", "x", "--otlp-endpoint", "http://localhost:4317"])
    assert config.otlp_endpoint == "http://localhost:4317"
    with pytest.raises(SystemExit):
        parse_args(["--model-id", "x", "--otlp-endpoint", "localhost:4317"])
    assert "--otlp-endpoint must be a collector URL such as http://localhost:4317" in capsys.readouterr().err


def test_without_the_packages_the_flag_says_what_to_install(monkeypatch):
    from tgi_compat import launch_config, tracing

    monkeypatch.setattr(tracing, "check_available", lambda: tracing.MISSING)
    with pytest.raises(LaunchError, match=r"pip install 'lightserve\[otlp\]'"):
        launch_config._check_otlp("http://localhost:4317")


def test_the_launched_server_sends_its_traces(collector, launcher_model_dir):
    """The real launcher: the flags reach the front-end process, which exports there."""
    sink, endpoint = collector
    server = LaunchedServer(launcher_model_dir, "--otlp-endpoint", endpoint, "--otlp-service-name", "launched",
                            env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        server.wait_healthy()
        response = requests.post(server.url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}},
                                 timeout=60)
        assert response.status_code == 200
        spans = sink.wait_for(4)
    finally:
        assert server.stop() == 0, server.output()
    assert {service for service, _ in spans} == {"launched"}
    assert sorted(span.name for _, span in spans) == ["generate", "inference", "queue", "validation"]


def test_an_unreachable_collector_costs_the_requests_nothing(hf_tokenizer, engine_backend, monkeypatch):
    """Export failures stay on the exporter's thread: requests are answered as without tracing."""
    from tests.e2e.server import free_port
    from tgi_compat import create_app

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")          # seconds: shutdown's last flush gives up soon
    settings = make_settings(otlp_endpoint=f"http://127.0.0.1:{free_port()}")   # nobody listens there
    with serve(create_app(settings, hf_tokenizer, engine_backend)) as url:
        for _ in range(3):
            response = requests.post(url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}},
                                     timeout=30)
            assert response.status_code == 200
        assert requests.get(url + "/health", timeout=5).status_code == 200
