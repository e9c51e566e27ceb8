"""Nodes (GPU servers running the agent) and their GPUs, as the platform sees them."""

from __future__ import annotations

from django.db import models


class Node(models.Model):
    class State(models.TextChoices):
        PENDING = "pending"  # credential issued, agent never seen
        UP = "up"
        DOWN = "down"
        CORDONED = "cordoned"  # no new jobs
        DRAINING = "draining"  # no new jobs; cordoned once empty

    name = models.SlugField(max_length=100, unique=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    token_hash = models.CharField(max_length=64)
    agent_version = models.CharField(max_length=32, blank=True)
    driver_version = models.CharField(max_length=32, blank=True)
    cuda_version = models.CharField(max_length=32, blank=True)
    backend = models.CharField(max_length=16, blank=True)  # nvml | sim
    # Where the gateway reaches this node's replicas, as its agent reported at registration
    # (GPUSHARE["NODE_ADDRESSES"] overrides it); blank: not reported, or malformed.
    address = models.CharField(max_length=253, blank=True)
    registered_at = models.DateTimeField(null=True, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    state_reason = models.CharField(max_length=200, blank=True)
    # The operator's cordon/drain of a node that then went down, restored when it registers again.
    state_before_down = models.CharField(max_length=16, choices=State.choices, blank=True)
    # What the agent enforces between tenants, as it reported at registration: {"tenancy": "multi"|"single",
    # "uid_pool", "network_policy", "job_egress"}; {} from an agent older than the report.
    isolation = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def single_tenant(self) -> bool:
        """The agent runs every job as one user: fine for one tenant, never for two."""
        return self.isolation.get("tenancy") == "single"

    @property
    def schedulable(self) -> bool:
        return self.state == self.State.UP


class Gpu(models.Model):
    class Health(models.TextChoices):
        OK = "ok"
        OUT_OF_SERVICE = "out_of_service"

    class Reservation(models.TextChoices):
        ANY = "any"
        DEDICATED_ONLY = "dedicated_only"
        SHARED_ONLY = "shared_only"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    uuid = models.CharField(max_length=96, unique=True)
    index = models.PositiveSmallIntegerField()
    model = models.CharField(max_length=64, db_index=True)
    memory_mb = models.PositiveIntegerField()
    mig_mode = models.BooleanField(default=False)
    isolation = models.CharField(max_length=8, default="none")  # what a slice here gets: mig | mps | none
    # MIG mode: the instances reported at registration, smallest first: [{uuid, memory_mb, profile}]
    # (agents.agent.gpus.mig_layout). The scheduler places a slice only where one holds it.
    mig_instances = models.JSONField(default=list, blank=True)
    health = models.CharField(max_length=16, choices=Health.choices, default=Health.OK)
    health_reason = models.CharField(max_length=200, blank=True)
    reservation = models.CharField(max_length=16, choices=Reservation.choices, default=Reservation.ANY)
    last_metrics = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["node__name", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_node_index")]

    def __str__(self) -> str:
        return f"{self.node.name}/{self.index} {self.model}"


class GpuOutage(models.Model):
    """A period a GPU was out of service (health event, node down, operator).

    The billing ledger reads these: held + idle + out-of-service seconds add
    up to a GPU's seconds in a month.
    """

    class Cause(models.TextChoices):
        HEALTH = "health"  # an XID/ECC/row-remap event; ends when the operator returns the GPU
        NODE_DOWN = "node_down"  # missed heartbeats; ends when the agent registers again

    gpu = models.ForeignKey(Gpu, on_delete=models.CASCADE, related_name="outages")
    cause = models.CharField(max_length=16, choices=Cause.choices, default=Cause.HEALTH)
    started_at = models.DateTimeField(db_index=True)
    ended_at = models.DateTimeField(null=True, blank=True, db_index=True)
    reason = models.CharField(max_length=200)

    class Meta:
        ordering = ["started_at"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(ended_at__isnull=True) | models.Q(ended_at__gte=models.F("started_at")),
                name="gpu_outage_ordered",
            ),
            models.UniqueConstraint(
                fields=["gpu", "cause"], condition=models.Q(ended_at__isnull=True), name="gpu_outage_one_open_per_cause"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.gpu} out {self.started_at:%Y-%m-%d %H:%M}: {self.reason}"


class LinkRefusal(models.Model):
    """A message the node link refused, with why (docs/operator-guide.md, "Trust model").

    ``command``: an agent refused a command (unsigned, bad signature, expired,
    replayed, addressed to another node); ``report``: the platform refused a
    report (not the protocol, unknown credential, naming another node, a
    platform task on the report queue); ``gpu_claim``: a node registered a GPU
    UUID another node owns. The fleet view counts them per node.
    """

    class Direction(models.TextChoices):
        COMMAND = "command"
        REPORT = "report"
        GPU_CLAIM = "gpu_claim"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, null=True, blank=True, related_name="link_refusals")
    direction = models.CharField(max_length=16, choices=Direction.choices)
    task = models.CharField(max_length=100, blank=True)
    job_id = models.BigIntegerField(null=True, blank=True)
    reason = models.CharField(max_length=300)
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    # A re-sent refusal report is counted once.
    dedupe = models.CharField(max_length=120, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["dedupe"], condition=~models.Q(dedupe=""), name="link_refusal_dedupe"),
        ]

    def __str__(self) -> str:
        return f"{self.direction} refused ({self.node or 'unknown node'}): {self.reason}"


class QuarantinedWindow(models.Model):
    """A usage window ingest refused: kept with the reason, never billed, shown to the operator."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="quarantined_windows")
    job_id = models.BigIntegerField(null=True, blank=True, db_index=True)
    attempt = models.BigIntegerField(null=True, blank=True)
    seq = models.BigIntegerField(null=True, blank=True)
    window = models.JSONField()
    reason = models.CharField(max_length=300)
    received_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-received_at", "-id"]

    def __str__(self) -> str:
        return f"window of job {self.job_id} from {self.node}: {self.reason}"
