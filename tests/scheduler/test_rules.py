"""Rule changes are validated data, audited, and followed by the next pass."""

from __future__ import annotations

import pytest
from django_scopes import scopes_disabled

from accounts.models import AuditLog
from scheduler.models import Job, JobState, PriorityClass
from scheduler.rules import (
    RuleError,
    priority_class_create,
    priority_class_update,
    scheduler_settings_update,
    tenant_weight_set,
)
from scheduler.services import schedule_pass
from tests.scheduler.conftest import node_add, reload, submit


def klass(name: str) -> PriorityClass:
    return PriorityClass.objects.get(name=name)


def test_a_rank_change_is_audited_and_followed_by_the_next_pass(sched, tenant):
    node_add("n1", 1)
    training = submit(tenant, gpus=1, priority="standard")
    batch = submit(tenant, gpus=1, priority="preemptible")
    for name in ("serving", "standard"):
        priority_class_update(actor=None, priority_class=klass(name), changes={"may_preempt": []})
    priority_class_update(actor=None, priority_class=klass("preemptible"), changes={"rank": 250})
    entry = AuditLog.objects.filter(action="priority_class.update", target="preemptible").latest("id")
    assert (entry.before["rank"], entry.after["rank"]) == (100, 250)
    schedule_pass()
    assert reload(batch).state == JobState.SCHEDULED and reload(training).state == JobState.QUEUED


@pytest.fixture
def refused():
    def check(call, message: str, field: str):
        before = AuditLog.objects.count()
        with pytest.raises(RuleError) as err:
            call()
        assert message in str(err.value) and err.value.field == field
        assert AuditLog.objects.count() == before

    return check


def test_invalid_rules_are_refused_with_the_rule_stated(sched, refused):
    serving, standard = klass("serving"), klass("standard")
    refused(
        lambda: priority_class_update(actor=None, priority_class=standard, changes={"may_preempt": ["standard"]}),
        "cannot preempt itself",
        "may_preempt",
    )
    refused(
        lambda: priority_class_update(actor=None, priority_class=standard, changes={"may_preempt": ["serving"]}),
        "class serving is not preemptible",
        "may_preempt",
    )
    refused(
        lambda: priority_class_update(actor=None, priority_class=standard, changes={"may_preempt": ["nope"]}),
        "unknown class(es) nope",
        "may_preempt",
    )
    refused(
        lambda: priority_class_update(actor=None, priority_class=klass("preemptible"), changes={"rank": 250}),
        "preempts preemptible, so preemptible's rank must stay below 200",
        "rank",
    )
    refused(
        lambda: priority_class_update(actor=None, priority_class=serving, changes={"default_for_kind": ""}),
        "inference jobs would have no default priority class",
        "default_for_kind",
    )
    refused(
        lambda: priority_class_update(actor=None, priority_class=serving, changes={"grace_period_s": -1}),
        "grace_period_s must be from 0",
        "grace_period_s",
    )
    refused(
        lambda: priority_class_update(actor=None, priority_class=serving, changes={"price_multiplier": "0"}),
        "price_multiplier must be above 0",
        "price_multiplier",
    )
    refused(
        lambda: priority_class_update(actor=None, priority_class=serving, changes={"colour": "red"}),
        "unknown priority class field(s): colour",
        "colour",
    )
    refused(lambda: priority_class_create(actor=None, name="Bad Name", rank=1), "short slug", "name")
    refused(lambda: tenant_weight_set(actor=None, tenant=None, weight="0"), "weight must be from 0.001", "weight")
    refused(
        lambda: scheduler_settings_update(actor=None, fair_share_half_life_s=0), "at least 1", "fair_share_half_life_s"
    )
    refused(lambda: scheduler_settings_update(actor=None, defrag="yes"), "defrag must be true or false", "defrag")
    refused(
        lambda: scheduler_settings_update(actor=None, defrag_min_interval_s=-1), "at least 0", "defrag_min_interval_s"
    )
    refused(lambda: scheduler_settings_update(actor=None, defrag_min_gain_s="10"), "whole number", "defrag_min_gain_s")


def test_preemption_cycles_are_refused(sched, refused):
    priority_class_create(actor=None, name="low", rank=50, preemptible=True)
    priority_class_create(actor=None, name="mid", rank=60, preemptible=True, may_preempt=["low"])
    # low may not preempt mid (mid has the higher rank) - and a direct cycle is caught as such too.
    refused(
        lambda: priority_class_update(actor=None, priority_class=klass("low"), changes={"may_preempt": ["mid"]}),
        "may only preempt lower-ranked classes",
        "may_preempt",
    )


def test_changes_are_audited(sched, tenant):
    priority_class_update(actor=None, priority_class=klass("preemptible"), changes={"grace_period_s": 5})
    entry = AuditLog.objects.filter(action="priority_class.update").latest("id")
    assert entry.before["grace_period_s"] == 30 and entry.after["grace_period_s"] == 5
    tenant_weight_set(actor=None, tenant=tenant, weight="3")
    entry = AuditLog.objects.filter(action="scheduler.tenant_weight").latest("id")
    assert entry.tenant == tenant and entry.after == {"weight": "3.000"}
    scheduler_settings_update(actor=None, backfill=False, fair_share_half_life_s=60)
    entry = AuditLog.objects.filter(action="scheduler.settings").latest("id")
    assert entry.after["backfill"] is False and entry.after["fair_share_half_life_s"] == 60


def test_backfill_switch_takes_effect_on_the_next_pass(sched, tenant):
    node_add("n1", 2)
    blocker = submit(tenant, gpus=1, max_runtime_s=3600)
    schedule_pass()
    head = submit(tenant, gpus=2)
    short = submit(tenant, gpus=1, max_runtime_s=60)
    scheduler_settings_update(actor=None, backfill=False)
    schedule_pass()
    assert reload(short).state == JobState.QUEUED
    assert reload(short).pending_reason == f"behind job {head.pk}, first in line (backfill is off)"
    scheduler_settings_update(actor=None, backfill=True)
    schedule_pass()
    assert reload(short).state == JobState.SCHEDULED
    assert reload(head).state == JobState.QUEUED and reload(blocker).state == JobState.SCHEDULED
    with scopes_disabled():
        assert Job.objects.filter(state=JobState.SCHEDULED).count() == 2


def test_defragmentation_settings_are_audited(sched):
    conf = scheduler_settings_update(actor=None, defrag=False, defrag_min_interval_s=600, defrag_min_gain_s=60)
    assert (conf.defrag, conf.defrag_min_interval_s, conf.defrag_min_gain_s) == (False, 600, 60)
    entry = AuditLog.objects.get(action="scheduler.settings")
    assert entry.before["defrag"] is True and entry.before["defrag_min_interval_s"] == 1800
    assert entry.after["defrag"] is False and entry.after["defrag_min_gain_s"] == 60
