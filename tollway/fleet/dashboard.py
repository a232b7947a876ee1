"""The fleet's /dashboard/data: every live replica's own /dashboard/data, merged into the
figures of the whole fleet, plus a section per replica. The page itself (/dashboard) is a
replica's, passed through by the ingress; it polls this.

Merged exactly wherever the parts allow it:
- counts, tokens, cost and rates add up; cost per 1M tokens and the prefix-cache hit rate are
  worked out again from the sums; KV use is weighted by each replica's KV blocks; engine busy
  is the mean over the replicas (each is one engine).
- latency percentiles come from the replicas' samples (?samples=1), never from their
  percentiles: a percentile of percentiles is not the fleet's.
- the charts over time add up each time bin's steps; a replica with no step in a bin keeps the
  queues and KV use of its latest one.
- the batch economics' medians (decode cost per decode batch size, prefill's cost) would need
  every step: they stay per replica (economics.by_replica), one line each on the page.
A replica that does not answer (dead, or failing) is listed with its state and no figures, and
its figures leave the totals, as its series leave /metrics.

The replicas check the caller's key: it goes to each with the request, and a refusal (401,
403) comes back as it came. The ingress holds no keys, and admits exactly what one server would.
"""
from __future__ import annotations

import asyncio

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tollway.config import TIERS
from tollway.fleet.router import ReplicaState
from tollway.server import errors
from tollway.server.live_stats import lane_latency, per_million, prefix_cache

# A replica's dashboard slower than this is shown without figures rather than holding the page.
ASK_SECONDS = 5.0
_SUMMED = ("finished", "running", "waiting", "tokens")


async def fleet_data(client: httpx.AsyncClient, replicas: list[ReplicaState], request: Request) -> Response:
    live = [r for r in replicas if r.alive]
    if not live:
        return JSONResponse(errors.error_body(503, "no replica is serving"), status_code=503)
    params = dict(request.query_params) | {"samples": "1"}
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    answers = await asyncio.gather(*(_ask(client, r, params, headers) for r in live))
    for answer in answers:
        if answer is not None and answer.status_code != 200:  # refused: the keys are the same on every replica
            return Response(answer.content, answer.status_code, media_type="application/json")
    bodies = {r.index: a.json() for r, a in zip(live, answers) if a is not None}
    if not bodies:
        return JSONResponse(errors.error_body(503, "no replica answered"), status_code=503)
    return JSONResponse(merge(replicas, bodies), headers={"Cache-Control": "no-store"})


async def _ask(client: httpx.AsyncClient, replica: ReplicaState, params: dict, headers: dict) -> httpx.Response | None:
    """The replica's answer, or None if it gave none worth showing (gone, failing, too slow)."""
    try:
        answer = await client.get(replica.url + "/dashboard/data", params=params, headers=headers, timeout=ASK_SECONDS)
    except httpx.HTTPError:
        return None
    return None if answer.status_code >= 500 else answer


def merge(replicas: list[ReplicaState], bodies: dict[int, dict]) -> dict:
    """The fleet's dashboard data from the replicas' (index -> body; at least one)."""
    parts = list(bodies.values())
    first = parts[0]
    blocks = [replicas[i].load.num_blocks for i in bodies]
    tiers = {}
    for tier in TIERS:
        lanes = [p["tiers"][tier] for p in parts]
        cost = None if first["tiers"][tier]["cost"] is None else sum(lane["cost"] for lane in lanes)
        summed = {field: sum(lane[field] for lane in lanes) for field in _SUMMED}
        ttft, tpot = ([v for p in parts for v in p["samples"][kind][tier]] for kind in ("ttft", "tpot"))
        tiers[tier] = {**lane_latency(ttft, tpot), **summed, "cost": cost,
                       "cost_per_m_tokens": per_million(cost, summed["tokens"])}
    totals = {field: sum(p["totals"][field] for p in parts)
              for field in ("steps", "generated_tokens", "tokens_per_s", "steps_per_s")}
    totals["busy"] = sum(p["totals"]["busy"] for p in parts) / len(parts)
    return {
        "model": first["model"], "now": first["now"], "price_per_hour": first["price_per_hour"],
        "window": first["window"], "history": first["history"], "totals": totals, "tiers": tiers,
        "kv_usage": _weighted([p["kv_usage"] for p in parts], blocks),
        "prefix_cache": prefix_cache(*(sum(p["prefix_cache"][k] for p in parts) for k in ("queried", "hits"))),
        "timeline": _timeline(parts, blocks),
        "economics": {"unit": first["economics"]["unit"], "steps": sum(p["economics"]["steps"] for p in parts),
                      "points": [pt for p in parts for pt in p["economics"]["points"]],
                      "unsplit": sum(p["economics"]["unsplit"] for p in parts),
                      "by_replica": [{"replica": i, "bins": p["economics"]["bins"], "prefill": p["economics"]["prefill"]}
                                     for i, p in bodies.items()]},
        "budgets": first["budgets"],  # the ledger is the fleet's: every replica reads the same burn
        "canary": first.get("canary"),  # read from the same shared ledger too
        "replicas": [_replica(r, bodies.get(r.index)) for r in replicas],
    }


def _replica(replica: ReplicaState, body: dict | None) -> dict:
    figures = {k: body[k] if body else None for k in ("totals", "tiers", "kv_usage", "prefix_cache")}
    return {"replica": replica.index, "state": replica.state, "answered": body is not None,
            "outstanding_tokens": replica.outstanding_tokens if replica.alive else None, **figures}


def _weighted(values: list[float], weights: list[int]) -> float:
    return sum(v * w for v, w in zip(values, weights)) / sum(weights)


def _timeline(parts: list[dict], blocks: list[int]) -> dict:
    """The replicas' charts over time on their common bins (the same width and times before
    now): steps and capped steps add up, step sizes are means over all the bin's steps, and
    queues and KV use are the sum and the blocks-weighted mean of each replica's latest state."""
    lines = [p["timeline"] for p in parts]
    times = sorted({t for tl in lines for t in tl["t"]})  # oldest first
    at = [dict(zip(tl["t"], range(len(tl["t"])))) for tl in lines]
    # Before its first step in the history a replica ran nothing; its KV held what the first step found.
    state = [({t: 0 for t in TIERS}, {t: 0 for t in TIERS}, tl["kv_usage"][0] if tl["t"] else p["kv_usage"])
             for tl, p in zip(lines, parts)]
    out = {"bin_seconds": lines[0]["bin_seconds"], "t": times, "steps": [], "seqs": [], "tokens": [], "capped": [],
           "kv_usage": [], "running": {t: [] for t in TIERS}, "waiting": {t: [] for t in TIERS}}
    for t in times:
        here = []  # (timeline, its index of this bin) of the replicas that stepped in it
        for k, tl in enumerate(lines):
            i = at[k].get(t)
            if i is not None:
                here.append((tl, i))
                state[k] = ({x: tl["running"][x][i] for x in TIERS}, {x: tl["waiting"][x][i] for x in TIERS},
                            tl["kv_usage"][i])
        steps = sum(tl["steps"][i] for tl, i in here)
        out["steps"].append(steps)
        out["capped"].append(sum(tl["capped"][i] for tl, i in here))
        for field in ("seqs", "tokens"):
            out[field].append(sum(tl[field][i] * tl["steps"][i] for tl, i in here) / steps)
        out["kv_usage"].append(_weighted([s[2] for s in state], blocks))
        for tier in TIERS:
            out["running"][tier].append(sum(s[0][tier] for s in state))
            out["waiting"][tier].append(sum(s[1][tier] for s in state))
    return out
