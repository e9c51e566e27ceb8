"""The gateway's routing table: where each replica is reached (issue #11), in a fixed number of queries."""

from __future__ import annotations

import pytest
from django_scopes import scopes_disabled

from agents.models import Node
from endpoints.models import Endpoint, Replica
from endpoints.selectors import node_address, routing_table
from scheduler.models import Job, JobState
from tests.factories import priority

pytestmark = pytest.mark.django_db

_ports = iter(range(20000, 30000))


def _replica(endpoint: Endpoint, node: Node, *, state: str = JobState.RUNNING) -> Replica:
    job = Job.objects.create(
        tenant=endpoint.tenant, kind="inference", mode="shared", gpu_milli=250, command=["serve"],
        priority=priority("serving"), max_runtime_s=3600, state=state, node=node, attempt=1,
    )  # fmt: skip
    return Replica.objects.create(
        tenant=endpoint.tenant, endpoint=endpoint, job=job, version=1, port=next(_ports), state=Replica.State.READY
    )


@pytest.fixture
def endpoint(rules, tenant):
    with scopes_disabled():
        yield Endpoint.objects.create(tenant=tenant, name="chat", command=["serve"], gpu_milli=250, max_replicas=8)


def _addresses(table) -> dict[int, str]:
    return {r.replica_id: r.address for route in table.values() for r in route.replicas}


@scopes_disabled()
def test_replicas_are_reached_at_the_address_their_node_reported(endpoint):
    reported = Node.objects.create(name="gpu-a", token_hash="x", state=Node.State.UP, address="10.0.3.17")
    silent = Node.objects.create(name="gpu-b", token_hash="x", state=Node.State.UP)  # an agent that reported none
    on_a, on_b = _replica(endpoint, reported), _replica(endpoint, silent)
    assert _addresses(routing_table()) == {on_a.pk: "10.0.3.17", on_b.pk: "127.0.0.1"}


@scopes_disabled()
def test_the_operators_setting_wins_over_what_the_agent_reported(endpoint, settings):
    nat = Node.objects.create(name="gpu-nat", token_hash="x", state=Node.State.UP, address="10.0.3.17")
    other = Node.objects.create(name="gpu-c", token_hash="x", state=Node.State.UP, address="10.0.3.18")
    settings.GPUSHARE = {**settings.GPUSHARE, "NODE_ADDRESSES": {"gpu-nat": "203.0.113.9"}}
    behind_nat, plain = _replica(endpoint, nat), _replica(endpoint, other)
    assert _addresses(routing_table()) == {behind_nat.pk: "203.0.113.9", plain.pk: "10.0.3.18"}


@scopes_disabled()
def test_the_routing_table_costs_the_same_queries_for_one_replica_or_many(endpoint, django_assert_num_queries):
    nodes = [
        Node.objects.create(name=f"gpu-{i}", token_hash="x", state=Node.State.UP, address=f"10.0.4.{i}")
        for i in range(4)
    ]
    _replica(endpoint, nodes[0])
    with django_assert_num_queries(2):
        assert len(_addresses(routing_table())) == 1
    for node in nodes:
        _replica(endpoint, node)
    _replica(endpoint, nodes[1], state=JobState.QUEUED)  # not routable
    with django_assert_num_queries(2):
        table = routing_table()
    assert sorted(_addresses(table).values()) == ["10.0.4.0", "10.0.4.0", "10.0.4.1", "10.0.4.2", "10.0.4.3"]


@pytest.mark.parametrize(
    ("reported", "setting", "expected"),
    [
        ("", None, "127.0.0.1"),
        ("gpu-a.internal", None, "gpu-a.internal"),
        ("fd00::17", None, "[fd00::17]"),  # as it goes in a URL
        ("10.0.3.17", "gpu-a.nat.example.com", "gpu-a.nat.example.com"),
        ("", "[fd00::9]", "[fd00::9]"),  # already bracketed by the operator: kept
    ],
)
def test_node_address(settings, reported, setting, expected):
    settings.GPUSHARE = {**settings.GPUSHARE, "NODE_ADDRESSES": {"gpu-a": setting} if setting else {}}
    assert node_address("gpu-a", reported) == expected
