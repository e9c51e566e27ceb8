"""A migration step for what only PostgreSQL has (triggers and their functions): the SQLite demo does
without them, so the step does nothing there."""

from __future__ import annotations

from django.db import migrations


def postgresql_only(sql: str, reverse_sql: str) -> migrations.RunPython:
    """Runs ``sql`` when migrating forward and ``reverse_sql`` when going back, on PostgreSQL only."""

    def forward(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(sql)

    def backward(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(reverse_sql)

    return migrations.RunPython(forward, backward)
