"""Idempotent job submission: the ``Idempotency-Key`` header of ``POST jobs/``.

The same key from the same tenant within ``KEY_TTL`` returns the job it first
created; the same key with a different body is a conflict. Two requests racing
with one key create one job: the loser's insert hits the unique constraint
(tenant, idempotency_key), its transaction rolls back (its scheduling message
with it) and it answers with the winner's job.

A wrapper over ``scheduler.services.job_submit`` so the scheduler's own
service stays free of HTTP concerns.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from datetime import timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from accounts.models import Tenant
from accounts.tenancy import acts_for_tenant

from .. import services
from ..models import Job

KEY_TTL = timedelta(hours=24)
MAX_KEY_LENGTH = 255


@dataclass(frozen=True)
class Submitted:
    job: Job
    created: bool


def request_hash(spec: services.JobSpec) -> str:
    """A digest of what was asked for, after validation (so key order or defaults don't matter)."""
    canonical = json.dumps(asdict(spec), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _existing(*, tenant: Tenant, key: str, digest: str) -> Job | None:
    job = Job.objects.filter(tenant=tenant, idempotency_key=key).first()
    if job is None:
        return None
    if job.submitted_at < timezone.now() - KEY_TTL:
        # The key has expired: free it so it can name a new job.
        Job.objects.filter(pk=job.pk).update(idempotency_key="")
        return None
    if job.request_hash != digest:
        raise services.JobError(
            f"Idempotency-Key '{key}' was already used for job {job.pk} with a different request body; "
            "use a new key for a different job",
            code="conflict",
        )
    return job


@services.admitted_again_once
@acts_for_tenant
def job_submit_idempotent(*, tenant: Tenant, user, spec: services.JobSpec, idempotency_key: str) -> Submitted:
    """Submit ``spec`` once per (tenant, key); a replay returns the original job."""
    if not idempotency_key:
        return Submitted(job=services.job_submit(tenant=tenant, user=user, spec=spec), created=True)
    digest = request_hash(spec)
    try:
        with transaction.atomic():
            found = _existing(tenant=tenant, key=idempotency_key, digest=digest)
            if found is not None:
                return Submitted(job=found, created=False)
            job = services.job_submit(tenant=tenant, user=user, spec=spec)
            Job.objects.filter(pk=job.pk).update(idempotency_key=idempotency_key, request_hash=digest)
            return Submitted(job=job, created=True)
    except IntegrityError:
        # Another request with this key committed first: answer with its job.
        with transaction.atomic():
            found = _existing(tenant=tenant, key=idempotency_key, digest=digest)
        if found is None:
            raise
        return Submitted(job=found, created=False)
