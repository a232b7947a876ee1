"""The SQL seam under the durable stores (API keys, the ledger and budgets, Batch API jobs and
files): a SQLite file on one machine, or one PostgreSQL database that a fleet of servers shares.

Stores write their SQL once, in SQLite's spelling with `?` parameters and no literal `%`; the
few places the two differ are settled here: the parameter style, column types in DDL, and how
a read-then-write transaction takes its lock. Connections are pooled: a thread takes one for a
statement or a transaction and hands it back. One that raised is closed, never reused, so a
broken connection or a half-done transaction (rolled back by the close) cannot leak into the
next caller. PostgreSQL's pool is psycopg_pool's, which checks a connection is alive before
handing it out: after the database restarts, requests get fresh connections, not dead ones.
"""
from __future__ import annotations

import re
import sqlite3
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

POSTGRES_SCHEMES = ("postgresql", "postgres")
_IDLE = 8  # SQLite: connections kept open between uses; more are opened under load and closed after
# PostgreSQL: connections per server at most (a fleet's servers share the database's
# max_connections, 100 by default); a caller waits up to _WAIT seconds for one.
_POSTGRES_CONNECTIONS = 32
_WAIT = 30.0
# PostgreSQL's REAL is 4 bytes (SQLite's is 8: dollars and seconds need them); BLOB is BYTEA there.
_POSTGRES_TYPES = {"REAL": "DOUBLE PRECISION", "BLOB": "BYTEA"}
_SCHEMA_LOCK = 0x7011_3A7  # advisory lock: servers starting together create the tables one at a time


def is_database_url(target: str | Path) -> bool:
    return isinstance(target, str) and urlsplit(target).scheme in POSTGRES_SCHEMES


def as_database(target: Database | str | Path) -> Database:
    """`target` itself, or a Database on it (a postgresql:// URL or a SQLite file)."""
    return target if isinstance(target, Database) else Database(target)


class Connection:
    """A pooled connection, taken by one thread at a time; `execute` takes SQLite's `?` style."""

    def __init__(self, raw, postgres: bool):
        self.raw, self.postgres = raw, postgres
        # SQLite's BEGIN IMMEDIATE already holds the database's write lock; PostgreSQL locks rows.
        self.for_update = " FOR UPDATE" if postgres else ""

    def execute(self, sql: str, args=()):
        return self.raw.execute(self._sql(sql), args)

    def executemany(self, sql: str, rows) -> None:
        if self.postgres:
            with self.raw.cursor() as cursor:
                cursor.executemany(self._sql(sql), rows)
        else:
            self.raw.executemany(sql, rows)

    def columns(self, table: str) -> list[str]:
        """The table's column names, as they are now."""
        return [d[0] for d in self.execute(f"SELECT * FROM {table} LIMIT 0").description]

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.postgres else sql


class Database:
    def __init__(self, target: str | Path):
        """`target`: a postgresql:// URL, or a SQLite file's path (its folder is created).
        Raises ValueError, in one line, when the database cannot be reached."""
        self.postgres = is_database_url(target)
        if self.postgres:
            try:
                import psycopg
                import psycopg_pool
            except ImportError:
                raise ValueError("a postgresql:// database needs psycopg and psycopg_pool: "
                                 "pip install 'tollway[postgres]'") from None
            self._psycopg = psycopg
            self.url = str(target)
            self.location = _redacted(self.url)
            self._probe()  # the reason, in one line, when the database cannot be reached
            self._pool = psycopg_pool.ConnectionPool(
                self.url, kwargs={"autocommit": True, "connect_timeout": 10}, min_size=1,
                max_size=_POSTGRES_CONNECTIONS, timeout=_WAIT, check=psycopg_pool.ConnectionPool.check_connection,
                open=True, name=f"tollway {self.location}")
        else:
            if isinstance(target, str) and "://" in target:
                raise ValueError(f"a database must be a postgresql:// URL or a SQLite file's path, got {target!r}")
            self.path = Path(target)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.location = str(self.path)
        self._idle: list = []
        self._lock = threading.Lock()
        self._closed = False
        # Also when the Database is dropped unclosed: the server keeps no connection of a store gone.
        self._close_idle = (weakref.finalize(self, self._pool.close) if self.postgres
                            else weakref.finalize(self, _close_idle, self._idle, self._lock))
        with self.connect():  # fail now, with a clear message, rather than at the first request
            pass

    def __str__(self) -> str:
        return self.location

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """A connection in autocommit mode: each statement commits on its own."""
        if self.postgres:
            from psycopg_pool import PoolTimeout

            try:
                with self._pool.connection() as raw:
                    try:
                        yield Connection(raw, True)
                    except BaseException:
                        raw.close()  # rolls back whatever it held; the pool opens another in its place
                        raise
            except PoolTimeout:
                raise ValueError(f"cannot use the database {self.location}: no connection free within {_WAIT:g} s "
                                 "(is it reachable?)") from None
            return
        with self._lock:
            raw = self._idle.pop() if self._idle else None
        if raw is None:
            raw = self._open()
        try:
            yield Connection(raw, False)
        except BaseException:
            raw.close()  # closing rolls back whatever it held
            raise
        with self._lock:
            if not self._closed and len(self._idle) < _IDLE:
                self._idle.append(raw)
                raw = None
        if raw is not None:
            raw.close()

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """One write transaction, committed when the block ends (rolled back if it raises).
        Reads in it may lock rows they are about to change with `connection.for_update`."""
        with self.connect() as db:
            db.execute("BEGIN" if self.postgres else "BEGIN IMMEDIATE")
            yield db
            db.execute("COMMIT")

    def query(self, sql: str, args=()) -> list[tuple]:
        """One autocommitted statement's rows."""
        with self.connect() as db:
            return db.execute(sql, args).fetchall()

    def run(self, sql: str, args=()) -> int:
        """One autocommitted statement; the number of rows it changed."""
        with self.connect() as db:
            return db.execute(sql, args).rowcount

    def create_schema(self, ddl: str) -> None:
        """Run CREATE ... IF NOT EXISTS statements, written in SQLite's types."""
        if not self.postgres:
            with self.connect() as db:
                db.raw.executescript(ddl)
            return
        ddl = re.sub(r"\b(REAL|BLOB)\b", lambda m: _POSTGRES_TYPES[m[1]], ddl)
        with self.schema_transaction() as db:
            db.raw.execute(ddl)

    @contextmanager
    def schema_transaction(self) -> Iterator[Connection]:
        """A transaction that changes tables: one server at a time, so that servers starting
        together neither collide in PostgreSQL's catalog nor migrate a table twice."""
        with self.transaction() as db:
            if self.postgres:
                db.execute(f"SELECT pg_advisory_xact_lock({_SCHEMA_LOCK})")
            yield db

    def close(self) -> None:
        """Close the idle connections; those in use close when handed back."""
        with self._lock:
            self._closed = True
        self._close_idle()

    def _probe(self) -> None:
        try:
            self._psycopg.connect(self.url, autocommit=True, connect_timeout=10).close()
        except self._psycopg.Error as e:
            raise ValueError(f"cannot use the database {self.location}: {' '.join(str(e).split())}") from None

    def _open(self):
        try:
            raw = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
            # WAL: readers never block the writer; FULL: a commit is on disk when it returns.
            raw.execute("PRAGMA journal_mode=WAL")
            raw.execute("PRAGMA synchronous=FULL")
        except sqlite3.Error as e:
            raise ValueError(f"cannot use the database {self.location}: {e}") from None
        return raw


def _close_idle(idle: list, lock: threading.Lock) -> None:
    with lock:
        connections = idle[:]
        idle.clear()
    for raw in connections:
        raw.close()


def _redacted(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{user.partition(':')[0]}:***@{host}").geturl()
