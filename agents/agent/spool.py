"""The agent's local state: an outbox of messages for the platform and the
jobs it runs, in one SQLite file.

Every report (usage windows, state changes, log chunks) is written here first
and deleted only after the broker accepted it, so a broker or platform outage
loses nothing; on reconnect the outbox drains in order. The platform ingests
idempotently, so a message sent twice (accepted, then the agent crashed
before deleting it) is harmless.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task TEXT NOT NULL,
    kwargs TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    job_id INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    pgid INTEGER NOT NULL,
    started_ms INTEGER NOT NULL,
    PRIMARY KEY (job_id, attempt)
);
"""


class Spool:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def put(self, task: str, kwargs: dict) -> None:
        with self._lock:
            self._db.execute("INSERT INTO outbox (task, kwargs) VALUES (?, ?)", (task, json.dumps(kwargs)))

    def peek(self, limit: int = 200) -> list[tuple[int, str, dict]]:
        with self._lock:
            rows = self._db.execute("SELECT id, task, kwargs FROM outbox ORDER BY id LIMIT ?", (limit,)).fetchall()
        return [(row_id, task, json.loads(kwargs)) for row_id, task, kwargs in rows]

    def remove(self, ids: list[int]) -> None:
        if not ids:
            return
        with self._lock:
            self._db.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in ids])

    def pending(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]

    def job_record(self, *, job_id: int, attempt: int, pgid: int, started_ms: int) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO jobs (job_id, attempt, pgid, started_ms) VALUES (?, ?, ?, ?)",
                (job_id, attempt, pgid, started_ms),
            )

    def job_forget(self, *, job_id: int, attempt: int) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE job_id = ? AND attempt = ?", (job_id, attempt))

    def jobs(self) -> list[tuple[int, int, int, int]]:
        with self._lock:
            return self._db.execute("SELECT job_id, attempt, pgid, started_ms FROM jobs").fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()
