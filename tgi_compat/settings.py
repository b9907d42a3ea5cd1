"""The front end's configuration: one frozen dataclass, filled by the launcher.

Field names follow TGI's launcher flags (``--max-concurrent-requests`` ->
``max_concurrent_requests``). Nothing here reads environment variables; the launcher
does (``COMPUTE_TYPE`` -> ``compute_type``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    model_id: str
    max_input_tokens: int                 # longest prompt, in tokens (after `truncate`)
    max_total_tokens: int                 # prompt + max_new_tokens budget of one request
    model_sha: str | None = None
    model_pipeline_tag: str | None = None
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_client_batch_size: int = 4
    validation_workers: int = 2
    api_key: str | None = None
    payload_limit: int = 2_000_000        # bytes of a request body
    # TGI 3.x leaves `prefill` empty unless --enable-prefill-logprobs; we compute them by default.
    enable_prefill_logprobs: bool = True
    disable_grammar_support: bool = False
    version: str = "0.1.0"
    router_name: str = "lightserve"       # /info "router" (TGI: "text-generation-router")
    sha: str | None = None
    docker_label: str | None = None
    # x-compute-type header (TGI: env COMPUTE_TYPE, default "gpu+optimized"); None: true to the
    # device: "gpu+optimized" on CUDA (as TGI), "cpu+optimized" on a CPU
    compute_type: str | None = None
    model_dtype: str = "float16"
    model_device_type: str = "cuda"
    num_shards: int = 1
    max_batch_total_tokens: int | None = None
    waiting_served_ratio: float = 0.0
    max_waiting_tokens: int = 20
    max_batch_prefill_tokens: int | None = None
    max_batch_size: int | None = None
    keep_alive_s: float = 15.0            # SSE keep-alive comment interval
    # --cors-allow-origin: the origins a browser may call from; None: any origin (TGI's default)
    cors_allow_origin: tuple[str, ...] | None = None
    # --graceful-termination-timeout: on shutdown, running requests (streams too: sse-starlette
    # otherwise cancels every stream the moment the server is told to exit) may go on this long
    stream_shutdown_grace_s: float = 0.0
    # --otlp-endpoint / --otlp-service-name: OpenTelemetry traces of the requests (tgi_compat.tracing)
    otlp_endpoint: str | None = None
    otlp_service_name: str = "text-generation-inference.router"
    kv_cache_dtype: str | None = None     # --kv-cache-dtype (/info "kv_cache_dtype", ours); None: model_dtype

    def __post_init__(self):
        checks = [
            (self.max_input_tokens > 0, "`max_input_tokens` must be > 0"),
            (self.max_input_tokens < self.max_total_tokens, "`max_input_tokens` must be < `max_total_tokens`"),
            (self.max_concurrent_requests > 0, "`max_concurrent_requests` must be > 0"),
            (self.max_best_of > 0, "`max_best_of` must be > 0"),
            (self.validation_workers > 0, "`validation_workers` must be > 0"),
            (self.payload_limit > 0, "`payload_limit` must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message} (got {self})")
        if self.compute_type is None:
            device = {"cuda": "gpu"}.get(self.model_device_type, self.model_device_type)
            object.__setattr__(self, "compute_type", f"{device}+optimized")

    @property
    def compat_return_full_text(self) -> bool:
        """Default of `return_full_text` on `POST /`: true for text-generation models (TGI)."""
        return self.model_pipeline_tag in (None, "text-generation")
