"""Broker configuration and queue names shared by the platform and the node agent.

Pure Python (no Django import) so that the agent can use it too. The embedded
default is kombu's filesystem transport: no broker server to install. Any URL
kombu understands (``redis://``, ``amqp://``) replaces it.
"""

from __future__ import annotations

from pathlib import Path

# Platform tasks (scheduling passes, invoice close, Stripe sync...): only the platform writes here.
PLATFORM_QUEUE = "platform"
# Node reports: every node writes here, nothing else; a worker runs only report tasks from it
# (gpushare/celery.py's ReportGate). Declared in the protocol, which both sides import.
REPORT_QUEUE = "reports"
# Redis: a message taken by a worker that then dies (kill -9) comes back after
# this long. Every platform task is idempotent and bounded well below it
# (CELERY_TASK_TIME_LIMIT), so a short timeout only speeds up recovery.
VISIBILITY_TIMEOUT_S = 120


def node_queue(node_name: str) -> str:
    """The Celery queue a node agent consumes its commands from."""
    return f"node.{node_name}"


def node_redis_keys(node_name: str) -> dict:
    """A node's own names for kombu's Redis bookkeeping keys (shared by default).

    kombu keeps every consumer's unacknowledged messages in one hash
    (``unacked``); a node's broker user must not read or restore other nodes'
    messages, so each agent keeps its own, which its Redis ACL alone allows
    (``manage.py node_credential``).
    """
    queue = node_queue(node_name)
    return {
        "unacked_key": f"unacked.{queue}",
        "unacked_index_key": f"unacked_index.{queue}",
        "unacked_mutex_key": f"unacked_mutex.{queue}",
    }


def broker_options(url: str, var_dir: Path, *, node: str = "") -> tuple[str, dict]:
    """Return ``(broker_url, broker_transport_options)`` for ``url``.

    ``filesystem://`` keeps its messages under ``var_dir/broker``; every
    process that shares ``var_dir`` shares the broker. ``node``: the options of
    that node's agent (its own kombu bookkeeping keys on Redis).
    """
    if url.startswith("filesystem://"):
        folder = Path(var_dir) / "broker"
        for sub in ("queue", "processed", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        return "filesystem://", {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"),
            "control_folder": str(folder / "control"),
            "store_processed": False,
        }
    if url.startswith(("redis://", "rediss://")):
        options = {"socket_connect_timeout": 2, "socket_timeout": 5, "visibility_timeout": VISIBILITY_TIMEOUT_S}
        return url, {**options, **(node_redis_keys(node) if node else {})}
    return url, {}
