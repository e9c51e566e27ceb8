"""Inference endpoints: a model served from shared slices behind the gateway.

Each replica is an ordinary job (kind ``inference``, class ``serving`` by
default) that the scheduler places and the agent runs, meters and bills; an
endpoint's cost is the sum of its replicas' costs.
"""

from __future__ import annotations

from django.db import models
from django_scopes import ScopedManager

from accounts.models import Tenant


class Endpoint(models.Model):
    class State(models.TextChoices):
        ACTIVE = "active"
        DELETED = "deleted"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="endpoints")
    created_by = models.ForeignKey("auth.User", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    name = models.SlugField(max_length=63)
    state = models.CharField(max_length=16, choices=State.choices, default=State.ACTIVE)
    # What starts one replica: an HTTP server listening on $PORT.
    command = models.JSONField()
    image = models.CharField(max_length=300, blank=True)
    env = models.JSONField(default=dict, blank=True)
    gpu_milli = models.PositiveIntegerField(help_text="slice per replica in thousandths (125, 250, 500) or whole GPUs")
    gpu_model = models.CharField(max_length=64, blank=True)
    priority = models.CharField(max_length=50, blank=True, help_text="priority class; default: serving")
    min_replicas = models.PositiveIntegerField(default=0)
    max_replicas = models.PositiveIntegerField(default=1)
    concurrency_target = models.PositiveIntegerField(default=4, help_text="in-flight requests per replica")
    idle_timeout_s = models.PositiveIntegerField(default=60)
    health_path = models.CharField(max_length=200, default="/health")
    # Bumped by every change of what a replica runs: a rolling update.
    version = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "name"], condition=models.Q(state="active"), name="endpoint_unique_active_name"
            ),
            models.CheckConstraint(
                condition=models.Q(max_replicas__gte=models.F("min_replicas")), name="endpoint_min_le_max"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"

    @property
    def gateway_path(self) -> str:
        """Where the gateway serves the endpoint (its routes in endpoints/gateway.py)."""
        return f"/e/{self.tenant.slug}/{self.name}/"


class Replica(models.Model):
    class State(models.TextChoices):
        STARTING = "starting"  # job submitted, not yet answering its health check
        READY = "ready"
        DRAINING = "draining"  # no new requests; stopped once idle
        STOPPED = "stopped"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="replicas")
    job = models.OneToOneField("scheduler.Job", on_delete=models.PROTECT, related_name="replica")
    version = models.PositiveIntegerField()
    port = models.PositiveIntegerField()
    state = models.CharField(max_length=16, choices=State.choices, default=State.STARTING, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    drain_started_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            # A port is handed to one live replica at a time (any node).
            models.UniqueConstraint(
                fields=["port"], condition=~models.Q(state="stopped"), name="replica_unique_live_port"
            ),
        ]

    def __str__(self) -> str:
        return f"replica {self.pk} of {self.endpoint_id} ({self.state})"


class EndpointLoad(models.Model):
    """What the gateway last saw of an endpoint's traffic (one row per endpoint)."""

    endpoint = models.OneToOneField(Endpoint, on_delete=models.CASCADE, related_name="load")
    inflight = models.PositiveIntegerField(default=0)
    queued = models.PositiveIntegerField(default=0)
    peak_concurrency = models.PositiveIntegerField(default=0, help_text="max in-flight+queued over the idle timeout")
    last_request_at = models.DateTimeField(null=True, blank=True)
    requests_total = models.BigIntegerField(default=0)
    errors_total = models.BigIntegerField(default=0)
    replica_inflight = models.JSONField(default=dict, blank=True)  # replica id -> in flight
    latency_ms = models.JSONField(default=dict, blank=True)  # p50/p95/p99 over the last minute
    updated_at = models.DateTimeField(auto_now=True)


class ScalingEvent(models.Model):
    """A scaling decision, kept so users can see why replicas came and went."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="scaling_events")
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    from_replicas = models.PositiveIntegerField()
    to_replicas = models.PositiveIntegerField()
    reason = models.CharField(max_length=200)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["-at", "-id"]


class EndpointMinute(models.Model):
    """One minute of an endpoint's traffic as the gateway saw it: the request-rate and latency history.

    The gateway sends the whole minute's figures (not increments) every second, so a
    replayed or repeated report rewrites the same row instead of counting twice.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="minutes")
    minute = models.DateTimeField(help_text="start of the minute (UTC)")
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0, help_text="answered by the gateway with 502/503")
    peak_concurrency = models.PositiveIntegerField(default=0, help_text="max in-flight+queued seen in the minute")
    p50_ms = models.PositiveIntegerField(null=True, blank=True)
    p95_ms = models.PositiveIntegerField(null=True, blank=True)
    p99_ms = models.PositiveIntegerField(null=True, blank=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["minute"]
        constraints = [models.UniqueConstraint(fields=["endpoint", "minute"], name="endpoint_minute_unique")]

    def __str__(self) -> str:
        return f"{self.endpoint_id} @ {self.minute:%Y-%m-%d %H:%M}: {self.requests} requests"
