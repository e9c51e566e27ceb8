"""Portal forms. The submit form validates through the API's serializer, so the
browser shows exactly the messages a CI pipeline gets."""

from __future__ import annotations

import json
import shlex
import uuid
from decimal import Decimal, InvalidOperation

from django import forms
from rest_framework.exceptions import ValidationError as DRFValidationError

from accounts.models import Role
from accounts.services import ALL_SCOPES, DEFAULT_SCOPES
from scheduler import services
from scheduler.api.idempotency import MAX_KEY_LENGTH
from scheduler.api.serializers import JobCreateSerializer
from scheduler.models import Job, JobKind

from .selectors import gpu_models, priority_classes


class JobSubmitForm(forms.Form):
    """Mirrors ``POST /api/v1/jobs/``; field names are the API's."""

    name = forms.CharField(required=False, label="Name", help_text="Optional; helps you find the job later.")
    kind = forms.ChoiceField(
        choices=JobKind.choices,
        label="Kind",
        initial=JobKind.TRAINING,
        help_text="Training takes whole GPUs; inference may take a shared slice.",
    )
    gpus = forms.CharField(
        label="GPUs", initial="1", help_text="1–8 whole GPUs, or 0.125, 0.25 or 0.5 of one GPU (inference only)."
    )
    gpu_model = forms.ChoiceField(required=False, label="GPU model")
    command = forms.CharField(
        label="Command",
        widget=forms.Textarea(attrs={"rows": 2, "spellcheck": "false"}),
        help_text="Split like a shell would: python train.py --epochs 3",
    )
    image = forms.CharField(required=False, label="Container image")
    env = forms.CharField(
        required=False,
        label="Environment",
        widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false"}),
        help_text="One NAME=value per line.",
    )
    priority = forms.ChoiceField(required=False, label="Priority class")
    max_runtime_seconds = forms.CharField(
        required=False,
        label="Max runtime (seconds)",
        help_text="The job is stopped after this long. Empty: the platform default.",
    )
    gpu_memory_mb = forms.CharField(required=False, label="GPU memory needed (MiB)")
    # One key per form shown: a double click or a resent POST submits one job.
    idempotency_key = forms.CharField(required=False, widget=forms.HiddenInput, max_length=MAX_KEY_LENGTH)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.is_bound:
            self.initial.setdefault("idempotency_key", f"portal-{uuid.uuid4()}")
        self.fields["gpu_model"].choices = [("", "Any model")] + [(m, m) for m in gpu_models()]
        self.fields["priority"].choices = [("", "Default for the kind")] + [
            (p.name, f"{p.name} (×{p.price_multiplier.normalize()}{', preemptible' if p.preemptible else ''})")
            for p in priority_classes()
        ]
        self.api_body: dict = {}
        self.validated: dict | None = None
        self.mode: str | None = None
        self.gpu_milli: int | None = None
        self.priority_class = None

    # Choice fields would reject an unknown value with Django's wording; the API
    # decides instead, so its message is the one shown.
    def _clean_fields(self):
        for name, bound in self._bound_items():
            self.cleaned_data[name] = bound.data if bound.data is not None else ""

    def clean(self):
        body, errors = api_body_from(self.cleaned_data)
        self.api_body = body
        serializer = JobCreateSerializer(data=body)
        if not serializer.is_valid():
            for key, messages in serializer.errors.items():
                errors.setdefault(key if key in self.fields else None, []).extend(str(m) for m in _flat(messages))
        else:
            self.validated = serializer.validated_data
        self._rules_check(serializer, errors)
        for key, messages in errors.items():
            for message in messages:
                self.add_error(key, message)
        return self.cleaned_data

    def _rules_check(self, serializer: JobCreateSerializer, errors: dict) -> None:
        """The request rules job_submit applies first (slice sizes, whole GPUs for
        training, a known priority class), checked as soon as kind and gpus are
        valid so typing shows them; they also give the mode for the estimate."""
        try:
            kind = serializer.fields["kind"].run_validation(self.api_body.get("kind"))
            self.gpu_milli = serializer.fields["gpus"].run_validation(self.api_body.get("gpus"))
            priority = serializer.fields["priority"].run_validation(self.api_body.get("priority", ""))
        except DRFValidationError:
            return
        try:
            self.mode = services.job_mode_for(kind=kind, gpu_milli=self.gpu_milli)
            self.priority_class = services.priority_for(kind=kind, name=priority)
        except services.JobError as exc:
            errors.setdefault(exc.field if exc.field in self.fields else None, []).append(str(exc))
            self.validated = self.mode = None

    def spec(self) -> services.JobSpec:
        return JobCreateSerializer.spec(self.validated)

    def add_job_error(self, exc: services.JobError) -> None:
        self.add_error(exc.field if exc.field in self.fields else None, str(exc))


def _flat(messages):
    if isinstance(messages, dict):
        for value in messages.values():
            yield from _flat(value)
    elif isinstance(messages, list):
        for value in messages:
            yield from _flat(value)
    else:
        yield messages


def _number_or_text(raw: str):
    """'2' -> 2, '0.25' -> 0.25, anything else unchanged (the serializer judges it)."""
    try:
        value = Decimal(raw)
    except InvalidOperation:
        return raw
    if not value.is_finite():
        return raw
    return int(value) if value == value.to_integral_value() else float(value)


def api_body_from(data: dict) -> tuple[dict, dict[str, list[str]]]:
    """The JSON body the API would get for this form, and the errors met turning
    the form's text into it (a command that does not split, an env line without '=')."""
    errors: dict[str, list[str]] = {}
    body: dict = {"kind": data.get("kind", "")}
    body["gpus"] = _number_or_text((data.get("gpus") or "").strip())
    try:
        body["command"] = shlex.split(data.get("command") or "")
    except ValueError as exc:
        body["command"] = []
        errors["command"] = [f"the command does not split into arguments: {exc}"]
    env: dict[str, str] = {}
    for number, line in enumerate((data.get("env") or "").splitlines(), start=1):
        if not line.strip():
            continue
        key, sep, value = line.partition("=")
        if not sep:
            errors.setdefault("env", []).append(f"line {number}: write NAME=value")
            continue
        env[key.strip()] = value
    if env:
        body["env"] = env
    for key in ("name", "image", "gpu_model", "priority"):
        if (data.get(key) or "").strip():
            body[key] = data[key].strip()
    for key in ("max_runtime_seconds", "gpu_memory_mb"):
        if (data.get(key) or "").strip():
            raw = data[key].strip()
            body[key] = int(raw) if raw.isdigit() and len(raw) < 16 else raw
    return body, errors


def form_initial_from_job(job: Job) -> dict:
    """A form pre-filled with a job's request (for resubmit)."""
    gpus = job.gpus
    return {
        "name": job.name,
        "kind": job.kind,
        "gpus": str(gpus),
        "gpu_model": job.gpu_model,
        "command": shlex.join(job.command),
        "image": job.image,
        "env": "\n".join(f"{k}={v}" for k, v in job.env.items()),
        "priority": job.priority.name,
        "max_runtime_seconds": str(job.max_runtime_s),
        "gpu_memory_mb": str(job.gpu_memory_mb or ""),
    }


def curl_for(body: dict, *, base_url: str) -> str:
    payload = json.dumps(body, separators=(", ", ": "))
    return (
        f"curl -sS -X POST {base_url}/api/v1/jobs/ \\\n"
        '  -H "Authorization: Bearer $GPUSHARE_TOKEN" \\\n'
        '  -H "Content-Type: application/json" \\\n'
        '  -H "Idempotency-Key: $(uuidgen)" \\\n'
        f"  -d {shlex.quote(payload)}"
    )


CLI_FLAGS = (
    ("name", "--name"),
    ("kind", "--kind"),
    ("gpus", "--gpus"),
    ("gpu_model", "--gpu-model"),
    ("gpu_memory_mb", "--gpu-memory-mb"),
    ("image", "--image"),
    ("priority", "--priority"),
    ("max_runtime_seconds", "--max-runtime-seconds"),
)


def cli_for(body: dict, *, base_url: str) -> str:
    """The same submission with the ``gpushare`` CLI (token and address from the environment)."""
    parts = ["gpushare", "submit"]
    for key, flag in CLI_FLAGS:
        if body.get(key) not in (None, ""):
            parts += [flag, str(body[key])]
    for key, value in (body.get("env") or {}).items():
        parts += ["--env", f"{key}={value}"]
    parts += ["--wait", "--"] + [str(arg) for arg in body.get("command") or []]
    return f"export GPUSHARE_URL={shlex.quote(base_url)}  # and GPUSHARE_TOKEN\n" + shlex.join(parts)


class InviteForm(forms.Form):
    email = forms.EmailField(label="Email", help_text="They get a one-time link, valid for a few days.")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER, label="Role")
    any_address = forms.BooleanField(
        required=False,
        label="Any address may accept",
        help_text="Owners only: whoever signs in with the link joins, not only this address's account.",
    )


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices, label="Role")


class TokenCreateForm(forms.Form):
    name = forms.CharField(max_length=100, label="Name", help_text="Where it is used, e.g. 'github-actions'.")
    scopes = forms.MultipleChoiceField(
        choices=[(s, s) for s in ALL_SCOPES],
        initial=list(DEFAULT_SCOPES),
        widget=forms.CheckboxSelectMultiple,
        label="Scopes",
    )
    expires_days = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=3650,
        label="Expires after (days)",
        help_text="Empty: never (revoke it when no longer needed).",
    )
