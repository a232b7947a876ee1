"""Batch jobs that outlive their completion window expire, as OpenAI's do: what finished is kept,
every other line goes to the error file as batch_expired. Servers sharing a store run each job
once: one claims it, the other takes it up when the first stops or dies, and a cancel asked of
either stops it. Runs the real runner on real SQLite and PostgreSQL stores; each line's
completion is a timed wait standing in for generation."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

from tollway.server.batch_runner import LEASE, BatchRunner
from tollway.server.batch_store import BatchStore
from tollway.storage.database import Database


async def _complete(url: str, body: dict, owner: str) -> dict:
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


def test_a_batch_past_its_window_expires_keeping_what_finished(store_target):
    store = BatchStore(Database(store_target))

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


def test_a_batch_found_expired_after_a_restart_expires_without_running(store_target):
    store = BatchStore(Database(store_target))
    calls = []

    async def complete(url: str, body: dict, owner: str) -> dict:
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


def test_a_batch_within_its_window_completes(store_target):
    store = BatchStore(Database(store_target))

    async def run() -> str:
        runner = BatchRunner(store, _complete)
        batch_id = _create(store, [0.0, 0.01], window=60.0)
        runner.start(batch_id)
        await asyncio.gather(*runner._tasks.values())
        return batch_id

    batch = store.batch(asyncio.run(run()))
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 2


def test_two_servers_on_one_store_run_each_line_once(store_target):
    stores = [BatchStore(Database(store_target)) for _ in range(2)]
    calls = []

    async def complete(url: str, body: dict, owner: str) -> dict:
        calls.append(body["seconds"])
        await asyncio.sleep(0.01)
        return {"id": "x"}

    async def run() -> tuple[str, str]:
        first = _create(stores[0], [0.1 * i for i in range(6)], window=60.0)
        second = _create(stores[1], [0.1 * i for i in range(6, 10)], window=60.0)
        runners = [BatchRunner(store, complete) for store in stores]
        for runner in runners:  # both servers start up and resume what is unfinished
            runner.resume()
        assert sorted(len(r._tasks) for r in runners) == [0, 2]
        await asyncio.gather(*(t for r in runners for t in r._tasks.values()))
        for runner in runners:
            await runner.shutdown()
        return first, second

    for batch_id in asyncio.run(run()):
        assert stores[1].batch(batch_id)["status"] == "completed"
    assert sorted(calls) == [0.1 * i for i in range(10)]


def test_a_job_moves_to_another_server_when_its_own_stops_or_dies(store_target):
    stores = [BatchStore(Database(store_target)) for _ in range(2)]
    started = []

    async def complete(url: str, body: dict, owner: str) -> dict:
        started.append(body["seconds"])
        await asyncio.sleep(body["seconds"])
        return {"id": "x"}

    async def until_started(n: int) -> None:
        while len(started) < n:
            await asyncio.sleep(0.01)

    async def run() -> str:
        batch_id = _create(stores[0], [0.0, 30.0], window=60.0)
        first, second = BatchRunner(stores[0], complete), BatchRunner(stores[1], complete)
        first.start(batch_id)
        second.start(batch_id)  # claimed: not here
        assert list(first._tasks) == [batch_id] and not second._tasks
        await until_started(2)
        await first.shutdown()  # mid-job: hands its claim back
        second.sweep()
        assert list(second._tasks) == [batch_id]
        await until_started(3)
        await second.shutdown()
        # A server that died keeps its claim until the lease runs out.
        third = BatchRunner(stores[1], complete)
        stores[0].claim(batch_id, "a server that died", time.time() - 1, LEASE)
        third.sweep()
        assert not third._tasks
        stores[0].claim(batch_id, "a server that died", time.time() - LEASE - 1, LEASE)
        third.sweep()
        assert list(third._tasks) == [batch_id]
        await until_started(4)
        await third.cancel(batch_id)
        return batch_id

    batch = stores[1].batch(asyncio.run(run()))
    assert batch["status"] == "cancelled" and batch["request_counts"]["completed"] == 1
    assert started == [0.0, 30.0, 30.0, 30.0]  # the finished line never ran again


def test_a_claim_of_a_killed_process_on_this_host_is_taken_at_once(store_target):
    """A server restarted after a SIGKILL resumes at once: the claim names its dead predecessor's
    process. Claims of live processes, of other hosts, and of other pid namespaces keep their lease."""
    store = BatchStore(Database(store_target))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = BatchRunner(store, _complete).owner.rpartition("/")[0].rpartition("/")[0]  # host/namespace
    host, namespace = here.split("/")

    async def run() -> None:
        for holder, taken in [(f"{here}/{os.getppid()}/x", False),           # alive: the test's parent
                              (f"other-host/{namespace}/{dead.pid}/x", False),
                              (f"{host}/{namespace}1/{dead.pid}/x", False),    # another container
                              ("0123456789abcdef", False),                        # an older server's claim
                              (f"{here}/{dead.pid}/x", True)]:
            batch_id = _create(store, [30.0], window=60.0)
            assert store.claim(batch_id, holder, time.time(), LEASE)
            runner = BatchRunner(store, _complete)
            runner.sweep()
            assert (batch_id in runner._tasks) == taken, holder
            assert store.claimant(batch_id) == (runner.owner if taken else holder)
            await runner.shutdown()

    asyncio.run(run())


def test_a_cancel_asked_of_another_server_stops_the_job_at_the_next_sweep(store_target):
    stores = [BatchStore(Database(store_target)) for _ in range(2)]

    async def run() -> str:
        batch_id = _create(stores[0], [0.0, 30.0], window=60.0)
        running, other = BatchRunner(stores[0], _complete), BatchRunner(stores[1], _complete)
        running.start(batch_id)
        while stores[0].batch(batch_id)["request_counts"]["completed"] < 1:
            await asyncio.sleep(0.01)
        assert (await other.cancel(batch_id))["status"] == "cancelling"
        running.sweep()
        await asyncio.gather(*running._tasks.values(), return_exceptions=True)
        return batch_id

    batch = stores[1].batch(asyncio.run(run()))
    assert batch["status"] == "cancelled" and batch["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
    assert [line["custom_id"] for line in _lines(stores[1], batch["output_file_id"])] == ["req-0"]


def test_uploads_kept_as_files_by_earlier_versions_move_into_the_database(tmp_path):
    store = BatchStore(tmp_path)
    uploaded = store.add_file("in.jsonl", "batch", b"{}")
    (tmp_path / "files").mkdir()  # as an earlier version left it: content in files/<id>
    (tmp_path / "files" / uploaded["id"]).write_bytes(b"old bytes")
    (tmp_path / "files" / ".file_x.tmp").write_bytes(b"a write a crash interrupted")
    store.database.run("DELETE FROM file_contents")
    restarted = BatchStore(tmp_path)
    assert restarted.file_content(uploaded["id"]) == b"old bytes" and not (tmp_path / "files").exists()
