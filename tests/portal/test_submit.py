"""The submit form: the API's messages next to the fields, nothing typed lost,
live validation and estimate, resubmit pre-filled."""

from __future__ import annotations

import html
import json
import shlex

import pytest
from django.urls import reverse
from django.utils.html import escape, strip_tags
from django_scopes import scopes_disabled

from scheduler.models import Job, JobState
from tests.portal.conftest import job_make

pytestmark = pytest.mark.django_db

GOOD = {"kind": "training", "gpus": "2", "command": "python train.py --epochs '3 4'", "name": "bert"}


def api_errors(api_client_for, tenant, body: dict) -> dict:
    response = api_client_for(tenant).post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 400, response.content
    return response.json()["error"]["fields"]


def test_a_valid_form_submits_the_same_job_as_the_api(client_for, tenant):
    owner = client_for(tenant)
    response = owner.post(
        reverse("portal:submit"), {**GOOD, "env": "SEED=1\nMODE=fast=yes", "max_runtime_seconds": "600"}
    )
    assert response.status_code == 302
    with scopes_disabled():
        job = Job.objects.get(tenant=tenant)
    assert response["Location"] == reverse("portal:job", kwargs={"pk": job.pk})
    assert job.command == ["python", "train.py", "--epochs", "3 4"]
    assert job.env == {"SEED": "1", "MODE": "fast=yes"}
    assert (job.gpu_milli, job.mode, job.max_runtime_s, job.state) == (2000, "dedicated", 600, JobState.QUEUED)
    assert job.submitted_by == owner.user


@pytest.mark.parametrize(
    ("form", "api_body", "field"),
    [
        ({"gpus": "lots"}, {"gpus": "lots"}, "gpus"),
        ({"kind": "mining"}, {"kind": "mining"}, "kind"),
        ({"env": "CUDA_VISIBLE_DEVICES=0"}, {"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env"),
        ({"max_runtime_seconds": "0"}, {"max_runtime_seconds": 0}, "max_runtime_seconds"),
        ({"gpu_memory_mb": "x"}, {"gpu_memory_mb": "x"}, "gpu_memory_mb"),
    ],
)
def test_errors_are_the_apis_next_to_the_field_and_input_is_kept(
    client_for, api_client_for, tenant, form, api_body, field
):
    expected = api_errors(api_client_for, tenant, {"kind": "training", "gpus": 1, "command": ["x"], **api_body})[field]
    owner = client_for(tenant)
    response = owner.post(reverse("portal:submit"), {**GOOD, **form})
    assert response.status_code == 400
    page = response.content.decode()
    errors = page.split(f'id="err-{field}"', 1)[1].split("</ul>", 1)[0]
    for message in expected:
        assert escape(message) in errors
    for value in ("bert", "python train.py --epochs '3 4'", *form.values()):
        assert escape(value) in page  # nothing typed is lost
    with scopes_disabled():
        assert not Job.objects.filter(tenant=tenant).exists()


def test_service_rules_show_the_apis_message(client_for, api_client_for, tenant):
    body = {"kind": "training", "gpus": 0.5, "command": ["x"]}
    response = api_client_for(tenant).post("/api/v1/jobs/", body, format="json")
    api_message = response.json()["error"]["fields"]["gpus"][0]
    page = client_for(tenant).post(reverse("portal:submit"), {**GOOD, "gpus": "0.5"}).content.decode()
    assert api_message in page.split('id="err-gpus"', 1)[1].split("</ul>", 1)[0]


def test_command_that_does_not_split_is_explained(client_for, tenant):
    page = client_for(tenant).post(reverse("portal:submit"), {**GOOD, "command": "python 'unclosed"}).content.decode()
    assert "the command does not split into arguments" in page


def test_live_check_shows_only_touched_fields_and_the_estimate(client_for, api_client_for, tenant):
    owner = client_for(tenant)
    url = reverse("portal:submit_check")
    response = owner.post(url, {"kind": "inference", "gpus": "0.25", "command": "", "_touched": "gpus"})
    page = response.content.decode()
    assert response.status_code == 200
    assert 'id="err-gpus" aria-live="polite" hx-swap-oob="true"></ul>' in page
    assert "This field" not in page  # command is empty but untouched: no error yet
    # 1/4 of an L4 (0.85/h shared) to 1/4 of an H100 (2.99/h) under the serving class (x1).
    assert "$0.21–$0.75" in strip_tags(page)  # per hour, as billing.selectors.job_estimate rounds it (cents)
    body = json.loads(html.unescape(page).split(" -d '", 1)[1].split("'", 1)[0])
    assert body == {"kind": "inference", "gpus": 0.25, "command": []}
    touched = owner.post(url, {"kind": "inference", "gpus": "0.3", "command": "", "_touched": "gpus,command"})
    page = touched.content.decode()
    assert "a shared slice is 0.125, 0.25 or 0.5 of a GPU" in page
    command_error = api_errors(api_client_for, tenant, {"kind": "inference", "gpus": 0.25, "command": []})["command"][0]
    assert escape(command_error) in page.split('id="err-command"', 1)[1].split("</ul>", 1)[0]


def test_resubmit_prefills_the_form_from_a_job(client_for, tenant):
    owner = client_for(tenant)
    job = job_make(tenant, user=owner.user, name="again", env={"A": "1"}, image="repo/img:1")
    page = owner.get(reverse("portal:submit") + f"?from={job.pk}").content.decode()
    for value in ("again", "python train.py", "A=1", "repo/img:1", 'value="1"'):
        assert value in page


def test_cli_box_parses_back_to_the_same_body(client_for, tenant):
    from gpushare_client.cli.app import State
    from gpushare_client.cli.jobs import job_body, submit

    form = {**GOOD, "gpus": "0.25", "kind": "inference", "env": "A=1\nB=x y", "priority": "serving", "image": "r/i:1"}
    page = client_for(tenant).post(reverse("portal:submit_check"), form).content.decode()
    cli = html.unescape(page.split('<pre id="cli">', 1)[1].split("</pre>", 1)[0])
    curl = html.unescape(page.split('<pre id="curl">', 1)[1].split("</pre>", 1)[0])
    export, line = cli.split("\n")
    assert export.startswith("export GPUSHARE_URL=http://testserver")
    argv = shlex.split(line)
    assert argv[:2] == ["gpushare", "submit"]
    with submit.make_context("submit", argv[2:], obj=State()) as ctx:
        from_cli = job_body(**ctx.params)
    from_curl = json.loads(curl.split(" -d '", 1)[1].rsplit("'", 1)[0])
    assert (
        from_cli
        == from_curl
        == {
            "kind": "inference",
            "gpus": 0.25,
            "command": ["python", "train.py", "--epochs", "3 4"],
            "name": "bert",
            "env": {"A": "1", "B": "x y"},
            "image": "r/i:1",
            "priority": "serving",
        }
    )


def test_blank_form_shows_no_errors_but_the_defaults_price(client_for, tenant):
    page = client_for(tenant).get(reverse("portal:submit")).content.decode()
    assert "<li>" not in page.split('id="submit-form"', 1)[1].split("</form>", 1)[0]  # no error shown yet
    assert "$0.70–$2.49" in strip_tags(page)  # one whole GPU, L4 to H100, standard class
    assert "gpushare submit --kind training --gpus 1 --wait --" in page


def test_a_resent_form_submits_one_job(client_for, tenant):
    owner = client_for(tenant)
    page = owner.get(reverse("portal:submit")).content.decode()
    key = page.split('name="idempotency_key" value="', 1)[1].split('"', 1)[0]
    assert key.startswith("portal-")
    first = owner.post(reverse("portal:submit"), {**GOOD, "idempotency_key": key})
    again = owner.post(reverse("portal:submit"), {**GOOD, "idempotency_key": key})  # a double click
    assert first.status_code == again.status_code == 302 and first["Location"] == again["Location"]
    # The same key with a changed request (edited after going back) is a new job, not an error.
    changed = owner.post(reverse("portal:submit"), {**GOOD, "gpus": "1", "idempotency_key": key})
    assert changed.status_code == 302 and changed["Location"] != first["Location"]
    with scopes_disabled():
        assert Job.objects.filter(tenant=tenant).count() == 2
