"""Messages from the platform to a node agent, on the node's own Celery queue."""

from __future__ import annotations

from agents.agent.brokerconf import node_queue
from gpushare.celery import app


def node_send(node_name: str, task: str, payload: dict) -> None:
    """Send ``task`` (``agent.launch``, ``agent.stop``...) to ``node_name``'s agent."""
    app.send_task(task, kwargs=payload, queue=node_queue(node_name))
