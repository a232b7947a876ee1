"""Batch jobs that outlive their completion window expire, as OpenAI's do: what finished is kept,
every other line goes to the error file as batch_expired. Runs the real runner on a real SQLite
store; each line's completion is a timed wait standing in for generation."""
from __future__ import annotations

import asyncio
import json
import time

from tollway.server.batch_runner import BatchRunner
from tollway.server.batch_store import BatchStore


async def _complete(url: str, body: dict) -> dict:
    await asyncio.sleep(body["seconds"])
    return {"id": f"done-{body['seconds']}"}


def _create(store: BatchStore, seconds: list[float], window: float) -> str:
    now = time.time()
    batch = {"id": f"batch_{len(store.batches())}", "object": "batch", "status": "validating", "created_at": int(now),
             "expires_at": now + window, "in_progress_at": None, "expired_at": None, "completed_at": None,
             "output_file_id": None, "error_file_id": None,
             "request_counts": {"total": len(seconds), "completed": 0, "failed": 0}}
    lines = [(f"req-{i}", "/v1/chat/completions", {"seconds": s}) for i, s in enumerate(seconds)]
    return store.create_batch(batch, lines)["id"]


def _lines(store: BatchStore, file_id: str | None) -> list[dict]:
    return [json.loads(line) for line in store.file_content(file_id).decode().splitlines()] if file_id else []


def test_a_batch_past_its_window_expires_keeping_what_finished(tmp_path):
    store = BatchStore(tmp_path)

    async def run() -> str:
        runner = BatchRunner(store, _complete)
        batch_id = _create(store, [0.0, 0.05, 30.0, 60.0], window=1.0)
        runner.start(batch_id)
        await asyncio.wait_for(asyncio.gather(*runner._tasks.values()), timeout=20)
        return batch_id

    started = time.monotonic()
    batch = store.batch(asyncio.run(run()))
    assert time.monotonic() - started < 10  # the 30 s and 60 s lines were cut off, not waited for
    assert batch["status"] == "expired" and batch["expired_at"] is not None and batch["completed_at"] is None
    assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    assert [line["custom_id"] for line in _lines(store, batch["output_file_id"])] == ["req-0", "req-1"]
    errors = _lines(store, batch["error_file_id"])
    assert [e["custom_id"] for e in errors] == ["req-2", "req-3"]
    assert all(e["error"]["code"] == "batch_expired" and e["response"] is None for e in errors)


def test_a_batch_found_expired_after_a_restart_expires_without_running(tmp_path):
    store = BatchStore(tmp_path)
    calls = []

    async def complete(url: str, body: dict) -> dict:
        calls.append(body)
        return {"id": "x"}

    async def run() -> str:
        batch_id = _create(store, [0.0, 0.0], window=-1.0)  # the server was down past the window
        runner = BatchRunner(store, complete)
        runner.resume()
        await asyncio.gather(*runner._tasks.values())
        return batch_id

    batch = store.batch(asyncio.run(run()))
    assert calls == []
    assert batch["status"] == "expired" and batch["request_counts"]["failed"] == 2
    assert batch["output_file_id"] is None and len(_lines(store, batch["error_file_id"])) == 2


def test_a_batch_within_its_window_completes(tmp_path):
    store = BatchStore(tmp_path)

    async def run() -> str:
        runner = BatchRunner(store, _complete)
        batch_id = _create(store, [0.0, 0.01], window=60.0)
        runner.start(batch_id)
        await asyncio.gather(*runner._tasks.values())
        return batch_id

    batch = store.batch(asyncio.run(run()))
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 2
