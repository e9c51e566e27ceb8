"""The console is for staff: everyone else gets the admin login, never a page or an action."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from agents.models import Node

PAGES = ["console:index", "console:fleet", "console:queue", "console:rules", "console:reports"]


@pytest.mark.parametrize("name", PAGES)
def test_staff_sees_every_page(staff_client, fleet, rules, name):
    response = staff_client.get(reverse(name), follow=True)
    assert response.status_code == 200
    assert b"gpushare operator console" in response.content


@pytest.mark.parametrize("name", PAGES)
@pytest.mark.parametrize("who", ["anonymous", "tenant owner"])
def test_non_staff_are_sent_to_the_admin_login(non_staff_client, name, who):
    client = Client() if who == "anonymous" else non_staff_client
    response = client.get(reverse(name))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))


def test_non_staff_cannot_act_on_nodes_or_jobs(non_staff_client, fleet, tenant, rules):
    from tests.console.test_queue import queued_job

    node = fleet[0]
    job = queued_job(tenant)
    for url in (
        reverse("console:node-action", args=[node.pk, "cordon"]),
        reverse("console:job-cancel", args=[job.pk]),
        reverse("console:job-reclass", args=[job.pk]),
        reverse("console:rules"),
        reverse("console:gpu-return", args=[node.gpus.first().pk]),
    ):
        response = non_staff_client.post(url, {"priority": "serving", "_save": "1"})
        assert response.status_code == 302 and response["Location"].startswith(reverse("admin:login")), url
    node.refresh_from_db()
    assert node.state == Node.State.UP
    job.refresh_from_db()
    assert job.state == "queued" and job.priority.name != "serving"
