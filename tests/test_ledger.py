"""The ledger: rows in and usage out of a real SQLite file and a real PostgreSQL database (read
back by a fresh store, as after a restart), concurrent writers, the CLI views."""
from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap

import pytest

from tollway.cli import main
from tollway.meter.ledger import NANOS, Ledger, LedgerRow, parse_time
from tollway.meter.report import economics


def row(rid, tier="standard", key="alice", tags=(), created=1000.0, prompt=10, completion=20, seconds=0.5,
        price_per_second=0.001, price=0.01):
    return LedgerRow(id=rid, created=created, key=key, tier=tier, model="m", prompt_tokens=prompt,
                     completion_tokens=completion, cached_tokens=0, queue_seconds=0.01, ttft_seconds=0.1,
                     e2e_seconds=1.0, engine_seconds=seconds, cost=seconds * price_per_second, price=price,
                     finish_reason="length", tags=list(tags))


def test_rows_round_trip_and_usage_groups(store_target):
    writer = Ledger(store_target)
    writer.record(row("a", "fast", tags=["team=x", "nightly"], created=100, seconds=2.0))
    writer.record(row("b", "standard", key="bob", tags=["team=x"], created=200))
    writer.record(row("c", "standard", created=300))
    writer.close()
    ledger = Ledger(store_target)  # a restarted server's view
    assert ledger.rows()[1] == row("b", "standard", key="bob", tags=["team=x"], created=200)
    assert [r.id for r in ledger.rows()] == ["a", "b", "c"]
    assert ledger.rows()[0].tags == ["team=x", "nightly"]
    by_tier = {r["tier"]: r for r in ledger.usage("tier")}
    assert by_tier["standard"]["requests"] == 2 and by_tier["standard"]["completion_tokens"] == 40
    assert by_tier["fast"]["cost"] == pytest.approx(0.002)
    assert by_tier["fast"]["margin"] == pytest.approx(0.01 - 0.002)
    by_tag = {r["tag"]: r["requests"] for r in ledger.usage("tag")}
    assert by_tag == {"nightly": 1, "team=x": 2}
    assert [r["key"] for r in ledger.usage("key", start=150)] == ["alice", "bob"]
    assert [r["requests"] for r in ledger.usage("tier", start=150, end=300)] == [1]  # end is exclusive
    assert ledger.usage("tier", key="bob")[0]["requests"] == 1
    with pytest.raises(ValueError, match="group_by"):
        ledger.usage("colour")


def test_a_row_is_on_disk_when_record_returns(tmp_path):
    path = tmp_path / "ledger.sqlite"
    Ledger(path).record(row("a"))
    other = sqlite3.connect(path)  # another connection, as another process would see it
    assert other.execute("SELECT id FROM requests").fetchall() == [("a",)]
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_concurrent_writers_never_corrupt_it(tmp_path):
    path = tmp_path / "ledger.sqlite"
    Ledger(path)
    script = textwrap.dedent(f"""
        import sys, threading
        from tollway.meter.ledger import Ledger, LedgerRow
        ledger = Ledger({str(path)!r})
        def write(t):
            for i in range(40):
                ledger.record(LedgerRow(f"{{sys.argv[1]}}-{{t}}-{{i}}", 1.0, "k", "standard", "m", 1, 1, 0, None, None,
                                        0.1, 0.1, 0.1, 0.1, "stop", [f"t{{t}}"]))
        threads = [threading.Thread(target=write, args=(t,)) for t in range(3)]
        [th.start() for th in threads]
        [th.join() for th in threads]
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, f"p{p}"]) for p in range(3)]
    assert all(p.wait(120) == 0 for p in procs)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert db.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 3 * 3 * 40
    assert db.execute("SELECT COUNT(*) FROM request_tags").fetchone()[0] == 3 * 3 * 40


def test_economics_measures_the_fast_premium(store_target):
    ledger = Ledger(store_target)
    assert economics(ledger)["fast_premium"] is None
    ledger.record(row("f", "fast", completion=100, seconds=3.0, price=0.5))
    ledger.record(row("s", "standard", completion=300, seconds=1.0, price=0.3))
    report = economics(ledger)
    fast, standard = report["tiers"]["fast"], report["tiers"]["standard"]
    assert fast["cost_per_m_output"] == pytest.approx(3.0 * 0.001 / 100 * 1e6)
    assert report["fast_premium"] == pytest.approx((3.0 / 100) / (1.0 / 300))
    assert standard["price_per_m_output"] == pytest.approx(0.3 / 300 * 1e6)


def test_cli_usage_and_report(tmp_path, capsys):
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path)
    ledger.record(row("f", "fast", completion=100, seconds=3.0))
    ledger.record(row("s", "standard", key="bob", completion=300, seconds=1.0))
    assert main(["usage", "--ledger", str(path), "--group-by", "key", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("key,requests,prompt_tokens") and lines[1].startswith("alice,1,") and len(lines) == 3
    assert main(["usage", "--ledger", str(path)]) == 0
    table = capsys.readouterr().out
    assert "fast" in table and "standard" in table and "margin" in table
    assert main(["report", "--ledger", str(path)]) == 0
    out = capsys.readouterr().out
    assert "fast premium" in out and "9.00x" in out
    assert main(["usage", "--ledger", str(tmp_path / "missing.sqlite")]) == 2
    assert "no ledger at" in capsys.readouterr().err
    assert main(["usage", "--ledger", str(path), "--start", "last tuesday"]) == 2
    assert "--start must be unix seconds or an ISO 8601 date" in capsys.readouterr().err


def test_cli_reads_the_fleets_postgres_ledger(postgres, capsys):
    url = postgres.new_database()
    ledger = Ledger(url)
    ledger.record(row("f", "fast", completion=100, seconds=3.0))
    ledger.record(row("s", "standard", key="bob", completion=300, seconds=1.0))
    assert main(["usage", "--database-url", url, "--group-by", "key", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("alice,1,")
    assert main(["report", "--database-url", url]) == 0
    assert "9.00x" in capsys.readouterr().out


@pytest.mark.parametrize("url, message", [
    ("postgresql://tollway@127.0.0.1:1/nowhere", "cannot use the database postgresql://tollway@127.0.0.1:1/nowhere: "),
    ("postgresql://tollway:s3cret@127.0.0.1:1/x", "cannot use the database postgresql://tollway:***@127.0.0.1:1/x: "),
    ("mysql://localhost/x", "a database URL must be postgresql://..., got 'mysql://localhost/x'"),
])
@pytest.mark.parametrize("command", [["usage"], ["keys", "list"], ["serve", "--kernel", "int8"]])
def test_a_bad_database_url_is_one_line(command, url, message, capsys):
    assert main([*command, "--database-url", url]) == 2  # serve: before it loads the model
    err = capsys.readouterr().err
    assert err.startswith(f"tollway: error: {message}") and err.count("\n") == 1 and "s3cret" not in err


def test_without_psycopg_the_cli_says_what_to_install(tmp_path):
    blocked = "import sys; sys.modules['psycopg'] = None; from tollway.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", blocked, "keys", "list", "--database-url", "postgresql:///x"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == ("tollway: error: a postgresql:// database needs psycopg and psycopg_pool: "
                           "pip install 'tollway[postgres]'\n")


def test_parse_time():
    assert parse_time("1700000000", "start") == 1700000000.0
    assert parse_time("2026-11-29", "start") == parse_time("2026-11-29T00:00:00+00:00", "start")
    assert parse_time(None, "start") is None
    with pytest.raises(ValueError, match="finite"):
        parse_time("nan", "start")


def test_money_sums_exactly(store_target):
    """Ten requests at 10 cents are a dollar: summed as floats they were 0.9999999999999999."""
    ledger = Ledger(store_target)
    for i in range(10):
        ledger.record(row(f"r{i}", price=0.1, seconds=0.1, price_per_second=1.0))
    [standard] = ledger.usage("tier")
    assert (standard["price"], standard["cost"]) == (1.0, 1.0)
    with ledger.database.connect() as db:
        assert Ledger.spent_nanos(db, "key", "alice", 0, 2000) == NANOS
    # A token at $0.05 per million is 50 nano-dollars: kept, not rounded away.
    ledger.record(row("tiny", tier="batch", price=0.05e-6))
    batch = ledger.usage("tier")[0]
    assert (batch["tier"], batch["price"]) == ("batch", 5e-8)


# The ledger's table as tollway wrote it before money was exact: dollars as floats.
_FLOAT_MONEY_SCHEMA = """
CREATE TABLE requests (id TEXT PRIMARY KEY, created REAL NOT NULL, key TEXT NOT NULL, tier TEXT NOT NULL,
    model TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, queue_seconds REAL, ttft_seconds REAL, e2e_seconds REAL NOT NULL,
    engine_seconds REAL NOT NULL, cost REAL NOT NULL, price REAL NOT NULL, finish_reason TEXT, tags TEXT NOT NULL);
CREATE INDEX requests_created ON requests(created);
CREATE INDEX requests_key ON requests(key, created);
CREATE TABLE request_tags (request_id TEXT NOT NULL REFERENCES requests(id), tag TEXT NOT NULL,
    PRIMARY KEY (request_id, tag));
"""


def test_a_ledger_with_float_money_is_migrated(tmp_path):
    path = tmp_path / "ledger.sqlite"
    old = sqlite3.connect(path)
    old.executescript(_FLOAT_MONEY_SCHEMA)
    old.execute("INSERT INTO requests VALUES ('a', 100, 'alice', 'fast', 'm', 10, 20, 0, 0.01, 0.1, 1.0, 2.0, "
                "0.000694, 0.0123, 'stop', '[\"team=x\"]')")
    old.execute("INSERT INTO request_tags VALUES ('a', 'team=x')")
    old.commit()
    old.close()
    ledger = Ledger(path)
    [a] = ledger.rows()
    assert (a.id, a.cost, a.price, a.tags, a.engine_seconds) == ("a", 0.000694, 0.0123, ["team=x"], 2.0)
    ledger.record(row("b", price=0.01))
    ledger.close()
    reopened = Ledger(path)  # migrated once; opening again changes nothing
    assert [(r.id, r.price) for r in reopened.rows()] == [("a", 0.0123), ("b", 0.01)]
    assert reopened.usage("key")[0]["price"] == 0.0223
    columns = [c[1] for c in sqlite3.connect(path).execute("PRAGMA table_info(requests)")]
    assert "cost" not in columns and "price_nanos" in columns


def test_a_postgres_restart_does_not_fail_requests(postgres):
    """The pooled connections die with the server; the pool checks each before handing it out."""
    ledger = Ledger(postgres.new_database())
    ledger.record(row("a"))
    postgres.restart()
    ledger.record(row("b"))
    assert [r.id for r in ledger.rows()] == ["a", "b"]
