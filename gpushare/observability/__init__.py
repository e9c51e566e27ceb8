"""Running gpushare in production: metrics, health, structured logs.

| module | what |
|---|---|
| ``context`` | the log context (request id, tenant, job, node) carried in contextvars; Django-free |
| ``logs`` | the ``LOGGING`` dict: JSON lines (python-json-logger) or human lines, quiet periodic tasks |
| ``metrics`` | the platform's Prometheus series (Celery tasks, scheduling passes, ingest lag, queue depth) |
| ``health`` | liveness/readiness checks (database, broker, cache) and the web's ops endpoints |
| ``heartbeat`` | the worker's and beat's heartbeat file, read by their readiness probe; Django-free |
| ``celery`` | what the Celery worker and beat run beside their work: heartbeat, metrics/health server |
| ``probe`` | ``python -m gpushare.observability.probe worker|beat``: the exec readiness probe |

The node agent has its own, Django-free, counterpart: ``agents/agent/metrics.py``
and ``agents/agent/opsserver.py``; the endpoint gateway ``endpoints/gateway_metrics.py``.
"""
