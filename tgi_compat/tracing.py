"""OpenTelemetry traces of the requests, to TGI's ``--otlp-endpoint`` (OTLP over gRPC, as TGI).

One trace per generation request, as TGI's router records it: a root span named after the
route's handler (``generate``, ``generate_stream``, ``chat_completions``, ...) with the request
id, the input length, the generated tokens and the finish reason, and three child spans for
its phases: ``validation`` (tokenizing, limits), ``queue`` (submission to the first token, the
prefill included) and ``inference`` (first token to last). Spans are recorded when the request
ends, from the timestamps the metrics use, and exported in batches on a background thread, so
tracing adds no work to the event loop but a few attribute sets per request.

``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-grpc`` are an optional extra
(``pip install 'lightserve[otlp]'``): the launcher refuses ``--otlp-endpoint`` without them.
"""
from __future__ import annotations

import time

MISSING = ("--otlp-endpoint needs OpenTelemetry's SDK and OTLP exporter: pip install 'lightserve[otlp]' "
           "(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-grpc), or leave the flag unset")


def check_available() -> str | None:
    """None when the OpenTelemetry packages import, else what to install."""
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return MISSING
    return None


class RequestTracer:
    """Records each finished request as a span tree and exports it to the collector."""

    def __init__(self, endpoint: str, service_name: str, export_delay_ms: int = 5000):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=export_delay_ms))
        self.tracer = self.provider.get_tracer("lightserve.tgi_compat")

    def record(self, name: str, timing, attributes: dict, error: str | None = None) -> None:
        """The request's spans, from its monotonic ``timing`` (``tgi_compat.outputs.Timing``)."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        now_ns, now = time.time_ns(), time.monotonic()

        def wall(t: float) -> int:
            return now_ns - int((now - t) * 1e9)

        end = timing.finished or now
        root = self.tracer.start_span(name, start_time=wall(timing.received), attributes=attributes)
        context = trace.set_span_in_context(root)
        phases = [("validation", timing.received, timing.validated), ("queue", timing.validated, timing.first_token),
                  ("inference", timing.first_token, timing.finished)]
        for phase, start, stop in phases:
            if start is not None:
                span = self.tracer.start_span(phase, context=context, start_time=wall(start))
                span.end(end_time=wall(stop if stop is not None else end))
        if error is not None:
            root.set_status(Status(StatusCode.ERROR, error))
        root.end(end_time=wall(end))

    def shutdown(self) -> None:
        """Export what is left (the front end's shutdown)."""
        self.provider.shutdown()
