"""Key checks and per-key rate limits, on a fake clock; the key store in SQLite and in PostgreSQL,
and `tollway keys` on the fleet's database."""
from __future__ import annotations

import pytest

from tollway.cli import main
from tollway.config import KeySpec
from tollway.server.errors import APIError
from tollway.server.keys import Gatekeeper, KeyDatabase


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


def test_requests_per_minute_slide():
    clock = Clock()
    gate = Gatekeeper([KeySpec("k", rpm=3)], clock=clock)
    key = gate.authenticate("Bearer k")
    for _ in range(3):
        gate.admit(key, 10)
        clock.now += 10
    with pytest.raises(APIError) as e:
        gate.admit(key, 10)
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "30"  # the first ages out at t=160
    clock.now = 160.0
    gate.admit(key, 10)


def test_tokens_per_minute_count_prompt_and_max_tokens():
    clock = Clock()
    gate = Gatekeeper([KeySpec("k", tpm=100)], clock=clock)
    key = gate.authenticate("Bearer k")
    gate.admit(key, 60)
    clock.now += 5
    gate.admit(key, 30)
    with pytest.raises(APIError) as e:
        gate.admit(key, 20)  # 110 > 100 until the 60 ages out at t=160
    assert e.value.headers["Retry-After"] == "55"
    with pytest.raises(APIError, match="more than the key's 100 per minute"):
        gate.admit(key, 101)  # could never fit: no point retrying
    clock.now = 160.0
    gate.admit(key, 20)


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
