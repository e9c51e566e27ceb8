"""The agent's local state: an outbox of reports for the platform, the jobs it
runs, and the command nonces it has seen, in one SQLite file.

Every report (usage windows, state changes, job exits, log chunks, health
events) is written here first, under its sequence number (the row id), and
deleted only when the platform acknowledges that sequence number
(``agent.ack``, sent after the report is stored): the broker taking a message
is not enough, as a worker can die holding it. A report sent but not
acknowledged is sent again after ``resend_after_s``; the platform ingests
idempotently, so a report stored twice counts once. The node's credential is
never written here: it is added when a report is sent.

Nonces of executed commands are kept until the command expires, so a replayed
command is refused even after the agent restarts.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
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
CREATE TABLE IF NOT EXISTS nonces (
    nonce TEXT PRIMARY KEY,
    expires_ms INTEGER NOT NULL
);
"""

# Secrets an older agent stored in its outbox rows: dropped when read (added at send time now).
_NEVER_STORED = ("token", "node")


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class Spool:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(outbox)")}
        if "sent_ms" not in columns:  # an outbox from before acknowledgements
            self._db.execute("ALTER TABLE outbox ADD COLUMN sent_ms INTEGER")
        self._scrub_old_rows()
        self._lock = threading.Lock()

    def _scrub_old_rows(self) -> None:
        """Remove the node token an older agent wrote into its outbox rows."""
        rows = self._db.execute("SELECT id, kwargs FROM outbox WHERE kwargs LIKE '%\"token\"%'").fetchall()
        for row_id, kwargs in rows:
            data = {k: v for k, v in json.loads(kwargs).items() if k not in _NEVER_STORED}
            self._db.execute("UPDATE outbox SET kwargs = ? WHERE id = ?", (json.dumps(data), row_id))

    # --- the outbox ---------------------------------------------------------

    def put(self, task: str, kwargs: dict) -> int:
        """Store a report's body; returns its sequence number."""
        data = {k: v for k, v in kwargs.items() if k not in _NEVER_STORED}
        with self._lock:
            cursor = self._db.execute("INSERT INTO outbox (task, kwargs) VALUES (?, ?)", (task, json.dumps(data)))
            return cursor.lastrowid

    def due(self, limit: int = 200, *, resend_after_s: float = 30.0, now_ms: int | None = None):
        """Reports to send now, in order: never sent, or sent over ``resend_after_s`` ago and not acknowledged."""
        cutoff = (now_ms or _now_ms()) - int(resend_after_s * 1000)
        with self._lock:
            rows = self._db.execute(
                "SELECT id, task, kwargs, sent_ms FROM outbox WHERE sent_ms IS NULL OR sent_ms < ? ORDER BY id LIMIT ?",
                (cutoff, limit),
            ).fetchall()
        return [(row_id, task, json.loads(kwargs), sent) for row_id, task, kwargs, sent in rows]

    def peek(self, limit: int = 200) -> list[tuple[int, str, dict]]:
        """Every report not yet acknowledged, in order (sent or not)."""
        with self._lock:
            rows = self._db.execute("SELECT id, task, kwargs FROM outbox ORDER BY id LIMIT ?", (limit,)).fetchall()
        return [(row_id, task, json.loads(kwargs)) for row_id, task, kwargs in rows]

    def mark_sent(self, ids: list[int], *, now_ms: int | None = None) -> None:
        if not ids:
            return
        at = now_ms or _now_ms()
        with self._lock:
            self._db.executemany("UPDATE outbox SET sent_ms = ? WHERE id = ?", [(at, i) for i in ids])

    def remove(self, ids: list[int]) -> int:
        """Drop acknowledged reports; returns how many were still here."""
        if not ids:
            return 0
        with self._lock:
            before = self._db.total_changes
            self._db.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in ids])
            return self._db.total_changes - before

    ack = remove

    def pending(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]

    def unsent(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM outbox WHERE sent_ms IS NULL").fetchone()[0]

    # --- command nonces -------------------------------------------------------

    def nonce_seen(self, nonce: str, expires_ms: int) -> bool:
        """Record ``nonce`` until ``expires_ms``; True if it was already recorded (a replay)."""
        now = _now_ms()
        with self._lock:
            self._db.execute("DELETE FROM nonces WHERE expires_ms < ?", (now,))
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO nonces (nonce, expires_ms) VALUES (?, ?)", (nonce, expires_ms)
            )
            return cursor.rowcount == 0

    # --- jobs -----------------------------------------------------------------

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
