"""Clients that hang up, against a real server with a real ledger: a storm of streaming and
plain requests closed at every stage (before the response starts, after 0, 1 or N chunks,
mid-generation) must leave nothing running, the KV cache as it was, and one ledger row per
call billed for what it ran; a plain request is aborted when its client goes; the watchdog
flags a hung engine."""
from __future__ import annotations

import asyncio
import random
import sqlite3
import time

import httpx
import pytest

from tollway.meter.ledger import NANOS
from tollway.request import SamplingParams
from tollway.server.metrics import Metrics

from tollway.fleet.ingress import create_ingress

from live_server import MODEL, make_meter, running_server, serving
from test_fleet import Rayless

STORM = 48
MAX_TOKENS = 48
MODES = ("before", "headers", "one", "some", "plain", "whole")
# Then the storm of the issue: everyone at once, gone after the first chunk. Aborts are then the
# engine's last events: nothing that runs after them would tidy up for them.
LAST_WAVE = 16


@pytest.fixture(scope="module")
def server(make_engine, tmp_path_factory):
    ledger = tmp_path_factory.mktemp("storm") / "ledger.sqlite"
    meter = make_meter(ledger)
    for details in running_server(make_engine(), Metrics(MODEL), meter=meter):
        yield {**details, "meter": meter, "ledger": ledger}


def gauges(url: str) -> dict[str, float]:
    """tollway:num_requests_running / _waiting summed over tiers, and KV use, from /metrics."""
    out = {"running": 0.0, "waiting": 0.0, "kv": 0.0}
    for line in httpx.get(url + "/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("tollway:num_requests_running{"):
            out["running"] += float(value)
        elif name.startswith("tollway:num_requests_waiting{"):
            out["waiting"] += float(value)
        elif name.startswith("tollway:kv_cache_usage_perc{"):
            out["kv"] = float(value)
    return out


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        now = gauges(url)
        if (now["running"], now["waiting"]) == (0, 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def rows_by_tag(ledger, prefix: str) -> dict[str, list[sqlite3.Row]]:
    db = sqlite3.connect(ledger)
    db.row_factory = sqlite3.Row
    rows = db.execute("SELECT r.*, t.tag FROM requests r JOIN request_tags t ON t.request_id = r.id "
                      "WHERE t.tag LIKE ?", (prefix + "%",)).fetchall()
    out: dict[str, list[sqlite3.Row]] = {}
    for row in rows:
        out.setdefault(row["tag"], []).append(row)
    return out


async def one_call(client: httpx.AsyncClient, url: str, i: int, mode: str, rng: random.Random,
                   tag: str = "storm") -> dict:
    """One client of the storm, tagged `tag`=i; returns what it saw: whether the response
    started, and the chunks it read."""
    seen = {"mode": mode, "started": False, "chunks": 0}
    body = {"model": MODEL, "prompt": [rng.randrange(1000, 30000) for _ in range(50)], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": mode != "plain", "metadata": {tag: str(i)}}

    async def stream(stop_after: int | None) -> None:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            seen["started"] = resp.status_code == 200
            if stop_after == 0:
                return
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    seen["chunks"] += 1
                    if stop_after is not None and seen["chunks"] >= stop_after:
                        return

    async def cut_off(work, seconds: float) -> None:
        task = asyncio.ensure_future(work)
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    if mode == "before":
        await cut_off(stream(None), rng.uniform(0.0, 0.05))
        seen["started"] = False  # it may have begun, but the client never read a byte of it
    elif mode == "plain":
        await cut_off(client.post(url + "/v1/completions", json=body), rng.uniform(0.05, 1.5))
    else:
        await stream({"headers": 0, "one": 1, "some": rng.randint(2, 8), "whole": None}[mode])
    return seen


async def storm(url: str, seed: int) -> list[dict]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
        async def staggered(i: int, mode: str) -> dict:
            await asyncio.sleep(rng.uniform(0, 0.5) if i % 2 else 0.0)  # half at once, half trickling in
            return await one_call(client, url, i, mode, random.Random(rng.random()))

        seen = await asyncio.gather(*(staggered(i, MODES[i % len(MODES)]) for i in range(STORM)))
        seen += await asyncio.gather(*(one_call(client, url, STORM + i, "one", random.Random(rng.random()))
                                       for i in range(LAST_WAVE)))
        return seen


def test_a_storm_of_hang_ups_leaves_nothing_running_and_bills_each_call_once(server):
    url = server["url"]
    before = wait_idle(url)
    attributed_before = server["meter"].attributed_seconds
    seen = asyncio.run(storm(url, seed=19))
    assert_all_withdrawn_and_billed(server, before, attributed_before, seen, "storm")
    assert sum(s["started"] for s in seen) >= (STORM + LAST_WAVE) // 2
    assert httpx.get(url + "/health").status_code == 200  # and the watchdog saw nothing stuck


def assert_all_withdrawn_and_billed(server, before: dict, attributed_before: float, seen: list[dict], tag: str):
    """Idle, KV as `before`, and one ledger row per call that reached the engine, billed for
    every step it was in (the meter's attributed seconds since `attributed_before`, all of it)."""
    url, meter = server["url"], server["meter"]
    after = wait_idle(url)
    assert (after["running"], after["waiting"]) == (0, 0), f"still held after the storm: {after}"
    assert after["kv"] == before["kv"], f"KV use {after['kv']} after the storm, {before['kv']} before"

    deadline = time.monotonic() + 10  # withdrawn calls' rows are written as the engine confirms each abort
    while time.monotonic() < deadline:
        rows = rows_by_tag(server["ledger"], tag + "=")
        billed = sum(r["engine_seconds"] for found in rows.values() for r in found)
        if billed >= meter.attributed_seconds - attributed_before - 1e-9:
            break
        time.sleep(0.2)
    for i, s in enumerate(seen):
        found = rows.get(f"{tag}={i}", [])
        assert len(found) <= 1, f"call {i} ({s['mode']}) has {len(found)} ledger rows"
        if s["started"]:
            assert len(found) == 1, f"call {i} ({s['mode']}) started its response but has no ledger row"
        if found:
            row = found[0]
            assert row["completion_tokens"] >= s["chunks"] if s["mode"] != "whole" else row["completion_tokens"] == MAX_TOKENS
            assert row["prompt_tokens"] in (0, 50)
            assert row["price_nanos"] / NANOS == pytest.approx(meter.price_card.billed("standard", row["prompt_tokens"],
                                                                                       row["completion_tokens"]))
            assert (row["engine_seconds"] > 0) == (row["prompt_tokens"] > 0)
            assert row["finish_reason"] == "length" if s["mode"] == "whole" else row["finish_reason"] in ("abort", "length")
    # Every step's engine time went to a call's row: none is lost to a row written before the
    # abort's last step, none to a call nobody settled.
    assert billed == pytest.approx(meter.attributed_seconds - attributed_before, rel=1e-6, abs=1e-9)


class OneReplica(Rayless):
    """A fleet's ingress in front of one plain server, on which it places every call."""

    async def route(self, hint):
        return self.router.replicas[0]


def test_hang_ups_behind_the_fleet_ingress_reach_the_replica(server):
    """The ingress lets go of the replica's connection when its client goes, before or after
    the response began, so the replica withdraws the call and bills it."""
    before = wait_idle(server["url"])
    attributed_before = server["meter"].attributed_seconds
    modes = ("before", "headers", "one", "some", "plain", "whole") * 3

    async def calls(url: str) -> list[dict]:
        rng = random.Random(7)
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
            return await asyncio.gather(*(one_call(client, url, i, mode, random.Random(rng.random()), "fleet")
                                          for i, mode in enumerate(modes)))

    for ingress in serving(create_ingress(OneReplica([server["url"]]))):
        seen = asyncio.run(calls(ingress))
    assert_all_withdrawn_and_billed(server, before, attributed_before, seen, "fleet")
    assert sum(s["started"] for s in seen) >= len(modes) // 2


def test_an_add_cancelled_while_queued_or_landing_leaves_nothing_behind(server):
    """The caller of add() goes away while the add waits behind a busy engine thread, or in the
    instant it lands: the engine thread lives on and nothing stays running."""
    engine = server["engine"]

    async def cancelled_adds() -> None:
        for delay in (0.0, 0.3, 0.6):
            engine.run(lambda _: time.sleep(0.5))  # the engine thread is busy: adds queue behind it
            submission = engine.check([5, 6, 7], SamplingParams(max_tokens=64, ignore_eos=True))
            task = asyncio.ensure_future(engine.add(submission))
            await asyncio.sleep(delay)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        out = None
        async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=2)):
            pass
        assert out.finished and len(out.token_ids) == 2

    asyncio.run(cancelled_adds())
    assert engine.alive, f"the engine thread died: {engine.error!r}"
    after = wait_idle(server["url"], timeout=10)
    assert (after["running"], after["waiting"]) == (0, 0)


def test_an_abort_ends_the_stream_with_a_final_output_and_frees_at_once(server):
    """With nothing else to run, no step follows an abort: its final output (finish_reason
    "abort") and the freed blocks must come from the abort itself."""
    engine = server["engine"]
    ended = []
    engine.observe(lambda report: ended.extend(report.outputs if report.plan is None else ()))

    async def abort_after_first_token():
        stream = await engine.add(engine.check([5, 6, 7, 8], SamplingParams(max_tokens=500, ignore_eos=True)))
        first = await stream.__anext__()
        stream.abort()
        return first, await stream.ended()

    first, final = asyncio.run(abort_after_first_token())
    assert final.finished and final.finish_reason == "abort" and len(final.token_ids) >= first.num_output_tokens >= 1
    assert [o.request_id for o in ended] == [final.request_id]  # the observers saw it end, once
    held = engine.occupancy
    assert held.idle and held.kv_blocks_used == 0 and engine.running == ()


def test_a_plain_request_is_aborted_when_its_client_goes(server):
    """Nothing streams, so only the server's listening for the hang-up can stop it."""
    url = server["url"]
    body = {"model": MODEL, "prompt": [7] * 20, "max_tokens": 4000, "ignore_eos": True, "metadata": {"plain": "gone"}}

    async def hang_up() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.ensure_future(client.post(url + "/v1/completions", json=body))
            deadline = time.monotonic() + 30  # a dead engine thread never runs it: fail, not hang
            while gauges(url)["running"] == 0:
                assert not task.done() and time.monotonic() < deadline, "the request never started running"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(hang_up())
    started = time.monotonic()
    after = wait_idle(url, timeout=10)
    assert (after["running"], after["waiting"]) == (0, 0), "the plain request kept running after its client left"
    assert time.monotonic() - started < 5
    deadline = time.monotonic() + 5
    while not (rows := rows_by_tag(server["ledger"], "plain=gone")) and time.monotonic() < deadline:
        time.sleep(0.1)
    (row,) = rows["plain=gone"]
    assert row["finish_reason"] == "abort" and 0 < row["completion_tokens"] < 4000 and row["engine_seconds"] > 0
