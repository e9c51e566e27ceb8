"""The portal's endpoint forms. They validate through the API's serializers, so the
browser shows the messages a CI pipeline gets."""

from __future__ import annotations

import shlex

from django import forms

from endpoints.api.serializers import EndpointUpdateSerializer, EndpointWriteSerializer

from .forms import _flat, _number_or_text

SLICES = [("0.125", "⅛ GPU"), ("0.25", "¼ GPU"), ("0.5", "½ GPU"), *((str(n), f"{n} GPU") for n in range(1, 9))]
# form field -> API field (the forms use the API's names except for the idle timeout)
NUMBERS = ("min_replicas", "max_replicas", "concurrency_target", "idle_timeout_seconds")


class EndpointForm(forms.Form):
    name = forms.CharField(max_length=63, label="Name", help_text="Letters, digits, - and _; part of its URL.")
    command = forms.CharField(
        label="Command",
        widget=forms.Textarea(attrs={"rows": 2, "spellcheck": "false"}),
        help_text="An HTTP server listening on $PORT, split like a shell would: python serve.py",
    )
    image = forms.CharField(required=False, label="Container image")
    gpus = forms.ChoiceField(choices=SLICES, initial="0.25", label="Slice per replica")
    min_replicas = forms.CharField(initial="0", label="Min replicas", help_text="0: scales to zero when idle.")
    max_replicas = forms.CharField(initial="1", label="Max replicas")
    concurrency_target = forms.CharField(initial="4", label="Requests in flight per replica")
    idle_timeout_seconds = forms.CharField(initial="60", label="Idle timeout (seconds)")
    health_path = forms.CharField(initial="/health", label="Health path")
    env = forms.CharField(
        required=False,
        label="Environment",
        widget=forms.Textarea(attrs={"rows": 2, "spellcheck": "false"}),
        help_text="One NAME=value per line.",
    )

    serializer_class = EndpointWriteSerializer

    def body(self) -> tuple[dict, dict]:
        """The API body from the form, and the problems found reading it."""
        data, errors, body = self.cleaned_data, {}, {}
        for name in self.fields:
            raw = (data.get(name) or "").strip() if isinstance(data.get(name), str) else data.get(name)
            if raw in ("", None):
                continue
            if name == "command":
                try:
                    body["command"] = shlex.split(raw)
                except ValueError as exc:
                    errors["command"] = [f"cannot split the command: {exc}"]
            elif name == "env":
                env = {}
                for line in raw.splitlines():
                    key, sep, value = line.strip().partition("=")
                    if line.strip() and not sep:
                        errors["env"] = [f"{line.strip()!r} is not NAME=value"]
                    elif line.strip():
                        env[key.strip()] = value
                body["env"] = env
            elif name in NUMBERS or name == "gpus":
                body[name] = _number_or_text(raw)
            else:
                body[name] = raw
        return body, errors

    def clean(self):
        body, errors = self.body()
        serializer = self.serializer_class(data=body)
        if not serializer.is_valid():
            for key, messages in serializer.errors.items():
                errors.setdefault(key if key in self.fields else None, []).extend(str(m) for m in _flat(messages))
        self.validated = serializer.validated_data if not errors else None
        for key, messages in errors.items():
            for message in messages:
                self.add_error(key, message)
        return self.cleaned_data


class EndpointEditForm(EndpointForm):
    """Change an endpoint: the name stays; a change of command, image, slice or env rolls out a new version."""

    name = None
    serializer_class = EndpointUpdateSerializer

    @classmethod
    def initial_from(cls, endpoint) -> dict:
        gpus = endpoint.gpu_milli / 1000
        return {
            "command": shlex.join(endpoint.command),
            "image": endpoint.image,
            "gpus": f"{gpus:g}",
            "min_replicas": str(endpoint.min_replicas),
            "max_replicas": str(endpoint.max_replicas),
            "concurrency_target": str(endpoint.concurrency_target),
            "idle_timeout_seconds": str(endpoint.idle_timeout_s),
            "health_path": endpoint.health_path,
            "env": "\n".join(f"{k}={v}" for k, v in endpoint.env.items()),
        }


class ScaleForm(forms.Form):
    min_replicas = forms.IntegerField(min_value=0, max_value=64, label="Min")
    max_replicas = forms.IntegerField(min_value=1, max_value=64, label="Max")
