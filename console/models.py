"""The console's own table: what-if replays too large to run inside a request."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class WhatIfRun(models.Model):
    """One preview of a draft rule set, computed by a Celery task; the page polls until it is done."""

    class State(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    window_start = models.DateTimeField()
    window_end = models.DateTimeField()
    draft = models.JSONField(help_text="the proposed rule set (console.rules.RuleSet as plain data)")
    state = models.CharField(max_length=8, choices=State.choices, default=State.QUEUED)
    result = models.JSONField(null=True, blank=True)
    error = models.CharField(max_length=300, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"what-if {self.pk} ({self.state})"
