"""``create_app``: the TGI-compatible Starlette application over an engine ``Backend``.

    app = create_app(settings, AutoTokenizer.from_pretrained(model_dir), backend)
    uvicorn.run(app, host="0.0.0.0", port=3000)
"""
from __future__ import annotations

import contextlib

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from engine.client import Backend

from .chat import ChatRoutes
from .completions import CompletionRoutes
from .errors import TGIError, handle_tgi_error, handle_unexpected_error
from .metrics import ServerMetrics
from .routes import Handlers
from .service import GenerateService
from .settings import ServerSettings
from .tokenization import TokenizerAdapter


def _routes(h: Handlers) -> list[Route]:
    chat, completions = ChatRoutes(h.settings, h.service), CompletionRoutes(h.settings, h.service)
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
    ]


def create_app(settings: ServerSettings, tokenizer, backend: Backend) -> Starlette:
    """``tokenizer``: a Hugging Face fast tokenizer (or a ``TokenizerAdapter``)."""
    owns_tokenizer = not isinstance(tokenizer, TokenizerAdapter)
    if owns_tokenizer:
        tokenizer = TokenizerAdapter(tokenizer, settings.validation_workers)
    metrics = ServerMetrics(settings.max_input_tokens, settings.max_total_tokens, settings.num_shards)
    service = GenerateService(settings, tokenizer, backend, metrics)
    handlers = Handlers(settings, service, backend, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if owns_tokenizer:
            tokenizer.close()

    cors = Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["GET", "POST"],
                      allow_headers=["content-type"])
    handlers_by_error = {TGIError: handle_tgi_error, Exception: handle_unexpected_error}
    app = Starlette(routes=_routes(handlers), middleware=[cors], exception_handlers=handlers_by_error,
                    lifespan=lifespan)
    app.state.settings, app.state.service, app.state.metrics = settings, service, metrics
    return app
