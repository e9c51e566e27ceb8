"""Check that PostgreSQL and Redis answer before the tests run.

Defaults: PostgreSQL at 127.0.0.1:5432 as user postgres, Redis at
127.0.0.1:6379 (DATABASE_URL / REDIS_URL override). When one does not answer
and `docker compose` works, start it from deploy/compose/test-services.yml; otherwise say
exactly what to start and exit non-zero.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

TEST_SERVICES = Path(__file__).resolve().parent.parent / "deploy" / "compose" / "test-services.yml"
DATABASE_URL = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpushare")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")


def postgres_ok() -> str | None:
    import psycopg2

    url = urlparse(DATABASE_URL)
    try:
        psycopg2.connect(
            host=url.hostname or "127.0.0.1",
            port=url.port or 5432,
            user=url.username or "postgres",
            password=url.password or None,
            dbname="postgres",
            connect_timeout=3,
        ).close()
    except psycopg2.Error as exc:
        return str(exc).strip()
    return None


def redis_ok() -> str | None:
    url = urlparse(REDIS_URL)
    try:
        with socket.create_connection((url.hostname or "127.0.0.1", url.port or 6379), timeout=3) as conn:
            if url.password:
                conn.sendall(f"AUTH {url.password}\r\n".encode())
                conn.recv(64)
            conn.sendall(b"PING\r\n")
            reply = conn.recv(64)
    except OSError as exc:
        return str(exc)
    return None if reply.startswith(b"+PONG") else f"unexpected reply {reply!r}"


def compose_command() -> list[str] | None:
    """`docker compose` (v2) or `docker-compose` (v1), when one is installed and an engine answers."""
    candidates = [["docker", "compose"]] if shutil.which("docker") else []
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    for command in candidates:
        if subprocess.run([*command, "version"], capture_output=True).returncode != 0:
            continue
        if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
            return None  # a client without an engine cannot start anything
        return command
    return None


def compose_up() -> bool:
    command = compose_command()
    if command is None:
        return False
    print(f"starting postgres and redis with {' '.join(command)} ...")
    return subprocess.run([*command, "-f", str(TEST_SERVICES), "up", "-d", "postgres", "redis"]).returncode == 0


def main() -> int:
    problems = {"PostgreSQL": postgres_ok(), "Redis": redis_ok()}
    if any(problems.values()) and compose_up():
        for _ in range(30):
            problems = {"PostgreSQL": postgres_ok(), "Redis": redis_ok()}
            if not any(problems.values()):
                break
            time.sleep(1)
    if any(problems.values()):
        for name, problem in problems.items():
            if problem:
                print(f"{name} does not answer: {problem}", file=sys.stderr)
        print(
            "\nThe tests need PostgreSQL (DATABASE_URL, default postgres://postgres@127.0.0.1:5432) and Redis\n"
            "(REDIS_URL, default redis://127.0.0.1:6379/0). Start them, e.g.:\n"
            "  docker compose -f deploy/compose/test-services.yml up -d\n"
            "or on Debian/Ubuntu:\n"
            "  pg_ctlcluster 15 main start   # PostgreSQL, trust auth for user postgres on 127.0.0.1\n"
            "  redis-server --daemonize yes --bind 127.0.0.1 --port 6379",
            file=sys.stderr,
        )
        return 1
    print("PostgreSQL and Redis answer.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
