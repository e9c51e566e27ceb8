"""Fixtures shared by the whole suite.

Unit tests use pytest-django's ``db``. Integration tests use ``platform``:
a live HTTP server (in this process), a real Celery worker process and real
node agent processes, all on PostgreSQL and Redis.
"""

from __future__ import annotations

import time

import pytest
from django.core.management.base import CommandError
from django.db import OperationalError
from django.test import TransactionTestCase
from rest_framework.test import APIClient

from accounts.models import Role
from tests.factories import TenantFactory, platform_rules_seed, token_for

pytest_plugins = ["tests.processes", "tests.browser_fixtures"]

_fixture_teardown = TransactionTestCase._fixture_teardown


def _fixture_teardown_retrying(self, attempts: int = 5):
    """Empty the tables after a transactional test, retrying a deadlock.

    The session's Celery worker outlives each test and may still be running a
    task (a paced scheduling pass, an ingest) when the TRUNCATE of the flush
    takes its locks table by table; PostgreSQL breaks such a cycle by failing
    one side, sometimes the flush. Production never truncates, so this is the
    test harness's problem alone: try again once the task has moved on.
    """
    for attempt in range(attempts):
        try:
            return _fixture_teardown(self)
        except CommandError as exc:
            cause = exc.__cause__
            if attempt == attempts - 1 or not (isinstance(cause, OperationalError) and "deadlock" in str(cause)):
                raise
            time.sleep(0.2 * (attempt + 1))


TransactionTestCase._fixture_teardown = _fixture_teardown_retrying


@pytest.fixture
def rules(db):
    platform_rules_seed()


@pytest.fixture
def tenant(db):
    return TenantFactory(slug="tenant-a")


@pytest.fixture
def other_tenant(db):
    return TenantFactory(slug="tenant-b")


@pytest.fixture
def api_client_for():
    """``api_client_for(tenant, role=..., scopes=...)`` -> an APIClient with a Bearer token."""

    def make(tenant, *, role: str = Role.OWNER, scopes=None, user=None) -> APIClient:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(tenant, role=role, scopes=scopes, user=user)}")
        return client

    return make
