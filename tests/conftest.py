"""Fixtures shared by the whole suite.

Unit tests use pytest-django's ``db``. Integration tests use ``platform``:
a live HTTP server (in this process), a real Celery worker process and real
node agent processes, all on PostgreSQL and Redis.
"""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from accounts.models import Role
from tests.factories import TenantFactory, platform_rules_seed, token_for

pytest_plugins = ["tests.processes", "tests.browser_fixtures"]


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
