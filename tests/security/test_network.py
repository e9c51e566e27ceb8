"""A job cannot connect to the node's local services (Redis, PostgreSQL, the
web server, the agent's metrics port) nor to another tenant's replica port;
the node's own processes (the gateway) still reach the replica, and a job
still reaches its own ports. nftables owner-match rules on the job uids,
installed by the agent and removed when it stops."""

from __future__ import annotations

import json
import socket
import urllib.parse

import pytest
from django.conf import settings

from agents.agent.netpolicy import table_name
from tests.agents.conftest import launch_direct, wait_output
from tests.factories import wait_for
from tests.processes import free_port
from tests.security.conftest import PY, job_result, nft_tables

pytestmark = pytest.mark.integration

REPLICA = r"""
import os, socket, threading, time
port = int(os.environ["PORT"])
server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", port))
server.listen(16)

def serve():
    while True:
        conn, _ = server.accept()
        conn.recv(1024)
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 9\r\n\r\nreplica-a")
        conn.close()

threading.Thread(target=serve, daemon=True).start()
print("LISTENING", flush=True)
# The job reaches its own port (torchrun's store, a notebook kernel): SYN retries cover the agent's next tick.
own = socket.create_connection(("127.0.0.1", port), timeout=10)
own.sendall(b"GET / HTTP/1.0\r\n\r\n")
print("OWN=" + own.recv(100).decode().split("\r\n\r\n")[-1], flush=True)
time.sleep(300)
"""

ATTACKER = r"""
import json, os, socket
targets = json.loads(os.environ["TARGETS"])
result = {}
for name, (host, port) in targets.items():
    try:
        socket.create_connection((host, port), timeout=2).close()
        result[name] = "CONNECTED"
    except OSError as exc:
        result[name] = type(exc).__name__
print("RESULT=" + json.dumps(result), flush=True)
"""


def _host_address() -> str | None:
    """A non-loopback address of this host, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_a_job_reaches_no_platform_service_nor_another_tenants_replica(platform, secure_agent):
    metrics_port = free_port()
    agent = secure_agent(extra=["--metrics-port", str(metrics_port)])
    replica_port = next(p for p in range(24000 + free_port() % 5000, 29999) if _free(p))
    launch_direct(agent, 9601, [PY, "-c", REPLICA], tenant="acme", env={"PORT": str(replica_port)})
    assert wait_output(agent, 9601, "OWN=", timeout=60).split("OWN=")[1].startswith("replica-a")

    # The gateway (a process of the node's own, not a job uid) reaches the replica.
    with socket.create_connection(("127.0.0.1", replica_port), timeout=5) as gateway:
        gateway.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert gateway.recv(100).endswith(b"replica-a")

    redis_url = urllib.parse.urlsplit(settings.REDIS_URL)
    web = urllib.parse.urlsplit(platform.url)
    from django.db import connection

    db = connection.settings_dict
    targets = {
        "redis": ["127.0.0.1", redis_url.port or 6379],
        "postgres": [db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)],
        "web": ["127.0.0.1", web.port],
        "agent_metrics": ["127.0.0.1", metrics_port],
        "replica_loopback": ["127.0.0.1", replica_port],
    }
    if (address := _host_address()) is not None:
        targets["replica_host_address"] = [address, replica_port]
    # Before the policy, each of these answers (the test's own process connects to them all).
    for host, port in targets.values():
        socket.create_connection((host, port), timeout=5).close()

    launch_direct(agent, 9602, [PY, "-c", ATTACKER], tenant="globex", env={"TARGETS": json.dumps(targets)})
    result = job_result(wait_output(agent, 9602, "RESULT=", timeout=60))
    assert set(result) == set(targets)
    for name, outcome in result.items():
        assert outcome != "CONNECTED", (name, result)
    assert f"table inet {table_name(agent.node)}" in nft_tables()

    agent.stop()  # the agent removes its table when it stops
    wait_for(lambda: table_name(agent.node) not in nft_tables(), timeout=10, what="the nft table removed")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


EGRESS = r"""
import json, os, socket
result = {}
for name, host in json.loads(os.environ["HOSTS"]).items():
    try:
        socket.create_connection((host, 80), timeout=3).close()
        result[name] = "CONNECTED"
    except OSError as exc:
        result[name] = type(exc).__name__
print("RESULT=" + json.dumps(result), flush=True)
"""
# Documentation ranges (RFC 5737): only our rules refuse them at once (an ICMP reject: ECONNREFUSED).
PLATFORM_HOST, OUTSIDE_HOST = "198.51.100.7", "203.0.113.9"


@pytest.mark.parametrize("egress", ["allow", "deny"])
def test_platform_addresses_are_refused_and_egress_is_the_operators_choice(secure_agent, egress):
    agent = secure_agent(extra=["--platform-addresses", "198.51.100.0/24", "--job-egress", egress])
    hosts = {"platform": PLATFORM_HOST, "outside": OUTSIDE_HOST}
    launch_direct(agent, 9611, [PY, "-c", EGRESS], tenant="acme", env={"HOSTS": json.dumps(hosts)})
    result = job_result(wait_output(agent, 9611, "RESULT=", timeout=60))
    assert result["platform"] == "ConnectionRefusedError", result  # rejected by the table, at once
    if egress == "deny":
        assert result["outside"] == "ConnectionRefusedError", result
    else:  # whatever the network does with it (this machine's gateway answers), the table lets it out
        assert result["outside"] != "ConnectionRefusedError", result
