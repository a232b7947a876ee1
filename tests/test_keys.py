"""Key checks and per-key rate limits, on a fake clock, counted in memory and in the key store
(SQLite and PostgreSQL), where two servers' gatekeepers share them; the key store in SQLite and
in PostgreSQL, and `tollway keys` on the fleet's database."""
from __future__ import annotations

import threading

import pytest

from tollway.cli import main
from tollway.config import KeySpec
from tollway.server.errors import APIError
from tollway.server.keys import Gatekeeper, KeyDatabase, owner_of


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def test_open_without_keys_and_closed_with_them(store_target):
    database = KeyDatabase(store_target)
    gate = Gatekeeper([], database)
    assert gate.open and gate.authenticate(None) is None
    database.add("a", ["standard"], None, None)
    assert not gate.open
    with pytest.raises(APIError) as e:
        gate.authenticate(None)
    assert e.value.status == 401
    with pytest.raises(APIError):
        gate.authenticate("Basic abc")


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def limits_store(request, tmp_path):
    """Where rate limits are counted: this process's memory (None), or a key store."""
    if request.param == "memory":
        return None
    return KeyDatabase(tmp_path / "keys.sqlite" if request.param == "sqlite"
                       else request.getfixturevalue("postgres").new_database())


def test_requests_per_minute_slide(limits_store):
    clock = Clock()
    gate = Gatekeeper([KeySpec("k", rpm=3)], limits_store, clock=clock)
    key = gate.authenticate("Bearer k")
    remaining = []
    for _ in range(3):
        headers = gate.admit(key, 10)
        remaining.append(headers["x-ratelimit-remaining-requests"])
        clock.now += 10
    assert remaining == ["2", "1", "0"] and headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-reset-requests"] == "40s"  # at t=120 the first (t=100) ages out in 40 s
    assert "x-ratelimit-limit-tokens" not in headers  # tokens are not limited
    with pytest.raises(APIError) as e:
        gate.admit(key, 10)
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "30"  # the first ages out at t=160
    assert e.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.value.headers["x-ratelimit-reset-requests"] == "30s"
    clock.now = 160.0
    gate.admit(key, 10)


def test_tokens_per_minute_count_prompt_and_max_tokens(limits_store):
    clock = Clock()
    gate = Gatekeeper([KeySpec("k", tpm=100)], limits_store, clock=clock)
    key = gate.authenticate("Bearer k")
    assert gate.admit(key, 60)["x-ratelimit-remaining-tokens"] == "40"
    clock.now += 5
    assert gate.admit(key, 30)["x-ratelimit-remaining-tokens"] == "10"
    with pytest.raises(APIError) as e:
        gate.admit(key, 20)  # 110 > 100 until the 60 ages out at t=160
    assert e.value.headers["Retry-After"] == "55"
    with pytest.raises(APIError, match="more than the key's 100 per minute"):
        gate.admit(key, 101)  # could never fit: no point retrying
    clock.now = 160.0
    gate.admit(key, 20)


def test_servers_on_one_store_share_the_limits_under_concurrent_requests(store_target):
    rpm, tpm, each = 25, 1000, 30
    keys = [KeySpec("sk-rpm", rpm=rpm), KeySpec("sk-tpm", tpm=tpm)]
    gates = [Gatekeeper(keys, KeyDatabase(store_target)) for _ in range(2)]  # two servers
    admitted, retry_after, lock = {"sk-rpm": 0, "sk-tpm": 0}, set(), threading.Lock()

    def hammer(worker: int) -> None:
        for i in range(each):
            key = keys[(worker + i) % 2]
            try:
                gates[i % 2].admit(key, 40)
            except APIError as e:
                assert e.status == 429
                with lock:
                    retry_after.add(e.headers["Retry-After"])
                continue
            with lock:
                admitted[key.key] += 1

    threads = [threading.Thread(target=hammer, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert admitted == {"sk-rpm": rpm, "sk-tpm": tpm // 40}
    assert retry_after and all(60 >= int(s) >= 50 for s in retry_after)  # the first admissions age out


def test_old_admissions_leave_no_rows(store_target):
    clock = Clock()
    store = KeyDatabase(store_target)
    gate = Gatekeeper([KeySpec("quiet", rpm=5), KeySpec("busy", rpm=5)], store, clock=clock)
    for name in ("quiet", "busy", "busy"):
        gate.admit(gate.authenticate(f"Bearer {name}"), 1)
    clock.now += 61
    gate.admit(gate.authenticate("Bearer busy"), 1)  # sweeps the quiet key; drops busy's own old ones
    rows = store.database.query("SELECT COUNT(*), COUNT(DISTINCT sha256) FROM rate_admissions")[0]
    assert rows == (1, 1) and store.database.query("SELECT COUNT(*) FROM rate_keys")[0][0] == 1


def test_entitlements():
    std = KeySpec("k", tiers=["standard"])
    assert Gatekeeper.entitled_tier(std, "standard", None) == "standard"
    assert Gatekeeper.entitled_tier(std, "standard", "auto") == "standard"
    assert Gatekeeper.entitled_tier(KeySpec("b", tiers=["batch", "standard"]), "standard", "auto") == "standard"
    with pytest.raises(APIError) as e:
        Gatekeeper.entitled_tier(std, "fast", "priority")
    assert e.value.status == 403 and "may use: standard" in e.value.message
    assert Gatekeeper.entitled_tier(None, "fast", "priority") == "fast"  # open server


def test_database_keys_round_trip(store_target):
    database = KeyDatabase(store_target)
    key = database.add("alice", ["fast", "standard"], rpm=5, tpm=None)
    found = KeyDatabase(store_target).lookup(key)  # another server's (or a restarted one's) view
    assert (found.name, found.tiers, found.rpm, found.tpm) == ("alice", ["fast", "standard"], 5, None)
    assert database.lookup(key + "x") is None
    assert [k["name"] for k in database.list()] == ["alice"]
    with pytest.raises(ValueError, match="tiers"):
        database.add("bob", ["gold"], None, None)
    assert database.revoke("alice") == 1 and database.lookup(key) is None


def test_keys_cli_on_the_fleets_database(postgres, capsys):
    url = postgres.new_database()
    assert main(["keys", "add", "--name", "alice", "--tiers", "standard,batch", "--rpm", "60", "--database-url", url]) == 0
    key = capsys.readouterr().out.strip()
    assert main(["keys", "list", "--database-url", url]) == 0
    assert capsys.readouterr().out == "alice\ttiers=standard,batch\trpm=60\ttpm=-\n"
    gate = Gatekeeper([KeySpec("sk-ops", "ops")], KeyDatabase(url))  # a server started on the same database
    assert gate.authenticate(f"Bearer {key}").name == "alice"
    assert main(["keys", "revoke", "--name", "alice", "--database-url", url]) == 0
    with pytest.raises(APIError):
        gate.authenticate(f"Bearer {key}")


def test_a_batch_owner_names_its_key_and_shares_its_window(tmp_path):
    database = KeyDatabase(tmp_path / "keys.sqlite")
    stored = database.add("dan", ["batch"], rpm=1, tpm=None)
    gate = Gatekeeper([KeySpec("sk-cfg", "cfg")], database, clock=Clock())
    dan = gate.authenticate(f"Bearer {stored}")
    assert gate.key_of(owner_of(gate.authenticate("Bearer sk-cfg"))).name == "cfg"
    found = gate.key_of(owner_of(dan))
    assert (found.name, found.rpm, found.key) == ("dan", 1, "")  # the store keeps no secret to give back
    assert gate.key_of("") is None and gate.key_of("0" * 64) is None
    gate.admit(found, 1, owner_of(dan))  # a batch line, as dan
    with pytest.raises(APIError):
        gate.admit(dan, 1)  # dan's own request finds the window spent
