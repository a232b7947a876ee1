"""The Batch API's durable state: uploaded files in a folder, their metadata and every batch and
batch line in SQLite.

Each line's result is committed on its own as it completes (INSERT OR IGNORE on the line's
number), and output files are only assembled from those rows at the end. A server killed at
any point therefore resumes with no lost line and no duplicated one.
"""
from __future__ import annotations

import json
import os
import secrets
import sqlite3
import tempfile
import time
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL, url TEXT NOT NULL,
    body TEXT NOT NULL, PRIMARY KEY (batch_id, line_no));
CREATE TABLE IF NOT EXISTS batch_results (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, ok INTEGER NOT NULL, line TEXT NOT NULL,
    PRIMARY KEY (batch_id, line_no));
"""
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class BatchStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        with self._db() as db:
            db.executescript(_SCHEMA)

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.root / "batches.sqlite", timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        return db

    # ---- files --------------------------------------------------------------------------

    def add_file(self, filename: str, purpose: str, data: bytes) -> dict:
        file_id = new_id("file")
        _write_atomically(self.files_dir / file_id, data)
        created = int(time.time())
        with self._db() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?)", (file_id, filename, purpose, len(data), created))
        return self.file(file_id)

    def file(self, file_id: str) -> dict | None:
        with self._db() as db:
            row = db.execute("SELECT id, filename, purpose, bytes, created_at FROM files WHERE id = ?",
                             (file_id,)).fetchone()
        return _file_object(row) if row else None

    def files(self, purpose: str | None = None) -> list[dict]:
        with self._db() as db:
            rows = db.execute("SELECT id, filename, purpose, bytes, created_at FROM files "
                              "WHERE ?1 IS NULL OR purpose = ?1 ORDER BY created_at, id", (purpose,)).fetchall()
        return [_file_object(r) for r in rows]

    def file_content(self, file_id: str) -> bytes:
        return (self.files_dir / file_id).read_bytes()

    def delete_file(self, file_id: str) -> bool:
        with self._db() as db:
            gone = db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        (self.files_dir / file_id).unlink(missing_ok=True)
        return bool(gone)

    # ---- batches ------------------------------------------------------------------------

    def create_batch(self, batch: dict, lines: list[tuple[str, str, dict]]) -> dict:
        """Store a new batch object and its lines (custom_id, url, body) in one transaction."""
        with self._db() as db:
            db.execute("INSERT INTO batches VALUES (?, ?)", (batch["id"], json.dumps(batch)))
            db.executemany("INSERT INTO batch_lines VALUES (?, ?, ?, ?, ?)",
                           [(batch["id"], i, cid, url, json.dumps(body)) for i, (cid, url, body) in enumerate(lines)])
        return batch

    def batch(self, batch_id: str) -> dict | None:
        with self._db() as db:
            row = db.execute("SELECT body FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            return None
        batch = json.loads(row[0])
        batch["request_counts"] = self._counts(batch_id, batch["request_counts"]["total"])
        return batch

    def batches(self) -> list[dict]:
        with self._db() as db:
            ids = [r[0] for r in db.execute("SELECT id FROM batches ORDER BY json_extract(body, '$.created_at') DESC, "
                                            "id DESC").fetchall()]
        return [self.batch(i) for i in ids]

    def update(self, batch_id: str, **fields) -> dict:
        with self._db() as db:
            batch = json.loads(db.execute("SELECT body FROM batches WHERE id = ?", (batch_id,)).fetchone()[0])
            batch.update(fields)
            db.execute("UPDATE batches SET body = ? WHERE id = ?", (json.dumps(batch), batch_id))
        return self.batch(batch_id)

    def unfinished(self) -> list[str]:
        with self._db() as db:
            rows = db.execute("SELECT id, json_extract(body, '$.status') FROM batches").fetchall()
        return [i for i, status in rows if status in UNFINISHED]

    def pending_lines(self, batch_id: str) -> list[tuple[int, str, str, dict]]:
        """Lines with no committed result yet: (line_no, custom_id, url, body)."""
        with self._db() as db:
            rows = db.execute("SELECT l.line_no, l.custom_id, l.url, l.body FROM batch_lines l LEFT JOIN batch_results r "
                              "ON r.batch_id = l.batch_id AND r.line_no = l.line_no "
                              "WHERE l.batch_id = ? AND r.line_no IS NULL ORDER BY l.line_no", (batch_id,)).fetchall()
        return [(n, cid, url, json.loads(body)) for n, cid, url, body in rows]

    def record(self, batch_id: str, line_no: int, ok: bool, line: dict) -> None:
        """A line's result, committed now; a second result for the same line is ignored."""
        with self._db() as db:
            db.execute("INSERT OR IGNORE INTO batch_results VALUES (?, ?, ?, ?)",
                       (batch_id, line_no, int(ok), json.dumps(line, separators=(",", ":"))))

    def _counts(self, batch_id: str, total: int) -> dict:
        with self._db() as db:
            done, failed = db.execute("SELECT COUNT(*), COALESCE(SUM(1 - ok), 0) FROM batch_results WHERE batch_id = ?",
                                      (batch_id,)).fetchone()
        return {"total": total, "completed": done - failed, "failed": failed}

    def write_results(self, batch_id: str) -> tuple[str | None, str | None]:
        """The output and error files, from the committed results in line order. Returns their
        ids (None where there is nothing to put in one)."""
        with self._db() as db:
            rows = db.execute("SELECT ok, line FROM batch_results WHERE batch_id = ? ORDER BY line_no",
                              (batch_id,)).fetchall()
        out = [line for ok, line in rows if ok]
        err = [line for ok, line in rows if not ok]
        output = self.add_file(f"{batch_id}_output.jsonl", "batch_output", _jsonl(out))["id"] if out else None
        error = self.add_file(f"{batch_id}_error.jsonl", "batch_output", _jsonl(err))["id"] if err else None
        return output, error


def _jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def _file_object(row) -> dict:
    file_id, filename, purpose, size, created = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created, "filename": filename,
            "purpose": purpose, "status": "processed"}


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
