"""A small HTTP client for the REST API v1, safe to retry.

Transient failures (connection refused or reset, a response lost on the way
back, 5xx, 429 with Retry-After) are retried with exponential backoff by
urllib3's ``Retry``. Retrying a POST is safe here: job submission carries an
Idempotency-Key (the platform returns the job the first attempt created) and
cancel is idempotent by nature. So are an endpoint's PATCH and scale (the same
values again change nothing); a retried endpoint create answers 409, which
``endpoint deploy`` turns into an update, and a retried DELETE answers 404,
which ``endpoint delete`` takes as done.
"""

from __future__ import annotations

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from .config import Config

API = "/api/v1/"
TIMEOUT = (10, 60)  # connect, read (seconds)


class ApiError(Exception):
    """The platform refused the request (4xx), or it could not be reached after the retries."""

    def __init__(self, message: str, *, status: int | None = None, code: str = "", fields: dict | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.fields = fields or {}

    def __str__(self) -> str:
        text = super().__str__()
        if self.fields:
            text += " (" + "; ".join(f"{k}: {' '.join(map(str, v))}" for k, v in self.fields.items()) + ")"
        return text


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
        allowed_methods=None,  # every method: our POSTs are idempotent (see the module doc)
        respect_retry_after_header=True,
        raise_on_status=False,
    )


class Client:
    def __init__(self, config: Config, *, retries: int = 6, backoff: float = 0.5):
        self.base = config.url + API
        self.session = requests.Session()
        self.session.headers.update(
            {"Authorization": f"Bearer {config.token}", "Accept": "application/json", "User-Agent": "gpushare-cli/1"}
        )
        adapter = HTTPAdapter(max_retries=retry_policy(retries, backoff))
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def request(self, method: str, path: str, *, params=None, json=None, headers=None) -> tuple[int, dict]:
        try:
            response = self.session.request(
                method, self.base + path, params=params, json=json, headers=headers, timeout=TIMEOUT
            )
        except requests.RequestException as exc:
            raise ApiError(f"cannot reach {self.base}: {exc}") from exc
        try:
            body = response.json()
        except ValueError:
            body = {}
        if response.status_code >= 400:
            error = body.get("error", {}) if isinstance(body, dict) else {}
            raise ApiError(
                error.get("message") or f"HTTP {response.status_code}: {response.text[:200]}",
                status=response.status_code,
                code=error.get("code", ""),
                fields=error.get("fields") or {},
            )
        return response.status_code, body

    def get(self, path: str, **params) -> dict:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})[1]

    def job_submit(self, body: dict, *, idempotency_key: str) -> tuple[dict, bool]:
        """Returns the job and whether this call created it (False: the key's earlier job)."""
        status, job = self.request("POST", "jobs/", json=body, headers={"Idempotency-Key": idempotency_key})
        return job, status == 201

    def job(self, job_id: int) -> dict:
        return self.get(f"jobs/{int(job_id)}/")

    def job_cancel(self, job_id: int) -> dict:
        return self.request("POST", f"jobs/{int(job_id)}/cancel/")[1]

    def job_logs(self, job_id: int, *, offset: int) -> dict:
        return self.get(f"jobs/{int(job_id)}/logs/", offset=offset)

    def endpoints(self, *, name: str | None = None) -> list[dict]:
        """The tenant's active endpoints (every page), or the one named ``name``."""
        found: list[dict] = []
        page = 1
        while True:
            body = self.get("endpoints/", name=name, page=page, page_size=500)
            found += body["results"]
            if not body.get("next"):
                return found
            page += 1

    def endpoint(self, endpoint_id: int) -> dict:
        return self.get(f"endpoints/{int(endpoint_id)}/")

    def endpoint_create(self, body: dict) -> dict:
        return self.request("POST", "endpoints/", json=body)[1]

    def endpoint_update(self, endpoint_id: int, changes: dict) -> dict:
        return self.request("PATCH", f"endpoints/{int(endpoint_id)}/", json=changes)[1]

    def endpoint_scale(self, endpoint_id: int, *, min_replicas: int, max_replicas: int) -> dict:
        body = {"min_replicas": min_replicas, "max_replicas": max_replicas}
        return self.request("POST", f"endpoints/{int(endpoint_id)}/scale/", json=body)[1]

    def endpoint_delete(self, endpoint_id: int) -> None:
        self.request("DELETE", f"endpoints/{int(endpoint_id)}/")
