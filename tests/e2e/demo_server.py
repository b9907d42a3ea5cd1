"""The bundled demo model (weights/demo: a trained tiny Llama with a chat template) behind
the real engine and front end, for the OpenAI-route tests. The engine is built once per
test process and shared; each caller starts its own uvicorn front end over it."""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from tests.e2e.conftest import make_settings, serve

DEMO = Path(__file__).resolve().parents[2] / "weights" / "demo"
DEMO_MODEL_ID = "lightserve/demo"


@functools.cache
def demo_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO)


@functools.cache
def demo_backend():
    from engine.client import InProcessBackend
    from engine.generation import Engine, EngineConfig

    return InProcessBackend(Engine(EngineConfig(model_dir=str(DEMO), device="cpu", kernel_backend="torch",
                                                num_slots=8192, max_requests=32)))


@contextlib.contextmanager
def serve_demo(**overrides):
    """``with serve_demo(api_key="k") as url: ...``: a front end over the shared demo engine."""
    from tgi_compat import create_app

    values = dict(model_id=DEMO_MODEL_ID, max_input_tokens=1024, max_total_tokens=2048)
    values.update(overrides)
    with serve(create_app(make_settings(**values), demo_tokenizer(), demo_backend())) as url:
        yield url

