"""The portal's webhook form."""

from __future__ import annotations

from django import forms

from webhooks.events import EVENT_TYPES

GROUPS = [
    ("*", "Every event"),
    ("job.*", "job.*: every change of a job's state"),
    ("endpoint.*", "endpoint.*: scaled or failed"),
    ("budget.*", "budget.*: the alert threshold, used up"),
    ("invoice.*", "invoice.*: issued, paid, payment failed"),
]
EVENT_CHOICES = [*GROUPS, *((t, f"{t}: {what}") for t, what in EVENT_TYPES.items() if t != "ping")]


class WebhookForm(forms.Form):
    url = forms.URLField(
        max_length=2000,
        label="URL",
        assume_scheme="https",
        help_text="Gets a signed POST per event. Public addresses only (loopback and private networks are refused).",
    )
    events = forms.MultipleChoiceField(
        choices=EVENT_CHOICES, widget=forms.CheckboxSelectMultiple, label="Events", initial=["job.*"]
    )
    description = forms.CharField(max_length=200, required=False, label="Description")

    def clean_events(self):
        chosen = self.cleaned_data["events"]
        return ["*"] if "*" in chosen else chosen
