"""A server whose engine has stopped answers new requests, streamed or not, with 503 and an
OpenAI-style error body, as /health does, not with an internal error."""
from __future__ import annotations

import httpx
import openai
import pytest

from tollway.async_engine import AsyncEngine
from tollway.server.app import create_app
from tollway.server.metrics import Metrics

from live_server import MODEL, serving


@pytest.fixture(scope="module")
def url(make_engine):
    engine = AsyncEngine(make_engine())
    app = create_app(engine, MODEL, Metrics(MODEL))
    for url in serving(app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        engine.shutdown()
        yield url


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_to_a_stopped_engine_gets_503(url, stream):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       stream=stream)
    assert raised.value.status_code == 503
    error = raised.value.response.json()["error"]
    assert error["code"] == "engine_stopped" and error["message"] == "the engine has stopped"
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and health.json()["error"]["message"] == "the engine has stopped"
