"""``create_app``: the TGI-compatible Starlette application over an engine ``Backend``.

    app = create_app(settings, AutoTokenizer.from_pretrained(model_dir), backend)
    uvicorn.run(app, host="0.0.0.0", port=3000)
"""
from __future__ import annotations

import contextlib
import gc

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from engine.client import Backend
from engine.processes import tune_collector_for_serving

from .api_docs import ApiDocs
from .chat import ChatRoutes
from .completions import CompletionRoutes
from .errors import TGIError, handle_tgi_error, handle_unexpected_error
from .frontend_group import FrontendMember
from .invocations import Invocations
from .metrics import ServerMetrics
from .tracing import RequestTracer
from .routes import Handlers
from .service import GenerateService
from .settings import ServerSettings
from .tokenization import TokenizerAdapter
from .vertex import Vertex


def _routes(h: Handlers) -> list[Route]:
    chat, completions = ChatRoutes(h.settings, h.service), CompletionRoutes(h.settings, h.service)
    sagemaker = Invocations(h.settings, h.compat_generate, chat.chat_completions, completions.completions)
    vertex = Vertex(h.settings, h.service, chat)
    return [
        Route("/generate", h.generate, methods=["POST"]),
        Route("/generate_stream", h.generate_stream, methods=["POST"]),
        Route("/", h.compat_generate, methods=["POST"]),
        Route("/tokenize", h.tokenize, methods=["POST"]),
        Route("/", h.health, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/ping", h.health, methods=["GET"]),
        Route("/info", h.info, methods=["GET"]),
        Route("/metrics", h.metrics_text, methods=["GET"]),
        Route("/v1/chat/completions", chat.chat_completions, methods=["POST"]),
        Route("/chat_tokenize", chat.chat_tokenize, methods=["POST"]),
        Route("/v1/completions", completions.completions, methods=["POST"]),
        Route("/v1/models", completions.models, methods=["GET"]),
        Route("/invocations", sagemaker.invocations, methods=["POST"]),
        Route("/vertex", vertex.vertex, methods=["POST"]),
        *ApiDocs(h.settings).routes(),
    ]


# Response headers a browser page may read (TGI's timing headers).
EXPOSED_HEADERS = ["x-compute-type", "x-compute-time", "x-compute-characters", "x-total-time",
                   "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token",
                   "x-prompt-tokens", "x-generated-tokens"]


def cors_middleware(settings: ServerSettings) -> Middleware:
    """CORS as TGI's `--cors-allow-origin` (any origin when unset), with the request headers
    browsers send: `Authorization` (for `--api-key`) and `Content-Type`. A preflight from
    another origin is refused (400, no `Access-Control-Allow-Origin`)."""
    origins = list(settings.cors_allow_origin) if settings.cors_allow_origin else ["*"]
    return Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                      allow_headers=["authorization", "content-type"], expose_headers=EXPOSED_HEADERS)


def create_app(settings: ServerSettings, tokenizer, backend: Backend,
               member: FrontendMember = FrontendMember()) -> Starlette:
    """``tokenizer``: a Hugging Face fast tokenizer (or a ``TokenizerAdapter``); ``member``: this front end's
    place among the server's front-end processes (what they share: the concurrency count and /metrics)."""
    owns_tokenizer = not isinstance(tokenizer, TokenizerAdapter)
    if owns_tokenizer:
        tokenizer = TokenizerAdapter(tokenizer, settings.validation_workers)
    metrics = ServerMetrics(settings.max_input_tokens, settings.max_total_tokens, settings.num_shards,
                            member.metrics_dir)
    if tokenizer.piece_cache is not None:
        tokenizer.piece_cache.observer = metrics.piece_cache
    backend.observe_steps(metrics.observe_steps)
    tracer = RequestTracer(settings.otlp_endpoint, settings.otlp_service_name) if settings.otlp_endpoint else None
    service = GenerateService(settings, tokenizer, backend, metrics, tracer, member.permits)
    handlers = Handlers(settings, service, backend, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        thresholds = gc.get_threshold()
        tune_collector_for_serving()
        yield
        gc.unfreeze()                  # collectable again at exit (finalizers of native objects run)
        gc.set_threshold(*thresholds)
        if owns_tokenizer:
            tokenizer.close()
        if tracer is not None:
            tracer.shutdown()          # exports the spans still waiting

    handlers_by_error = {TGIError: handle_tgi_error, Exception: handle_unexpected_error}
    app = Starlette(routes=_routes(handlers), middleware=[cors_middleware(settings)],
                    exception_handlers=handlers_by_error, lifespan=lifespan)
    app.state.settings, app.state.service, app.state.metrics = settings, service, metrics
    return app
