"""The fleet grid and the queue cost a fixed number of queries, however big the fleet or queue."""

from __future__ import annotations

from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from scheduler.services import schedule_pass
from tests.console.conftest import node_with_gpus
from tests.console.test_queue import queued_job


def queries(client, url) -> int:
    with CaptureQueriesContext(connection) as captured:
        assert client.get(url).status_code == 200
    return len(captured)


def test_fleet_grid_queries_do_not_grow_with_nodes_and_jobs(staff_client, tenant, rules):
    node_with_gpus("n0")
    queued_job(tenant)
    schedule_pass()
    small = queries(staff_client, reverse("console:fleet"))
    for i in range(1, 6):
        node_with_gpus(f"n{i}", ("H100-80GB",) * 4)
    for _ in range(8):
        queued_job(tenant)
    schedule_pass()
    assert queries(staff_client, reverse("console:fleet")) == small


def test_queue_queries_do_not_grow_with_the_queue(staff_client, tenant, other_tenant, rules):
    queued_job(tenant)
    small = queries(staff_client, reverse("console:queue"))
    for _ in range(10):
        queued_job(other_tenant, priority="serving")
    assert queries(staff_client, reverse("console:queue")) == small
