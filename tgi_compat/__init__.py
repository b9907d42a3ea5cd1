"""The HTTP front end: Hugging Face text-generation-inference's API over our engine.

``create_app(settings, tokenizer, backend)`` builds the Starlette app (``app``);
``ServerSettings`` is its configuration (``settings``). Modules, one job each:
schema (JSON -> typed request), validation (TGI's checks and messages), tokenization,
detokenizer, stop, generation (backend events -> tokens), service (permits, metrics,
logs), responses / sse (wire formats), errors (statuses), http_input (auth, body),
metrics, routes.
"""
from __future__ import annotations

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str):
    """``create_app`` and ``ServerSettings`` load on first use: the launcher imports this package's
    flag parsing without the HTTP app (and torch), so a taken port fails within a second."""
    if name == "create_app":
        from .app import create_app
        return create_app
    if name == "ServerSettings":
        from .settings import ServerSettings
        return ServerSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
