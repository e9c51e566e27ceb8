"""The address a node's replicas are reached at: the agent's option and detection, what registration stores,
and where operators see it (issue #11)."""

from __future__ import annotations

import logging
import socket

import pytest
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from agents import services
from agents.agent import address as address_module
from agents.agent.address import address_detect, address_valid, broker_host
from agents.agent.config import AgentConfig, parse_args
from agents.agent.gpus import SimBackend
from agents.agent.main import Agent
from agents.models import Node
from tests.factories import UserFactory

REGISTRATION = {
    "agent_version": "0.1.0",
    "backend": "sim",
    "gpus": [{"index": 0, "uuid": "GPU-addr-0", "model": "H100-80GB", "memory_mb": 81559}],
    "running": [],
}

# --- the agent: option, validation, detection ------------------------------------------------


@pytest.mark.parametrize(
    "value", ["10.0.3.17", "127.0.0.1", "fd00::17", "gpu-node-17", "gpu-node-17.dc1.example.com", "node17.example."]
)
def test_ip_addresses_and_host_names_are_valid(value):
    assert address_valid(value)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "10.0.0.300",  # a mistyped IP address, not a name
        "gpu node",
        "-gpu.example.com",
        "gpu_node.example.com",
        "http://10.0.0.1",
        "10.0.0.1:8080",
        "a" * 64 + ".example.com",
        "a." * 127 + "com",  # 257 characters
        "gpu..example.com",
        None,
        17,
    ],
)
def test_malformed_addresses_are_not(value):
    assert not address_valid(value)


@pytest.fixture
def agent_env(monkeypatch):
    monkeypatch.setenv("GPUSHARE_AGENT_TOKEN", "gpn_test")
    monkeypatch.delenv("GPUSHARE_AGENT_ADVERTISE_ADDRESS", raising=False)
    return monkeypatch


def test_the_flag_sets_the_address(agent_env):
    assert parse_args(["--advertise-address", " 10.0.3.17 "]).advertise_address == "10.0.3.17"


def test_the_environment_sets_the_address_and_the_flag_wins(agent_env):
    agent_env.setenv("GPUSHARE_AGENT_ADVERTISE_ADDRESS", "gpu-node-17.internal")
    assert parse_args([]).advertise_address == "gpu-node-17.internal"
    assert parse_args(["--advertise-address", "10.0.3.17"]).advertise_address == "10.0.3.17"


def test_without_either_the_address_is_detected(agent_env):
    assert parse_args([]).advertise_address == ""


@pytest.mark.parametrize("bad", ["10.0.0.300", "gpu node", "http://gpu-node-17"])
def test_a_bad_address_stops_the_agent_with_a_clear_error(agent_env, capsys, bad):
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--advertise-address", bad])
    assert stopped.value.code == 2
    assert f"--advertise-address {bad!r} is neither an IP address nor a host name" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("filesystem://", None),
        ("redis://:secret@redis.internal:6380/0", ("redis.internal", 6380)),
        ("rediss://10.0.0.5/0", ("10.0.0.5", 9)),
        ("sentinel://s1.internal:26379;sentinel://s2.internal:26379", ("s1.internal", 26379)),
        ("redis://host:notaport/0", None),
    ],
)
def test_the_broker_host_is_read_from_its_url(url, expected):
    assert broker_host(url) == expected


class FakeProbe:
    """A UDP socket that records where it was pointed and answers with a chosen source address."""

    def __init__(self, source: str | None, connected: list):
        self.source, self.connected = source, connected

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def connect(self, target):
        if self.source is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        self.connected.append(target)

    def getsockname(self):
        return (self.source, 54321)


def _probe(monkeypatch, source: str | None) -> list:
    connected: list = []
    monkeypatch.setattr(address_module.socket, "socket", lambda family, kind: FakeProbe(source, connected))
    return connected


def test_detection_takes_the_source_address_of_the_route_to_the_broker(monkeypatch):
    connected = _probe(monkeypatch, "10.0.3.17")
    assert address_detect("redis://:secret@redis.internal:6380/0") == "10.0.3.17"
    assert connected == [("redis.internal", 6380)]


def test_detection_falls_back_to_loopback_when_the_broker_cannot_be_reached(monkeypatch):
    _probe(monkeypatch, None)
    assert address_detect("redis://nowhere.invalid:6379/0") == "127.0.0.1"


def test_detection_falls_back_to_loopback_without_a_broker_host(monkeypatch):
    connected = _probe(monkeypatch, "10.0.3.17")
    assert address_detect("filesystem://") == "127.0.0.1"
    assert connected == []  # nothing to route to: no probe at all


def test_a_broker_on_this_host_gives_loopback():
    # A real socket: the route to 127.0.0.1 always leaves from 127.0.0.1.
    assert address_detect("redis://127.0.0.1:6379/12") == "127.0.0.1"


def _agent(tmp_path, **config) -> Agent:
    conf = AgentConfig(node="n-addr", token="gpn_test", broker_url="filesystem://", var_dir=tmp_path, **config)
    return Agent(conf, SimBackend("sim:1xH100-80GB", "n-addr"), link=None, spool=None)


def test_registration_reports_the_configured_address(tmp_path):
    agent = _agent(tmp_path, advertise_address="gpu-node-17.internal")
    assert agent.registration()["address"] == "gpu-node-17.internal"


def test_registration_reports_the_detected_address_without_one(tmp_path, monkeypatch):
    _probe(monkeypatch, "10.0.3.17")
    agent = _agent(tmp_path)
    agent.config.broker_url = "redis://redis.internal:6379/0"
    assert agent.registration()["address"] == "10.0.3.17"


# --- the platform: what registration stores ---------------------------------------------------


def _registered(info: dict) -> Node:
    token = services.node_credential_issue(name="n-addr")
    node = services.node_authenticate(name="n-addr", token=token)
    services.node_register(node=node, info=info)
    return Node.objects.get(pk=node.pk)


def test_registration_stores_the_reported_address(db):
    node = _registered({**REGISTRATION, "address": "10.0.3.17"})
    assert node.address == "10.0.3.17" and node.state == Node.State.UP
    services.node_register(node=node, info={**REGISTRATION, "address": "gpu-node-17.internal"})
    assert Node.objects.get(pk=node.pk).address == "gpu-node-17.internal"  # a re-registration updates it


@pytest.mark.parametrize("bad", ["10.0.0.300", "evil host; rm -rf", "x" * 300, ["10.0.0.1"], 17])
def test_a_malformed_address_is_dropped_with_a_warning_and_the_node_still_registers(db, caplog, bad):
    with caplog.at_level(logging.WARNING, logger="agents.services"):
        node = _registered({**REGISTRATION, "address": bad})
    assert node.address == "" and node.state == Node.State.UP and node.gpus.count() == 1
    assert "node n-addr reported a malformed address" in caplog.text


def test_an_agent_that_reports_no_address_leaves_it_blank(db):
    node = _registered({**REGISTRATION, "address": "10.0.3.17"})
    services.node_register(node=node, info=REGISTRATION)  # an older agent on the same node
    assert Node.objects.get(pk=node.pk).address == ""


# --- where operators see it -------------------------------------------------------------------


def test_operators_see_the_address_in_the_nodes_api_and_the_fleet_grid(db):
    _registered({**REGISTRATION, "address": "10.0.3.17"})
    Node.objects.create(name="n-silent", token_hash="x", state=Node.State.UP)
    operator = UserFactory(username="ops-addr@example.test", is_staff=True, is_superuser=True)
    api = APIClient()
    api.force_login(operator)
    by_name = {n["name"]: n["address"] for n in api.get("/api/v1/nodes/").json()["results"]}
    assert by_name == {"n-addr": "10.0.3.17", "n-silent": ""}
    console = Client()
    console.force_login(operator)
    html = console.get(reverse("console:fleet")).content.decode()
    assert '<span data-testid="node-address"' in html
    assert ">10.0.3.17</span>" in html and ">no address reported</span>" in html


# --- a real agent process ---------------------------------------------------------------------


@pytest.mark.integration
def test_real_agents_register_with_their_address(platform, agent_factory):
    agent_factory("node-addr", gpus="sim:1xL4-24GB", extra=["--advertise-address", "gpu-node-17.internal"])
    agent_factory("node-addr-auto", gpus="sim:1xL4-24GB")  # detected: the test broker is Redis on 127.0.0.1
    assert dict(Node.objects.filter(name__startswith="node-addr").values_list("name", "address")) == {
        "node-addr": "gpu-node-17.internal",
        "node-addr-auto": "127.0.0.1",
    }
