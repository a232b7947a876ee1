"""The ledger: one SQLite row per API request, written before its response ends.

WAL mode with synchronous=FULL: a commit is on disk when `record` returns, so a request
whose response completed survives a SIGKILL or a power cut. Readers never block the writer.
Each thread has its own connection; SQLite serialises writers, across processes too.
"""
from __future__ import annotations

import datetime
import json
import math
import sqlite3
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

GROUPS = ("key", "tier", "tag", "model")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,            -- unix seconds at arrival
    key TEXT NOT NULL,                -- the API key's name ('' on an open server)
    tier TEXT NOT NULL,
    model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    queue_seconds REAL,               -- arrival to first scheduled
    ttft_seconds REAL,
    e2e_seconds REAL NOT NULL,
    engine_seconds REAL NOT NULL,     -- attributed engine time
    cost REAL NOT NULL,               -- engine_seconds x the machine's price
    price REAL NOT NULL,              -- billed from the price card
    finish_reason TEXT,
    tags TEXT NOT NULL                -- JSON list, also in request_tags
);
CREATE INDEX IF NOT EXISTS requests_created ON requests(created);
CREATE INDEX IF NOT EXISTS requests_key ON requests(key, created);
CREATE TABLE IF NOT EXISTS request_tags (
    request_id TEXT NOT NULL REFERENCES requests(id),
    tag TEXT NOT NULL,
    PRIMARY KEY (request_id, tag)
);
CREATE INDEX IF NOT EXISTS request_tags_tag ON request_tags(tag);
CREATE TABLE IF NOT EXISTS alerts (  -- budget alerts sent, so each fires once per period
    budget TEXT NOT NULL,
    period_start REAL NOT NULL,
    threshold REAL NOT NULL,
    sent REAL NOT NULL,
    PRIMARY KEY (budget, period_start, threshold)
);
"""


@dataclass
class LedgerRow:
    id: str
    created: float
    key: str
    tier: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_seconds: float | None
    ttft_seconds: float | None
    e2e_seconds: float
    engine_seconds: float
    cost: float
    price: float
    finish_reason: str | None
    tags: list[str] = field(default_factory=list)


class Ledger:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        with self._db() as db:
            db.executescript(_SCHEMA)

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.row_factory = sqlite3.Row
            self._local.db = db
        return db

    def record(self, row: LedgerRow) -> None:
        """Insert the row and its tags in one transaction, on disk when this returns."""
        values = asdict(row)
        values["tags"] = json.dumps(row.tags)
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute(f"INSERT INTO requests ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
                       list(values.values()))
            db.executemany("INSERT INTO request_tags VALUES (?, ?)", [(row.id, t) for t in dict.fromkeys(row.tags)])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def rows(self, start: float | None = None, end: float | None = None) -> list[LedgerRow]:
        where, args = _window(start, end)
        out = []
        for r in self._db().execute(f"SELECT * FROM requests {where} ORDER BY created", args):
            values = dict(r)
            values["tags"] = json.loads(values["tags"])
            out.append(LedgerRow(**values))
        return out

    def usage(self, group_by: str, start: float | None = None, end: float | None = None,
              key: str | None = None) -> list[dict]:
        """Totals per group over requests created in [start, end), optionally only one key's.
        Grouped by tag, a request counts once under each of its tags."""
        if group_by not in GROUPS:
            raise ValueError(f"group_by must be one of {', '.join(GROUPS)}")
        where, args = _window(start, end, "r.created")
        if key is not None:
            where += (" AND " if where else "WHERE ") + "r.key = ?"
            args.append(key)
        source = "requests r JOIN request_tags t ON t.request_id = r.id" if group_by == "tag" else "requests r"
        column = "t.tag" if group_by == "tag" else f"r.{group_by}"
        query = (f"SELECT {column} AS grp, COUNT(*) AS requests, SUM(r.prompt_tokens) AS prompt_tokens, "
                 f"SUM(r.completion_tokens) AS completion_tokens, SUM(r.cached_tokens) AS cached_tokens, "
                 f"SUM(r.engine_seconds) AS engine_seconds, SUM(r.cost) AS cost, SUM(r.price) AS price "
                 f"FROM {source} {where} GROUP BY grp ORDER BY grp")
        out = []
        for r in self._db().execute(query, args):
            row = {group_by: r["grp"], **{k: r[k] for k in r.keys() if k != "grp"}}
            row["margin"] = row["price"] - row["cost"]
            out.append(row)
        return out

    def spent(self, scope: str, name: str, since: float) -> float:
        """Billed dollars since `since` for one key (by name) or one tag."""
        if scope == "key":
            query, args = "SELECT SUM(price) FROM requests WHERE key = ? AND created >= ?", (name, since)
        else:
            query = ("SELECT SUM(r.price) FROM requests r JOIN request_tags t ON t.request_id = r.id "
                     "WHERE t.tag = ? AND r.created >= ?")
            args = (name, since)
        return self._db().execute(query, args).fetchone()[0] or 0.0

    def claim_alert(self, budget: str, period_start: float, threshold: float, now: float) -> bool:
        """True the first time this alert is claimed for this period (across restarts)."""
        cur = self._db().execute("INSERT OR IGNORE INTO alerts VALUES (?, ?, ?, ?)", (budget, period_start, threshold, now))
        return cur.rowcount == 1

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None


def _window(start: float | None, end: float | None, column: str = "created") -> tuple[str, list]:
    clauses, args = [], []
    if start is not None:
        clauses.append(f"{column} >= ?")
        args.append(start)
    if end is not None:
        clauses.append(f"{column} < ?")
        args.append(end)
    return ("WHERE " + " AND ".join(clauses)) if clauses else "", args


def parse_time(value: str | None, name: str) -> float | None:
    """A usage window's bound: unix seconds, or an ISO 8601 date or time (UTC unless it says)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            t = datetime.datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"{name} must be unix seconds or an ISO 8601 date, got {value!r}") from None
        return (t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)).timestamp()
    if not math.isfinite(seconds):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return seconds
