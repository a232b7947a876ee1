"""vLLM's /tokenize, /detokenize, /tokenizer_info and /version, `tollway --version`, and the
refusal of /v1/embeddings, through a real server that takes API keys."""
from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from live_server import MODEL, running_server
from tollway import __version__
from tollway.config import KeySpec
from tollway.server.keys import Gatekeeper

KEY = "sk-tokenize"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(make_engine):
    yield from running_server(make_engine(kernel="int8", num_blocks=64), gatekeeper=Gatekeeper([KeySpec(KEY, "k")]))


def _post(server, path, **body):
    return httpx.post(server["url"] + path, json=body, headers=AUTH, timeout=30)


def test_tokenize_and_detokenize_round_trip(server, default_tokenizer):
    text = "Hello, world! Ünïcödé too."
    body = _post(server, "/tokenize", model=MODEL, prompt=text, return_token_strs=True).json()
    assert body["tokens"] == default_tokenizer.encode(text) and body["tokens"][0] == default_tokenizer.bos_token_id
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == server["sync"].max_model_len
    assert body["token_strs"][0] == default_tokenizer.bos_token
    assert "".join(body["token_strs"][1:]) == text
    bare = _post(server, "/tokenize", prompt=text, add_special_tokens=False).json()
    assert bare["tokens"] == body["tokens"][1:] and "token_strs" not in bare
    assert _post(server, "/detokenize", model=MODEL, tokens=body["tokens"]).json() == {"prompt": text}
    assert _post(server, "/detokenize", tokens=[server["engine"].vocab_size - 1]).status_code == 200  # the last id


def test_tokenize_messages_gives_the_chat_prompt(server):
    """The tokens a chat completion of the same messages is charged for."""
    tokens = _post(server, "/tokenize", messages=MESSAGES).json()["tokens"]
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0) as client:
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert len(tokens) == chat.usage.prompt_tokens
    without = _post(server, "/tokenize", messages=MESSAGES, add_generation_prompt=False).json()["tokens"]
    assert len(without) < len(tokens) and tokens[:len(without)] == without


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, None),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "a", "surprise": 1}, 400, "surprise"),
    ("/tokenize", {"messages": MESSAGES, "tools": [1]}, 400, "tools"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_bodies_are_refused_by_name(server, path, body, status, param):
    resp = _post(server, path, **body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"]


def test_tokenizer_info_names_the_special_tokens(server, default_tokenizer):
    info = httpx.get(server["url"] + "/tokenizer_info", headers=AUTH).json()
    assert info["eos_token"] == default_tokenizer.eos_token and info["bos_token"] == default_tokenizer.bos_token


def test_keys_are_checked_as_on_v1_and_version_is_open(server):
    for method, path in [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
                         ("POST", "/v1/embeddings")]:
        resp = httpx.request(method, server["url"] + path, json={"prompt": "a", "tokens": [1]})
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(server["url"] + "/version").json() == {"version": __version__}


def test_embeddings_are_refused_with_the_reason(server):
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model=MODEL, input="hello")
    error = refused.value.body
    assert error["param"] == "model" and error["code"] == "model_not_supported"
    assert "generative model" in error["message"] and "embeddings" in error["message"]


def test_cli_prints_its_version():
    done = subprocess.run([sys.executable, "-m", "tollway", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == __version__
