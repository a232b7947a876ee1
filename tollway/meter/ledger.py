"""The ledger: one row per API request, written before its response ends, in a SQLite file
(the default) or a PostgreSQL database that a fleet of servers shares (tollway/storage).

A commit is durable when `record` returns (SQLite: WAL with synchronous=FULL; PostgreSQL:
its default synchronous_commit), so a request whose response completed survives a SIGKILL or
a power cut. Readers never block the writer; writers are serialised by the database, across
processes and machines too.
"""
from __future__ import annotations

import datetime
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tollway.storage.database import Connection, Database, as_database

GROUPS = ("key", "tier", "tag", "model")
# Money is stored as integer nano-dollars, so sums are exact. Not micro-dollars: a token at
# $0.05 per million costs 0.05 of one.
NANOS = 10**9
MONEY = ("cost", "price")
ROW_MONEY = MONEY + ("canary_cost",)  # a row's money; usage sums MONEY
PROMOTED, CONTROL = "promoted", "control"  # a canary-eligible request's arm (LedgerRow.canary)


def to_nanos(dollars: float) -> int:
    return round(dollars * NANOS)


def to_dollars(nanos) -> float:
    return int(nanos) / NANOS  # int(): PostgreSQL's SUM of BIGINT is NUMERIC


def migrate_float_money(db: Connection, table: str, columns: dict[str, str]) -> None:
    """Replace each column of `table` that kept dollars as floats (old name -> new name) with
    one of nano-dollars, in the caller's schema transaction; a column already gone is skipped,
    so a table is migrated once, by the first server to start."""
    present = db.columns(table)
    for old, new in columns.items():
        if old not in present:
            continue
        db.execute(f"ALTER TABLE {table} ADD COLUMN {new} BIGINT NOT NULL DEFAULT 0")
        db.execute(f"UPDATE {table} SET {new} = CAST(ROUND({old} * {NANOS}) AS BIGINT)")
        db.execute(f"ALTER TABLE {table} DROP COLUMN {old}")


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
    cost_nanos BIGINT NOT NULL,       -- engine_seconds x the machine's price, in nano-dollars
    price_nanos BIGINT NOT NULL,      -- billed from the price card, in nano-dollars
    finish_reason TEXT,
    tags TEXT NOT NULL,               -- JSON list, also in request_tags
    canary TEXT,                      -- 'promoted' | 'control' for a canary-eligible request
    canary_cost_nanos BIGINT NOT NULL DEFAULT 0  -- fast premium not billed to a promoted request
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
    canary: str | None = None  # "promoted" | "control" where the canary could have promoted it
    canary_cost: float = 0.0  # the fast price less the billed one, for a promoted request billed as standard


class Ledger:
    def __init__(self, target: Database | str | Path):
        """`target`: a Database, a postgresql:// URL, or a SQLite file's path."""
        self.database = as_database(target)
        self.database.create_schema(_SCHEMA)
        # Ledgers written before money was exact kept dollars as floats in `cost` and `price`.
        with self.database.schema_transaction() as db:
            migrate_float_money(db, "requests", {name: f"{name}_nanos" for name in MONEY})
            if "canary" not in db.columns("requests"):  # ledgers from before the canary
                db.execute("ALTER TABLE requests ADD COLUMN canary TEXT")
                db.execute("ALTER TABLE requests ADD COLUMN canary_cost_nanos BIGINT NOT NULL DEFAULT 0")

    def record(self, row: LedgerRow) -> None:
        """Insert the row and its tags in one transaction, durable when this returns."""
        with self.database.transaction() as db:
            self.write(db, row)

    @staticmethod
    def write(db: Connection, row: LedgerRow) -> None:
        """Insert the row and its tags in the caller's transaction."""
        values = asdict(row)
        values["tags"] = json.dumps(row.tags)
        for name in ROW_MONEY:
            values[f"{name}_nanos"] = to_nanos(values.pop(name))
        db.execute(f"INSERT INTO requests ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
                   list(values.values()))
        db.executemany("INSERT INTO request_tags VALUES (?, ?)", [(row.id, t) for t in dict.fromkeys(row.tags)])

    @staticmethod
    def has(db: Connection, request_id: str) -> bool:
        """Whether the request's row is in the ledger (read in the caller's transaction)."""
        return db.execute("SELECT 1 FROM requests WHERE id = ?", (request_id,)).fetchone() is not None

    def rows(self, start: float | None = None, end: float | None = None) -> list[LedgerRow]:
        return self._rows(*_window(start, end))

    def canary_rows(self, start: float | None = None, end: float | None = None,
                    key: str | None = None) -> list[LedgerRow]:
        """The canary's requests (promoted or control) in [start, end), optionally only one key's."""
        where, args = _window(start, end)
        where += (" AND " if where else "WHERE ") + "canary IS NOT NULL"
        if key is not None:
            where += " AND key = ?"
            args.append(key)
        return self._rows(where, args)

    def _rows(self, where: str, args: list) -> list[LedgerRow]:
        out = []
        for values in self._dicts(f"SELECT * FROM requests {where} ORDER BY created", args):
            values["tags"] = json.loads(values["tags"])
            for name in ROW_MONEY:
                values[name] = to_dollars(values.pop(f"{name}_nanos"))
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
                 f"SUM(r.engine_seconds) AS engine_seconds, SUM(r.cost_nanos) AS cost, SUM(r.price_nanos) AS price "
                 f"FROM {source} {where} GROUP BY grp ORDER BY grp")
        out = []
        for r in self._dicts(query, args):
            row = {group_by: r.pop("grp"), **r}
            for name in MONEY:
                row[name] = to_dollars(row[name])  # of an exact integer sum
            row["margin"] = row["price"] - row["cost"]
            out.append(row)
        return out

    @staticmethod
    def spent_nanos(db: Connection, scope: str, name: str, start: float, end: float) -> int:
        """Billed nano-dollars in [start, end) for one key (by name) or one tag."""
        if scope == "key":
            query = "SELECT SUM(price_nanos) FROM requests WHERE key = ? AND created >= ? AND created < ?"
        else:
            query = ("SELECT SUM(r.price_nanos) FROM requests r JOIN request_tags t ON t.request_id = r.id "
                     "WHERE t.tag = ? AND r.created >= ? AND r.created < ?")
        return int(db.execute(query, (name, start, end)).fetchone()[0] or 0)

    def claim_alert(self, budget: str, period_start: float, threshold: float, now: float) -> bool:
        """True the first time this alert is claimed for this period (across restarts and servers)."""
        return self.database.run("INSERT INTO alerts VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                                 (budget, period_start, threshold, now)) == 1

    def close(self) -> None:
        self.database.close()

    def _dicts(self, query: str, args) -> list[dict]:
        with self.database.connect() as db:
            cursor = db.execute(query, args)
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, r)) for r in cursor.fetchall()]


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
