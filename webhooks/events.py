"""The pure parts of webhooks: which events exist, which a subscription matches,
how a delivery is signed and verified, and when a failed one is tried again.
No Django here (tests and receivers can use it as it is)."""

from __future__ import annotations

import hashlib
import hmac
import json
import random
import secrets
import time
from fnmatch import fnmatchcase

# The events tenants can subscribe to (docs/webhooks.md has what each carries).
EVENT_TYPES: dict[str, str] = {
    "job.queued": "a job was submitted, or requeued after preemption or a lost node",
    "job.scheduled": "a job was placed on a node",
    "job.running": "a job's processes started",
    "job.succeeded": "a job exited 0",
    "job.failed": "a job exited non-zero, or the platform failed it",
    "job.cancelled": "a job was cancelled",
    "job.preempted": "a job was preempted by a higher class",
    "job.lost": "a job's node went away",
    "endpoint.scaled": "an endpoint's autoscaler changed its replica count",
    "endpoint.failed": "a replica of an endpoint failed or was lost",
    "budget.threshold": "this month's spend or GPU-hours passed the alert threshold (once a month)",
    "budget.exhausted": "this month's budget is used up (once a month)",
    "invoice.issued": "a month's invoice was finalized and sent for payment",
    "invoice.paid": "an invoice was paid",
    "invoice.payment_failed": "an invoice's payment failed",
    "ping": "a test delivery sent from the portal",
}

SIGNATURE_HEADER = "Gpushare-Signature"
# A receiver should refuse a signature older than this (a replayed delivery).
TOLERANCE_S = 300
# Tries of one round: the first at once, then after these many seconds (about 10 hours in all).
BACKOFF_S = (10, 30, 120, 600, 1800, 3600, 3 * 3600, 6 * 3600)
MAX_TRIES = len(BACKOFF_S) + 1


def patterns_problems(patterns) -> list[str]:
    """What is wrong with a subscription's list of event types or patterns ("job.*", "*")."""
    if not isinstance(patterns, list) or not patterns:
        return ["choose at least one event"]
    problems = []
    for pattern in patterns:
        if not isinstance(pattern, str) or not any(fnmatchcase(t, pattern) for t in EVENT_TYPES):
            problems.append(f"{pattern!r} matches no event (known: {', '.join(EVENT_TYPES)})")
    return problems


def subscribed(patterns: list[str], event_type: str) -> bool:
    """A ``ping`` goes only where it is sent; every other event where a pattern matches it."""
    if event_type == "ping":
        return False
    return any(fnmatchcase(event_type, p) for p in patterns)


def secret_new() -> str:
    return "whsec_" + secrets.token_urlsafe(32)


def sign(secret: str, body: bytes, *, timestamp: int | None = None) -> str:
    """The ``Gpushare-Signature`` header: ``t=<unix seconds>,v1=<hex HMAC-SHA256 of "t.body">``
    (Stripe's scheme: the timestamp is signed with the body, so an old delivery cannot be replayed)."""
    t = int(time.time()) if timestamp is None else int(timestamp)
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


class SignatureError(ValueError):
    pass


def verify(secret: str, body: bytes, header: str, *, tolerance_s: int = TOLERANCE_S, now: float | None = None) -> int:
    """Check a delivery as a receiver must: a v1 signature of this body with this secret, made
    within ``tolerance_s`` (a replay of an old delivery fails). Returns the timestamp."""
    parts: dict[str, list[str]] = {}
    for item in (header or "").split(","):
        key, _, value = item.strip().partition("=")
        parts.setdefault(key, []).append(value)
    try:
        t = int(parts["t"][0])
    except (KeyError, ValueError) as exc:
        raise SignatureError("no timestamp in the signature header") from exc
    expected = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    if not any(hmac.compare_digest(expected, given) for given in parts.get("v1", [])):
        raise SignatureError("the signature does not match the body")
    if abs((time.time() if now is None else now) - t) > tolerance_s:
        raise SignatureError(f"the signature is older than {tolerance_s} s: a replay")
    return t


def envelope(*, event_id: int, event_type: str, created_ms: int, tenant: str, data: dict) -> bytes:
    """The body of every delivery (the same bytes on every try of it)."""
    body = {"id": f"evt_{event_id}", "type": event_type, "created_ms": created_ms, "tenant": tenant, "data": data}
    return json.dumps(body, separators=(",", ":"), sort_keys=True, default=str).encode()


def next_delay_s(tries: int, *, rng: random.Random | None = None) -> float | None:
    """Seconds until the next try after ``tries`` failed ones (None: give up), with ±10% jitter."""
    if tries >= MAX_TRIES:
        return None
    base = BACKOFF_S[tries - 1]
    return base * (0.9 + 0.2 * (rng or random).random())
