"""The node token is on no readable surface of the node, the agent's state is
private, and a node says which tenancy it enforces."""

from __future__ import annotations

import os
import stat

import pytest

from agents.models import Node
from tests.agents.conftest import env_dump_command, launch_direct, parse_env_dump, unique_node_name, wait_output
from tests.security.conftest import PY

pytestmark = pytest.mark.integration


def test_the_token_is_gone_from_the_agents_environment_and_its_state_is_private(secure_agent):
    agent = secure_agent()
    # Even root reading the agent's initial environment (/proc/<pid>/environ) no longer finds it.
    environ = open(f"/proc/{agent.proc.pid}/environ", "rb").read()
    assert b"GPUSHARE_AGENT_TOKEN=" in environ  # the variable's name is left, its value overwritten
    assert agent.token.encode() not in environ
    assert agent.token.encode() not in open(f"/proc/{agent.proc.pid}/cmdline", "rb").read()
    launch_direct(agent, 9801, [PY, "-c", "print('ok', flush=True)"])
    wait_output(agent, 9801, "ok")
    state = agent.var_dir / "agent" / agent.node
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(state.parent).st_mode) == 0o700
    for path in [*state.iterdir(), *(state / "logs").iterdir()]:
        if path.is_file():
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    work_root = os.stat(agent.argv[agent.argv.index("--work-root") + 1])
    assert stat.S_IMODE(work_root.st_mode) == 0o711  # entered, never listed


def test_a_token_file_others_can_read_is_refused(agent_factory, tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("whatever")
    token_file.chmod(0o644)
    agent = agent_factory(unique_node_name(), extra=["--token-file", str(token_file)], wait=False)
    assert agent.proc.wait(timeout=30) != 0
    assert "must be readable by the agent only" in agent.log()


def test_single_tenant_mode_is_said_at_start_and_shown_in_the_fleet(agent_factory, admin_client):
    node = unique_node_name()
    agent = agent_factory(node, extra=["--tenancy", "single"])
    assert "SINGLE-TENANT MODE" in agent.log()
    assert Node.objects.get(name=node).isolation == {"tenancy": "single"}
    fleet = admin_client.get("/console/fleet/").content.decode()
    assert 'data-testid="node-tenancy"' in fleet and "single-tenant" in fleet
    # ... and the job sees no secret of the agent's anyway.
    launch_direct(agent, 9811, env_dump_command())
    env = parse_env_dump(wait_output(agent, 9811, "ENV="))
    assert "GPUSHARE_AGENT_TOKEN" not in env and agent.token not in str(env)


def test_a_multi_tenant_node_reports_its_isolation(secure_agent):
    agent = secure_agent()
    isolation = Node.objects.get(name=agent.node).isolation
    assert isolation["tenancy"] == "multi" and isolation["network_policy"] == "nft"
    assert isolation["uid_pool"] == agent.argv[agent.argv.index("--uid-pool") + 1]


def test_a_multi_tenant_node_never_falls_back_silently(agent_factory, tmp_path):
    """A work root job uids cannot enter: the agent refuses to start, and says why."""
    hidden = tmp_path / "private"  # pytest's tmp dirs are 0700
    agent = agent_factory(
        unique_node_name(),
        extra=["--tenancy", "multi", "--work-root", str(hidden / "jobs"), "--uid-pool", "400000-400003"],
        wait=False,
    )
    assert agent.proc.wait(timeout=30) != 0
    assert "cannot reach their work dirs" in agent.log()
