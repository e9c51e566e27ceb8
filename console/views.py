"""The operator console's custom pages. Staff only: everyone else is sent to the admin login.

Views read through console.selectors and write through the owning apps'
services (which write the audit row in the same transaction).
"""

from __future__ import annotations

from datetime import datetime

from django.contrib import admin, messages
from django.contrib.admin.views.decorators import staff_member_required
from django.http import Http404
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.utils import timezone
from django.views.decorators.http import require_POST

from agents import services as agent_services
from agents.models import Gpu, Node
from scheduler.models import PriorityClass

from . import forms, replay, selectors, services
from .models import WhatIfRun
from .rules import RuleSet, rule_changes, rules_problems


def _page(request, template: str, title: str, **context) -> TemplateResponse:
    return TemplateResponse(request, template, {**admin.site.each_context(request), "title": title, **context})


@staff_member_required
def index(request):
    return redirect("console:fleet")


# --- fleet -----------------------------------------------------------------


@staff_member_required
def fleet(request):
    rows = selectors.fleet_grid()
    context = {"rows": rows, "summary": selectors.fleet_summary(rows)}
    if request.htmx:
        return TemplateResponse(request, "console/_fleet_grid.html", context)
    return _page(request, "console/fleet.html", "Fleet", **context)


NODE_ACTIONS = {
    "cordon": services.node_cordon,
    "drain": services.node_drain,
    "uncordon": services.node_uncordon,
}


@staff_member_required
@require_POST
def node_action(request, pk: int, action: str):
    node = Node.objects.filter(pk=pk).first()
    if node is None or action not in NODE_ACTIONS:
        raise Http404("no such node or action")
    try:
        NODE_ACTIONS[action](node=node, actor=request.user, reason=request.POST.get("reason", "").strip())
    except services.ConsoleError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Node {node.name}: {action} done.")
    return redirect("console:fleet")


@staff_member_required
@require_POST
def gpu_return(request, pk: int):
    gpu = Gpu.objects.select_related("node").filter(pk=pk).first()
    if gpu is None:
        raise Http404("no such GPU")
    if gpu.health == Gpu.Health.OK:
        messages.error(request, f"GPU {gpu} is in service already.")
    else:
        agent_services.gpu_return_to_service(gpu=gpu, actor=request.user, note=request.POST.get("note", "").strip())
        messages.success(request, f"GPU {gpu} is back in service.")
    return redirect("console:fleet")


# --- queue -----------------------------------------------------------------


@staff_member_required
def queue(request):
    context = {"rows": selectors.queue_rows(), "classes": PriorityClass.objects.order_by("-rank")}
    if request.htmx:
        return TemplateResponse(request, "console/_queue_table.html", context)
    return _page(request, "console/queue.html", "Queue", **context)


def _job_or_404(pk: int):
    job = selectors.job_for_console(job_id=pk)
    if job is None:
        raise Http404("no such job")
    return job


@staff_member_required
@require_POST
def job_cancel(request, pk: int):
    job = _job_or_404(pk)
    try:
        services.job_cancel(job=job, actor=request.user, reason=request.POST.get("reason", "").strip())
    except services.ConsoleError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Job {job.pk} of {job.tenant.slug}: cancelled.")
    return redirect("console:queue")


@staff_member_required
@require_POST
def job_reclass(request, pk: int):
    job = _job_or_404(pk)
    target = PriorityClass.objects.filter(name=request.POST.get("priority", "")).first()
    if target is None:
        messages.error(request, "Choose an existing priority class.")
        return redirect("console:queue")
    try:
        services.job_priority_change(job=job, priority=target, actor=request.user)
    except services.ConsoleError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Job {job.pk} of {job.tenant.slug}: now in class {target.name}.")
    return redirect("console:queue")


# --- priority rules with the what-if preview ---------------------------------


def _rules_forms(request):
    current = replay.ruleset_current()
    tenants = selectors.tenant_slugs()
    data = request.POST if request.method == "POST" else None
    ordered = PriorityClass.objects.order_by("-rank", "name")
    classes = forms.PriorityClassRuleFormSet(data, prefix="cls", queryset=ordered)
    fair = forms.FairShareForm(
        data,
        tenants=tenants,
        initial={
            "half_life_hours": round(current.half_life_s / 3600, 2),
            **{f"weight__{slug}": current.weights.get(slug, 1) for slug in tenants},
        },
    )
    window = forms.WindowForm(data or None, initial={"hours": 24})
    return current, classes, fair, window


@staff_member_required
def rules(request):
    current, classes, fair, window = _rules_forms(request)
    context = {
        "classes_formset": classes,
        "fair": fair,
        "window": window,
        "problems": [],
        "comparison": None,
        "run": None,
        "recent": selectors.rule_changes_recent(),
    }
    if request.method == "POST":
        valid = classes.is_valid() & fair.is_valid() & window.is_valid()
        if valid:
            proposed = RuleSet(
                classes=tuple(f.draft() for f in classes.forms), weights=fair.weights(), half_life_s=fair.half_life_s()
            )
            context["changes"] = rule_changes(current, proposed)
            context["problems"] = rules_problems(proposed) or services.rules_dry_run(current=current, proposed=proposed)
            if not context["problems"] and "_save" in request.POST:
                try:
                    count = services.rules_apply(current=current, proposed=proposed, actor=request.user)
                except services.ConsoleError as exc:
                    context["problems"] = [str(exc)]
                else:
                    messages.success(request, f"Saved {count} rule change(s); the next scheduling pass follows them.")
                    return redirect("console:rules")
            elif not context["problems"]:
                start, end = window.bounds()
                count = selectors.submissions_count(start=start, end=end)
                if count > replay.MAX_REPLAY_JOBS:
                    context["problems"] = [
                        f"the window holds {count} submissions and a preview replays at most "
                        f"{replay.MAX_REPLAY_JOBS}: choose a shorter window"
                    ]
                elif count > replay.INLINE_REPLAY_JOBS:
                    context["run"] = services.whatif_run_start(
                        actor=request.user, proposed=proposed, start=start, end=end
                    )
                else:
                    context["comparison"] = replay.preview_window(proposed=proposed, start=start, end=end)
    return _page(request, "console/rules.html", "Priority rules and what-if preview", **context)


# --- reports ---------------------------------------------------------------


@staff_member_required
def reports(request):
    now = timezone.now()
    month_text = request.GET.get("month") or f"{now:%Y-%m}"
    try:
        month = datetime.strptime(month_text, "%Y-%m").date()
    except ValueError:
        messages.error(request, f"month must look like YYYY-MM (e.g. 2026-03), got {month_text!r}")
        return redirect("console:reports")
    report = selectors.usage_report(month=month, now=now)
    return _page(request, "console/reports.html", f"Reports for {month:%Y-%m}", report=report, month_text=month_text)


@staff_member_required
def whatif_run(request, pk: int):
    """The state of a queued preview, polled by the rules page until it is done."""
    run = WhatIfRun.objects.filter(pk=pk).first()
    if run is None:
        raise Http404("no such preview")
    return TemplateResponse(request, "console/_whatif_run.html", {"run": run, "comparison": run.result})
