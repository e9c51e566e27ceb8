"""Forms of the console's custom pages."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

from django import forms
from django.forms import modelformset_factory
from django.utils import timezone

from scheduler.models import JobKind, PriorityClass

from .rules import ClassDraft

CLASS_FIELDS = [
    "rank",
    "preemptible",
    "may_preempt",
    "min_runtime_s",
    "grace_period_s",
    "price_multiplier",
    "default_for_kind",
]


class PriorityClassRuleForm(forms.ModelForm):
    default_for_kind = forms.ChoiceField(
        choices=[("", "—"), *JobKind.choices], required=False, label="default for kind"
    )

    class Meta:
        model = PriorityClass
        fields = CLASS_FIELDS
        widgets = {"may_preempt": forms.SelectMultiple(attrs={"size": 3})}

    def draft(self) -> ClassDraft:
        return ClassDraft.from_form(self.cleaned_data, name=self.instance.name)


PriorityClassRuleFormSet = modelformset_factory(PriorityClass, form=PriorityClassRuleForm, extra=0, can_delete=False)


class WindowForm(forms.Form):
    hours = forms.IntegerField(
        min_value=1,
        max_value=24 * 31,
        initial=24,
        label="replay (hours)",
        help_text="Submissions of this window are replayed on the fleet as it is now.",
    )
    end = forms.DateTimeField(
        required=False,
        label="ending at (UTC)",
        help_text="empty: now",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
        input_formats=["%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M:%S"],
    )

    def bounds(self) -> tuple[datetime, datetime]:
        end = self.cleaned_data.get("end") or timezone.now()
        return end - timedelta(hours=self.cleaned_data["hours"]), end

    def clean_end(self):
        end = self.cleaned_data.get("end")
        if end and end > timezone.now():
            raise forms.ValidationError("the window must end now or in the past: there is no history after now")
        return end


class FairShareForm(forms.Form):
    """The fair-share half-life and one weight per tenant (``weight__<slug>``)."""

    half_life_hours = forms.DecimalField(
        min_value=0.01,
        max_digits=8,
        decimal_places=2,
        label="fair-share half-life (hours)",
        help_text="Past usage counts half as much after this long.",
    )

    def __init__(self, *args, tenants: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.tenants = tenants
        for slug in tenants:
            self.fields[f"weight__{slug}"] = forms.DecimalField(
                min_value=0.001,
                max_digits=8,
                decimal_places=3,
                label=slug,
                initial=1,
                required=False,
                help_text="empty: 1",
            )

    def weights(self) -> dict:
        return {slug: self.cleaned_data[f"weight__{slug}"] or Decimal(1) for slug in self.tenants}

    def half_life_s(self) -> int:
        return int(self.cleaned_data["half_life_hours"] * 3600)

    def weight_fields(self):
        return [self[f"weight__{slug}"] for slug in self.tenants]
