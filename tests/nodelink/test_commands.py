"""Commands reach a real agent process over the real broker: only what the platform signed for that node runs.

Each refused command is refused by the agent (nothing runs), reported to the
platform and counted per node (agents.LinkRefusal, the fleet view).
"""

from __future__ import annotations

import sys
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings

from agents import nodelink
from agents.agent.protocol import LAUNCH, CommandSigner
from agents.dispatch import _redis_push, node_send
from agents.models import LinkRefusal
from tests.agents.conftest import unique_node_name
from tests.factories import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def launch_body(job_id: int, marker) -> dict:
    return {
        "job_id": job_id,
        "attempt": 1,
        "tenant": "t",
        "command": [sys.executable, "-c", f"open({str(marker)!r}, 'a').write('ran\\n')"],
        "env": {},
        "gpu_uuids": [],
        "share_milli": 1000,
        "mode": "dedicated",
        "max_runtime_s": 60,
        "grace_s": 2,
    }


def push(node: str, task: str, kwargs: dict) -> None:
    """Put a message on ``node``'s queue as anyone with write access to the broker could."""
    _redis_push(settings.CELERY_BROKER_URL, [(node, task, kwargs)])


def refusals(node: str) -> list[str]:
    return list(LinkRefusal.objects.filter(node__name=node, direction="command").values_list("reason", flat=True))


def wait_refused(node: str, count: int, what: str) -> list[str]:
    return wait_for(lambda: len(r := refusals(node)) >= count and r, timeout=30, what=what)


def test_only_a_signed_command_for_this_node_runs(agent_factory, tmp_path):
    node, other = unique_node_name(), unique_node_name()
    agent = agent_factory(node, gpus="sim:1xH100-80GB")
    markers = {name: tmp_path / f"{name}.ran" for name in ("unsigned", "expired", "other", "forged", "good")}
    signer = nodelink.signer()

    # 1. unsigned: the launch a job could write with broker access before (a plain Celery message)
    push(node, LAUNCH, launch_body(9101, markers["unsigned"]))
    # 2. signed by the platform, but expired
    hour_ago = int(time.time() * 1000) - 3_600_000
    push(node, LAUNCH, signer.sign(node, LAUNCH, launch_body(9102, markers["expired"]), now=hour_ago))
    # 3. signed by the platform for another node, put on this node's queue
    push(node, LAUNCH, signer.sign(other, LAUNCH, launch_body(9103, markers["other"])))
    # 4. signed with a key the platform does not have
    forger = CommandSigner(Ed25519PrivateKey.generate())
    push(node, LAUNCH, forger.sign(node, LAUNCH, launch_body(9104, markers["forged"])))

    reasons = wait_refused(node, 4, "four refusals")
    assert any("unsigned" in r for r in reasons), reasons
    assert any("expired" in r for r in reasons), reasons
    assert any("addressed to node" in r for r in reasons), reasons
    assert any("does not trust" in r for r in reasons), reasons
    # 5. the control: the platform's own signed launch runs
    node_send(node, LAUNCH, launch_body(9105, markers["good"]))
    wait_for(markers["good"].exists, timeout=30, what="the signed launch to run")
    time.sleep(1)
    for name in ("unsigned", "expired", "other", "forged"):
        assert not markers[name].exists(), f"the {name} command ran"
    assert "command 'agent.launch' refused" in agent.log()


def test_a_replayed_command_is_refused(agent_factory, tmp_path):
    node = unique_node_name()
    agent_factory(node, gpus="sim:1xH100-80GB")
    marker = tmp_path / "replay.ran"
    envelope = nodelink.signer().sign(node, LAUNCH, launch_body(9201, marker))

    push(node, LAUNCH, envelope)
    wait_for(marker.exists, timeout=30, what="the launch to run")
    wait_for(lambda: marker.read_text().count("ran") == 1, timeout=10, what="the job to finish")
    push(node, LAUNCH, envelope)  # the very same signed message, captured and sent again

    reasons = wait_refused(node, 1, "the replay to be refused")
    assert any("replayed" in r for r in reasons), reasons
    assert marker.read_text().count("ran") == 1


def test_refusals_are_counted_per_node_in_the_fleet_view(agent_factory, client, django_user_model):
    node = unique_node_name()
    agent_factory(node, gpus="sim:1xH100-80GB")
    push(node, LAUNCH, {"job_id": 1, "attempt": 1, "command": ["true"]})
    wait_refused(node, 1, "the refusal")
    operator = django_user_model.objects.create_user("op-link", "op-link@example.com", "pw", is_staff=True)
    operator.is_superuser = True
    operator.save()
    client.force_login(operator)

    page = client.get("/console/fleet/")

    assert page.status_code == 200
    assert "refused" in page.content.decode()
