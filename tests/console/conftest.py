"""Fixtures for the operator console: a staff operator, a non-staff user, a small fleet without agents."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from agents.models import Gpu, Node


@pytest.fixture
def operator(db):
    return get_user_model().objects.create_user(
        "operator@example.test", password="operator-pass", is_staff=True, is_superuser=True
    )


@pytest.fixture
def staff_client(operator):
    client = Client()
    client.force_login(operator)
    return client


@pytest.fixture
def non_staff_client(db, tenant):
    from tests.factories import member_add

    user = member_add(tenant, role="owner")
    client = Client()
    client.force_login(user)
    return client


def node_with_gpus(name: str, models=("H100-80GB", "H100-80GB"), *, state=Node.State.UP) -> Node:
    """A registered node with GPUs, as if its agent had registered (no process)."""
    node = Node.objects.create(name=name, state=state, token_hash="x", backend="sim")
    for index, model in enumerate(models):
        Gpu.objects.create(
            node=node,
            uuid=f"GPU-{name}-{index}",
            index=index,
            model=model,
            memory_mb=81920 if "H100" in model else 24576,
            last_metrics={"util": 42.0, "memory_used_mb": 1024, "temperature_c": 51},
        )
    return node


@pytest.fixture
def fleet(db):
    return [node_with_gpus("node-a"), node_with_gpus("node-b", ("L4-24GB",) * 2)]
