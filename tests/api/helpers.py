"""Small builders shared by the API tests."""

from __future__ import annotations

from django_scopes import scopes_disabled

from accounts.models import Role
from agents.models import Gpu, Node
from scheduler import services
from tests.factories import member_add


def job_make(tenant, *, kind="training", gpu_milli=1000, name="", command=("true",), user=None, **spec):
    user = user or member_add(tenant, role=Role.MEMBER)
    job_spec = services.JobSpec(kind=kind, gpu_milli=gpu_milli, command=list(command), name=name, **spec)
    with scopes_disabled():
        return services.job_submit(tenant=tenant, user=user, spec=job_spec)


def node_make(name="node-1", *, gpus=2, model="H100-80GB") -> Node:
    node = Node.objects.create(name=name, token_hash="x", state=Node.State.UP)
    for index in range(gpus):
        Gpu.objects.create(node=node, uuid=f"GPU-{name}-{index}", index=index, model=model, memory_mb=81559)
    return node


def assert_error(response, status: int, code: str, field: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.content[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "fields"}, body
    assert body["error"]["code"] == code, body
    assert body["error"]["message"], body
    if field is not None:
        assert field in body["error"]["fields"], body
    return body["error"]
