"""The HTTP surface a TGI user relies on besides generation itself, against one demo server
with an API key and an origin list: real clients with any model name, CORS preflights,
`/docs` and `/api-doc/openapi.json`, `/invocations`, `x-compute-type`, `/metrics` through
prometheus_client's parser, and the Grafana dashboard's metric names."""
from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
import requests
from huggingface_hub import InferenceClient
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.demo_server import serve_demo

KEY = "secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALLOWED, OTHER = "https://app.example", "https://evil.example"
CHAT = [{"role": "user", "content": "Write a function that reverses a string."}]
DASHBOARD = Path(__file__).resolve().parents[2] / "bench" / "grafana" / "lightserve.json"


@pytest.fixture(scope="module")
def url():
    with serve_demo(api_key=KEY, cors_allow_origin=(ALLOWED,), model_device_type="cpu") as base:
        yield base


def post(url: str, path: str, body: dict, headers: dict | None = None) -> requests.Response:
    return requests.post(url + path, json=body, headers=headers or AUTH, timeout=60)


# ---- real clients, any model name -------------------------------------------------------

def test_inference_client_chat_completion_any_model(url):
    client = InferenceClient(url, api_key=KEY, timeout=60)
    reply = client.chat_completion(CHAT, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 4
    chunks = list(client.chat_completion(CHAT, max_tokens=4, temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    named = client.chat_completion(CHAT, model="some-org/any-model", max_tokens=2, temperature=0)
    assert named.choices[0].message.content


def test_inference_client_text_generation(url):
    client = InferenceClient(url, api_key=KEY, timeout=60)
    whole = client.text_generation("def reverse(s):", max_new_tokens=4, details=True)
    assert whole.details.generated_tokens == 4 and whole.generated_text
    tokens = list(client.text_generation("def reverse(s):", max_new_tokens=4, stream=True, details=True))
    assert len(tokens) == 4 and tokens[-1].generated_text == whole.generated_text


def test_openai_sdk_with_an_arbitrary_model_name(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    chat = client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=3, temperature=0)
    assert chat.choices[0].message.content and chat.model == "gpt-4o"
    completion = client.completions.create(model="meta-llama/Llama-3-8B", prompt="def f(", max_tokens=3)
    assert completion.choices[0].text and completion.usage.completion_tokens == 3


def test_an_unknown_adapter_id_on_generate_is_still_refused(url):
    response = post(url, "/generate", {"inputs": "x", "parameters": {"adapter_id": "my-lora", "max_new_tokens": 1}})
    assert response.status_code == 422 and "my-lora" in response.json()["error"]


# ---- CORS from --cors-allow-origin ------------------------------------------------------

def preflight(url: str, origin: str) -> requests.Response:
    return requests.options(url + "/generate", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_preflight_with_authorization_from_the_allowed_origin(url):
    response = preflight(url, ALLOWED)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ALLOWED
    allowed = {h.strip().lower() for h in response.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type"} <= allowed
    assert {"GET", "POST"} <= {m.strip() for m in response.headers["access-control-allow-methods"].split(",")}
    answer = post(url, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 1}},
                  headers={**AUTH, "Origin": ALLOWED})
    assert answer.headers["access-control-allow-origin"] == ALLOWED
    assert "x-compute-type" in answer.headers["access-control-expose-headers"]


def test_cors_refuses_another_origin(url):
    response = preflight(url, OTHER)
    assert response.status_code == 400 and "access-control-allow-origin" not in response.headers
    simple = requests.get(url + "/info", headers={"Origin": OTHER}, timeout=10)
    assert simple.status_code == 200 and "access-control-allow-origin" not in simple.headers


def test_cors_allows_any_origin_by_default(serve_app):
    with serve_app() as base:
        response = preflight(base, OTHER)
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"


# ---- /api-doc/openapi.json and /docs ----------------------------------------------------

def test_openapi_document_validates_and_describes_our_routes(url):
    from openapi_spec_validator import validate

    from tests.e2e.conftest import make_settings
    from tests.e2e.demo_server import demo_backend, demo_tokenizer
    from tgi_compat import create_app

    document = requests.get(url + "/api-doc/openapi.json", timeout=10).json()
    validate(document)
    documented = {(path, method) for path, item in document["paths"].items() for method in item}
    app = create_app(make_settings(), demo_tokenizer(), demo_backend())
    served = {(r.path, m.lower()) for r in app.routes for m in r.methods if m != "HEAD"
              and not r.path.startswith(("/docs", "/api-doc"))}
    assert documented == served
    assert document["info"]["version"] == "0.1.0"


def test_docs_serve_the_swagger_ui_offline(url):
    page = requests.get(url + "/docs", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/api-doc/openapi.json" in page.text and "SwaggerUIBundle" in page.text
    assets = re.findall(r'(?:src|href)="(/docs/[^"]+)"', page.text)
    assert {"/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css"} <= set(assets)
    for asset in assets:
        response = requests.get(url + asset, timeout=10)
        assert response.status_code == 200 and len(response.content) > 500, asset
    assert requests.get(url + "/docs/index.html", timeout=10).status_code == 404


# ---- /invocations and x-compute-type ----------------------------------------------------

def test_invocations_answers_a_tgi_body_like_post_root(url):
    body = {"inputs": "def reverse(s):", "parameters": {"max_new_tokens": 5, "do_sample": False}}
    expected = post(url, "/", body)
    response = post(url, "/invocations", body)
    assert response.status_code == 200 and response.json() == expected.json()
    assert isinstance(response.json(), list) and response.headers["x-compute-type"] == "cpu+optimized"
    generate = post(url, "/generate", body).json()
    assert response.json()[0]["generated_text"].endswith(generate["generated_text"])
    stream = post(url, "/invocations", {**body, "stream": True})
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert stream.headers["x-compute-type"] == "cpu+optimized"
    events = [json.loads(line[5:]) for line in stream.text.splitlines() if line.startswith("data:")]
    assert len(events) == 5 and events[-1]["generated_text"] == response.json()[0]["generated_text"]


def test_invocations_answers_a_chat_body_like_chat_completions(url):
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0}
    expected = post(url, "/v1/chat/completions", body).json()
    answer = post(url, "/invocations", body).json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"] == expected["choices"] and answer["usage"] == expected["usage"]
    completion = post(url, "/invocations", {"prompt": "def f(", "max_tokens": 2, "temperature": 0}).json()
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 2


def test_invocations_refuses_other_bodies_and_needs_the_key(url):
    other = post(url, "/invocations", {"text": "hello"})
    assert other.status_code == 422 and "`messages`" in other.json()["error"]
    assert requests.post(url + "/invocations", json={"inputs": "x"}, timeout=10).status_code == 401


# ---- /vertex ----------------------------------------------------------------------------

def test_vertex_predicts_each_instance_in_order(url):
    """A generate instance samples with only its `max_new_tokens` and `seed` (the rest is unused);
    a chat instance runs as /v1/chat/completions; predictions keep the instances' order. Each
    comparison runs alone in the engine (the same batch), as its reference did."""
    sampled = post(url, "/generate", {"inputs": "def reverse(s):",
                                      "parameters": {"do_sample": True, "seed": 7, "max_new_tokens": 6}})
    generate = {"inputs": "def reverse(s):", "parameters": {"seed": 7, "max_new_tokens": 6, "do_sample": False,
                                                            "temperature": 50.0, "stop": ["s"], "return_full_text": True}}
    alone = post(url, "/vertex", {"instances": [generate]})
    assert alone.status_code == 200, alone.text
    assert alone.json() == {"predictions": [sampled.json()["generated_text"]]}
    chat = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "temperature": 0})
    chatted = post(url, "/vertex", {"instances": [{"messages": CHAT, "max_tokens": 5, "temperature": 0}]})
    assert chatted.json() == {"predictions": [chat.json()["choices"][0]["message"]["content"]]}
    one_token = {"inputs": "def reverse(s):", "parameters": {"max_new_tokens": 1}}
    chat_instance = {"messages": CHAT, "max_tokens": 12, "temperature": 0}
    mixed = post(url, "/vertex", {"instances": [one_token, chat_instance, one_token]})
    assert mixed.status_code == 200, mixed.text
    lengths = [len(post(url, "/tokenize", {"inputs": text}).json()) for text in mixed.json()["predictions"]]
    assert lengths[0] <= 3 and lengths[2] <= 3 and lengths[1] > 4, (mixed.json(), lengths)


def test_vertex_errors_are_tgis(url):
    empty = post(url, "/vertex", {"instances": []})
    assert (empty.status_code, empty.json()) == (
        422, {"error": "Input validation error", "error_type": "Input validation error"})
    failed = post(url, "/vertex", {"instances": [{"inputs": "def f(", "parameters": {"max_new_tokens": 2}},
                                                 {"inputs": ""}]})          # `inputs` cannot be empty
    assert (failed.status_code, failed.json()) == (
        500, {"error": "Incomplete generation", "error_type": "Incomplete generation"})
    shapeless = post(url, "/vertex", {"instances": [{"text": "hi"}]})
    assert shapeless.status_code == 422 and "instances[0]" in shapeless.json()["error"]
    assert post(url, "/vertex", {"predictions": []}).status_code == 422
    denied = requests.post(url + "/vertex", json={"instances": [{"inputs": "x"}]}, timeout=10)
    assert (denied.status_code, denied.content) == (401, b"")


def test_compute_type_is_true_to_the_device(url):
    stream = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "stream": True})
    assert stream.headers["x-compute-type"] == "cpu+optimized"
    from tgi_compat import ServerSettings

    assert ServerSettings("m", 10, 20).compute_type == "gpu+optimized"      # CUDA: TGI's value
    assert ServerSettings("m", 10, 20, compute_type="custom").compute_type == "custom"


# ---- /metrics and the Grafana dashboard -------------------------------------------------

TGI_NAMES = {"tgi_request_count", "tgi_request_success", "tgi_request_failure", "tgi_request_duration",
             "tgi_request_validation_duration", "tgi_request_queue_duration", "tgi_request_inference_duration",
             "tgi_request_mean_time_per_token_duration", "tgi_request_generated_tokens", "tgi_request_input_length",
             "tgi_request_max_new_tokens", "tgi_batch_current_size", "tgi_batch_current_max_tokens",
             "tgi_batch_max_total_tokens", "tgi_queue_size"}


def exported(url: str) -> dict:
    text = requests.get(url + "/metrics", timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_metrics_parse_with_tgi_names(url):
    post(url, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2}}).raise_for_status()
    families = exported(url)
    assert TGI_NAMES <= set(families)
    assert families["tgi_request_count"].type == "counter" and families["tgi_request_duration"].type == "histogram"
    assert families["tgi_request_success"].samples[0].value >= 1
    assert families["tgi_kv_cache_total_slots"].samples[0].value == 8192


def dashboard_series(dashboard: dict) -> set[str]:
    """Every `tgi_*` series the panels' PromQL queries name."""
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert queries, "the dashboard has no queries"
    return {name for query in queries for name in re.findall(r"\btgi_[a-z_]+", query)}


def is_exported(series: str, families: dict) -> bool:
    """A family's own name, or a histogram's `_bucket`/`_sum`/`_count` series."""
    base, _, suffix = series.rpartition("_")
    return series in families or (suffix in ("bucket", "sum", "count") and base in families
                                  and families[base].type == "histogram")


def test_grafana_dashboard_queries_only_exported_metrics(url):
    families = exported(url)
    used = dashboard_series(json.loads(DASHBOARD.read_text()))
    assert not {series for series in used if not is_exported(series, families)}
    assert {"tgi_request_duration_bucket", "tgi_queue_size", "tgi_kv_cache_usage", "tgi_batch_forward_duration_bucket",
            "tgi_prefix_cache_hit_tokens", "tgi_tokenizer_piece_cache_hits", "tgi_tokenizer_piece_cache_misses"} <= used
    assert not is_exported("tgi_batch_forward_latency_bucket", families)     # the check can fail


def test_grafana_queries_are_balanced():
    """Every PromQL query closes what it opens (a stray parenthesis makes Grafana show nothing)."""
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            depth = 0
            for char in target["expr"]:
                depth += {"(": 1, ")": -1}.get(char, 0)
                assert depth >= 0, (panel["title"], target["expr"])
            assert depth == 0, (panel["title"], target["expr"])
