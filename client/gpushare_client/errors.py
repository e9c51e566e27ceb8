"""Typed errors: each carries the API's stable ``code`` (docs/api.md), the HTTP status and
the fields the platform named. Catch the class, or compare ``code``."""

from __future__ import annotations


class GpushareError(Exception):
    """Base class of everything this package raises on purpose."""


class ConfigError(GpushareError):
    """No platform address or token, or an unreadable config file."""


class ApiError(GpushareError):
    """The platform refused the request, or could not be reached after the retries.

    ``status`` is the HTTP status (None when unreachable), ``code`` the API's error
    code (``invalid``, ``not_found``, ``quota_exceeded``, ...), ``fields`` the
    culprit fields with their messages, ``retry_after`` the seconds a 429/503
    asked to wait (the last one, once the retries are spent).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str = "",
        fields: dict[str, list[str]] | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.fields = fields or {}
        self.retry_after = retry_after

    def __str__(self) -> str:
        # The platform's message already names the fields it refused ("Invalid input: gpus: ...");
        # add only what it does not say.
        extra = [
            f"{name}: {' '.join(problems)}"
            for name, problems in self.fields.items()
            if not all(problem in self.message for problem in problems)
        ]
        return self.message + (f" ({'; '.join(extra)})" if extra else "")

    @property
    def transient(self) -> bool:
        """Unreachable, or the platform's own trouble: worth waiting out."""
        return self.status is None or self.status >= 500 or self.status == 429


class Unreachable(ApiError):
    """No answer from the platform (connection refused or reset, timeout) after the retries."""


class BadRequest(ApiError):
    """400 ``invalid``: the request breaks a rule stated in the message."""


class Unauthenticated(ApiError):
    """401: no, unknown, revoked or expired token."""


class Forbidden(ApiError):
    """403 ``forbidden``: the token lacks a scope, the role may not, the tenant is suspended."""


class QuotaExceeded(Forbidden):
    """403 ``quota_exceeded``: the job is above a quota (the message names the limit)."""


class BudgetExhausted(Forbidden):
    """403 ``budget_exhausted``: this month's GPU-hours or spend is used up."""


class BudgetExceeded(BudgetExhausted):
    """403 ``budget_exceeded``: what the job can cost (its money hold) is more than the budget has left;
    the message states both. ``gpushare estimate`` shows the hold before submitting."""


class NotFound(ApiError):
    """404: no such object for this tenant (another tenant's looks the same)."""


class MethodNotAllowed(ApiError):
    """405."""


class Conflict(ApiError):
    """409: the object's state does not allow it, or an Idempotency-Key reused with another body."""


class TooLarge(ApiError):
    """413: the request body is over the platform's limit."""


class RateLimited(ApiError):
    """429 after the retries: too many requests for this token (``retry_after`` says how long to wait)."""


class ServerError(ApiError):
    """5xx after the retries."""


class WaitTimeout(GpushareError):
    """``wait``/``watch`` gave up before the job ended; the job keeps running. ``job`` is the last seen."""

    def __init__(self, job, timeout: float):
        super().__init__(f"job {job.id} still {job.state} after {timeout:g} s")
        self.job = job
        self.timeout = timeout


_BY_CODE: dict[str, type[ApiError]] = {
    "invalid": BadRequest,
    "unauthenticated": Unauthenticated,
    "forbidden": Forbidden,
    "quota_exceeded": QuotaExceeded,
    "budget_exhausted": BudgetExhausted,
    "budget_exceeded": BudgetExceeded,
    "not_found": NotFound,
    "method_not_allowed": MethodNotAllowed,
    "conflict": Conflict,
    "too_large": TooLarge,
    "rate_limited": RateLimited,
    "server_error": ServerError,
}
_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequest,
    401: Unauthenticated,
    403: Forbidden,
    404: NotFound,
    405: MethodNotAllowed,
    409: Conflict,
    413: TooLarge,
    429: RateLimited,
}


def error_for(status: int, code: str) -> type[ApiError]:
    """The error class for an answer: by the API's code, else by the HTTP status."""
    if code in _BY_CODE:
        return _BY_CODE[code]
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return ServerError if status >= 500 else ApiError
