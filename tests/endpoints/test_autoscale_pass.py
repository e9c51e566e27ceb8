"""The periodic autoscale pass says what it did (replicas started, drained, stopped), so an idle
platform's pass returns 0 and its log line stays at DEBUG (gpushare/observability/logs.py)."""

from __future__ import annotations

import pytest
from django_scopes import scopes_disabled

from endpoints.models import Replica
from endpoints.services import EndpointSpec, endpoint_autoscale_all, endpoint_create

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("rules")]


def deploy(tenant, name: str, *, min_replicas: int) -> None:
    spec = EndpointSpec(name=name, command=["python", "s.py"], gpu_milli=250, min_replicas=min_replicas, max_replicas=2)
    endpoint_create(tenant=tenant, user=None, spec=spec)


def test_a_pass_over_endpoints_scaled_to_zero_did_nothing(tenant):
    deploy(tenant, "idle-a", min_replicas=0)
    deploy(tenant, "idle-b", min_replicas=0)
    assert endpoint_autoscale_all() == 0
    with scopes_disabled():
        assert not Replica.objects.exists()


def test_a_pass_that_starts_replicas_counts_them(tenant):
    deploy(tenant, "warm", min_replicas=2)
    deploy(tenant, "idle", min_replicas=0)
    started = endpoint_autoscale_all()
    with scopes_disabled():
        assert started == Replica.objects.count() == 2
    assert endpoint_autoscale_all() == 0  # in line now: the next pass changes nothing
