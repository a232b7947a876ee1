"""API keys: who may call, in which lanes, and how much per minute.

Keys come from the config file's [[keys]] and from a store that `tollway keys` manages (a
SQLite file, or the fleet's PostgreSQL database; it keeps only a SHA-256 of each key). With no
keys anywhere the server is open, as vLLM is without --api-key. A key's rpm and tpm limits are
counted in the store's database, shared by every server on it (rate_limits.py).
"""
from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from tollway.config import TIERS, KeySpec
from tollway.server.errors import APIError
from tollway.server.rate_limits import DatabaseLimits, MemoryLimits
from tollway.storage.database import Database, as_database

_SCHEMA = """CREATE TABLE IF NOT EXISTS keys (
    sha256 TEXT PRIMARY KEY, name TEXT NOT NULL, tiers TEXT NOT NULL, rpm INTEGER, tpm INTEGER,
    created REAL NOT NULL);"""


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def owner_of(key: KeySpec | None) -> str:
    """Whose a Batch API file or batch is: the key's SHA-256, as the key store names it ("": the
    open server's, one owner for every caller)."""
    return _digest(key.key) if key is not None else ""


class KeyDatabase:
    """The store of keys (`tollway keys add/list/revoke`)."""

    def __init__(self, target: Database | str | Path):
        """`target`: a Database, a postgresql:// URL, or a SQLite file's path."""
        self.database = as_database(target)
        self.database.create_schema(_SCHEMA)

    def add(self, name: str, tiers: list[str], rpm: int | None, tpm: int | None) -> str:
        """A new key, returned once; only its hash is stored."""
        key = "sk-tw-" + secrets.token_urlsafe(24)
        KeySpec(key, name, tiers, rpm, tpm).validate()
        self.database.run("INSERT INTO keys VALUES (?, ?, ?, ?, ?, ?)",
                          (_digest(key), name, json.dumps(tiers), rpm, tpm, time.time()))
        return key

    def revoke(self, name: str) -> int:
        return self.database.run("DELETE FROM keys WHERE name = ?", (name,))

    def list(self) -> list[dict]:
        rows = self.database.query("SELECT name, tiers, rpm, tpm, created FROM keys ORDER BY created")
        return [{"name": n, "tiers": json.loads(t), "rpm": rpm, "tpm": tpm, "created": c} for n, t, rpm, tpm, c in rows]

    def lookup(self, key: str) -> KeySpec | None:
        found = self.lookup_digest(_digest(key))
        return KeySpec(key, found.name, found.tiers, found.rpm, found.tpm) if found else None

    def lookup_digest(self, digest: str) -> KeySpec | None:
        """The key whose SHA-256 is `digest`, with its secret (which only the caller knows) left empty."""
        rows = self.database.query("SELECT name, tiers, rpm, tpm FROM keys WHERE sha256 = ?", (digest,))
        return KeySpec("", rows[0][0], json.loads(rows[0][1]), rows[0][2], rows[0][3]) if rows else None

    def count(self) -> int:
        return self.database.query("SELECT COUNT(*) FROM keys")[0][0]


class Gatekeeper:
    """Authenticates a request's key, picks the tier it may have, and applies its limits."""

    def __init__(self, keys: list[KeySpec], database: KeyDatabase | None = None,
                 clock: Callable[[], float] = time.time):
        """`database`: the key store, where rate limits are counted too (None: in this process)."""
        self._keys = {k.key: k for k in keys}
        self.database = database
        self._limits = DatabaseLimits(database.database, clock) if database else MemoryLimits(clock)

    @property
    def open(self) -> bool:
        """No keys configured anywhere: every request is let in."""
        return not self._keys and (self.database is None or self.database.count() == 0)

    def authenticate(self, authorization: str | None) -> KeySpec | None:
        """The caller's key, or None when the server is open; 401 otherwise."""
        if self.open:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        key = self._keys.get(token) or (self.database.lookup(token) if self.database else None)
        if key is None:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return key

    def in_database(self, authorization: str | None) -> bool:
        """Whether authenticate would look this key up in the key database (I/O)."""
        scheme, _, token = (authorization or "").partition(" ")
        return (not self.open and self.database is not None and scheme.lower() == "bearer" and bool(token)
                and token not in self._keys)

    def authenticate_admin(self, authorization: str | None) -> KeySpec | None:
        """An admin's key, or None when the server is open; 401 without a valid key, 403 for a
        key that is not an admin's."""
        key = self.authenticate(authorization)
        if key is not None and not key.admin:
            raise APIError(403, "this needs an admin key (tollway serve --admin-key, or admin = true in [[keys]])",
                           code="admin_required")
        return key

    @staticmethod
    def entitled_tier(key: KeySpec | None, tier: str, wire: str | int | None, param: str = "service_tier") -> str:
        """The tier to serve: the asked one if the key may use it; `auto` falls back to standard.
        `wire`: what asked for it, the value of the field `param` (service_tier.asked_tier)."""
        if key is None or tier in key.tiers:
            return tier
        if wire == "auto" and "standard" in key.tiers:
            return "standard"
        allowed = ", ".join(t for t in TIERS if t in key.tiers)
        raise APIError(403, f"this API key may not use the {tier} lane ({param}={wire!r}); it may use: {allowed}",
                       param=param, code="tier_not_allowed")

    def key_of(self, owner: str) -> KeySpec | None:
        """The key a Batch API owner (owner_of) names, if it still exists; None for the open server's."""
        if not owner:
            return None
        configured = next((k for k in self._keys.values() if owner_of(k) == owner), None)
        return configured or (self.database.lookup_digest(owner) if self.database else None)

    def admit(self, key: KeySpec | None, tokens: int, owner: str | None = None) -> dict[str, str]:
        """Count a request of `tokens` against the key's limits, or refuse it with 429. Returns
        the x-ratelimit-* headers of what the key has left (none for a key without limits).
        `owner`: the key's owner_of, for a key found by key_of (which may not know its secret)."""
        if key is None or not key.limited:
            return {}
        return self._limits.admit(owner or owner_of(key), key.rpm, key.tpm, tokens).headers()
