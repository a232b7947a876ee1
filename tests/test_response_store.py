"""The Responses API's kept responses (response_store.py) on SQLite and PostgreSQL: each seen
by its owner only, deleted once, and gone after 30 days."""
from __future__ import annotations

import sqlite3
import time

from tollway.server import response_store
from tollway.server.response_store import ResponseStore
from tollway.storage.database import as_database


def test_a_kept_response_is_its_owners_only(store_target):
    store = ResponseStore(as_database(store_target))
    body = {"id": "resp_1", "object": "response", "output": []}
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    items = [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
    store.put(body, conversation, items, "alice")
    reopened = ResponseStore(as_database(store_target))  # another server on the same database
    assert reopened.get("resp_1", "alice") == body and reopened.conversation("resp_1", "alice") == conversation
    assert reopened.input_items("resp_1", "alice") == items
    assert reopened.get("resp_1", "bob") is None and reopened.conversation("resp_1", "bob") is None
    assert reopened.input_items("resp_1", "bob") is None
    assert not reopened.delete("resp_1", "bob")
    assert reopened.delete("resp_1", "alice") and not reopened.delete("resp_1", "alice")
    assert store.get("resp_1", "alice") is None


def test_responses_past_their_retention_go(store_target):
    now = [1_000_000.0]
    store = ResponseStore(as_database(store_target), clock=lambda: now[0])
    store.put({"id": "resp_old"}, [], [], "")
    now[0] += response_store.RETENTION_SECONDS + 1
    store.put({"id": "resp_new"}, [], [], "")
    assert store.get("resp_old", "") is None and store.get("resp_new", "") == {"id": "resp_new"}


def test_a_store_made_before_input_items_were_kept_gains_them(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL, "
                   "body TEXT NOT NULL, conversation TEXT NOT NULL)")
        db.execute("INSERT INTO responses VALUES ('resp_1', '', ?, '{}', '[]')", (time.time(),))
    store = ResponseStore(as_database(path))
    assert store.input_items("resp_1", "") == []
    store.put({"id": "resp_2"}, [], [{"id": "msg_1"}], "")
    assert store.input_items("resp_2", "") == [{"id": "msg_1"}]
