"""Priority rules: validation that names the contradiction, preview before save, audited save."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.urls import reverse

from accounts.models import AuditLog
from console.rules import ClassDraft, RuleSet, rules_problems
from scheduler.models import PriorityClass


def drafts(**overrides) -> RuleSet:
    base = {
        "serving": ClassDraft("serving", 300, may_preempt=frozenset({"preemptible"}), default_for_kind="inference"),
        "standard": ClassDraft("standard", 200, may_preempt=frozenset({"preemptible"}), default_for_kind="training"),
        "preemptible": ClassDraft("preemptible", 100, preemptible=True),
    }
    base.update(overrides)
    return RuleSet(classes=tuple(base.values()))


def test_the_seeded_rules_are_consistent():
    assert rules_problems(drafts()) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"preemptible": ClassDraft("preemptible", 100, preemptible=True, may_preempt=frozenset({"preemptible"}))},
            "class preemptible may not preempt itself",
        ),
        (
            {"standard": ClassDraft("standard", 200, may_preempt=frozenset({"serving"}))},
            "class standard may preempt serving, but serving is not preemptible",
        ),
        (
            {"standard": ClassDraft("standard", 200, may_preempt=frozenset({"gold"}))},
            "class standard may preempt gold, which does not exist",
        ),
        (
            {"preemptible": ClassDraft("preemptible", 400, preemptible=True)},
            "class standard (rank 200) may preempt only lower ranks, but preemptible has rank 400",
        ),
        (
            {"preemptible": ClassDraft("preemptible", 100, preemptible=True, default_for_kind="training")},
            "one default class per job kind: training has preemptible, standard",
        ),
        (
            {"preemptible": ClassDraft("preemptible", 100, preemptible=True, default_for_kind="batch")},
            "class preemptible is the default for 'batch', which is not a job kind (kinds: training, inference)",
        ),
    ],
)
def test_each_contradiction_is_named(change, message):
    assert message in rules_problems(drafts(**change))


def test_a_preemption_cycle_is_found_even_when_each_edge_looks_fine_alone():
    rules = RuleSet(
        classes=(
            ClassDraft("a", 100, preemptible=True, may_preempt=frozenset({"b"})),
            ClassDraft("b", 100, preemptible=True, may_preempt=frozenset({"c"})),
            ClassDraft("c", 100, preemptible=True, may_preempt=frozenset({"a"})),
        )
    )
    problems = rules_problems(rules)
    assert "preemption cycle: a -> b -> c -> a (classes would preempt each other in turn)" in problems


def form_data(**overrides) -> dict:
    """The rules page's POST body for the seeded rules, with overrides like {'standard-rank': 50}."""
    data = {
        "cls-TOTAL_FORMS": "3",
        "cls-INITIAL_FORMS": "3",
        "cls-MIN_NUM_FORMS": "0",
        "cls-MAX_NUM_FORMS": "1000",
        "half_life_hours": "168",
        "hours": "24",
    }
    for i, c in enumerate(PriorityClass.objects.order_by("-rank", "name")):
        row = {
            "id": c.pk,
            "rank": c.rank,
            "min_runtime_s": c.min_runtime_s,
            "grace_period_s": c.grace_period_s,
            "price_multiplier": c.price_multiplier,
            "default_for_kind": c.default_for_kind,
        }
        if c.preemptible:
            row["preemptible"] = "on"
        row["may_preempt"] = [p.pk for p in c.may_preempt.all()]
        for key, value in row.items():
            data[f"cls-{i}-{key}"] = value
        for key, value in overrides.items():
            name, _, field = key.partition("-")
            if name == c.name:
                data[f"cls-{i}-{field}"] = value
    for key, value in overrides.items():
        if key.startswith("weight__") or key in ("half_life_hours", "hours"):
            data[key] = value
    return data


def test_preview_does_not_save_and_shows_the_change(staff_client, rules, tenant):
    response = staff_client.post(reverse("console:rules"), {**form_data(**{"preemptible-rank": 150}), "_preview": "1"})
    assert response.status_code == 200
    assert response.context["problems"] == []
    assert [(c.what, c.field, c.before, c.after) for c in response.context["changes"]] == [
        ("class preemptible", "rank", 100, 150)
    ]
    assert response.context["comparison"] is not None
    assert PriorityClass.objects.get(name="preemptible").rank == 100
    assert not AuditLog.objects.filter(action="priority_class.update").exists()


def test_a_contradiction_blocks_preview_and_save_with_its_reason(staff_client, rules):
    serving = PriorityClass.objects.get(name="serving")
    body = form_data(**{"standard-may_preempt": [serving.pk]})
    for button in ("_preview", "_save"):
        response = staff_client.post(reverse("console:rules"), {**body, button: "1"})
        assert response.status_code == 200
        assert "class standard may preempt serving, but serving is not preemptible" in response.content.decode()
        assert response.context["comparison"] is None
    assert not PriorityClass.objects.get(name="standard").may_preempt.filter(name="serving").exists()
    assert not AuditLog.objects.exists()


def test_save_writes_the_rules_and_an_audit_row_per_class(staff_client, operator, rules):
    response = staff_client.post(
        reverse("console:rules"),
        {**form_data(**{"preemptible-rank": 150, "preemptible-grace_period_s": 5}), "_save": "1"},
    )
    assert response.status_code == 302
    changed = PriorityClass.objects.get(name="preemptible")
    assert (changed.rank, changed.grace_period_s) == (150, 5)
    entry = AuditLog.objects.get(action="priority_class.update")
    assert entry.actor == operator and entry.target == "preemptible" and entry.tenant is None
    assert (entry.before["rank"], entry.after["rank"]) == (100, 150)
    assert (entry.before["grace_period_s"], entry.after["grace_period_s"]) == (30, 5)
    assert entry.after["price_multiplier"] == str(Decimal("0.600"))
    page = staff_client.get(reverse("console:rules"))
    assert [(e.action, e.target) for e in page.context["recent"]] == [("priority_class.update", "preemptible")]
    assert "priority_class.update preemptible" in page.content.decode()


def test_one_save_can_move_a_default_and_reorder_classes_in_the_order_the_scheduler_accepts(staff_client, rules):
    # Move 'training' default from standard to preemptible, lift preemptible above standard and drop the
    # standard -> preemptible edge: each alone would be refused by the scheduler in some order.
    standard = PriorityClass.objects.get(name="standard")
    body = form_data(
        **{
            "preemptible-rank": 250,
            "preemptible-default_for_kind": "training",
            "standard-default_for_kind": "",
            "standard-may_preempt": [],
        }
    )
    response = staff_client.post(reverse("console:rules"), {**body, "_save": "1"})
    assert response.status_code == 302, response.context["problems"]
    preemptible = PriorityClass.objects.get(name="preemptible")
    standard.refresh_from_db()
    assert (preemptible.rank, preemptible.default_for_kind) == (250, "training")
    assert standard.default_for_kind == "" and not standard.may_preempt.exists()
    entries = AuditLog.objects.filter(action="priority_class.update").order_by("id")
    assert {e.target for e in entries} == {"standard", "preemptible"}
    last = {e.target: e.after for e in entries}  # the audit trail ends at the saved rules
    assert (last["preemptible"]["rank"], last["preemptible"]["default_for_kind"]) == (250, "training")
    assert (last["standard"]["default_for_kind"], last["standard"]["may_preempt"]) == ("", [])
    assert all(e.before != e.after for e in entries)


def test_weights_and_half_life_are_saved_through_the_scheduler_and_audited(staff_client, operator, rules, tenant):
    from scheduler.models import TenantShare
    from scheduler.passes import settings_get

    body = form_data(**{f"weight__{tenant.slug}": "3", "half_life_hours": "24"})
    response = staff_client.post(reverse("console:rules"), {**body, "_preview": "1"})
    assert [(c.what, c.field) for c in response.context["changes"]] == [
        (f"tenant {tenant.slug}", "weight"),
        ("fair share", "half_life_s"),
    ]
    response = staff_client.post(reverse("console:rules"), {**body, "_save": "1"})
    assert response.status_code == 302
    from django_scopes import scopes_disabled

    with scopes_disabled():
        assert TenantShare.objects.get(tenant=tenant).weight == Decimal("3.000")
    assert settings_get().fair_share_half_life_s == 24 * 3600
    weight_entry = AuditLog.objects.get(action="scheduler.tenant_weight")
    assert weight_entry.actor == operator and weight_entry.after == {"weight": "3.000"}
    assert AuditLog.objects.get(action="scheduler.settings").after["fair_share_half_life_s"] == 86400
    # The page now shows what is in force.
    page = staff_client.get(reverse("console:rules"))
    assert page.context["fair"].initial[f"weight__{tenant.slug}"] == Decimal("3.000")
