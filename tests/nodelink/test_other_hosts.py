"""Nodes on other hosts: nothing assumes the agent shares the platform's host (issue #16, point 7).

Two network namespaces play two GPU servers. Each is joined to the platform's
host (the root namespace, where PostgreSQL, Redis, the web server, the Celery
worker, beat and the endpoint gateway run) by a veth link on a bridge, on a
private /24 this test creates and removes (10.231.77.0/24, or the next free
one): the platform is .1, the nodes .2 and .3. A node's only way to the
platform is that link: its loopback is its own, so the platform's 127.0.0.1
services (PostgreSQL, Redis) are out of its reach, and it has no other route.
Redis is reached through a TCP forwarder bound on the platform's veth address
only (the broker's port on the platform's LAN address, as in production).

Each agent has what an operator gives a node, and nothing else: its own var
dir, its credential in a 0600 token file, the platform's public keys in a file
copied in, a broker URL with its own Redis ACL user (``manage.py
node_credential``), ``--advertise-address`` set to its namespace's address; no
database URL, no Django settings, and the platform's var dir and signing-key
directory are hidden from it (empty tmpfs in its own mount namespace).

End to end: a training job runs on one node, a 1/4 slice on the other, and an
inference request through the gateway reaches a replica on a node over the
veth; reports (events, usage windows, logs) come back over the same link.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shlex
import shutil
import sqlite3
import subprocess
import sys
import time
import uuid
from contextlib import closing
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import redis
import requests
from django.conf import settings
from django_scopes import scopes_disabled

from agents.agent.netpolicy import table_name
from agents.brokeracl import redis_acl_rules, redis_user
from agents.models import Node
from billing.models import UsageWindow
from chaos.proxy import CuttableProxy
from endpoints.models import Replica
from tests.factories import TenantFactory, token_for, wait_for
from tests.processes import AgentProcess

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

MODEL_SERVER = str(Path(__file__).resolve().parent.parent / "endpoints" / "model_server.py")
SCOPES = ["jobs:read", "jobs:write", "usage:read", "endpoints:invoke"]


def _netns_unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth links, a bridge)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2's `ip` and util-linux's `unshare`"
    if subprocess.run(["ip", "netns", "list"], capture_output=True, check=False).returncode != 0:
        return "`ip netns` is unavailable here"
    return ""


if reason := _netns_unavailable():  # pragma: no cover - CI and the dev machines run as root
    pytest.skip(reason, allow_module_level=True)


def ip(*args: str, netns: str = "") -> str:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


def _free_subnet() -> ipaddress.IPv4Network:
    """10.231.77.0/24, or the next 10.231.x.0/24 no address or route of this machine uses (a parallel run)."""
    used = ip("-4", "-o", "addr", "show") + ip("-4", "route", "show", "table", "all")
    for third in range(77, 127):
        if not re.search(rf"\b10\.231\.{third}\.", used):
            return ipaddress.IPv4Network(f"10.231.{third}.0/24")
    raise RuntimeError("no free 10.231.x.0/24 for the test's hosts")


class Hosts:
    """A bridge on the platform's host and one namespace per node host, each on a veth into the bridge."""

    def __init__(self, names: tuple[str, ...]):
        self.tag = uuid.uuid4().hex[:5]
        self.net = _free_subnet()
        hosts = list(self.net.hosts())
        self.platform_address = str(hosts[0])
        self.bridge = f"gs{self.tag}br"
        self.namespaces: dict[str, str] = {}
        self.addresses: dict[str, str] = {}
        self._links: list[str] = []
        self._bridge_made = False
        try:
            self._make(names, hosts[1:])
        except BaseException:
            self.close()  # whatever was made before the failure
            raise

    def _make(self, names: tuple[str, ...], addresses: list) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        ip("addr", "add", f"{self.platform_address}/{self.net.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, name in enumerate(names):
            ns, outer, inner = f"gs-{self.tag}-{name}", f"gs{self.tag}{name}0", f"gs{self.tag}{name}1"
            ip("netns", "add", ns)
            self.namespaces[name] = ns
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._links.append(outer)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", outer, "master", self.bridge)
            ip("link", "set", outer, "up")
            address = str(addresses[i])
            ip("addr", "add", f"{address}/{self.net.prefixlen}", "dev", inner, netns=ns)
            ip("link", "set", inner, "up", netns=ns)
            ip("link", "set", "lo", "up", netns=ns)
            self.addresses[name] = address

    def exec_argv(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[name]]

    def close(self) -> None:
        for ns in self.namespaces.values():
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        for link in [*self._links, *([self.bridge] if self._bridge_made else [])]:
            subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)


@pytest.fixture
def hosts():
    made = Hosts(("a", "b"))
    yield made
    made.close()


@pytest.fixture
def broker_on_the_lan(hosts):
    """Redis on the platform's LAN address: a forwarder bound on the bridge's address only."""
    target = urlsplit(settings.REDIS_URL)
    proxy = CuttableProxy(target.hostname or "127.0.0.1", target.port or 6379, listen_host=hosts.platform_address)
    yield proxy
    proxy.close()


def _hidden() -> list[Path]:
    """The platform's own directories, which a node on another host does not have: its var dir and key dir."""
    from agents.nodelink import key_dir

    var_dir, keys = Path(settings.VAR_DIR).resolve(), key_dir().resolve()
    keys.mkdir(parents=True, exist_ok=True)
    var_dir.mkdir(parents=True, exist_ok=True)
    return [var_dir] if keys.is_relative_to(var_dir) else [var_dir, keys]


@pytest.fixture
def remote_agent(hosts, broker_on_the_lan, celery_worker_process, tmp_path):
    """``remote_agent(host, node, gpus)``: an agent in ``host``'s namespace, set up as an operator would."""
    from agents.nodelink import trusted_keys
    from agents.services import node_credential_issue

    admin = redis.Redis.from_url(settings.REDIS_URL)
    db = urlsplit(settings.REDIS_URL).path.lstrip("/") or "0"
    started: list[AgentProcess] = []
    users: list[str] = []
    pools: list[tuple[int, int]] = []

    def make(host: str, node: str, gpus: str, extra=()) -> AgentProcess:
        # What the operator carries to the node: a credential, a broker password, the platform's public keys.
        token = node_credential_issue(name=node)
        password = secrets.token_urlsafe(16)
        admin.execute_command("ACL", "SETUSER", redis_user(node), *redis_acl_rules(node, password))
        users.append(redis_user(node))
        etc = tmp_path / f"host-{host}" / "etc"
        etc.mkdir(parents=True, mode=0o700)
        (etc / "token").write_text(token + "\n")
        os.chmod(etc / "token", 0o600)
        (etc / "platform-keys.pub").write_text("\n".join(trusted_keys()) + "\n")
        broker = f"redis://{redis_user(node)}:{password}@{hosts.platform_address}:{broker_on_the_lan.port}/{db}"
        var_dir = tmp_path / f"host-{host}" / "var"
        # Its own mount namespace too: the platform's var dir and signing keys are not there (empty tmpfs over them).
        mounts = " && ".join(f"mount -t tmpfs -o size=64k,mode=700 gshidden {shlex.quote(str(d))}" for d in _hidden())
        argv = [
            *hosts.exec_argv(host),
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'{mounts} && exec "$0" "$@"',
            sys.executable,
            "-m",
            "agents",
            "--node",
            node,
            "--token-file",
            str(etc / "token"),
            "--broker",
            broker,
            "--advertise-address",
            hosts.addresses[host],
            "--var-dir",
            str(var_dir),
            "--gpus",
            gpus,
            "--sample-interval",
            "0.2",
            "--window",
            "1",
            "--heartbeat",
            "1",
            *(extra or ["--tenancy", "single"]),
        ]
        # Nothing of the platform's environment: no DATABASE_URL, REDIS_URL, settings module or key.
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(var_dir),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "GPUSHARE_NODELINK_PUBLIC_KEY_FILE": str(etc / "platform-keys.pub"),
        }
        if "--uid-pool" in extra:
            pools.append(tuple(int(u) for u in extra[list(extra).index("--uid-pool") + 1].split("-")))
        agent = AgentProcess(node=node, token=token, argv=argv, env=env, var_dir=var_dir).start()
        started.append(agent)
        wait_for(
            lambda: (
                Node.objects.filter(name=node, state=Node.State.UP, gpus__isnull=False).exists()
                or agent.proc.poll() is not None
            ),
            timeout=60,
            what=f"agent {node} on host {host} to register",
        )
        if agent.proc.poll() is not None:
            raise RuntimeError(f"agent {node} exited: {agent.log()[-3000:]}")
        return agent

    yield make
    for agent in started:
        agent.stop()
    for first, last in pools:  # a multi-tenant node's job uids: nothing left running, no lock file left
        for proc in psutil.process_iter(["uids"]):
            if proc.info["uids"] and first <= proc.info["uids"].real <= last:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
        for uid in range(first, last + 1):
            Path(f"/run/gpushare/uids/{uid}").unlink(missing_ok=True)
    for user in users:
        admin.execute_command("ACL", "DELUSER", user)


@pytest.fixture
def work_root():
    """Job work dirs of the multi-tenant node: a root every job uid can traverse (tmp_path is 0700)."""
    root = Path(f"/tmp/gpushare-hosts-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    root.mkdir(mode=0o711)
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


# Jobs on the multi-tenant node run as pool uids, which cannot enter this venv's interpreter (under /root).
PY = "/usr/bin/python3"

# A job on a node host: what it can see of the platform's host, then a little work.
PROBE = r"""
import os, socket, sys, time
for name, (host, port) in (
    ("redis", ("127.0.0.1", {redis})), ("postgres", ("127.0.0.1", {pg})), ("lan_broker", ({lan!r}, {lan_port}))
):
    try:
        socket.create_connection((host, port), timeout=2).close()
        print(name + "=reachable")
    except OSError as exc:
        print(name + "=" + type(exc).__name__)
print("signing_key_visible=" + str(os.path.exists({key!r})))
print("visible=" + os.environ.get("CUDA_VISIBLE_DEVICES", ""), flush=True)
time.sleep(1.5)
"""


def _outbox(agent: AgentProcess) -> list[str]:
    """The reports still in the agent's outbox, not yet acknowledged (its own state file, read-only)."""
    path = agent.var_dir / "agent" / agent.node / "state.sqlite3"
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
        return [task for (task,) in db.execute("SELECT task FROM outbox")]


def _job(platform, session, body: dict) -> dict:
    response = session.post(f"{platform.url}/api/v1/jobs/", json=body, timeout=10)
    assert response.status_code == 201, response.text
    return response.json()


def _finished(platform, session, job_id: int, timeout: float = 90) -> dict:
    def done():
        body = session.get(f"{platform.url}/api/v1/jobs/{job_id}/", timeout=10).json()
        return body if body["state"] in ("succeeded", "failed", "cancelled") else None

    return wait_for(done, timeout=timeout, what=f"job {job_id} to finish")


def _logs(platform, session, job_id: int, marker: str) -> str:
    return wait_for(
        lambda: (
            marker in (data := session.get(f"{platform.url}/api/v1/jobs/{job_id}/logs/", timeout=10).json()["data"])
            and data
        ),
        timeout=30,
        what=f"job {job_id}'s log",
    )


def test_a_job_a_slice_and_an_endpoint_request_cross_to_agents_on_other_hosts(
    platform, hosts, broker_on_the_lan, remote_agent, work_root, gateway, beat
):
    from django.db import connection

    from agents.nodelink import SIGNING, key_dir

    started = time.monotonic()
    a = remote_agent("a", f"host-a-{hosts.tag}", "sim:1xH100-80GB")
    # Host b is multi-tenant: a uid per job, and an nftables policy in its own namespace that keeps jobs off
    # the platform's addresses and lets only the gateway's host into replica ports.
    base = 1_900_000_000 + int(hosts.tag, 16) % 90_000 * 1000
    b = remote_agent(
        "b",
        f"host-b-{hosts.tag}",
        "sim:1xL4-24GB",
        extra=[
            "--tenancy",
            "multi",
            "--uid-pool",
            f"{base}-{base + 7}",
            "--work-root",
            str(work_root / "b"),
            "--platform-addresses",
            f"{hosts.platform_address}/32",
            "--gateway-addresses",
            f"{hosts.platform_address}/32",
        ],
    )
    nodes = {n.name: n for n in Node.objects.filter(name__in=[a.node, b.node])}
    # Each registered with the address it advertised on its own link, not the platform's loopback.
    assert nodes[a.node].address == hosts.addresses["a"]
    assert nodes[b.node].address == hosts.addresses["b"]
    for agent in (a, b):
        assert agent.proc.poll() is None, agent.log()[-2000:]
        assert list(agent.var_dir.iterdir()), "the agent keeps its state in its own var dir"
    # Without --advertise-address an agent would pick its address on the route to the broker: its own link's.
    broker = a.argv[a.argv.index("--broker") + 1]
    detect = "import sys; from agents.agent.address import address_detect; print(address_detect(sys.argv[1]))"
    detected = subprocess.run(
        [*hosts.exec_argv("a"), sys.executable, "-c", detect, broker], capture_output=True, text=True, check=True
    )
    assert detected.stdout.strip() == hosts.addresses["a"]
    # The multi-tenant node's nftables policy is its host's own: in b's namespace, not on the platform's host.
    tables = subprocess.run(
        [*hosts.exec_argv("b"), "nft", "list", "tables"], capture_output=True, text=True, check=True
    ).stdout
    assert f"table inet {table_name(b.node)}" in tables
    assert table_name(b.node) not in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout

    tenant = TenantFactory(slug="acme")
    session = platform.session_for(tenant)
    probe = PROBE.format(
        redis=urlsplit(settings.REDIS_URL).port or 6379,
        pg=int(connection.settings_dict["PORT"] or 5432),
        key=str(key_dir() / SIGNING),
        lan=hosts.platform_address,
        lan_port=broker_on_the_lan.port,
    )
    assert (key_dir() / SIGNING).exists()  # the platform's key, which the nodes must not see

    # A whole GPU for a training job on host a; a quarter of one (an inference job: slices are) on host b.
    training = _job(
        platform,
        session,
        {"kind": "training", "gpus": 1, "gpu_model": "H100-80GB", "command": [sys.executable, "-c", probe]},
    )
    sliced = _job(
        platform,
        session,
        {"kind": "inference", "gpus": 0.25, "gpu_model": "L4-24GB", "command": [PY, "-c", probe]},
    )
    for created, node in ((training, a.node), (sliced, b.node)):
        job = _finished(platform, session, created["id"])
        assert job["state"] == "succeeded", (job, a.log()[-1500:], b.log()[-1500:])
        assert job["node"] == node and job["exit_code"] == 0
        log = _logs(platform, session, job["id"], "visible=")
        # The job ran on its own host: the platform's loopback services are not there, nor its key.
        # (Refused on the single-tenant node, whose loopback has nothing there; the multi-tenant node's policy
        # drops a job's packets to local addresses before that.)
        assert "redis=" in log and "redis=reachable" not in log and "postgres=reachable" not in log, log
        if node == a.node:
            assert "redis=ConnectionRefusedError" in log and "postgres=ConnectionRefusedError" in log, log
        assert "signing_key_visible=False" in log, log
        if node == b.node:  # the multi-tenant node's policy: the platform's LAN address is refused to jobs
            assert "lan_broker=ConnectionRefusedError" in log, log
        assert f"visible={job['gpu_uuids'][0]}" in log
        with scopes_disabled():
            windows = list(UsageWindow.objects.filter(job_id=job["id"]).order_by("seq"))
        assert windows and all(w.node_id == nodes[node].pk for w in windows), "metered, attributed to its node"
        assert [w.seq for w in windows] == list(range(len(windows)))
        assert job["usage"]["gpu_seconds"] > 0 and float(job["cost"]) > 0
    assert float(_finished(platform, session, sliced["id"])["gpus"]) == 0.25
    # Delivery is end to end across the link: each agent's outbox lets go of its reports (registration, job
    # events, usage windows, log chunks) only when the platform's acknowledgements come back over it. Nothing
    # runs on either node now, so both outboxes empty.
    for agent in (a, b):
        wait_for(lambda agent=agent: not _outbox(agent), timeout=60, what=f"{agent.node}'s outbox acknowledged")

    # An endpoint: its replica on host b, the gateway on the platform's host reaching it over the veth.
    token = token_for(tenant, scopes=SCOPES)
    auth = {"Authorization": f"Bearer {token}"}
    deployed = requests.post(
        f"{platform.url}/api/v1/endpoints/",
        json={
            "name": "echo",
            "command": [PY, MODEL_SERVER],
            "env": {"SLEEP_S": "0.05", "BIND": "0.0.0.0"},
            "gpus": 0.25,
            "gpu_model": "L4-24GB",
            "min_replicas": 1,
            "max_replicas": 1,
            "concurrency_target": 2,
            "idle_timeout_seconds": 60,
            "health_path": "/health",
        },
        headers=auth,
        timeout=10,
    )
    assert deployed.status_code == 201, deployed.text
    answer = wait_for(
        lambda: (
            (r := requests.post(f"{gateway}/e/acme/echo/predict", data=b"over the veth", headers=auth, timeout=120))
            and r.status_code == 200
            and r.json()
        ),
        timeout=120,
        what=f"an answer through the gateway (agent b: {b.log()[-1500:]})",
    )
    assert answer["echo"] == "over the veth"
    assert answer["peer"] == hosts.platform_address, "the request came from the platform's host, over the link"
    with scopes_disabled():
        replica = Replica.objects.select_related("job__node").get(endpoint_id=deployed.json()["id"])
    assert replica.job.node.name == b.node and replica.state == Replica.State.READY

    for agent in (a, b):
        assert "NOPERM" not in agent.log() and "refused" not in agent.log(), agent.log()[-2000:]
    print(f"other hosts: {time.monotonic() - started:.1f}s end to end over {hosts.net}")
