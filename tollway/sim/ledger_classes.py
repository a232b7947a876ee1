"""Classes of traffic derived from the ledger's recent requests, grouped by key or by tag: each
group's rate over the window, and its prompt and output lengths (mean, spread, range).

The ledger is opened read-only (SQLite's mode=ro): advising must not write to, migrate or
lock the file a server is recording into. The ledger does not know what latency a group
needs, so the SLOs are given (`--slo ttft=2s,tpot=100ms,chat:tpot=30ms`, by class name).
"""
from __future__ import annotations

import json
import sqlite3
import statistics
from pathlib import Path

from tollway.sim.traffic_classes import TrafficClass
from tollway.traffic.stats import SLO
from tollway.traffic.workload import Lengths

GROUP_BY = ("key", "tag")


def _read_rows(path: Path, start: float | None, end: float | None) -> list[tuple]:
    if not path.is_file():
        raise ValueError(f"no ledger at {path}")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            return db.execute("SELECT created, key, tags, prompt_tokens, completion_tokens FROM requests "
                              "WHERE created >= ? AND created < ? ORDER BY created",
                              (start if start is not None else float("-inf"),
                               end if end is not None else float("inf"))).fetchall()
        finally:
            db.close()
    except sqlite3.Error as e:
        raise ValueError(f"cannot read the ledger {path}: {e}") from None


def _lengths(values: list[int]) -> Lengths:
    return Lengths(round(statistics.fmean(values)), statistics.pstdev(values), min(values), max(values))


def classes_from_ledger(path: str | Path, group_by: str, slo: SLO, percentile: float,
                        start: float | None = None, end: float | None = None) -> list[TrafficClass]:
    """One class per key (or tag) with traffic in [start, end); its rate over that window (or,
    where a bound is open, over the first to the last request in it)."""
    if group_by not in GROUP_BY:
        raise ValueError(f"--group-by: expected one of {', '.join(GROUP_BY)}, got {group_by!r}")
    rows = _read_rows(Path(path), start, end)
    if not rows:
        raise ValueError(f"the ledger {path} has no requests in the window")
    first = start if start is not None else rows[0][0]
    last = end if end is not None else rows[-1][0]
    window = last - first
    if not window > 0:
        raise ValueError("the ledger's window is too short to measure a rate: give --start and --end")
    groups: dict[str, list[tuple[int, int]]] = {}
    for _, key, tags, prompt, output in rows:
        for name in ([key or "(no key)"] if group_by == "key" else json.loads(tags)):
            groups.setdefault(name, []).append((prompt, output))
    classes = []
    for name, shapes in sorted(groups.items()):
        limits = slo.for_tier(name)
        if not limits:
            raise ValueError(f"--slo: no limits for the class {name!r}: give ttft=...,tpot=... (for all) or {name}:tpot=...")
        if "e2e" in limits:
            raise ValueError("--slo: the advisor judges ttft and tpot, not e2e")
        classes.append(TrafficClass(name, len(shapes) / window, _lengths([p for p, _ in shapes]),
                                    _lengths([max(1, o) for _, o in shapes]), limits, percentile))
    if not classes:
        raise ValueError(f"no request in the ledger's window has a {group_by}")
    return classes
