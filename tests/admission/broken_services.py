"""Test-only services that get tenancy wrong, for the service walk to catch (tests/admission/test_service_scopes.py)."""

from __future__ import annotations

from django_scopes import scopes_disabled

from accounts.tenancy import acts_for_tenant
from scheduler.models import Job


def jobs_count_forgot_scope(*, tenant) -> int:
    """Filters by hand and never enters the tenant's scope: outside a scope this raises ScopeError."""
    return Job.objects.filter(tenant=tenant).count()


def jobs_count_scopes_disabled(*, tenant) -> int:
    """Turns the scopes off to act for one tenant: a forgotten filter here would read every tenant's jobs."""
    with scopes_disabled():
        return Job.objects.filter(tenant=tenant).count()


@acts_for_tenant
def jobs_count(*, tenant) -> int:
    """Right: the scope narrows the query to the tenant's jobs even without a filter."""
    return Job.objects.count()
