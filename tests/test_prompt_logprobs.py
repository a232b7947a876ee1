"""Prompt logprobs through a real server: echo with logprobs in OpenAI's legacy shape, vLLM's
prompt_logprobs field, and lm-evaluation-harness's local-completions model scoring a small
loglikelihood task, each against the engine's own numbers for the same tokens."""
from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest

from live_server import MODEL, running_server
from tollway.request import SamplingParams

PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def server(make_engine):
    # Small chunks: a prompt's logprobs come from several prefill steps.
    yield from running_server(make_engine(max_num_batched_tokens=16))


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def _engine_prompt_logprobs(server, prompt_ids: list[int], top_n: int = 1) -> list[dict | None]:
    """The engine's own prompt logprobs for `prompt_ids`, straight through it."""
    async def run():
        out = None
        async for out in server["engine"].generate(prompt_ids, SamplingParams(max_tokens=1, temperature=0,
                                                                              prompt_logprobs=top_n)):
            pass
        return out.prompt_logprobs
    return asyncio.run(run())


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(server, client, default_tokenizer):
    ids = default_tokenizer.encode(PROMPT)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    own = _engine_prompt_logprobs(server, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(own[i]["logprob"], abs=1e-5)
        assert lp.token_logprobs[i] <= 0
        # the top 2 and the prompt token's own
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and 2 <= len(top) <= 3
        assert max(top.values()) >= lp.token_logprobs[i]
    assert resp.choices[0].text.startswith(PROMPT)
    assert lp.text_offset[:2] == [0, 0]  # BOS takes none of the echoed text
    assert lp.text_offset[len(ids) - 1] + len(lp.tokens[len(ids) - 1]) == len(PROMPT)  # the last takes its own
    assert lp.text_offset[len(ids)] == len(PROMPT)  # the completion's tokens follow the prompt's text
    # the generated tokens' part is what the same request without echo gives
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    assert lp.token_logprobs[len(ids):] == plain.choices[0].logprobs.token_logprobs


def test_a_streamed_echo_carries_the_prompt_logprobs_first(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1,
                                            echo=True, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs


def test_max_tokens_0_with_echo_scores_the_prompt_alone(client, default_tokenizer):
    """OpenAI's legacy way to score a text, which vLLM serves too."""
    ids = default_tokenizer.encode(PROMPT)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, temperature=0, logprobs=1, echo=True)
    choice = resp.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1, echo=True)
    assert choice.logprobs.token_logprobs == scored.choices[0].logprobs.token_logprobs[:len(ids)]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT


def test_max_tokens_0_needs_echo(server):
    for path, body in [("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})]:
        resp = httpx.post(server["url"] + path, json={"model": MODEL, "max_tokens": 0, **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", path


def test_vllm_prompt_logprobs_field(server, default_tokenizer):
    ids = default_tokenizer.encode(PROMPT)
    body = httpx.post(server["url"] + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3}).json()
    scored = body["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    own = _engine_prompt_logprobs(server, ids, 3)
    for token_id, position, mine in zip(ids[1:], scored[1:], own[1:]):
        entry = position[str(token_id)]  # the prompt token's own, whatever its rank
        assert entry["logprob"] == pytest.approx(mine["logprob"], abs=1e-5) and entry["rank"] == mine["rank"] >= 1
        assert entry["decoded_token"] == default_tokenizer.decode([token_id], skip_special_tokens=False)
        # the top 3 by rank, and the prompt token's own where it is not among them
        assert sorted(e["rank"] for e in position.values())[:3] == [1, 2, 3]
        assert len(position) == (3 if mine["rank"] <= 3 else 4)
        # ranks follow the logprobs
        best = min(position.values(), key=lambda e: e["rank"])
        assert best["logprob"] == max(e["logprob"] for e in position.values())
    # A chat's come beside its choices, as vLLM's.
    chat = httpx.post(server["url"] + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(p) == 1 for p in chat["prompt_logprobs"][1:])


def test_prompt_logprobs_bypass_the_prefix_cache(server, client):
    """A prompt the prefix cache holds still has every position scored."""
    prompt = "A long shared opening that fills several KV blocks, so that the cache holds it. " * 3
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=0, echo=True)
    third = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens > 32 and third.usage.prompt_tokens_details.cached_tokens >= 16  # it holds it
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    scored = again.choices[0].logprobs.token_logprobs
    assert scored[0] is None and all(lp is not None for lp in scored[1:])


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_bad_prompt_logprobs_are_refused_by_name(server, body, param):
    resp = httpx.post(server["url"] + "/v1/completions", json={"model": MODEL, "prompt": "Hi", **body})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param


def test_lm_eval_local_completions_scores_as_the_engine_does(server, default_tokenizer):
    """lm-evaluation-harness's local-completions model, with the server's own tokenizer (its
    remote backend: /tokenizer_info, /tokenize, /detokenize) and no network beyond the server,
    scores a small loglikelihood task: each continuation's summed logprob and greediness are
    the engine's for the same tokens."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=server["url"] + "/v1/completions", model=MODEL, tokenizer_backend="remote",
                             tokenized_requests=True, max_retries=1)
    task = [("The capital of France is", " Paris"), ("The capital of France is", " a banana"),
            ("2 + 2 =", " 4"), ("Water boils at 100 degrees", " Celsius")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(task)]
    scores = lm.loglikelihood(requests, disable_tqdm=True)
    assert len(scores) == len(task)
    for (context, continuation), (logprob, greedy) in zip(task, scores):
        whole = default_tokenizer.encode(context + continuation, add_special_tokens=False)
        ctx = len(default_tokenizer.encode(context, add_special_tokens=False))
        own = _engine_prompt_logprobs(server, whole)
        expected = sum(e["logprob"] for e in own[ctx:])
        assert logprob == pytest.approx(expected, abs=1e-4) and math.isfinite(logprob) and logprob < 0
        assert greedy == all(e["rank"] == 1 for e in own[ctx:])
    (paris, _), (banana, _) = scores[:2]
    assert paris > banana  # the model knows something
