"""Portal and console paper cuts: operators land on the console, Job and GPU pages in the admin,
the waiting banner's plural, the Email login label, money on pages, endpoint pages, webhook
pages, and a running job's live samples."""

from __future__ import annotations

import html

from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from django.utils.html import strip_tags
from django_scopes import scopes_disabled

from accounts.models import Role
from agents.models import Gpu
from endpoints.models import Endpoint
from scheduler.models import Allocation, Job, JobState
from webhooks import services as webhook_services
from webhooks.models import Delivery

from .conftest import job_make


def operator_client() -> Client:
    user = get_user_model().objects.create_superuser("op@example.com", "op@example.com", "pw-operator-1")
    client = Client()
    client.force_login(user)
    return client


def test_an_operator_lands_on_the_console(db):
    client = operator_client()
    response = client.get("/")
    assert response.status_code == 302 and response["Location"] == reverse("console:index")
    polled = client.get(reverse("portal:dashboard_live"), HTTP_HX_REQUEST="true")
    assert polled.status_code == 204 and polled["HX-Redirect"] == reverse("console:index")
    assert client.get(response["Location"], follow=True).status_code == 200


def test_a_user_without_a_tenant_still_gets_the_explanation(db):
    user = get_user_model().objects.create_user("lost@example.com", "lost@example.com", "pw-lost-12")
    client = Client()
    client.force_login(user)
    assert client.get("/").status_code == 403


def test_the_admin_has_job_and_gpu_pages(rules, tenant, node):
    job = job_make(tenant, name="visible-to-ops", env={"SECRET_TOKEN": "hunter2"})
    client = operator_client()
    listing = client.get("/admin/scheduler/job/")
    assert listing.status_code == 200 and "visible-to-ops" in listing.content.decode()
    detail = client.get(f"/admin/scheduler/job/{job.pk}/change/").content.decode()
    assert "visible-to-ops" in detail and "submitted" in detail  # its events inline
    assert "hunter2" not in detail  # a tenant's environment stays out of the console
    cancel = client.post("/admin/scheduler/job/", {"action": "cancel", "_selected_action": [job.pk]}, follow=True)
    assert "Cancelling 1 job." in cancel.content.decode()
    with scopes_disabled():
        assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED
    gpus = client.get("/admin/agents/gpu/")
    assert gpus.status_code == 200 and "GPU-portal-0" in gpus.content.decode()
    gpu = Gpu.objects.get(uuid="GPU-portal-0")
    assert client.get(f"/admin/agents/gpu/{gpu.pk}/change/").status_code == 200


def test_the_waiting_banner_counts_and_pluralises(client_for, tenant):
    owner = client_for(tenant)
    big = job_make(tenant, user=owner.user, name="big", gpus=8000)
    with scopes_disabled():
        Job.objects.filter(pk=big.pk).update(pending_reason="no node has 8 GPUs")
    page = strip_tags(owner.get("/").content.decode())
    assert "1 job waiting: no node has 8 GPUs." in page and "job(s)" not in page
    other = job_make(tenant, user=owner.user, name="other")
    with scopes_disabled():
        Job.objects.filter(pk=other.pk).update(pending_reason="the tenant's quota of 1 dedicated GPU is in use")
        third = job_make(tenant, user=owner.user, name="third", gpus=8000)
        Job.objects.filter(pk=third.pk).update(pending_reason="no node has 8 GPUs")
    page = html.unescape(strip_tags(owner.get("/").content.decode()))
    assert (
        "3 jobs waiting (2 jobs: no node has 8 GPUs; 1 job: the tenant's quota of 1 dedicated GPU is in use)." in page
    )


def test_the_login_field_says_email(db):
    page = Client().get(reverse("login")).content.decode()
    assert '<label for="id_username">Email' in page and "Username" not in page
    assert 'autocomplete="username"' in page


def test_money_on_pages_is_to_the_cent_with_the_exact_figure_on_hover(client_for, tenant, node):
    from .conftest import job_ran

    owner = client_for(tenant)
    job = job_ran(job_make(tenant, user=owner.user), node, windows=3, amount="0.0012345")
    page = owner.get(reverse("portal:jobs")).content.decode()
    assert '<span class="money" title="$0.0037035 exact">&lt;$0.01</span>' in page or (
        '<span class="money" title="$0.0037035 exact"><$0.01</span>' in page
    )
    detail = owner.get(reverse("portal:job", args=[job.pk])).content.decode()
    assert 'title="$0.0037035 exact"' in detail


# --- endpoint pages --------------------------------------------------------------------------------


def test_endpoints_are_created_changed_scaled_and_deleted_in_the_portal(client_for, tenant, other_tenant):
    owner = client_for(tenant)
    assert owner.get(reverse("portal:endpoint_create")).status_code == 200
    form = {
        "name": "llm",
        "command": "python serve.py --port $PORT",
        "gpus": "0.25",
        "min_replicas": "0",
        "max_replicas": "3",
        "concurrency_target": "4",
        "idle_timeout_seconds": "60",
        "health_path": "/health",
        "env": "MODEL=small",
    }
    bad = owner.post(reverse("portal:endpoint_create"), {**form, "min_replicas": "5", "name": "Not a name"})
    assert bad.status_code == 400
    text = strip_tags(bad.content.decode())
    assert "Enter a valid" in text and "min_replicas must not exceed max_replicas" not in text or "name" in text
    created = owner.post(reverse("portal:endpoint_create"), form)
    assert created.status_code == 302
    with scopes_disabled():
        endpoint = Endpoint.objects.get(tenant=tenant, name="llm")
    assert (endpoint.command, endpoint.gpu_milli, endpoint.env) == (
        ["python", "serve.py", "--port", "$PORT"],
        250,
        {"MODEL": "small"},
    )
    assert created["Location"] == reverse("portal:endpoint", args=[endpoint.pk])

    edit = owner.get(reverse("portal:endpoint_edit", args=[endpoint.pk])).content.decode()
    assert "python serve.py --port" in edit and "MODEL=small" in edit
    changed = owner.post(reverse("portal:endpoint_edit", args=[endpoint.pk]), {**form, "env": "MODEL=big"}, follow=True)
    assert "Rolling out version 2" in changed.content.decode()
    with scopes_disabled():
        endpoint.refresh_from_db()
    assert (endpoint.version, endpoint.env) == (2, {"MODEL": "big"})
    refused = owner.post(
        reverse("portal:endpoint_scale", args=[endpoint.pk]), {"min_replicas": 4, "max_replicas": 2}, follow=True
    )
    assert "min_replicas must not exceed max_replicas" in refused.content.decode()
    owner.post(reverse("portal:endpoint_scale", args=[endpoint.pk]), {"min_replicas": 1, "max_replicas": 5})
    with scopes_disabled():
        endpoint.refresh_from_db()
    assert (endpoint.min_replicas, endpoint.max_replicas, endpoint.version) == (1, 5, 2)

    # Another tenant's endpoint is a 404 on every page; a viewer may not change one.
    stranger = client_for(other_tenant)
    for name in ("portal:endpoint_edit", "portal:endpoint_scale", "portal:endpoint_delete"):
        assert (
            stranger.post(reverse(name, args=[endpoint.pk]), {"min_replicas": 0, "max_replicas": 1}).status_code == 404
        )
    viewer = client_for(tenant, role=Role.VIEWER)
    assert viewer.post(reverse("portal:endpoint_delete", args=[endpoint.pk])).status_code == 403
    assert viewer.get(reverse("portal:endpoint_create")).status_code == 403

    deleted = owner.post(reverse("portal:endpoint_delete", args=[endpoint.pk]))
    assert deleted.status_code == 302 and deleted["Location"] == reverse("portal:endpoints")
    with scopes_disabled():
        assert Endpoint.objects.get(pk=endpoint.pk).state == Endpoint.State.DELETED
    assert owner.get(reverse("portal:endpoint", args=[endpoint.pk])).status_code == 404


# --- webhook pages -----------------------------------------------------------------------------------


def test_webhooks_are_registered_seen_with_attempts_and_re_sent(
    client_for, tenant, other_tenant, settings, monkeypatch
):
    monkeypatch.setattr(webhook_services, "_send_soon", lambda ids: None)  # this test sends them itself
    owner = client_for(tenant)
    assert owner.get(reverse("portal:webhooks")).status_code == 200
    refused = owner.post(reverse("portal:webhooks"), {"url": "http://127.0.0.1:9/hook", "events": ["job.*"]})
    assert refused.status_code == 400 and "public addresses only" in refused.content.decode()
    settings.GPUSHARE = {**settings.GPUSHARE, "WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/32"}
    added = owner.post(
        reverse("portal:webhooks"), {"url": "http://127.0.0.1:9/hook", "events": ["job.*", "invoice.issued"]}
    )
    assert added.status_code == 302
    with scopes_disabled():
        webhook = tenant.webhooks.get()
    assert webhook.events == ["job.*", "invoice.issued"]
    detail = owner.get(added["Location"])
    assert webhook.secret in detail.content.decode() and detail["Cache-Control"] == "no-store"

    job_make(tenant, user=owner.user)  # job.queued
    with scopes_disabled():
        delivery = Delivery.objects.get(webhook=webhook)
    webhook_services.delivery_send(delivery_id=delivery.pk)  # nothing listens on port 9: a failed try
    page = strip_tags(owner.get(added["Location"]).content.decode())
    assert "job.queued" in page and "ConnectionRefused" in page or "Connection refused" in page
    owner.post(reverse("portal:delivery_resend", args=[webhook.pk, delivery.pk]))
    with scopes_disabled():
        delivery.refresh_from_db()
    assert (delivery.state, delivery.tries) == ("pending", 0)
    owner.post(reverse("portal:webhook_action", args=[webhook.pk, "ping"]))
    with scopes_disabled():
        assert Delivery.objects.filter(webhook=webhook, event__type="ping").count() == 1

    stranger = client_for(other_tenant)
    assert stranger.get(reverse("portal:webhook", args=[webhook.pk])).status_code == 404
    assert stranger.post(reverse("portal:webhook_action", args=[webhook.pk, "delete"])).status_code == 404
    assert stranger.post(reverse("portal:delivery_resend", args=[webhook.pk, delivery.pk])).status_code == 404
    member = client_for(tenant, role=Role.MEMBER)
    assert member.get(reverse("portal:webhook", args=[webhook.pk])).status_code == 403  # the secret is managers'
    assert "Webhooks" not in member.get("/").content.decode()

    owner.post(reverse("portal:webhook_action", args=[webhook.pk, "rotate"]))
    with scopes_disabled():
        assert tenant.webhooks.get().secret != webhook.secret
    owner.post(reverse("portal:webhook_action", args=[webhook.pk, "delete"]))
    with scopes_disabled():
        assert not tenant.webhooks.exists()


# --- a running job's live samples --------------------------------------------------------------------


def test_a_running_jobs_charts_get_the_agents_latest_samples(client_for, tenant, other_tenant, node):
    owner = client_for(tenant)
    job = job_make(tenant, user=owner.user, gpus=1000)
    neighbour = job_make(other_tenant, gpus=1000)
    gpu = node.gpus.get(index=0)
    with scopes_disabled():
        Allocation.objects.create(tenant=tenant, job=job, gpu=gpu, share_milli=1000)
        Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING, node=node, started_at=timezone.now())
    url = reverse("portal:job_metrics", args=[job.pk])
    assert owner.get(url).json()["live"] is None  # no heartbeat with the job's use yet
    now = timezone.now()
    node.last_heartbeat_at = now
    node.save(update_fields=["last_heartbeat_at"])
    gpu.last_metrics = {
        "util": 91.0,
        "memory_used_mb": 30000,
        "power_w": 412.5,
        "jobs": {str(job.pk): {"sm_util": 88.0, "memory_mb": 21000}, str(neighbour.pk): {"sm_util": 3, "memory_mb": 9}},
    }
    gpu.save(update_fields=["last_metrics"])
    live = owner.get(url).json()["live"]
    assert live == {"t": int(now.timestamp() * 1000), "sm_util_pct": 88.0, "memory_mb": 21000, "power_w": 412.5}
    with scopes_disabled():
        Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED)
    assert owner.get(url).json()["live"] is None  # ended: the windows tell the rest
