"""``Client``: the REST API v1 from Python, safe to retry (docs/sdk.md).

HTTP goes over kept-alive ``http.client`` connections (``transport.py``;
urllib3's pool manager cost ~150-200 µs of CPU more per call, requests on top of
it ~0.4 ms more), or through urllib3's ``ProxyManager`` when the environment
names a proxy. Transient failures (connection refused or reset, an answer
lost on the way back, 5xx, and 429/503 with ``Retry-After``, which is
honoured) are retried with exponential backoff by urllib3's ``Retry``, either way. Retrying a POST is safe:
``submit`` always sends an Idempotency-Key (the platform returns the job the
first attempt created), cancel is idempotent, an endpoint's PATCH and scale set
values (the same again changes nothing), a retried endpoint create answers 409
and a retried DELETE 404. Refusals raise the typed errors of ``errors.py``.
"""

from __future__ import annotations

import json as jsonlib
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3
from urllib3.util.retry import Retry

from . import __version__
from .config import Config, config_load
from .errors import ApiError, Unreachable, WaitTimeout, error_for
from .models import (
    Endpoint,
    Finished,
    Job,
    LogPage,
    LogText,
    Outage,
    Recovered,
    StateChanged,
    Submission,
    Usage,
    UsageRow,
    WatchEvent,
)
from .transport import Direct

API = "/api/v1/"
TIMEOUT = (10.0, 60.0)  # connect, read (seconds)
PREEMPTED_PATIENCE_S = 120.0  # a preempted job not requeued within this is given up on
LOG_PATIENCE_S = 60.0  # after the job ended, how long to wait for the rest of its log
JOB_FIELDS = (
    "name",
    "kind",
    "gpus",
    "command",
    "image",
    "env",
    "gpu_model",
    "gpu_memory_mb",
    "priority",
    "max_runtime_seconds",
    "array",
)


def retry_policy(retries: int = 6, backoff: float = 0.5) -> Retry:
    return Retry(
        total=retries,
        connect=retries,
        read=retries,
        status=retries,
        other=retries,
        backoff_factor=backoff,
        backoff_max=30,
        status_forcelist=(429, 500, 502, 503, 504),
        allowed_methods=None,  # every method: see the module doc
        respect_retry_after_header=True,  # 429 and 503
        raise_on_status=False,
    )


def pool_manager(url: str, **kwargs: Any) -> urllib3.PoolManager:
    """urllib3's pools for ``url``'s scheme, through the proxy the environment names for it
    (``HTTPS_PROXY`` / ``HTTP_PROXY``, not for a host in ``NO_PROXY``), as curl and requests do."""
    parts = urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
        return urllib3.ProxyManager(proxy, **kwargs)
    return urllib3.PoolManager(**kwargs)


def array_body(array: int | str | Mapping[str, Any]) -> dict[str, Any]:
    """``10`` (ten tasks), ``"1-1000"`` / ``"1-99:2"`` (task indexes, Slurm's grammar) or the API's mapping."""
    if isinstance(array, Mapping):
        return dict(array)
    if isinstance(array, bool):
        raise ValueError("array is a task count or an index range such as 1-1000")
    if isinstance(array, int):
        return {"count": array}
    text = str(array).strip()
    if text.isdigit():
        return {"count": int(text)}
    return {"range": text}


class Client:
    """A tenant's view of the platform, authenticated by an API token.

    ``Client()`` reads ``GPUSHARE_URL`` / ``GPUSHARE_TOKEN`` (or the config file,
    see ``config.py``); pass ``url`` and ``token`` to choose. ``retries`` is how
    many times a transient failure is retried before it raises.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        retries: int = 6,
        backoff: float = 0.5,
        timeout: tuple[float, float] = TIMEOUT,
        user_agent: str = f"gpushare-client/{__version__}",
    ):
        config = config_load(url=url, token=token)
        self.config: Config = config
        self.base = config.url + API
        self.timeout = urllib3.Timeout(connect=timeout[0], read=timeout[1])
        self.headers = {
            "Authorization": f"Bearer {config.token}",
            "Accept": "application/json",
            "User-Agent": user_agent,
        }
        policy = retry_policy(retries, backoff)
        self.http = pool_manager(self.base, retries=policy, timeout=self.timeout)
        # Direct calls skip urllib3's pools (transport.py); through a proxy they go through ProxyManager.
        self.direct = None if isinstance(self.http, urllib3.ProxyManager) else Direct(retries=policy, timeout=timeout)

    def close(self) -> None:
        self.http.clear()
        if self.direct is not None:
            self.direct.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- HTTP ------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, Any]:
        """One call (retried as the module doc says): (HTTP status, decoded JSON body).
        ``path`` is relative to /api/v1/, or a full URL (a page's ``next``)."""
        url = path if path.startswith(("http://", "https://")) else self.base + path
        query = {k: v for k, v in (params or {}).items() if v is not None}
        if query:
            url += ("&" if "?" in url else "?") + urlencode(query, doseq=True)
        sent = {**self.headers, **(headers or {})}
        data = None
        if json is not None:
            data = jsonlib.dumps(json).encode()
            sent["Content-Type"] = "application/json"
        try:
            if self.direct is not None:
                response = self.direct.request(method, url, body=data, headers=sent)
            else:
                response = self.http.request(method, url, body=data, headers=sent)
        except urllib3.exceptions.HTTPError as exc:
            raise Unreachable(f"cannot reach {self.base}: {exc}") from exc
        try:
            body = jsonlib.loads(response.data) if response.data else {}
        except ValueError:
            body = {}
        if response.status >= 400:
            error = body.get("error", {}) if isinstance(body, dict) else {}
            code = error.get("code") or ""
            retry_after = response.headers.get("Retry-After")
            text = response.data[:200].decode(errors="replace")
            raise error_for(response.status, code)(
                error.get("message") or f"HTTP {response.status}: {text}",
                status=response.status,
                code=code,
                fields=error.get("fields") or {},
                retry_after=float(retry_after) if retry_after and retry_after.isdigit() else None,
            )
        return response.status, body

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params)[1]

    def pages(self, path: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Every item of a paginated list, following each page's ``next`` link (page numbers
        or cursors alike: the link is the platform's to build)."""
        body = self.get(path, **params)
        while True:
            yield from body.get("results", [])
            if not body.get("next"):
                return
            body = self.get(body["next"])

    # --- jobs --------------------------------------------------------------------------

    def submit(
        self,
        command: Sequence[str] | str | None = None,
        *,
        gpus: float | None = None,
        kind: str | None = None,
        name: str | None = None,
        image: str | None = None,
        env: Mapping[str, str] | None = None,
        gpu_model: str | None = None,
        gpu_memory_mb: int | None = None,
        priority: str | None = None,
        max_runtime_seconds: int | None = None,
        array: int | str | Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        body: Mapping[str, Any] | None = None,
    ) -> Submission:
        """Submit a job (or a job array); see docs/api.md for each field.

        ``command`` is a list of arguments, or one string run by ``/bin/sh -c``; ``gpus``
        defaults to 1.
        ``kind`` defaults to ``inference`` for a slice (0.125, 0.25, 0.5) and
        ``training`` for whole GPUs. ``array`` makes it a job array: a task count
        (``10``) or an index range (``"1-1000"``). ``body`` gives the fields as the
        API's mapping instead (the keyword arguments win over it).

        ``idempotency_key``: the same key within 24 h returns the jobs it created
        (``Submission.created`` is False) instead of submitting again; derive it
        from your CI run to make a re-run safe. Without one, a fresh key is sent,
        which still makes the client's own retries safe.
        """
        fields: dict[str, Any] = dict(body or {})
        given = {
            "command": command,
            "name": name,
            "image": image,
            "env": dict(env) if env is not None else None,
            "gpu_model": gpu_model,
            "gpu_memory_mb": gpu_memory_mb,
            "priority": priority,
            "max_runtime_seconds": max_runtime_seconds,
            "kind": kind,
        }
        fields.update({k: v for k, v in given.items() if v is not None})
        if gpus is not None:
            fields["gpus"] = gpus
        fields.setdefault("gpus", 1)
        if isinstance(fields.get("command"), str):
            fields["command"] = ["/bin/sh", "-c", fields["command"]]
        if array is not None:
            fields["array"] = array_body(array)
        if "kind" not in fields:
            whole = float(fields["gpus"]).is_integer()
            fields["kind"] = "training" if whole else "inference"
        key = idempotency_key or f"sdk-{uuid.uuid4()}"
        status, answer = self.request("POST", "jobs/", json=fields, headers={"Idempotency-Key": key})
        return Submission.from_api(answer, created=status == 201)

    def job(self, job_id: int) -> Job:
        return Job.from_api(self.get(f"jobs/{int(job_id)}/"))

    def jobs(
        self,
        *,
        state: str | Sequence[str] | None = None,
        kind: str | None = None,
        name: str | None = None,
        array: int | None = None,
        page_size: int = 100,
        limit: int | None = None,
    ) -> Iterator[Job]:
        """The tenant's jobs, newest first, across pages (``limit`` stops early); ``array``: its tasks."""
        params: dict[str, Any] = {"kind": kind, "name": name, "array": array, "page_size": page_size}
        if state is not None:
            params["state"] = [state] if isinstance(state, str) else list(state)
        for count, item in enumerate(self.pages("jobs/", **params)):
            if limit is not None and count >= limit:
                return
            yield Job.from_api(item)

    def cancel(self, job_id: int) -> Job:
        """Cancel a job: a queued one at once, a running one gracefully. A finished job is left as it is."""
        return Job.from_api(self.request("POST", f"jobs/{int(job_id)}/cancel/")[1])

    def logs(self, job_id: int, *, offset: int = 0) -> LogPage:
        """One read of the job's log from byte ``offset`` (at most 1 MiB)."""
        page = self.get(f"jobs/{int(job_id)}/logs/", offset=offset)
        return LogPage(
            job=page["job"],
            offset=page["offset"],
            next_offset=page["next_offset"],
            data=page["data"],
            complete=bool(page.get("complete")),
        )

    def stream_logs(
        self, job_id: int, *, offset: int = 0, follow: bool = True, poll_interval: float = 2.0
    ) -> Iterator[str]:
        """The job's output as it comes; with ``follow`` until the job has ended and all of it is read."""
        while True:
            page = self.logs(job_id, offset=offset)
            if page.data:
                yield page.data
            moved = page.next_offset != offset
            offset = page.next_offset
            if page.complete or (not follow and not moved):
                return
            if not moved:
                time.sleep(poll_interval)

    def watch(
        self,
        job_id: int,
        *,
        logs: bool = False,
        timeout: float | None = None,
        poll_interval: float = 2.0,
        outage_patience: float = 900.0,
        wake: threading.Event | None = None,
    ) -> Iterator[WatchEvent]:
        """Follow a job until it ends: ``StateChanged`` (first, and on each change of state or queue
        position), ``LogText`` (with ``logs``), ``Outage``/``Recovered`` while the platform is away
        (waited out for ``outage_patience`` seconds; the job runs on regardless), and ``Finished``
        last. Raises ``WaitTimeout`` after ``timeout`` seconds. ``wake.set()`` ends a sleep early."""
        return JobWatch(
            self, job_id, logs=logs, poll_interval=poll_interval, outage_patience=outage_patience, wake=wake
        ).events(timeout=timeout)

    def wait(
        self,
        job_id: int,
        *,
        timeout: float | None = None,
        poll_interval: float = 2.0,
        on_event: Callable[[WatchEvent], None] | None = None,
    ) -> Job:
        """Block until the job ends and return it (``WaitTimeout`` after ``timeout`` seconds)."""
        for event in self.watch(job_id, timeout=timeout, poll_interval=poll_interval):
            if on_event is not None:
                on_event(event)
            if isinstance(event, Finished):
                return event.job
        raise AssertionError("watch ends with Finished")  # pragma: no cover

    # --- endpoints -------------------------------------------------------------------------

    def endpoints(self, *, name: str | None = None) -> list[Endpoint]:
        """The tenant's active endpoints (every page), or the one named ``name`` (exact)."""
        return [Endpoint.from_api(e) for e in self.pages("endpoints/", name=name, page_size=500)]

    def endpoint(self, endpoint_id: int) -> Endpoint:
        return Endpoint.from_api(self.get(f"endpoints/{int(endpoint_id)}/"))

    def endpoint_create(self, body: Mapping[str, Any]) -> Endpoint:
        return Endpoint.from_api(self.request("POST", "endpoints/", json=dict(body))[1])

    def endpoint_update(self, endpoint_id: int, changes: Mapping[str, Any]) -> Endpoint:
        return Endpoint.from_api(self.request("PATCH", f"endpoints/{int(endpoint_id)}/", json=dict(changes))[1])

    def endpoint_scale(self, endpoint_id: int, *, min_replicas: int, max_replicas: int) -> Endpoint:
        body = {"min_replicas": min_replicas, "max_replicas": max_replicas}
        return Endpoint.from_api(self.request("POST", f"endpoints/{int(endpoint_id)}/scale/", json=body)[1])

    def endpoint_delete(self, endpoint_id: int) -> None:
        self.request("DELETE", f"endpoints/{int(endpoint_id)}/")

    # --- usage, quota, estimates -------------------------------------------------------------

    def usage(self, *, start: str | None = None, end: str | None = None, group_by: str | None = None) -> Usage:
        """GPU-seconds and cost between ``start`` and ``end`` (ISO 8601; default: this month so far, UTC),
        optionally per day, job or GPU model."""
        now = datetime.now(UTC).replace(microsecond=0)
        start = start or now.replace(day=1, hour=0, minute=0, second=0).isoformat()
        end = end or (now + timedelta(seconds=1)).isoformat()
        body = self.get("usage/", start=start, end=end, group_by=group_by)
        return Usage(group_by=body.get("group_by"), rows=tuple(UsageRow.from_api(r) for r in body["results"]), raw=body)

    def quota(self) -> dict[str, Any]:
        """Limits, what is held now, headroom and the month's budget (docs/api.md)."""
        return self.get("quota/")

    def estimate(
        self,
        *,
        gpus: float = 1,
        kind: str | None = None,
        max_runtime_seconds: int = 3600,
        priority: str | None = None,
        gpu_model: str | None = None,
    ) -> dict[str, Any]:
        """What a job would cost per GPU model it may land on (and what it would hold against the budget)."""
        kind = kind or ("training" if float(gpus).is_integer() else "inference")
        return self.get(
            "estimate/",
            kind=kind,
            gpus=gpus,
            max_runtime_seconds=max_runtime_seconds,
            priority=priority,
            gpu_model=gpu_model,
        )


class JobWatch:
    """The state of following one job (``Client.watch``); ``events`` may be called again after an
    interruption and carries on from the same log offset and last seen state."""

    def __init__(
        self,
        client: Client,
        job_id: int,
        *,
        logs: bool,
        poll_interval: float,
        outage_patience: float,
        wake: threading.Event | None = None,
        tick: Callable[[], None] | None = None,
    ):
        self.client, self.job_id, self.logs = client, int(job_id), logs
        self.tick = tick  # called before each poll (the CLI's ``run`` sends a cancel from it)
        self.poll_interval, self.outage_patience = poll_interval, outage_patience
        self.wake = wake or threading.Event()
        self.offset = 0
        self.log_complete = not logs
        self.job: Job | None = None
        self.seen: tuple | None = None
        self.preempted_since: float | None = None
        self.finished_since: float | None = None
        self.outage_since: float | None = None

    def _sleep(self) -> None:
        self.wake.wait(self.poll_interval)
        self.wake.clear()

    def _read_logs(self) -> Iterator[LogText]:
        while not self.log_complete:
            page = self.client.logs(self.job_id, offset=self.offset)
            moved = page.next_offset != self.offset
            self.offset = page.next_offset
            self.log_complete = page.complete
            if page.data:
                yield LogText(page.data)
            if not moved:
                return

    def _ended(self, job: Job) -> bool:
        if job.finished:
            return True
        if job.state == "preempted":
            self.preempted_since = self.preempted_since or time.monotonic()
            return time.monotonic() - self.preempted_since > PREEMPTED_PATIENCE_S
        self.preempted_since = None
        return False

    def events(self, *, timeout: float | None = None) -> Iterator[WatchEvent]:
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            if self.tick is not None:
                self.tick()
            try:
                if self.logs:
                    yield from self._read_logs()
                job = self.client.job(self.job_id)
            except ApiError as exc:
                if not exc.transient:
                    raise
                self.outage_since = self.outage_since or time.monotonic()
                if time.monotonic() - self.outage_since > self.outage_patience:
                    raise
                yield Outage(exc)
            else:
                if self.outage_since is not None:
                    self.outage_since = None
                    yield Recovered()
                self.job = job
                now = (job.state, job.queue_position)
                if now != self.seen:
                    self.seen = now
                    yield StateChanged(job)
                if self._ended(job):
                    self.finished_since = self.finished_since or time.monotonic()
                    late = time.monotonic() - self.finished_since > LOG_PATIENCE_S
                    if self.log_complete or job.state == "preempted" or late:
                        yield Finished(job)
                        return
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeout(self.job or self.client.job(self.job_id), timeout or 0)
            self._sleep()
