"""Responses kept for previous_response_id, GET and DELETE /v1/responses/{id} and its
input_items: in the ledger's database (a SQLite file, or the fleet's PostgreSQL database), each
with its conversation as chat messages, its input items and the API key that made it
(keys.owner_of), seen by that key only. Kept 30 days, as OpenAI keeps them."""
from __future__ import annotations

import json
import time
from collections.abc import Callable

from tollway.storage.database import Database

RETENTION_SECONDS = 30 * 86400

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,          -- keys.owner_of the key that made it ('' on an open server)
    created REAL NOT NULL,
    body TEXT NOT NULL,           -- the Response object, JSON
    conversation TEXT NOT NULL,   -- the chat messages up to and with its output, JSON
    input_items TEXT NOT NULL     -- its input as the items GET .../input_items lists, JSON
);
CREATE INDEX IF NOT EXISTS responses_created ON responses(created);
"""


class ResponseStore:
    def __init__(self, database: Database, clock: Callable[[], float] = time.time):
        self.database, self.clock = database, clock
        self.database.create_schema(_SCHEMA)
        with self.database.schema_transaction() as db:
            if "input_items" not in db.columns("responses"):  # stores made before input items were kept
                db.execute("ALTER TABLE responses ADD COLUMN input_items TEXT NOT NULL DEFAULT '[]'")

    def put(self, body: dict, conversation: list[dict], input_items: list[dict], owner: str) -> None:
        """Keep a finished response; those past their 30 days go in the same transaction."""
        now = self.clock()
        with self.database.transaction() as db:
            db.execute("DELETE FROM responses WHERE created < ?", (now - RETENTION_SECONDS,))
            db.execute("INSERT INTO responses (id, owner, created, body, conversation, input_items) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (body["id"], owner, now, json.dumps(body),
                                                     json.dumps(conversation), json.dumps(input_items)))

    def get(self, response_id: str, owner: str) -> dict | None:
        """The Response object, if `owner` has one of that id."""
        return self._read("body", response_id, owner)

    def conversation(self, response_id: str, owner: str) -> list[dict] | None:
        """The chat messages a response continuing `response_id` follows, if `owner` has it."""
        return self._read("conversation", response_id, owner)

    def input_items(self, response_id: str, owner: str) -> list[dict] | None:
        """The response's input items, if `owner` has it."""
        return self._read("input_items", response_id, owner)

    def _read(self, column: str, response_id: str, owner: str):
        rows = self.database.query(f"SELECT {column} FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return json.loads(rows[0][0]) if rows else None

    def delete(self, response_id: str, owner: str) -> bool:
        return bool(self.database.run("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)))
