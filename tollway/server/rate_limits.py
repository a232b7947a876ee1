"""Per-key rate limits: requests, and tokens (prompt + max_tokens, as OpenAI counts them), in a
sliding 60-second window.

A server counts them in its key store's database, so every server sharing that database (the
replicas on one machine share its SQLite file; servers on several machines, one PostgreSQL
database) draws on one window per key. An admission is one short transaction: lock the key's
row (`SELECT ... FOR UPDATE`; SQLite's `BEGIN IMMEDIATE` locks the file), drop its entries older
than the window, then refuse or record the request; two servers cannot both take the last slot.
A Gatekeeper built without a store (in code, in tests) counts in its own memory.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tollway.server.errors import APIError
from tollway.storage.database import Database

WINDOW = 60.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rate_keys (  -- one per rate-limited key: the row its admissions lock
    sha256 TEXT PRIMARY KEY  -- the key's name in the key store: its SHA-256
);
CREATE TABLE IF NOT EXISTS rate_admissions (  -- each request admitted in the last window
    sha256 TEXT NOT NULL,
    at REAL NOT NULL,  -- unix seconds: servers on several machines need clocks in step (NTP)
    tokens INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS rate_admissions_key ON rate_admissions(sha256, at);
"""
_LOCK = "SELECT 1 FROM rate_keys WHERE sha256 = ?"  # + the connection's FOR UPDATE


class MemoryLimits:
    """The windows of one process."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._lock = threading.Lock()
        self._admitted: dict[str, deque[tuple[float, int]]] = {}  # key's name -> (time, tokens), oldest first

    def admit(self, name: str, rpm: int | None, tpm: int | None, tokens: int) -> Window:
        """Count a request of `tokens` against key `name`'s limits, or refuse it with 429."""
        with self._lock:
            now = self.clock()
            admitted = self._admitted.setdefault(name, deque())
            while admitted and admitted[0][0] <= now - WINDOW:
                admitted.popleft()
            refusal, window = _decide(rpm, tpm, tokens, now, len(admitted), sum(n for _, n in admitted),
                                      admitted[0][0] if admitted else now, lambda: admitted)
            if refusal is None:
                admitted.append((now, tokens))
        if refusal is not None:
            raise refusal
        return window


class DatabaseLimits:
    """The windows every server on `database` shares."""

    def __init__(self, database: Database, clock: Callable[[], float] = time.time):
        self.database, self.clock = database, clock
        self.database.create_schema(_SCHEMA)
        self._next_sweep = 0.0

    def admit(self, name: str, rpm: int | None, tpm: int | None, tokens: int) -> Window:
        """Count a request of `tokens` against key `name`'s limits, or refuse it with 429."""
        if self.clock() >= self._next_sweep:
            self._sweep()
        with self.database.transaction() as db:
            while db.execute(_LOCK + db.for_update, (name,)).fetchone() is None:
                # A key's first request: a second server's insert waits on ours, then does nothing.
                db.execute("INSERT INTO rate_keys VALUES (?) ON CONFLICT DO NOTHING", (name,))
            now = self.clock()  # read under the lock: admissions are recorded in the order they win it
            db.execute("DELETE FROM rate_admissions WHERE sha256 = ? AND at <= ?", (name, now - WINDOW))
            count, used, oldest = db.execute("SELECT COUNT(*), COALESCE(SUM(tokens), 0), MIN(at) FROM rate_admissions "
                                             "WHERE sha256 = ?", (name,)).fetchone()
            # Committed either way: a refusal must not cost the pool its connection.
            refusal, window = _decide(rpm, tpm, tokens, now, count, used, oldest if count else now, lambda: db.execute(
                "SELECT at, tokens FROM rate_admissions WHERE sha256 = ? ORDER BY at", (name,)).fetchall())
            if refusal is None:
                db.execute("INSERT INTO rate_admissions VALUES (?, ?, ?)", (name, now, tokens))
        if refusal is not None:
            raise refusal
        return window

    def _sweep(self) -> None:
        """Forget the keys with nothing in their window (gone quiet, or revoked): their rows would
        otherwise stay until their next request. Once a window, each under its key's lock."""
        now = self.clock()
        self._next_sweep, cutoff = now + WINDOW, now - WINDOW
        quiet = "NOT EXISTS (SELECT 1 FROM rate_admissions a WHERE a.sha256 = rate_keys.sha256 AND a.at > ?)"
        for (name,) in self.database.query(f"SELECT sha256 FROM rate_keys WHERE {quiet}", (cutoff,)):
            with self.database.transaction() as db:
                db.execute(_LOCK + db.for_update, (name,))
                # Asked again under the lock: a request may have come in since.
                if db.execute(f"DELETE FROM rate_keys WHERE sha256 = ? AND {quiet}", (name, cutoff)).rowcount:
                    db.execute("DELETE FROM rate_admissions WHERE sha256 = ?", (name,))


@dataclass(frozen=True)
class Window:
    """A key's limits and its use of them in the window, as OpenAI's x-ratelimit-* headers say them."""

    rpm: int | None
    tpm: int | None
    requests: int  # admitted in the window
    tokens: int
    reset: float  # seconds until the window's oldest admission ages out, freeing room

    def headers(self) -> dict[str, str]:
        headers = {}
        for what, limit, used in (("requests", self.rpm, self.requests), ("tokens", self.tpm, self.tokens)):
            if limit is not None:
                headers |= {f"x-ratelimit-limit-{what}": str(limit),
                            f"x-ratelimit-remaining-{what}": str(max(0, limit - used)),
                            f"x-ratelimit-reset-{what}": _duration(self.reset)}
        return headers


def _duration(seconds: float) -> str:
    """OpenAI's way of writing a reset time: 20ms, 8.64s, 1m0s."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, seconds = divmod(seconds, 60)
    return f"{int(minutes)}m{seconds:.3g}s" if minutes else f"{seconds:.3g}s"


def _decide(rpm: int | None, tpm: int | None, tokens: int, now: float, count: int, used: int, oldest: float,
            admitted: Callable[[], Iterable[tuple[float, int]]]) -> tuple[APIError | None, Window]:
    """The refusal, if any, and the key's window after the decision (see _refusal)."""
    refusal = _refusal(rpm, tpm, tokens, now, count, used, oldest, admitted)
    if refusal is not None:
        window = Window(rpm, tpm, count, used, oldest + WINDOW - now)
        refusal.headers = (refusal.headers or {}) | window.headers()
        return refusal, window
    return None, Window(rpm, tpm, count + 1, used + tokens, oldest + WINDOW - now)


def _refusal(rpm: int | None, tpm: int | None, tokens: int, now: float, count: int, used: int, oldest: float,
             admitted: Callable[[], Iterable[tuple[float, int]]]) -> APIError | None:
    """The 429 for a request of `tokens`, given the key's limits and its `count` requests and
    `used` tokens in the window (`admitted` lists them, oldest first), or None when it fits."""
    if rpm is not None and count >= rpm:
        return _limited("requests", rpm, oldest + WINDOW - now)
    if tpm is not None and used + tokens > tpm:
        if tokens > tpm:
            return APIError(429, f"this request needs {tokens} tokens, more than the key's {tpm} per minute",
                            code="rate_limit_exceeded")
        for at, n in admitted():  # oldest first: when enough has aged out of the window
            used -= n
            if used + tokens <= tpm:
                return _limited("tokens", tpm, at + WINDOW - now)
    return None


def _limited(what: str, limit: int, wait: float) -> APIError:
    seconds = max(1, int(wait + 0.999))
    return APIError(429, f"rate limit reached: {limit} {what} per minute; retry in {seconds} s",
                    code="rate_limit_exceeded", headers={"Retry-After": str(seconds)})
