"""The HTTP front end: Hugging Face text-generation-inference's API over our engine.

``create_app(settings, tokenizer, backend)`` builds the Starlette app (``app``);
``ServerSettings`` is its configuration (``settings``). Modules, one job each:
schema (JSON -> typed request), validation (TGI's checks and messages), tokenization,
detokenizer, stop, generation (backend events -> tokens), service (permits, metrics,
logs), responses / sse (wire formats), errors (statuses), http_input (auth, body),
metrics, routes.
"""
from .app import create_app
from .settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
