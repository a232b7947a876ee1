"""The Batch API through the official openai client, and a server killed mid-batch."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tollway.config import BudgetSpec, KeySpec
from tollway.server.keys import Gatekeeper

from live_server import MODEL, free_port, make_meter, running_server, wait_until_up
from test_server import server  # noqa: F401 -- the shared live server


def _jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _chat_line(i: int, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}"}], "max_tokens": 4,
                     "temperature": 0, **body}}


def _wait(client: openai.OpenAI, batch_id: str, until: tuple[str, ...], timeout: float = 240):
    deadline = time.time() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.time() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused") as client:
        yield client


def test_a_batch_runs_in_the_batch_lane_from_upload_to_output(client):
    lines = [_chat_line(i) for i in range(6)] + [_chat_line(6, max_tokens=-1)]
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(_jsonl(lines))
    assert client.files.content(uploaded.id).content == _jsonl(lines)
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "test"})
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 7
    done = _wait(client, batch.id, ("completed", "failed"))
    assert done.status == "completed" and done.metadata == {"job": "test"}
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 1)
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == [f"req-{i}" for i in range(6)]
    for x in out:
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and x["error"] is None
        assert body["service_tier"] == "flex" and body["usage"]["completion_tokens"] == 4
    [err] = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert err["custom_id"] == "req-6" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["param"] == "max_tokens"
    assert batch.id in [b.id for b in client.batches.list().data]


def test_bad_lines_fail_validation_with_their_line_numbers(client):
    data = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n{not json\n' \
           b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n' \
           b'{"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {}}\n'
    uploaded = client.files.create(file=("bad.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed"
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "invalid_json_line"), (3, "duplicate_custom_id"),
                                                              (4, "mismatched_url")]


def test_cancel_keeps_what_finished(client):
    uploaded = client.files.create(file=("c.jsonl", io.BytesIO(_jsonl([_chat_line(i, max_tokens=30)
                                                                         for i in range(40)]))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled"
    finished = cancelled.request_counts.completed + cancelled.request_counts.failed
    lines = client.files.content(cancelled.output_file_id).text.splitlines() if cancelled.output_file_id else []
    assert len(lines) == finished < 40
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


@pytest.mark.parametrize("body, status, param", [
    ({"input_file_id": "file_nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"}, 404,
     "input_file_id"),
    ({"input_file_id": "x", "endpoint": "/v1/embeddings", "completion_window": "24h"}, 400, "endpoint"),
    ({"input_file_id": "x", "endpoint": "/v1/chat/completions", "completion_window": "1h"}, 400, "completion_window"),
    ({"endpoint": "/v1/chat/completions"}, 400, "input_file_id"),
])
def test_bad_batch_requests(server, body, status, param):  # noqa: F811
    r = httpx.post(server["url"] + "/v1/batches", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param


def test_upload_needs_purpose_batch(server):  # noqa: F811
    r = httpx.post(server["url"] + "/v1/files", files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "fine-tune"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    assert httpx.get(server["url"] + "/v1/files/file_nope").status_code == 404


def test_files_list_in_pages_the_client_walks_to_the_end(client):
    mine = [client.files.create(file=(f"page{i}.jsonl", io.BytesIO(_jsonl([_chat_line(i)]))), purpose="batch").id
            for i in range(5)]
    walked = list(client.files.list(limit=2))  # auto-pagination: it must end
    ids = [f.id for f in walked]
    assert len(ids) == len(set(ids)) and set(mine) <= set(ids)
    keys = [(f.created_at, f.id) for f in walked]
    assert keys == sorted(keys, reverse=True)  # newest first, as OpenAI
    first = client.files.list(limit=2, order="asc")
    assert len(first.data) == 2 and first.has_more
    rest = client.files.list(after=first.data[-1].id, order="asc", limit=10_000)
    assert not rest.has_more and [f.id for f in first.data + rest.data] == ids[::-1]
    with pytest.raises(openai.BadRequestError) as bad:
        client.files.list(limit=0)
    assert bad.value.body["param"] == "limit"


OWNER_KEYS = [KeySpec("sk-ann", "ann"), KeySpec("sk-ben", "ben"), KeySpec("sk-slow", "slow", rpm=2),
              KeySpec("sk-broke", "broke")]


@pytest.fixture(scope="module")
def keyed(make_engine, tmp_path_factory):
    """Keys, a meter and a budget nothing fits in, for key `broke`."""
    folder = tmp_path_factory.mktemp("owned")
    meter = make_meter(folder / "ledger.sqlite", [BudgetSpec(limit=1e-12, key="broke", period="daily")])
    yield from running_server(make_engine(num_blocks=64), gatekeeper=Gatekeeper(OWNER_KEYS),
                              batch_dir=folder, meter=meter)


def _as(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=key, max_retries=0)


def _batch_of(client: openai.OpenAI, lines: list[dict]):
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    return uploaded, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")


def test_files_and_batches_belong_to_the_key_that_made_them(keyed):
    ann, ben = _as(keyed, "sk-ann"), _as(keyed, "sk-ben")
    uploaded, batch = _batch_of(ann, [_chat_line(i) for i in range(2)])
    done = _wait(ann, batch.id, ("completed",))
    for call in (lambda: ben.files.retrieve(uploaded.id), lambda: ben.files.content(uploaded.id),
                 lambda: ben.files.content(done.output_file_id), lambda: ben.files.delete(uploaded.id),
                 lambda: ben.batches.retrieve(batch.id), lambda: ben.batches.cancel(batch.id),
                 lambda: ben.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [f.id for f in ben.files.list()] == [] and [b.id for b in ben.batches.list()] == []
    assert {f.id for f in ann.files.list()} == {uploaded.id, done.output_file_id}
    assert [b.id for b in ann.batches.list()] == [batch.id]
    assert ann.files.delete(uploaded.id).deleted
    # Metered as ann's own requests, in the batch lane.
    usage = httpx.get(keyed["url"] + "/v1/usage", params={"group_by": "tier"},
                      headers={"Authorization": "Bearer sk-ann"}).json()["data"]
    assert [(row["tier"], row["requests"]) for row in usage] == [("batch", 2)]


def test_batch_lines_are_budgeted_as_their_keys_requests(keyed):
    broke = _as(keyed, "sk-broke")
    _, batch = _batch_of(broke, [_chat_line(0)])
    done = _wait(broke, batch.id, ("completed",))
    assert (done.request_counts.completed, done.request_counts.failed) == (0, 1)
    error = json.loads(broke.files.content(done.error_file_id).text)
    assert error["response"]["status_code"] == 429
    assert error["response"]["body"]["error"]["code"] == "insufficient_quota"


def test_batch_lines_wait_for_room_in_their_keys_rate_limit(keyed):
    slow = _as(keyed, "sk-slow")
    _, batch = _batch_of(slow, [_chat_line(i) for i in range(3)])
    deadline = time.time() + 60
    while slow.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.time() < deadline
        time.sleep(0.2)
    time.sleep(1)
    throttled = slow.batches.retrieve(batch.id)  # the third waits for the window, and has not failed
    assert throttled.status == "in_progress" and throttled.request_counts.failed == 0
    assert throttled.request_counts.completed == 2
    with pytest.raises(openai.RateLimitError):  # the batch spent the key's window
        slow.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    cancelled = slow.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.request_counts.completed == 2


@pytest.mark.slow  # a process of its own
def test_a_server_killed_mid_batch_resumes_without_losing_or_repeating_a_line(tmp_path):
    """SIGKILL while a batch runs, restart on the same data directory: every input line has
    exactly one output line."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tollway", "serve", "--port", str(port), "--data-dir", str(tmp_path),
           "--keys-db", str(tmp_path / "keys.sqlite")]

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_until_up(proc, url)
        return proc

    n = 16
    proc = start()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    try:
        # Lengths differ, so lines finish one after another and the kill lands mid-batch.
        lines = [_chat_line(i, max_tokens=4 + 4 * i) for i in range(n)]
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.time() + 240
        while client.batches.retrieve(batch.id).request_counts.completed < 3:
            assert time.time() < deadline
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc = start()
        assert client.batches.retrieve(batch.id).request_counts.completed < n  # it really was mid-batch
        done = _wait(client, batch.id, ("completed",))
        ids = [json.loads(x)["custom_id"] for x in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(ids) == sorted(f"req-{i}" for i in range(n)) and len(ids) == len(set(ids)) == n
        assert done.request_counts.completed == n and done.request_counts.failed == 0
    finally:
        client.close()  # its connection to the killed server too
        proc.kill()
        proc.wait(10)


def test_a_batch_of_responses_api_lines_outputs_response_objects_kept_for_their_key(keyed):
    ann, ben = _as(keyed, "sk-ann"), _as(keyed, "sk-ben")
    asked = {"model": MODEL, "instructions": "Answer briefly.", "max_output_tokens": 4, "temperature": 0,
             "input": [{"role": "user", "content": [{"type": "input_text", "text": "Name a river."}]}]}
    lines = [{"custom_id": "plain", "method": "POST", "url": "/v1/responses", "body": asked},
             {"custom_id": "reasons", "method": "POST", "url": "/v1/responses",
              "body": {**asked, "reasoning": {"effort": "low"}}},
             {"custom_id": "streams", "method": "POST", "url": "/v1/responses", "body": {**asked, "stream": True}}]
    uploaded = ann.files.create(file=("r.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = ann.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h")
    done = _wait(ann, batch.id, ("completed", "failed"))
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 1, 2)
    [line] = [json.loads(x) for x in ann.files.content(done.output_file_id).text.splitlines()]
    body = line["response"]["body"]
    assert line["custom_id"] == "plain" and body["id"].startswith("resp_")
    assert line["response"]["request_id"] == body["id"]
    assert (body["object"], body["service_tier"], body["instructions"]) == ("response", "flex", "Answer briefly.")
    assert body["usage"]["output_tokens"] == 4 and body["usage"]["cost"] > 0 and body["status"] == "incomplete"
    # The same response as a request of its own: greedy output is the same in the batch lane.
    assert body["output"][0]["content"][0]["text"] == ann.responses.create(**asked).output_text
    assert ann.responses.retrieve(body["id"]).output_text == body["output"][0]["content"][0]["text"]
    with pytest.raises(openai.NotFoundError):
        ben.responses.retrieve(body["id"])
    errors = {x["custom_id"]: x["response"]
              for x in map(json.loads, ann.files.content(done.error_file_id).text.splitlines())}
    assert {cid: (r["status_code"], r["body"]["error"]["param"]) for cid, r in errors.items()} == {
        "reasons": (400, "reasoning"), "streams": (400, "stream")}
