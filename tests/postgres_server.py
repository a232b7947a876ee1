"""A real, throwaway PostgreSQL server for the shared-state tests: initdb into a temporary
folder, pg_ctl start on a free loopback port (its unix socket in that folder too), and a fresh
empty database for each test that asks.

PostgreSQL refuses to run as root, and CI runs as root: there the server runs as the `postgres`
user that Debian's package creates, in a folder it owns. Without PostgreSQL's binaries (or
psycopg) the tests that need it skip, unless TOLLWAY_REQUIRE_POSTGRES is set, as .ci/run sets it.
"""
from __future__ import annotations

import glob
import itertools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from live_server import free_port

USER = "tollway"  # the cluster's superuser; trust authentication, loopback and socket only


def _bin_dir() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


def _unavailable(reason: str):
    if os.environ.get("TOLLWAY_REQUIRE_POSTGRES"):
        pytest.fail(f"{reason}, and TOLLWAY_REQUIRE_POSTGRES is set (apt-get install -y postgresql; "
                    f"pip install 'psycopg[binary]')")
    pytest.skip(reason)


class PostgresServer:
    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="tollway-pg-"))  # not under pytest's 0700 root-only tree
        self.as_owner: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            self.as_owner = ["runuser", "-u", "postgres", "--"]
        self.data = self.root / "data"
        self.port = free_port()
        self._names = itertools.count()

    def start(self) -> None:
        self._run("initdb", "-D", self.data, "-U", USER, "-A", "trust", "--no-sync", "--no-locale", "-E", "UTF8")
        # fsync off: a throwaway cluster; what is under test is tollway's transactions, not the disk.
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   f"-c max_connections=300")
        self._run("pg_ctl", "-D", self.data, "-l", self.root / "server.log", "-w", "-t", "60", "-o", options, "start")

    def restart(self) -> None:
        """Stop at once, cutting every connection as a crash would, and start again."""
        self._run("pg_ctl", "-D", self.data, "-l", self.root / "server.log", "-m", "immediate", "-w", "-t", "60",
                  "restart")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """The URL of a new, empty database."""
        import psycopg

        name = f"test_{next(self._names)}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def _run(self, program: str, *args) -> None:
        done = subprocess.run([*self.as_owner, self.bin_dir / program, *map(str, args)], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            log = self.root / "server.log"
            raise RuntimeError(f"{program} failed: {done.stderr.strip()}\n{log.read_text() if log.exists() else ''}")


@pytest.fixture(scope="session")
def postgres():
    """A running PostgreSQL server for the whole session (skips without one, see above)."""
    bin_dir = _bin_dir()
    if bin_dir is None:
        _unavailable("PostgreSQL is not installed")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _unavailable("psycopg is not installed")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        _unavailable("running as root, and runuser is missing to start PostgreSQL as its own user")
    server = PostgresServer(bin_dir)
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def store_target(request, tmp_path):
    """Where a store keeps its tables, once per backend: a SQLite file, or a new PostgreSQL
    database's URL. Open it twice for two servers' (or a restarted server's) view of it."""
    if request.param == "sqlite":
        return tmp_path / "store.sqlite"
    return request.getfixturevalue("postgres").new_database()
