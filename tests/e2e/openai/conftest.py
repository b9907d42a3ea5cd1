"""The OpenAI-route tests' fixtures: a demo-model front end per test module and the real
`openai` SDK pointed at it."""
import pytest

from tests.e2e.demo_server import serve_demo


@pytest.fixture(scope="module")
def url():
    """A demo front end, one per test module."""
    with serve_demo() as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    """The real `openai` SDK pointed at ``url``."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
