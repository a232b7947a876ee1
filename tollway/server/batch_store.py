"""The Batch API's durable state: uploaded files, and every batch and batch line, in a SQLite
file (the default) or the fleet's PostgreSQL database (tollway/storage). Each file and batch
belongs to the API key that made it (its owner: keys.owner_of), and is seen only by that key.

Each line's result is committed on its own as it completes (ignored if the line already has
one), and output files are only assembled from those rows at the end. A server killed at any
point therefore resumes with no lost line and no duplicated one.
"""
from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

from tollway.storage.database import Database, as_database, is_database_url

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS file_contents (
    id TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL, url TEXT NOT NULL,
    body TEXT NOT NULL, PRIMARY KEY (batch_id, line_no));
CREATE TABLE IF NOT EXISTS batch_results (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, ok INTEGER NOT NULL, line TEXT NOT NULL,
    PRIMARY KEY (batch_id, line_no));
CREATE TABLE IF NOT EXISTS owners (  -- a table of its own: stores made before owners need no migration
    id TEXT PRIMARY KEY, owner TEXT NOT NULL);  -- a file's or batch's id; no row: the open server's ("")
CREATE TABLE IF NOT EXISTS batch_claims (  -- which server runs a job, while it keeps renewing
    batch_id TEXT PRIMARY KEY, owner TEXT NOT NULL, expires REAL NOT NULL);
"""
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class BatchStore:
    def __init__(self, target: Database | str | Path):
        """`target`: a Database, a postgresql:// URL, or a folder to keep a SQLite file in."""
        folder = None if isinstance(target, Database) or is_database_url(target) else Path(target)
        self.database = as_database(folder / "batches.sqlite" if folder else target)
        self.database.create_schema(_SCHEMA)
        if folder is not None:
            self._adopt_files(folder / "files")

    # ---- files --------------------------------------------------------------------------

    def add_file(self, filename: str, purpose: str, data: bytes, owner: str = "") -> dict:
        """`owner`: keys.owner_of the key uploading it ("": the open server's)."""
        file_id = new_id("file")
        with self.database.transaction() as db:
            db.execute("INSERT INTO file_contents VALUES (?, ?)", (file_id, data))
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?)", (file_id, filename, purpose, len(data), int(time.time())))
            db.execute("INSERT INTO owners VALUES (?, ?)", (file_id, owner))
        return self.file(file_id, owner)

    def file(self, file_id: str, owner: str) -> dict | None:
        """The file, if `owner` has one of that id."""
        rows = self.database.query(f"{_FILES} WHERE f.id = ? AND {_OWNED}", (file_id, owner))
        return _file_object(rows[0]) if rows else None

    def files(self, owner: str, purpose: str | None, after: dict | None, limit: int, newest_first: bool) -> list[dict]:
        """A page of `owner`'s files: up to `limit` past the file `after`, by creation time."""
        where, args = [_OWNED], [owner]
        if purpose is not None:
            where.append("f.purpose = ?")
            args.append(purpose)
        if after is not None:  # keyset paging on (created_at, id): stable while files come and go
            past = "<" if newest_first else ">"
            where.append(f"(f.created_at {past} ? OR (f.created_at = ? AND f.id {past} ?))")
            args += [after["created_at"], after["created_at"], after["id"]]
        order = "DESC" if newest_first else "ASC"
        rows = self.database.query(f"{_FILES} WHERE {' AND '.join(where)} ORDER BY f.created_at {order}, f.id {order} "
                                   "LIMIT ?", (*args, limit))
        return [_file_object(r) for r in rows]

    def file_content(self, file_id: str) -> bytes:
        return bytes(self.database.query("SELECT data FROM file_contents WHERE id = ?", (file_id,))[0][0])

    def delete_file(self, file_id: str) -> bool:
        with self.database.transaction() as db:
            db.execute("DELETE FROM file_contents WHERE id = ?", (file_id,))
            db.execute("DELETE FROM owners WHERE id = ?", (file_id,))
            return bool(db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount)

    def _adopt_files(self, folder: Path) -> None:
        """Move uploads that earlier versions kept as files in `folder` into the database."""
        if not folder.is_dir():
            return
        for path in folder.iterdir():
            if not path.name.startswith("."):  # dot files: writes a crash interrupted, never listed
                self.database.run("INSERT INTO file_contents VALUES (?, ?) ON CONFLICT DO NOTHING",
                                  (path.name, path.read_bytes()))
            path.unlink()
        folder.rmdir()

    # ---- batches ------------------------------------------------------------------------

    def create_batch(self, batch: dict, lines: list[tuple[str, str, dict]], owner: str = "") -> dict:
        """Store a new batch object and its lines (custom_id, url, body) in one transaction."""
        with self.database.transaction() as db:
            db.execute("INSERT INTO batches VALUES (?, ?)", (batch["id"], json.dumps(batch)))
            db.execute("INSERT INTO owners VALUES (?, ?)", (batch["id"], owner))
            db.executemany("INSERT INTO batch_lines VALUES (?, ?, ?, ?, ?)",
                           [(batch["id"], i, cid, url, json.dumps(body)) for i, (cid, url, body) in enumerate(lines)])
        return batch

    def batch(self, batch_id: str, owner: str | None = None) -> dict | None:
        """The batch; with `owner`, only if it is theirs."""
        rows = self.database.query(f"SELECT body FROM batches f WHERE f.id = ?"
                                   f"{'' if owner is None else f' AND {_OWNED}'}",
                                   (batch_id,) if owner is None else (batch_id, owner))
        if not rows:
            return None
        batch = json.loads(rows[0][0])
        batch["request_counts"] = self._counts(batch_id, batch["request_counts"]["total"])
        return batch

    def batches(self, owner: str = "") -> list[dict]:
        """`owner`'s, newest first."""
        bodies = [json.loads(body) for (body,) in self.database.query(f"SELECT body FROM batches f WHERE {_OWNED}",
                                                                       (owner,))]
        bodies.sort(key=lambda b: (b["created_at"], b["id"]), reverse=True)
        return [self.batch(b["id"]) for b in bodies]

    def owner(self, object_id: str) -> str:
        """Who made a file or batch: the key whose lines a batch runs as."""
        rows = self.database.query("SELECT owner FROM owners WHERE id = ?", (object_id,))
        return rows[0][0] if rows else ""

    def update(self, batch_id: str, **fields) -> dict:
        with self.database.transaction() as db:
            body = db.execute(f"SELECT body FROM batches WHERE id = ?{db.for_update}", (batch_id,)).fetchone()[0]
            batch = json.loads(body)
            batch.update(fields)
            db.execute("UPDATE batches SET body = ? WHERE id = ?", (json.dumps(batch), batch_id))
        return self.batch(batch_id)

    def unfinished(self) -> dict[str, str]:
        """The status of every job not yet done, by id."""
        statuses = {i: json.loads(body)["status"] for i, body in self.database.query("SELECT id, body FROM batches")}
        return {i: status for i, status in statuses.items() if status in UNFINISHED}

    def claim(self, batch_id: str, owner: str, now: float, lease: float) -> bool:
        """Take the job for `owner` (or keep it) for `lease` seconds from `now`; False while
        another owner's claim is live."""
        return self.database.run(
            "INSERT INTO batch_claims VALUES (?, ?, ?) ON CONFLICT (batch_id) DO UPDATE SET owner = excluded.owner, "
            "expires = excluded.expires WHERE batch_claims.owner = excluded.owner OR batch_claims.expires <= ?",
            (batch_id, owner, now + lease, now)) == 1

    def claimant(self, batch_id: str) -> str | None:
        """The owner of the job's claim, live or lapsed; None when none was made."""
        rows = self.database.query("SELECT owner FROM batch_claims WHERE batch_id = ?", (batch_id,))
        return rows[0][0] if rows else None

    def release(self, batch_id: str, owner: str) -> None:
        """Drop the job's claim if `owner` still holds it."""
        self.database.run("DELETE FROM batch_claims WHERE batch_id = ? AND owner = ?", (batch_id, owner))

    def unclaim(self, owner: str) -> None:
        self.database.run("DELETE FROM batch_claims WHERE owner = ?", (owner,))

    def pending_lines(self, batch_id: str) -> list[tuple[int, str, str, dict]]:
        """Lines with no committed result yet: (line_no, custom_id, url, body)."""
        rows = self.database.query(
            "SELECT l.line_no, l.custom_id, l.url, l.body FROM batch_lines l LEFT JOIN batch_results r "
            "ON r.batch_id = l.batch_id AND r.line_no = l.line_no "
            "WHERE l.batch_id = ? AND r.line_no IS NULL ORDER BY l.line_no", (batch_id,))
        return [(n, cid, url, json.loads(body)) for n, cid, url, body in rows]

    def record(self, batch_id: str, line_no: int, ok: bool, line: dict) -> None:
        """A line's result, committed now; a second result for the same line is ignored."""
        self.database.run("INSERT INTO batch_results VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                          (batch_id, line_no, int(ok), json.dumps(line, separators=(",", ":"))))

    def _counts(self, batch_id: str, total: int) -> dict:
        done, failed = self.database.query("SELECT COUNT(*), COALESCE(SUM(1 - ok), 0) FROM batch_results "
                                           "WHERE batch_id = ?", (batch_id,))[0]
        return {"total": total, "completed": done - failed, "failed": failed}

    def write_results(self, batch_id: str) -> tuple[str | None, str | None]:
        """The output and error files, from the committed results in line order. Returns their
        ids (None where there is nothing to put in one)."""
        rows = self.database.query("SELECT ok, line FROM batch_results WHERE batch_id = ? ORDER BY line_no",
                                   (batch_id,))
        out = [line for ok, line in rows if ok]
        err = [line for ok, line in rows if not ok]
        owner = self.owner(batch_id)
        output = self.add_file(f"{batch_id}_output.jsonl", "batch_output", _jsonl(out), owner)["id"] if out else None
        error = self.add_file(f"{batch_id}_error.jsonl", "batch_output", _jsonl(err), owner)["id"] if err else None
        return output, error


# A file's columns, and the condition that the object aliased f belongs to the owner given.
_FILES = "SELECT f.id, f.filename, f.purpose, f.bytes, f.created_at FROM files f"
_OWNED = "COALESCE((SELECT o.owner FROM owners o WHERE o.id = f.id), '') = ?"


def _jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def _file_object(row) -> dict:
    file_id, filename, purpose, size, created = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created, "filename": filename,
            "purpose": purpose, "status": "processed"}

